"""Starting a job and ending it: the launcher (one host, or one rank or one host of a torchrun/SLURM job), the
attempt a torchrun/SLURM job's ranks agree on, SIGTERM handling, and what a job gives back to Hydra.

``launcher`` is the one entry ``runner.cli`` calls; ``external`` (``launcher.mode=per_rank``) and ``per_host``
(``launcher.mode=per_host``) are the two ways a job runs under torchrun or SLURM.
"""
