"""The adaptive checkpoint interval: Daly's optimum (``interval``), the failure rate learned from a job's
own restarts (``failures``), the policy that combines them (``policy.AdaptiveInterval``), and a
discrete-event simulation that compares it with fixed intervals (``simulate``, ``ft-checkpoint simulate``).
Pure maths and the standard library: nothing here imports torch."""
