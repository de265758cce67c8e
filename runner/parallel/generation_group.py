"""The tensor-parallel group as the TP layers see it, across the generations of a run.

``runner.parallel.tensor``'s layers keep the group they were built with. A run's TP group is rebuilt
with every generation (``Comm``), so the layers get this stand-in: its rank and size are the rank's TP
coordinate and the TP degree, which no recovery changes, and each collective runs on the group the
communicator holds at that moment. A failed collective drops every group of the generation and raises
``CollectiveFailure``, as the gradient reduction's do, so the step is abandoned and redone after the
recovery.
"""

from __future__ import annotations

import torch

from runner.comm import Comm


class _Done:
    """The work of a collective that already completed (``Comm.tp_collective`` waits for it)."""

    @staticmethod
    def wait() -> bool:
        return True


class GenerationTPGroup:
    def __init__(self, comm: Comm, tp_rank: int, tp_size: int) -> None:
        self.comm, self._rank, self._size = comm, tp_rank, tp_size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        self.comm.tp_collective(lambda pg: pg.allreduce(tensors))
        return _Done()

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> _Done:
        self.comm.tp_collective(lambda pg: pg.allgather(outputs, inputs))
        return _Done()
