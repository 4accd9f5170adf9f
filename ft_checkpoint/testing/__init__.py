"""Test support that ships with the package: real storage servers on 127.0.0.1 (``servers``) and a local
filesystem that injects faults (``faults``, the ``faulty://`` protocol, which exists only in a process that
imports ``ft_checkpoint.testing.faults``: a user's install knows no such protocol). Used by the test suite, the
benchmarks and the chaos runs; nothing here is imported by the core.

May import: every layer of the core; not ``integrations`` or ``tools``.
"""
