"""A model-parallel group (tensor or pipeline) as the layers and the schedule see it, across the generations of
a run.

``runner.parallel.tensor``'s layers and ``runner.parallel.pipeline``'s schedule keep the group they were built
with. A run's groups are rebuilt with every generation (``Comm``), so they get this stand-in: its rank and size
are the rank's coordinate and the degree of one dimension ("tp" or "pp"), which no recovery changes, and each
operation runs on that dimension's group the communicator holds at that moment. A failed collective or receive
drops every group of the generation and raises ``CollectiveFailure``, as the gradient reduction's do, so the step
is abandoned and redone after the recovery. Sends (the pipeline's only) are launched and waited for with the
communicator's other launched work, so a failure never leaves one in flight when the groups go.
"""

from __future__ import annotations

import torch

from runner.training.comm import Comm


class _Done:
    """The work of an operation that already completed (``Comm.subgroup_collective`` waits for it)."""

    @staticmethod
    def wait() -> bool:
        return True


class _Launched:
    """The work of a launched send: waiting for it waits for everything the communicator launched."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def wait(self) -> bool:
        self.comm.wait_all()
        return True


class GenerationGroup:
    def __init__(self, comm: Comm, dim: str, rank: int, size: int) -> None:
        self.comm, self.dim, self._rank, self._size = comm, dim, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        self.comm.subgroup_collective(self.dim, lambda pg: pg.allreduce(tensors))
        return _Done()

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> _Done:
        self.comm.subgroup_collective(self.dim, lambda pg: pg.allgather(outputs, inputs))
        return _Done()

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Launched:
        self.comm.launch_send(lambda pg: pg.send(tensors, peer, tag))
        return _Launched(self.comm)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Done:
        self.comm.subgroup_collective(self.dim, lambda pg: pg.recv(tensors, peer, tag))
        return _Done()

