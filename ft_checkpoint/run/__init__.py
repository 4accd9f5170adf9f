"""Run bookkeeping: what one run of a job holds and remembers across its restarts.

- ``lease``: one writer per directory (``lease.json``, fenced; ``owner_lock``: the lock on ``lease.lock`` its owner
  holds while it lives, proof on one kernel that it is gone); ``journal``: one JSON object per event
  (starts, resumes, saves, commits, ends), the source of the failure rate and the goodput report;
- ``retention``: which committed steps to delete, never the newest; ``preemption``, ``slurm``: notices of
  an end to come (signals, the job's end time); ``dist``: process groups of our own, and what all ranks agree on;
- ``background``: background work that still happens at interpreter exit.

May import: ``config``, ``format``, ``store``, ``progress``, ``units``, ``errors``; not ``policies`` (side by side).
"""
