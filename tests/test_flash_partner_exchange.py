"""The neighbour backup between two real processes over a real gloo group: the HOLDER's process
writes the owner's snapshot into its own host's memory, and a lost owner restores from that copy; an
exchange a recovery abandons ends at once and commits nothing; in a run, a lost node's ranks restore
from copies their holders' processes wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.recovery.flash_ckpt.hygiene import cleanup
from runner.recovery.flash_ckpt.restore import load_newest
from runner.recovery.flash_ckpt.segment import Slot, read_header
from runner.recovery.flash_ckpt.shm import segment_name, slot_paths
from runner.recovery.flash_ckpt.slots import committed_steps
from tests.conftest import run_cli
from tests.test_flash_ckpt import assert_same, make_state

REPO = Path(__file__).resolve().parents[1]

_RANK = """
import json, os, sys
from datetime import timedelta
sys.path[:0] = [{tests!r}, {repo!r}]
import torch, torch.distributed as dist
from test_flash_ckpt import make_state
from runner.recovery.flash_ckpt.replica import exchange_with_partners
from runner.recovery.flash_ckpt.snapshotter import Snapshotter

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


_ABANDONED = """
import json, sys, threading
from datetime import timedelta
sys.path[:0] = [{tests!r}, {repo!r}]
import torch.distributed as dist
from test_flash_ckpt import make_state
from runner.recovery.flash_ckpt.snapshotter import Snapshotter
from runner.recovery.flash_ckpt.replica import Abandonment, exchange_with_partners

rank, other = {rank}, 1 - {rank}
snap = Snapshotter({job!r}, rank)
snap.save(make_state(5), 5)
snap.wait()
store = dist.FileStore({store!r}, 2)
pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
events, abandonment, out = [], Abandonment(), {{}}
exchange = threading.Thread(target=exchange_with_partners, args=(pg, {job!r}, rank, (other, other), [(other, other)],
                                                                  5, timedelta(seconds=60), events.append, abandonment))
if rank == 0:  # its partner does not answer until a recovery abandoned this exchange
    exchange.start()
    exchange.join(timeout=1.0)
    out["waiting"] = exchange.is_alive()
    abandonment.abandon()
    store.set("abandoned", "1")
else:
    store.wait(["abandoned"])
    exchange.start()
exchange.join()
snap.close(unlink=False)  # the segments stay for the test to read
print(json.dumps({{**out, "events": [[e.kind, e.where, e.detail] for e in events]}}))
"""


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_an_abandoned_exchange_commits_nothing_when_its_copy_arrives_after(job, tmp_path):
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", _ABANDONED.format(tests=str(REPO / "tests"), repo=str(REPO),
                                                                        rank=r, job=job, store=store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
        ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        assert ranks[0]["waiting"]  # rank 0 waited for its partner's copy when the recovery came
        # the copy of rank 1's arrives after the abandonment: rank 0 receives and commits none of it
        (copy,) = [e for e in ranks[0]["events"] if e[2].startswith("copy of rank 1")]
        assert copy == ["backup_failed", "rank 0",
                        "copy of rank 1: ExchangeFailed: abandoned: a recovery replaced its generation"]
        assert not committed_steps(segment_name(job, 1, 0))
    finally:
        for p in procs:
            p.kill()
        cleanup(job)


@pytest.mark.slow
def test_a_lost_nodes_ranks_restore_from_copies_their_holders_processes_wrote(run_dir):
    run = run_cli("+recipe=gpt_tiny", "trainer.max_steps=15", "ft=[flash_ckpt]", "ft.flash_ckpt.every_n_steps=5",
                  "parallel.nodes=2", "parallel.procs_per_node=2", "fault=kill_node", "fault.node=1",
                  "fault.step=13", run_dir=run_dir)
    assert run.summary["status"] == "completed", run.output[-4000:]
    pid = {e["rank"]: e["pid"] for e in run.events("worker_started") if e["role"] == "initial"}
    restored = {e["rank"]: e for e in run.events("snapshot_restored")}
    for owner, holder in ((2, 0), (3, 1)):  # node 1's ranks; their holders are the same local ranks on node 0
        assert restored[owner]["source"] == "partner" and restored[owner]["step"] == 10
        assert restored[owner]["written_by"]["pid"] == pid[holder] != pid[owner]
