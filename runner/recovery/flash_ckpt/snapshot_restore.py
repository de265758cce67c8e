"""Worker side of a restart from flash checkpoints (the controller's ``restart_all``).

Every rank was started again (role ``restore``) and none holds live state, so each one lists the
snapshots of its logical rank (own memory, the partner node's copy, disk) and the ranks agree, in
the new group, on the newest step all of them hold. Each rank then loads that step, verified; if
some rank's copies of it all fail their checksums, the ranks agree again without that step, so a
corrupt snapshot costs an older step, never a mixed one. Model weights from memory are copied
straight into the module's parameters (already allocated and faulted in), so Lightning's
``load_state_dict`` finds them in place and copies nothing; the rest is loaded into new tensors.
The checkpoint dict goes back to Lightning (``Strategy.load_checkpoint``), which restores model,
optimizer, schedulers and loops; the data position follows from ``global_step``. Later snapshots of
the abandoned timeline are invalidated. A collective failure on the way waits for the controller's
next generation.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from runner.plumbing.events import EventLog
from runner.recovery.common.hooks import RecoveryLoop
from runner.recovery.flash_ckpt.prefetch import Prefetch
from runner.recovery.flash_ckpt.restore import (
    NoSnapshot,
    invalidate_newer,
    list_snapshots,
    load_newest,
    newest_common_step,
)
from runner.training.comm import CollectiveFailure, Comm, RunFailedError
from runner.training.state import ReplicaState


class SnapshotRestore:
    """`prefetch`: this rank's segments mapped, and memory faulted in, while the process started."""

    def __init__(self, comm: Comm, events: EventLog, recovery: RecoveryLoop, job_id: str, ckpt_dir: Path,
                 prefetch: Prefetch | None = None) -> None:
        self.comm, self.events, self.recovery = comm, events, recovery
        self.job_id, self.ckpt_dir = job_id, ckpt_dir
        self.prefetch = prefetch

    def __call__(self, state: ReplicaState) -> dict:
        regroup = False
        try:
            while True:
                try:
                    if regroup:
                        timeout_s = self.recovery.recovery_timeout_s
                        self.comm.join(self.comm.await_layout(timeout_s, newer_than=self.comm.gen))
                    return self._agree_and_load(state)
                except CollectiveFailure as err:  # a rank died meanwhile: the controller restarts everyone again
                    self.recovery.abandon(state, f"during snapshot restore: {err}")
                    regroup = True
        finally:
            if self.prefetch is not None:
                self.prefetch.close()

    def _agree_and_load(self, state: ReplicaState) -> dict:
        t0 = time.time()
        live = state.live_weights()
        rank = self.comm.logical_rank
        held = sorted({c.step for c in list_snapshots(self.job_id, rank, self.ckpt_dir)}, reverse=True)
        refused: set[int] = set()
        while True:
            table = self._gather([s for s in held if s not in refused])
            step = newest_common_step(table)
            if step is None:
                raise RunFailedError(
                    f"no snapshot step is held, with a valid checksum, by every rank (steps per rank: {table}); "
                    "there is nothing consistent to restart from: snapshot more often (ft.flash_ckpt.every_n_steps), "
                    "persist to disk (ft.flash_ckpt.persist_every_n_steps) or keep neighbour backups on")
            try:
                restored = load_newest(self.job_id, rank, self.ckpt_dir, step=step, into=live, prefetch=self.prefetch)
                skipped = restored.skipped
            except NoSnapshot as err:
                restored, skipped = None, err.skipped
            for s in skipped:
                self.events.emit("snapshot_skipped", step=s.candidate.step, source=s.candidate.source,
                                 location=str(s.candidate.location), reason=s.reason)
            if all(ok for (ok,) in self._gather([int(restored is not None)])):
                break
            refused.add(step)
        assert restored is not None  # the loop ends once every rank, this one included, restored
        dropped = invalidate_newer(self.job_id, rank, step, self.ckpt_dir)
        c = restored.candidate
        self.events.emit("snapshot_restored", step=step, source=c.source, location=str(c.location),
                         restore_s=time.time() - t0, skipped=len(restored.skipped), refused=sorted(refused),
                         invalidated=sorted({d.step for d in dropped}), written_by=restored.written_by)
        return restored.state

    def _gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (lengths may differ): a length round, then padded values."""
        dev = self.comm.device
        lengths = self.comm.allgather(torch.tensor([len(values)], dtype=torch.int64, device=dev))
        width = max(1, max(int(n) for n in lengths))
        padded = torch.full((width,), -1, dtype=torch.int64, device=dev)
        padded[: len(values)] = torch.tensor(values, dtype=torch.int64)
        rows = self.comm.allgather(padded)
        return [row[: int(n)].tolist() for row, n in zip(rows, lengths)]
