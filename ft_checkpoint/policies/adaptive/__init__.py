"""The adaptive checkpoint interval: Daly's optimum (``interval``), the failure rate learned from a job's
own restarts (``failures``), the policy that combines them (``policy.AdaptiveInterval``), and a
discrete-event simulation that compares it with fixed intervals (``simulate``, ``ft-checkpoint simulate``).
With a fast tier: the multi-level model and its plan (``multilevel``), failure classes learned from the journal
(``classes``), the policy for both tiers (``tier_policy.MultiLevelInterval``) and its simulation
(``simulate_tiers``, ``ft-checkpoint simulate --tiers``). Pure maths and the standard library: nothing here imports torch.

May import: what ``policies`` may, and ``policies.policy``."""
