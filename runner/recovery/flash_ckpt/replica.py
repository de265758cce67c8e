"""Neighbour backup: a copy of a rank's newest snapshot in a segment held by a partner rank.

In a real multi-node job the bytes would travel over torch.distributed (or the partner would
read the owner's segment over the network) and land in the partner's /dev/shm. In the CPU
simulation every node shares this host's /dev/shm, so the copy is a local memcpy into the
segment named ``rrflash.<job>.r<owner>.b<holder>``: the name says whose memory it stands for,
and losing the owner's own segment (a lost node) leaves the backup to restore from.
"""

from __future__ import annotations

from pathlib import Path

from .chunks import Plan
from .segment import Slot, encode_meta
from .shm import segment_name
from .slots import SlotWriter, newest_verified


def backup_to_partner(job_id: str, owner: int, holder: int) -> int:
    """Copy `owner`'s newest verified snapshot into the backup segment `holder` keeps for it.

    Each chunk is checked before it is copied and the copy commits only if all of them match,
    so a corrupt snapshot is never replicated. Returns the step.
    """
    target = segment_name(job_id, owner, holder)
    return newest_verified(segment_name(job_id, owner), lambda path, step: _copy(path, step, target, holder))


def _copy(path: Path, step: int, target: str, holder: int) -> int:
    src = Slot.open(path)
    try:
        src.lock(exclusive=False)
        meta = {**src.committed_meta(step), "holder": holder}
        plan = src.plan(meta)
        writer = SlotWriter(target)
        try:
            dst = writer.begin(len(encode_meta(meta)), plan.data_len)
            try:  # the region moves as one piece per chunk; the chunk checksums carry over
                region = [{"path": "data region", "offset": 0, "nbytes": plan.data_len}]
                whole = Plan.of(region, plan.data_len, plan.chunk_bytes)
                whole.drain(src.region(), [dst.region().ctypes.data], meta["digests"],
                            lambda c: src.mismatch(meta, plan, c))
            except BaseException:
                writer.abort(dst)
                raise
            writer.commit(dst, step, meta)
        finally:
            writer.close()
    finally:
        src.close()
    return step
