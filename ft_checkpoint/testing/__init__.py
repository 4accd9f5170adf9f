"""Test support that ships with the package: real storage servers on 127.0.0.1 (``servers``) and a local
filesystem that injects faults (``faults``, the ``faulty://`` protocol, registered through fsspec's entry
points). Used by the test suite, the benchmarks and the chaos runs; nothing here is imported by the core.
"""
