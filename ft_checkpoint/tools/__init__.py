"""The ``ft-checkpoint`` command line and what it reads: ``catalog`` (ls, verify, inspect, gc) and ``goodput``
(report). Nothing here imports torch, except ``inspect`` of a format-1 step (a pickled metadata, written by 0.1.0).

May import: every layer of the core; not ``integrations`` or ``testing``."""
