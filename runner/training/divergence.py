"""What a step does when the replica check (``runner.training.replica_check``) finds its replicas diverged.

Every member of the reduction's group reads the same reduced fingerprints, so every member reaches the
same decision at the same step without another message:

- a majority exists (more than half the members hold one fingerprint), the model is replicated whole
  on every rank (tp*pp = 1) and the optimizer state is too (parallel.zero = 0): the lowest member of the
  majority broadcasts its state (``runner.training.transfer.exchange``: parameters, optimizer state, the
  corruption guard's history), the disagreeing members adopt it, and the step's gradients are recomputed
  and reduced again, so no gradient of a diverged replica enters an update;
- otherwise (no majority, e.g. two replicas that disagree; a model slice or ZeRO-1 shard, whose
  optimizer state no other member holds whole): ``RunFailedError`` on every member, so the run ends
  ``failed`` with the reason and never ``completed``.

Both log ``replica_diverged`` (once per group, by its lowest member). Failing, the members first meet in one
collective over the group, so that the finding is logged before any of them reports the failure: the controller
ends the run at a member's fatal report, and the lowest member could be stopped before it logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from runner.plumbing.events import EventLog
from runner.training import replica_check
from runner.training.comm import Comm, RunFailedError
from runner.training.state import ReplicaState
from runner.training.transfer import exchange


class ReplicaDivergence:
    def __init__(self, comm: Comm, events: EventLog, state: ReplicaState, every_n_steps: int,
                 params: Callable[[], list[Tensor]], restorable: Callable[[], bool]) -> None:
        """``params``: the replica's trainable parameters, in the reducer's order; ``restorable``: whether this
        layout keeps a whole replica's state on every member (tp*pp = 1, no ZeRO-1)."""
        self.comm, self.events, self.state = comm, events, state
        self.every_n_steps = every_n_steps
        self._params, self._restorable = params, restorable

    @property
    def size(self) -> int:
        """Slots in the step's accounting vector (none when the check is off)."""
        return replica_check.SLOTS_PER_REPLICA * self.comm.dp_size if self.every_n_steps > 0 else 0

    def slots(self, step: int) -> Tensor:
        """This member's slots for ``step``'s reduction: its fingerprint on a check step, zeros between checks."""
        if not replica_check.due(step, self.every_n_steps):
            return torch.zeros(self.size, dtype=torch.float64)
        return replica_check.encode(replica_check.fingerprint(self._params()), self.comm.dp_rank, self.comm.dp_size)

    def inspect(self, step: int, reduced: Tensor) -> bool:
        """After ``step``'s reduction: True when a diverged member was restored and the step must be recomputed;
        raises ``RunFailedError`` when no member can be trusted."""
        if not replica_check.due(step, self.every_n_steps):
            return False
        found = replica_check.verdict(replica_check.decode(reduced))
        if not found.diverged:
            return False
        source = found.source if self._restorable() else None
        self._report(step, found, source)
        if source is None:  # the finding is logged before any member fails the run (a fatal report ends it at once)
            self.comm.allgather_replicas(torch.zeros(1))
            raise RunFailedError(self._reason(step, found))
        src_pg = next(pg for pg, logical in enumerate(self.comm.joined.logical)
                      if self.comm.coords_of(logical)[0] == source)
        receive = self.comm.dp_rank in found.disagreeing
        ckpt = exchange(self.comm, self.state.dump_state() if self.comm.dp_rank == source else None, src_pg,
                        receive=receive)
        if receive:
            self.state.adopt_replica_state(ckpt)
        return True

    def _report(self, step: int, found: replica_check.Verdict, source: Optional[int]) -> None:
        if self.comm.dp_rank != min(found.fingerprints):
            return
        _, pp, tp = self.comm.coords_of(self.comm.logical_rank)
        self.events.emit(
            "replica_diverged", step=step, gen=self.comm.gen, replicas=found.disagreeing,
            ranks=[self._logical_of(r, pp, tp) for r in found.disagreeing],
            checksums={str(r): f"{fp:08x}" for r, fp in sorted(found.fingerprints.items())},
            **({"slice": [pp, tp]} if self.comm.replica_size > 1 else {}),
            action="fail" if source is None else "restore_from_majority",
            **({"source": self._logical_of(source, pp, tp)} if source is not None else {}),
            **({"reason": self._reason(step, found)} if source is None else {}))

    def _logical_of(self, dp: int, pp: int, tp: int) -> int:
        topology = self.comm.topology
        return dp if topology is None else topology.rank_of(dp, pp, tp)

    def _reason(self, step: int, found: replica_check.Verdict) -> str:
        why = ("no majority of them agrees" if found.majority is None else
               "each holds a slice of the model or a ZeRO-1 shard of the optimizer state, which no other member "
               "holds whole to restore from")
        counts = len(set(found.fingerprints.values()))
        return (f"replicas diverged: at step {step} the data-parallel replicas' parameters had {counts} distinct "
                f"fingerprints over {len(found.fingerprints)} members (replicas {found.disagreeing} disagree), and "
                f"{why} [trainer.replica_check_every_n_steps]")
