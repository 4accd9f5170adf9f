"""Run bookkeeping: the lease, the journal, retention, preemption, Slurm, process groups."""
