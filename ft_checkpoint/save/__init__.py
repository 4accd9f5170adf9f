"""The save path: a state copied out of the training's way, written in the background, committed.

- ``staging``: the state's tensors copied into host buffers allocated once and reused;
- ``engine``: ``CheckpointEngine``, one save in flight: stage, write the shard files (DCP), commit the manifest;
  a background error is raised at the next save, wait or close;
- ``writer_process``: shard files written by a process of their own, from the shared staging arena;
- ``pending_gradients``: whether an optimizer holds gradients for a later step (a save then would lose them);
- ``save_events``: what follows a commit (journal, retention, lease heartbeat, the cost the policies learn from).

May import: ``state``, ``policies``, ``run``, ``config``, ``format``, ``store`` and below; not ``load`` (side by side).
"""
