"""The flash checkpoint's host memory, as a fault takes it away (``RecoveryAction.host_memory``).

In the CPU simulation every node shares this host's /dev/shm, so a lost node's memory has to be
taken away explicitly: its ranks' own segments and the partner copies they held. A whole-host loss
takes every segment of the job; a silent corruption flips one byte of a committed snapshot's data.
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.recovery.flash_ckpt.hygiene import cleanup
from runner.recovery.flash_ckpt.segment import read_header
from runner.recovery.flash_ckpt.shm import PREFIX, SHM_DIR, check_job_id, segment_name, slot_paths
from runner.recovery.flash_ckpt.slots import committed_steps


class SnapshotMemory:
    """The snapshot segments of job ``job_id`` (a ``runner.recovery.actions.HostMemory``)."""

    def __init__(self, job_id: str) -> None:
        check_job_id(job_id)
        self.job_id = job_id

    def drop_node(self, ranks: list[int]) -> list[Path]:
        """Unlink what the memory of a node with ``ranks`` held: their own snapshots and their partner copies."""
        doomed = [p for r in ranks for p in slot_paths(segment_name(self.job_id, r))]
        doomed += [p for r in ranks for p in SHM_DIR.glob(f"{PREFIX}.{self.job_id}.r*.b{r}.s*")]
        removed = [p for p in doomed if p.exists()]
        for path in removed:
            path.unlink(missing_ok=True)
        return removed

    def drop_host(self) -> list[Path]:
        """A whole-host loss: every segment of the job goes."""
        return cleanup(self.job_id)

    def corrupt_newest(self, rank: int) -> int:
        """Flip one byte of tensor data in ``rank``'s newest committed own snapshot; returns its step."""
        held = committed_steps(segment_name(self.job_id, rank))
        if not held:
            raise LookupError(f"rank {rank} of job {self.job_id} has no committed snapshot to corrupt")
        step, path = held[0]
        header = read_header(path)
        assert header is not None  # committed_steps lists only slots whose header parses
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, header.data_off)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), header.data_off)
        finally:
            os.close(fd)
        return step
