"""Tiers beside the durable checkpoint directory: a fast tier in each node's memory or local disk, with peer copies.

The durable ``dirpath`` survives anything short of losing the store; a fast tier (``fast_dirpath``: host shared
memory or a node-local disk) survives a process crash, and with a peer copy of each rank's files on the next
node of a ring (``fast_replicas``), the loss of one node. Saves to either tier are staged once; a resume takes
the newest complete step from the fastest place that has it. One module per concept:

- ``node``: node identity and the ring of peers;
- ``folder``: a node's fast-tier folder (a checkpoint directory per rank, commit marks, retention, hygiene);
- ``write``: one rank's part of a step, written from the staged copy;
- ``transfer``: step folders sent between ranks over the fast tier's own gloo group, checked as received;
- ``room``: the space a node needs, checked at the first save;
- ``sources``: what each node holds, and which rank takes its part from where at a resume;
- ``fast_tier``: the fast tier of one manager, putting them together.

May import: ``save``, ``load``, ``state`` and every layer below them; not ``manager`` or the integrations.
"""
