"""Flash checkpoint: snapshot, persist, restore, backup and hygiene, asserted on real state.

Every test gets its own job id and fails if a segment of that job is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.agents.fork_server import ForkServer
from runner.recovery.actions import NodePersist
from runner.recovery.flash_ckpt import segment
from runner.recovery.flash_ckpt.checksum import digest
from runner.recovery.flash_ckpt.chunks import Plan, address
from runner.recovery.flash_ckpt.codec import flatten
from runner.recovery.flash_ckpt.disk import checkpoint_path, list_checkpoints, read_verified
from runner.recovery.flash_ckpt.hygiene import cleanup, cleanup_stale
from runner.recovery.flash_ckpt.persister import (
    PersistClient,
    Persister,
    PersistError,
    connect_persister,
    persist_latest,
    persister_address,
    settle_node_persister,
    start_node_persister,
)
from runner.recovery.flash_ckpt.prefetch import Prefetch
from runner.recovery.flash_ckpt.replica import backup_to_partner
from runner.recovery.flash_ckpt.restore import NoSnapshot, list_snapshots, load_newest, newest_common_step
from runner.recovery.flash_ckpt.segment import PAGE, read_header
from runner.recovery.flash_ckpt.shm import ShmSpaceError, job_files, segment_name, slot_paths
from runner.recovery.flash_ckpt.slots import SlotWriter
from runner.recovery.flash_ckpt.snapshotter import Snapshotter
from tests.local_hosts import wait_for

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def snap(job):
    s = Snapshotter(job, 0)
    yield s
    s.close(unlink=True)


def make_state(step: int) -> dict:
    """A Lightning-shaped checkpoint whose every tensor depends on `step`."""
    g = torch.Generator().manual_seed(step)
    sd = OrderedDict(w=torch.randn(64, 48, generator=g), b=torch.randn(48, generator=g))
    sd._metadata = OrderedDict({"": {"version": 1}})
    return {
        "global_step": step,
        "state_dict": sd,
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64, 48, generator=g)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "foreach": None}],
            }
        ],
        "loops": {"fit_loop": {"total": step, "ratio": float("inf")}},
        "extra": {
            "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
            "mask": torch.rand(5, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
            "strided": torch.randn(6, 4, generator=g).t(),
            "ids": torch.randint(0, 1000, (9,), generator=g, dtype=torch.int64),
        },
    }


def assert_same(a, b, where="state"):
    """Bit-identical tensors, identical Python types, keys in the same order."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def slot_of(job: str, step: int) -> Path:
    return next(c.location for c in list_snapshots(job, 0) if c.step == step and c.source == "memory")


# --- snapshot and restore -------------------------------------------------------------------


def test_roundtrip_is_bit_identical_and_restores_private_copies(job, snap):
    state = make_state(3)
    state["tied"] = state["state_dict"]["w"]
    snap.save(state, 3)
    snap.wait()
    restored = load_newest(job, 0)
    assert restored.candidate.step == 3 and restored.candidate.source == "memory" and not restored.skipped
    assert_same(state, restored.state)
    assert restored.state["tied"] is restored.state["state_dict"]["w"]  # stored once, tied again

    restored.state["state_dict"]["w"].add_(1.0)  # training on the restored tensors...
    again = load_newest(job, 0)  # ...must not reach the snapshot
    assert not again.skipped
    assert_same(state["state_dict"], again.state["state_dict"])


def test_restore_into_live_tensors_fills_them_in_place(job, snap):
    snap.save(make_state(4), 4)
    snap.wait()
    live = make_state(99)
    w = live["state_dict"]["w"]
    restored = load_newest(job, 0, into=live)
    assert restored.state["state_dict"]["w"].data_ptr() == w.data_ptr()
    assert_same(make_state(4)["state_dict"], live["state_dict"])


