"""The neighbour backup between two real processes over a real gloo group: the HOLDER's process
writes the owner's snapshot into its own host's memory, and a lost owner restores from that copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from runner.recovery.flash_ckpt import cleanup, load_newest, segment_name
from runner.recovery.flash_ckpt.segment import Slot, read_header
from runner.recovery.flash_ckpt.shm import slot_paths
from tests.test_flash_ckpt import assert_same, make_state

REPO = Path(__file__).resolve().parents[1]

_RANK = """
import json, os, sys
from datetime import timedelta
sys.path[:0] = [{tests!r}, {repo!r}]
import torch, torch.distributed as dist
from test_flash_ckpt import make_state
from runner.recovery.flash_ckpt import Snapshotter, exchange_with_partners

rank, other = {rank}, 1 - {rank}
state = make_state(5)
state["extra"]["owner"] = torch.tensor(rank)
snap = Snapshotter({job!r}, rank)
snap.save(state, 5)
snap.wait()
pg = dist.ProcessGroupGloo(dist.FileStore({store!r}, 2), rank, 2, timedelta(seconds=60))
events = []
# each is the other's partner: send to it, receive from it
exchange_with_partners(pg, {job!r}, rank, (other, other), [(other, other)], 5, timedelta(seconds=60), events.append)
snap.close(unlink=False)  # the segments stay for the test to read
print(json.dumps({{"pid": os.getpid(), "events": [[e.kind, e.step, e.where, e.detail] for e in events]}}))
"""


def test_the_holders_process_writes_the_copy_into_its_own_memory(job, tmp_path):
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK.format(tests=str(REPO / "tests"), repo=str(REPO), rank=r,
                                                                   job=job, store=store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
        ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        for holder, owner in ((1, 0), (0, 1)):
            assert ranks[holder]["events"] == [["backed_up", 5, f"rank {holder}", f"copy of rank {owner}"]]
            (path,) = [p for p in slot_paths(segment_name(job, owner, holder)) if p.exists()]
            assert read_header(path).pid == ranks[holder]["pid"]  # written by the holder, not the owner
            slot = Slot.open(path)
            try:
                meta = slot.committed_meta(5)
            finally:
                slot.close()
            assert meta["holder"] == holder and meta["written_by"]["pid"] == ranks[holder]["pid"]

        for path in slot_paths(segment_name(job, 0)):  # rank 0's host and its memory are gone
            path.unlink(missing_ok=True)
        restored = load_newest(job, 0, tmp_path)
        assert restored.candidate.source == "partner" and restored.candidate.step == 5
        expected = make_state(5)
        expected["extra"]["owner"] = torch.tensor(0)
        assert_same(expected, restored.state)
    finally:
        for p in procs:
            p.kill()
        cleanup(job)
