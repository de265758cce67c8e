"""Lightning ClusterEnvironment backed by the runner's membership, not by environment variables.

The rank Lightning sees is the logical data-parallel rank, which the runner may reassign at run
time (a spare taking a failed rank's place); processes are always created by the runner.
"""

from __future__ import annotations

from lightning.fabric.plugins.environments import ClusterEnvironment

from runner.training.status import WorkerStatus


class RunnerEnvironment(ClusterEnvironment):
    def __init__(self, comm, status: WorkerStatus) -> None:
        self.comm, self.status = comm, status

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self.comm.store.host if hasattr(self.comm.store, "host") else "127.0.0.1"

    @property
    def main_port(self) -> int:
        return int(getattr(self.comm.store, "port", 0))

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.comm.layout.dp if self.comm.layout else self.status.dp

    def set_world_size(self, size: int) -> None:
        """The world size comes from the membership table; Lightning's value is ignored."""

    def global_rank(self) -> int:
        return self.comm.logical_rank if self.comm.layout else self.status.logical_rank

    def set_global_rank(self, rank: int) -> None:
        """The rank comes from the membership table; Lightning's value is ignored."""

    def local_rank(self) -> int:
        return self.status.local_rank

    def node_rank(self) -> int:
        return self.status.node