def test_prefetched_restore_reads_premapped_slots_into_prepared_memory(job, monkeypatch):
    """A restarting rank's restore goes through the mappings and the memory its Prefetch made,
    skips a corrupt newest snapshot all the same, and returns private, bit-identical tensors."""
    writer = Snapshotter(job, 0)
    writer.save(make_state(1), 1)
    writer.save(make_state(2), 2)
    writer.close()  # as in a restarted rank: no writer mapping of these slots in this process
    path = slot_of(job, 2)
    flip_byte(path, read_header(path).data_off + 100)

    prefetch = Prefetch(job, 0)
    try:
        assert prefetch.ready(60)
        assert len(segment._READERS) == 2  # both slots mapped ahead
        monkeypatch.setattr(segment.mmap, "mmap", lambda *a, **k: pytest.fail("a slot was mapped again"))
        live = make_state(99)
        restored = load_newest(job, 0, into={"state_dict": live["state_dict"]}, prefetch=prefetch)
        assert restored.candidate.step == 1 and [s.candidate.step for s in restored.skipped] == [2]
        assert_same(make_state(1), restored.state)
        assert restored.state["state_dict"]["w"].data_ptr() == live["state_dict"]["w"].data_ptr()
        exp_avg = restored.state["optimizer_states"][0]["state"][0]["exp_avg"]
        ids = restored.state["extra"]["ids"]
        assert exp_avg.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr()  # both in the prepared memory
        exp_avg.add_(1.0)  # training on the restored tensors leaves the snapshot as it was
        assert_same(make_state(1), load_newest(job, 0).state)
    finally:
        prefetch.close()
        cleanup(job)
    assert not segment._READERS

def test_save_async_copies_referenced_tensors_and_double_buffers(job, snap):
    for step in (1, 2, 3):
        state = make_state(step)
        snap.save_async(state, step)
        snap.wait()
        state["state_dict"]["w"].zero_()  # the optimizer step after wait() must not leak in
    assert [c.step for c in list_snapshots(job, 0)] == [3, 2]
    assert_same(make_state(3), load_newest(job, 0).state)
    assert_same(make_state(2), load_newest(job, 0, step=2).state)


def test_interrupted_write_is_never_current(job, snap):
    snap.save(make_state(1), 1)
    snap.save(make_state(2), 2)
    snap.wait()
    writer = SlotWriter(segment_name(job, 0))  # a writer that dies halfway through step 3
    slot = writer.begin(PAGE, 1024)
    slot.data()[:512].fill_(7)
    writer.abort(slot)
    writer.close()
    assert [c.step for c in list_snapshots(job, 0)] == [2]
    assert_same(make_state(2), load_newest(job, 0).state)


def test_flipped_byte_is_detected_and_skipped(job, snap, tmp_path):
    events = []
    snap.save(make_state(1), 1)
    snap.save(make_state(2), 2)
    snap.wait()
    path = slot_of(job, 2)
    flip_byte(path, read_header(path).data_off + 100)
    restored = load_newest(job, 0, on_event=events.append)
    assert restored.candidate.step == 1
    assert_same(make_state(1), restored.state)
    [skip] = restored.skipped
    assert skip.candidate.location == path
    assert "checksum mismatch in data bytes 0-" in skip.reason and '"w"' in skip.reason
    assert [(e.kind, e.step) for e in events] == [("skipped", 2)]
    assert persist_latest(snap.segment, tmp_path) == checkpoint_path(tmp_path, 0, 1)  # never persists step 2

    path1 = slot_of(job, 1)
    flip_byte(path1, read_header(path1).meta_off + 10)
    with pytest.raises(NoSnapshot, match="metadata checksum") as err:
        load_newest(job, 0)
    assert [s.candidate.step for s in err.value.skipped] == [2, 1]


def test_prefault_falls_back_to_touching_pages(job, snap, monkeypatch):
    monkeypatch.setattr(segment, "_MADV_POPULATE_WRITE", 12345)  # EINVAL, as on kernels before 5.14
    snap.save(make_state(1), 1)
    snap.wait()
    assert_same(make_state(1), load_newest(job, 0).state)


