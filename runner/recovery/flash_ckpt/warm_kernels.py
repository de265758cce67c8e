"""Imported by the fork server of a run with flash checkpoints (``RestartAll.worker_preload``): loads the copy
kernels once, compiling them on the first run after an install, so that every worker forked from it
has them ready. Loading them in a worker instead stalls its first snapshot or restore (~0.3 s from
numba's cache; ~3.5 s to compile, which the runner's stall rule rightly takes for a hang)."""

from .kernels import warm_up

warm_up()
