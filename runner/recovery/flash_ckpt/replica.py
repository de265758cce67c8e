"""Neighbour backup: a copy of a rank's newest snapshot in a segment held by a partner rank.

In a real multi-node job the bytes would travel over torch.distributed (or the partner would
read the owner's segment over the network) and land in the partner's /dev/shm. In the CPU
simulation every node shares this host's /dev/shm, so the copy is a local memcpy into the
segment named ``rrflash.<job>.r<owner>.b<holder>``: the name says whose memory it stands for,
and losing the owner's own segment (a lost node) leaves the backup to restore from.
"""

from __future__ import annotations

from pathlib import Path

from .segment import encode_meta
from .slots import SlotWriter, newest_verified, open_verified
from .shm import segment_name


def backup_to_partner(job_id: str, owner: int, holder: int) -> int:
    """Copy `owner`'s newest verified snapshot into the backup segment `holder` keeps for it.

    The source is verified first, so a corrupt snapshot is never replicated. Returns the step.
    """
    target = segment_name(job_id, owner, holder)
    return newest_verified(segment_name(job_id, owner), lambda path, step: _copy(path, step, target, holder))


def _copy(path: Path, step: int, target: str, holder: int) -> int:
    with open_verified(path, step) as (src, meta):
        meta = {**meta, "holder": holder}
        data_len = max((e["offset"] + e["nbytes"] for e in meta["tensors"]), default=0)
        writer = SlotWriter(target)
        try:
            dst = writer.begin(len(encode_meta(meta)), data_len)
            try:
                dst.data()[:data_len].copy_(src.data()[:data_len])
            except BaseException:
                writer.abort(dst)
                raise
            writer.commit(dst, step, meta)
        finally:
            writer.close()
    return step