def test_checksum_sees_flips_and_moved_blocks():
    data = torch.randn(3 * 1024 + 5).view(torch.uint8).numpy().copy()
    base = digest(data)
    flipped = data.copy()
    flipped[5000] ^= 1
    swapped = data.copy()
    swapped[:4096], swapped[4096:8192] = data[4096:8192], data[:4096]
    assert len({base, digest(flipped), digest(swapped), digest(data[:-1])}) == 4
    assert digest(data) == base


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
@pytest.mark.parametrize("two_streams", [False, True])
def test_fused_copy_kernels_match_the_checksum_and_copy_every_byte(chunk_bytes, two_streams):
    """The copy kernels' chunk checksums equal ``digest`` of the region bytes, padding is zeroed
    on the way in and summed on the way out, odd-sized and caller-copied tensors included."""
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(300_000, generator=g), "odd_int8": torch.arange(13, dtype=torch.int8),
             "odd_bf16": torch.randn(7, generator=g).bfloat16(), "strided": torch.randn(100, 100, generator=g)[:, :3],
             "empty": torch.zeros(0), "across_chunks": torch.arange(2_000_001, dtype=torch.int8)}
    flat = flatten(state)
    entries, data_len = segment.plan_layout(flat)
    plan = Plan.of(entries, data_len, chunk_bytes)
    region = np.full(data_len, 0xAB, dtype=np.uint8)  # stale bytes everywhere, padding included
    srcs = [address(t) for t in flat.tensors]
    assert srcs[list(state).index("strided")] is None  # not contiguous: the caller copies it
    for entry, tensor, src in zip(entries, flat.tensors, srcs):
        if src is None:
            raw = tensor.contiguous().view(torch.uint8).numpy().ravel()
            region[entry["offset"] : entry["offset"] + entry["nbytes"]] = raw
    with ThreadPoolExecutor(1) as pool:
        helper = pool if two_streams else None
        digests = plan.fill(region, srcs, helper)
        assert digests == [digest(region[plan.span(c)]) for c in range(plan.nchunks)]
        next_starts = [e["offset"] for e in entries[1:]] + [data_len]
        for entry, src, next_start in zip(entries, srcs, next_starts):
            if src is not None:  # the padding after a tensor the kernel copied is zeroed
                assert not region[entry["offset"] + entry["nbytes"] : next_start].any()

        outs = [torch.full(t.shape, 0, dtype=t.dtype) for t in flat.tensors]
        plan.drain(region, [address(o) for o in outs], digests, lambda c: AssertionError(f"chunk {c}"), helper)
        for out, tensor in zip(outs, flat.tensors):
            assert torch.equal(out.view(torch.uint8), tensor.contiguous().view(torch.uint8))

        padding = entries[list(state).index("odd_int8")]["offset"] + 13
        for where in (padding, data_len - 1, 0):
            corrupt = region.copy()
            corrupt[where] ^= 0x10
            with pytest.raises(ValueError, match=f"chunk {where // chunk_bytes}$"):
                plan.drain(corrupt, [address(o) for o in outs], digests, lambda c: ValueError(f"chunk {c}"), helper)


def test_invalidate_after_drops_an_abandoned_timeline(job, snap):
    snap.save(make_state(5), 5)
    snap.save(make_state(10), 10)
    assert snap.invalidate_after(5) == [10]
    assert [c.step for c in list_snapshots(job, 0)] == [5]
    snap.save(make_state(6), 6)
    snap.wait()
    assert [c.step for c in list_snapshots(job, 0)] == [6, 5]


def test_unsupported_values_are_refused_not_pickled():
    with pytest.raises(TypeError, match=r'\["callbacks", "cb"\]'):
        flatten({"callbacks": {"cb": object()}})


def test_newest_common_step():
    assert newest_common_step([[10, 5], [10, 15, 5], [5, 10]]) == 10
    assert newest_common_step([[15, 5], [10, 5]]) == 5
    assert newest_common_step([[15], [10]]) is None
    assert newest_common_step([]) is None


# --- persist ----------------------------------------------------------------------------------


def test_persist_is_atomic_verified_and_keeps_last_n(job, snap, tmp_path):
    persister = Persister(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        snap.save(make_state(step), step)
        snap.wait()
        path = persister.persist(snap.segment, step)
        assert path == checkpoint_path(tmp_path, 0, step)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [4, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step000000003-rank0.ckpt", "step000000003-rank0.ckpt.sum",
        "step000000004-rank0.ckpt", "step000000004-rank0.ckpt.sum",
    ]  # no temp files, no orphaned sidecars
    assert_same(make_state(4), torch.load(checkpoint_path(tmp_path, 0, 4), weights_only=True))

    snap.close(unlink=True)  # memory gone: restore falls back to disk, skipping a damaged file
    flip_byte(checkpoint_path(tmp_path, 0, 4), 200)
    restored = load_newest(job, 0, tmp_path)
    assert restored.candidate.source == "disk" and restored.candidate.step == 3
    assert "checksum mismatch" in restored.skipped[0].reason
    assert_same(make_state(3), restored.state)


def test_persist_of_older_step_removes_abandoned_timeline_files(job, snap, tmp_path):
    persister = Persister(tmp_path, keep=5)
    for step in (2, 4):
        snap.save(make_state(step), step)
        snap.wait()
        persister.persist(snap.segment, step)
    snap.invalidate_after(2)  # rolled back to 2, then step 3 of the new timeline
    snap.save(make_state(3), 3)
    snap.wait()
    persister.persist(snap.segment, 3)
    assert [s for s, _ in list_checkpoints(tmp_path, 0)] == [3, 2]


def _served_client(tmp_path, **kw):
    """A client wired to a Persister whose serve loop the test starts when it wants."""
    req_r, req_w = Pipe(duplex=False)
    res_r, res_w = Pipe(duplex=False)
    events = []
    client = PersistClient(req_w, res_r, on_event=events.append)
    server = threading.Thread(target=Persister(tmp_path, **kw).serve, args=(req_r, res_w), daemon=True)
    return client, server, events, (req_r, res_w)


def test_persist_request_is_never_overtaken_by_newer_saves(job, snap, tmp_path):
    client, server, events, _ = _served_client(tmp_path, keep=5)
    snap.save(make_state(1), 1)
    snap.wait()
    client.request(snap.segment, 1)  # the persister has not even started yet
    snap.save(make_state(2), 2)  # fills the other slot
    snap.save_async(make_state(3), 3)  # needs step 1's slot: must wait for the persister's copy
    server.start()
    snap.wait()
    [outcome] = client.drain()
    assert outcome.ok and outcome.step == 1
    assert_same(make_state(1), torch.load(outcome.path, weights_only=True))
    assert [c.step for c in list_snapshots(job, 0)] == [3, 2]
    client.close()
    server.join()
    assert [(e.kind, e.step) for e in events] == [("persisted", 1)]


def test_every_failed_persist_is_reported(job, snap, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    client, server, events, _ = _served_client(blocker)
    server.start()
    with pytest.raises(PersistError, match="step 7 is not in memory"):
        client.request(snap.segment, 7)
    snap.save(make_state(1), 1)
    snap.wait()
    client.request(snap.segment, 1)
    with pytest.raises(PersistError, match="step 1: .*Error") as err:
        client.drain()
    assert [o.ok for o in err.value.outcomes] == [False]
    assert [(e.kind, e.step) for e in events] == [("persist_failed", 1)]
    client.close()
    server.join()
    snap.save(make_state(2), 2)  # the failed persist released its pin
    snap.wait()


def test_persister_death_fails_pending_requests(job, snap, tmp_path):
    client, _server, _events, (req_r, res_w) = _served_client(tmp_path)
    snap.save(make_state(1), 1)
    snap.wait()
    client.request(snap.segment, 1)
    req_r.close()
    res_w.close()  # the persister process is gone
    with pytest.raises(PersistError, match="persister exited before reporting"):
        client.drain()
    client.close()
    snap.save(make_state(2), 2)
    snap.save(make_state(3), 3)  # reuses step 1's slot: the pin is gone
    snap.wait()


# --- crashes, partners, hygiene ---------------------------------------------------------------

_CRASHING_WORKER = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {repo!r}]
from test_flash_ckpt import make_state
from runner.recovery.flash_ckpt.snapshotter import Snapshotter
from tests.local_hosts import wait_for
snap = Snapshotter({job!r}, 0)
for step in (1, 2, 3):
    snap.save(make_state(step), step)
snap.wait()
snap.save_async(make_state(4), 4)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_breakpoint_persist_after_crash_then_stale_cleanup(job, snap, tmp_path):
    crashed = f"{job}x"
    script = _CRASHING_WORKER.format(tests=str(REPO / "tests"), repo=str(REPO), job=crashed)
    try:
        # through `sh -c '...; true'` so that the worker's parent is gone too, as after a node crash
        proc = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0"; true', script],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        newest = list_snapshots(crashed, 0)[0].step
        assert newest in (3, 4)  # step 4 may or may not have committed before the kill

        path = persist_latest(segment_name(crashed, 0), tmp_path)
        assert path == checkpoint_path(tmp_path, 0, newest)
        assert_same(make_state(newest), torch.load(path, weights_only=True))

        snap.save(make_state(1), 1)  # a live job on the same host keeps its segments
        snap.wait()
        removed = cleanup_stale(keep_job_id=None)
        assert {p.name for p in removed} >= {p.name for p in slot_paths(segment_name(crashed, 0))}
        assert not job_files(crashed)
        assert [c.step for c in list_snapshots(job, 0)] == [1]
    finally:
        cleanup(crashed)


def _ask_for_a_persist(address: str, segment: str, conn) -> None:
    """A trainer that asks its node persister for step 1 of `segment`, says so, and waits to be killed."""
    client = connect_persister(address, segment, 0)
    assert client is not None
    client.request(segment, 1)
    conn.send("asked")
    conn.recv()


@pytest.mark.parametrize("bound", ["met", "passed"])
def test_a_restart_lists_snapshots_only_once_the_node_persister_finished_for_dead_trainers(bound, job, snap, tmp_path):
    """A dead trainer's persist is still being written when a restart settles. Within the settle's bound
    (``met``) the write and the persist at breakpoint after it land before the settle answers; past it
    (``passed``) they are called off, and nothing of them lands afterwards, not even once the disk comes back."""
    out_dir, events = tmp_path / "checkpoints", tmp_path / "events.jsonl"
    out_dir.mkdir()
    snap.save(make_state(1), 1)
    snap.wait()
    server = ForkServer.fork()
    persister = start_node_persister(server, NodePersist(job, out_dir, 3, events, start=""), 0)
    address = persister_address(job, 0)
    # the persister's write of step 1 blocks until the test reads the other end: a disk that is slow, for as long as
    # the test wants
    slow = out_dir / f".{checkpoint_path(out_dir, 0, 1).name}.tmp{persister.process.pid}"
    os.mkfifo(slow)
    live = connect_persister(address, segment_name(job, 1), 1)  # a trainer that is alive: nothing to wait for
    reader = threading.Thread(target=lambda: slow.open("rb").read(), daemon=True)
    try:
        ours, theirs = Pipe()
        trainer = server.start(_ask_for_a_persist, (address, snap.segment), connections=(theirs,))
        theirs.close()
        assert ours.poll(60) and ours.recv() == "asked"
        trainer.kill()
        trainer.join(20)
        assert trainer.exitcode == -9

        if bound == "met":
            reader.start()
            settled = settle_node_persister(address, timeout_s=60)
            assert settled is not None and (settled.waited, settled.left) == (1, 0)
            # its request failed (the write went into the pipe) and was logged, as nobody could receive it; then the
            # persist at breakpoint wrote step 1: all of it before the settle returned
            assert_same(make_state(1), read_verified(checkpoint_path(out_dir, 0, 1)))
            last = ("snapshot_breakpoint_persisted", 1, None)
        else:
            settled = settle_node_persister(address, timeout_s=0.5)
            assert settled is not None and (settled.waited, settled.left) == (1, 1)  # the dead trainer's, still writing
            reader.start()  # the disk comes back: the request fails as above, the persist at breakpoint is written...
            wait_for("the persist at breakpoint",
                     lambda: events.exists() and "snapshot_breakpoint_failed" in events.read_text())
            assert "PublishRefused" in events.read_text()  # ...and not put in place: the restart listed the disk
            assert sorted(p.name for p in out_dir.iterdir()) == []  # no file, no sidecar, no temp file left
            last = ("snapshot_breakpoint_failed", -1, None)
            settled = settle_node_persister(address, timeout_s=60)
            assert settled is not None and (settled.waited, settled.left) == (0, 0)  # called off: not owed again
        logged = [json.loads(line) for line in events.read_text().splitlines()]
        assert [(e["kind"], e.get("snapshot_step", -1), e.get("ok")) for e in logged] == [
            ("snapshot_persist_unreported", 1, False), last]
        reader.join(20)
    finally:
        assert live is not None
        live.close()
        persister.stop()
        server.close()
    assert settle_node_persister(address, timeout_s=1) is None  # nobody listens there any more


def test_partner_copy_restores_a_lost_node(job, snap, tmp_path):
    snap.save(make_state(5), 5)
    snap.wait()
    assert backup_to_partner(job, owner=0, holder=1) == 5
    snap.close(unlink=True)  # node 0 and its /dev/shm are gone
    restored = load_newest(job, 0, tmp_path)
    assert restored.candidate.source == "partner" and restored.candidate.step == 5
    assert_same(make_state(5), restored.state)

    copy = next(iter(job_files(job)))
    flip_byte(copy, read_header(copy).data_off + 3)
    with pytest.raises(NoSnapshot, match="checksum mismatch"):
        load_newest(job, 0, tmp_path)
    with pytest.raises(LookupError, match="no committed snapshot"):
        backup_to_partner(job, owner=0, holder=1)  # nothing of rank 0 left to replicate
    assert cleanup(job) == [copy]  # the end of the run removes the partner's copy too


def test_cleanup_removes_all_of_a_job_and_nothing_else(job, snap):
    other = Snapshotter(f"{job}o", 0)
    try:
        snap.save(make_state(1), 1)
        other.save(make_state(1), 1)
        snap.wait()
        backup_to_partner(job, 0, 1)
        assert len(cleanup(job)) == 2  # one own slot (the second appears at the next save), one backup
        assert not job_files(job)
        assert len(job_files(f"{job}o")) == 1
    finally:
        other.close(unlink=True)


def test_full_shm_fails_early_with_one_clear_paragraph(job, snap, monkeypatch):
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if str(p).startswith("/dev/shm") else real(p))
    with pytest.raises(ShmSpaceError) as err:
        snap.save(make_state(1), 1)
    msg = str(err.value)
    assert "/dev/shm" in msg and "--shm-size" in msg and "\n" not in msg
    assert not job_files(job)

