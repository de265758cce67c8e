"""A host cut off silently, as in a power loss, under launcher.mode=per_host: three torchrun trees as three hosts,
each in a network namespace of its own with its own address on a bridge; host 1's processes are frozen and its
link taken down, so that no connection is reset. The controller sees the host's heartbeat stop, the survivors'
collectives blocked on the frozen peers are aborted (not waited out to the collective timeout), and the spare
host takes over as when a host is killed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.distributed import TCPStore

from runner.plumbing import protocol
from runner.plumbing.protocol import Layout
from runner.training.comm import CollectiveFailure, Comm
from tests import netns
from tests import test_torchrun_per_host as per_host
from tests.conftest import read_summary
from tests.local_hosts import Job, events, free_port, max_step, processes_of, wait_for

LAYOUT, SECRET = per_host.LAYOUT, per_host.SECRET
# the fixtures: the same layout's fault-free run under launcher=local, and its checksum
local_fault_free, local_checksum = per_host.local_fault_free, per_host.local_checksum

COLLECTIVE_TIMEOUT_S = 30.0  # launcher.collective_timeout_s's default: what the survivors must not wait out


TIMEOUTS = SimpleNamespace(collective_timeout_s=COLLECTIVE_TIMEOUT_S, rendezvous_timeout_s=30.0,
                           recovery_timeout_s=30.0)
PAIR = Layout(gen=0, members=[0, 1], logical=[0, 1], dp=2)


def _silent_member(port: int, resume, late) -> None:
    """The second member, in a process of its own (a group's constructor holds the GIL while it waits for its
    peers, so two members in one process's threads can deadlock): joins, takes part in one collective (its
    connections are up, as in training), stays silent until told, then joins the collective the first one gave up
    on, as a host whose link came back does. ``late``: whether that collective reached the first member (it
    completed) or found its connections closed (it failed)."""
    silent = Comm(TCPStore("127.0.0.1", port, is_master=False), 1, "gloo", torch.device("cpu"), TIMEOUTS)
    silent.join(PAIR)
    silent.allreduce([torch.ones(4)])
    if resume.wait(60):
        try:
            silent.allreduce([torch.full((4,), 100.0)])
            late.value = 1
        except CollectiveFailure:
            late.value = 0
    silent.abort()


def test_a_collective_given_up_on_a_peer_cut_off_is_fenced_its_late_data_reaching_nothing():
    """Two gloo members; the second goes silent (its connections open) in a collective. Once the generation is
    marked cut off, the first stops waiting at once, far from the collective timeout, and its abort closes the
    generation's connections and waits for the given-up collective to end: when the peer comes back and sends, as
    after a partition healed, nothing reaches the tensor, which the next generation's step already uses again."""
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    resume, late = ctx.Event(), ctx.Value("i", -1)
    peer = ctx.Process(target=_silent_member, args=(store.port, resume, late))
    peer.start()
    try:
        live = Comm(store, 0, "gloo", torch.device("cpu"), TIMEOUTS)
        live.join(PAIR)
        live.allreduce([torch.ones(4)])
        store.set(protocol.cut_off_key(0), "node(s) [1] went silent")
        bucket = torch.ones(4)
        t0 = time.monotonic()
        with pytest.raises(CollectiveFailure, match=r"gen 0: node\(s\) \[1\] went silent"):
            live.allreduce([bucket])
        assert time.monotonic() - t0 < 2.0 and live.pg is None  # given up on, its group aborted and fenced
        assert live._stuck == []
        bucket.fill_(7.0)  # the next generation's step writes into the same bucket
        resume.set()  # the peer comes back and sends its part of the given-up collective
        peer.join(60)
        assert torch.equal(bucket, torch.full((4,), 7.0))  # nothing of it reached the bucket
        assert peer.exitcode == 0 and late.value == 0  # its collective found the connections closed
        live.abort()
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join()


MESSAGE_FLOATS = 128 * 2**20  # 512 MiB in one message (a broadcast sends its tensor whole): long to send, frozen midway


def _receiving_member(port: int, fenced, checked, out) -> None:
    """The first member, in a process of its own: receives the second's broadcast, which is frozen midway and cut
    off; once the call failed, the next generation's step writes into the tensor. ``out``: whether the call failed
    with the cut-off reason, how long it took, the work the fence left waiting (``Comm.stranded``), whether the
    tensor still holds only what the step wrote after the sender came back."""
    comm = Comm(TCPStore("127.0.0.1", port, is_master=False), 0, "gloo", torch.device("cpu"), TIMEOUTS)
    comm.join(PAIR)
    comm.allreduce([torch.ones(4)])
    tensor = torch.zeros(MESSAGE_FLOATS)
    t0 = time.monotonic()
    try:
        comm.broadcast(tensor, 1)
    except CollectiveFailure as err:
        out[0] = float("went silent" in str(err))
    out[1] = time.monotonic() - t0
    out[2] = comm.stranded
    tensor.fill_(7.0)
    fenced.set()
    checked.wait(60)
    out[3] = float(bool((tensor == 7.0).all()))
    os._exit(0)  # as a worker ends: nothing waits for the stranded work's group


def _sending_member(port: int, ready) -> None:
    comm = Comm(TCPStore("127.0.0.1", port, is_master=False), 1, "gloo", torch.device("cpu"), TIMEOUTS)
    comm.join(PAIR)
    comm.allreduce([torch.ones(4)])
    tensor = torch.full((MESSAGE_FLOATS,), 100.0)
    ready.set()
    with pytest.raises(CollectiveFailure):  # its rest finds the connection closed
        comm.broadcast(tensor, 1)
    os._exit(0)


def test_a_receive_cut_off_midway_is_fenced_without_stopping_the_worker_its_late_data_reaching_nothing():
    """gloo fails a closed connection's posted receives but not the one whose message it was reading: that one waits
    out its own timeout (docs/recovery.md, "Fencing a dropped generation"). The sender is frozen halfway through a
    512 MiB message and its generation cut off: the receiver gives the broadcast up at once, closes the connection,
    finds the receive still waiting and every connection closed, and goes on rather than stopping; when the sender
    comes back and sends the rest, nothing reaches the tensor the next generation uses."""
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    ready, fenced, checked = ctx.Event(), ctx.Event(), ctx.Event()
    out = ctx.Array("d", [-1.0] * 4)
    receiver = ctx.Process(target=_receiving_member, args=(store.port, fenced, checked, out))
    sender = ctx.Process(target=_sending_member, args=(store.port, ready))
    receiver.start()
    sender.start()
    try:
        assert ready.wait(60)
        io = psutil.Process(sender.pid)
        before = io.io_counters().write_chars
        deadline = time.monotonic() + 60
        while io.io_counters().write_chars - before < MESSAGE_FLOATS // 2:  # an eighth of its bytes: on its way
            assert time.monotonic() < deadline and sender.is_alive(), "the broadcast never started"
        io.send_signal(signal.SIGSTOP)
        sent = io.io_counters().write_chars - before
        assert sent < 4 * MESSAGE_FLOATS, sent  # frozen midway
        store.set(protocol.cut_off_key(0), "node(s) [1] went silent")
        deadline = time.monotonic() + 60
        while not fenced.wait(0.05):  # the fence's wait (2 s), then the call's failure
            assert receiver.is_alive(), receiver.exitcode  # stopped: 5 is EXIT_UNFENCED
            assert time.monotonic() < deadline, "the broadcast was never given up on"
        failed, took, stranded, _ = out[:]
        assert failed == 1.0 and took < 10.0, (failed, took)  # given up on, far from the collective timeout (30 s)
        assert stranded == 1.0  # the receive gloo left waiting on the closed connection
        io.send_signal(signal.SIGCONT)  # the sender comes back and sends the rest of the message
        sender.join(60)
        assert sender.exitcode == 0
        checked.set()
        receiver.join(60)
        assert receiver.exitcode == 0 and out[3] == 1.0  # nothing of the late message reached the tensor
    finally:
        for p in (receiver, sender):
            if p.is_alive():
                psutil.Process(p.pid).send_signal(signal.SIGCONT)
                p.kill()
                p.join()


@pytest.mark.slow
@pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))
def test_a_host_cut_off_silently_is_detected_by_heartbeat_and_replaced_by_the_spare_host(make_job, local_checksum):
    job = make_job()
    with netns.Hosts(3) as hosts:
        try:
            _run(job, hosts, local_checksum)
        finally:
            job.close()  # SIGKILL ends the frozen tree too


@pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))  # default tier: about 1 minute
@pytest.mark.parametrize("route", ["store", "agent"])  # agent: the agents' own round trips, every quarter of the bound
def test_when_the_controllers_host_is_cut_off_silently_every_other_host_exits_non_zero_within_30s(make_job, route):
    """Host 0 (the controller, the control-plane store, torchrun's rendezvous store) loses its link, its processes
    running on: the other hosts' store calls neither answer nor fail, yet their agents and workers stop within the
    bound (``controller_lost_after_s``) and every process of their trees is gone within 30 s, with a non-zero code."""
    job = make_job()
    with netns.Hosts(3) as hosts:
        try:
            trees = start_hosts(job, hosts, *LAYOUT, f"heartbeat.route={route}")
            host0 = _tree_pids(trees[0].pid)
            hosts.cut_off(0)
            cut = time.monotonic()
            others = trees[1:]
            for tree in others:
                tree.wait(timeout=max(1.0, 30 - (time.monotonic() - cut)))
            wait_for("hosts 1 and 2's processes to end", lambda: not processes_of(job.token) - host0,
                     timeout_s=max(1.0, 30 - (time.monotonic() - cut)))
            took = time.monotonic() - cut
            assert all(tree.returncode != 0 for tree in others), job.output()
            lost = {str(e["rank"]): e for e in events(job.run_dir, "controller_lost")}  # agents' and workers'
            assert {"agent-1", "agent-2"} <= set(lost), job.output()
            assert lost["agent-1"]["exit_code"] == lost["agent-2"]["exit_code"] == 3
            print(f"host 0 cut off: hosts 1 and 2 ended after {took:.1f}s")
        finally:
            job.close()


def _run(job: Job, hosts: netns.Hosts, checksum: str) -> None:
    trees = start_hosts(job, hosts, *LAYOUT)
    frozen = [psutil.Process(p) for p in _tree_pids(trees[1].pid)]
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    hosts.cut_off(1)
    t_cut = time.time()

    survivors = [trees[0], trees[2]]
    wait_for("the summary", lambda: (job.run_dir / "summary.json").exists(), procs=survivors)
    s = read_summary(job.run_dir)
    assert s["status"] == "completed", job.output()
    (rec,) = s["recoveries"]
    assert (rec["fault"], rec["action"], rec["victims"]) == ("node_loss", "swap_spare", [2, 3])
    assert s["samples_lost"] == 0 and s["param_checksum"] == checksum

    detected = events(job.run_dir, "fault_detected")[0]  # the first symptom: host 1's heartbeat stopped
    assert (detected["symptom"], detected.get("node")) == ("node_silent", 1), detected
    hb = 0.1 * 10  # heartbeat.interval_s x heartbeat.misses (the defaults)
    print(f"host 1 cut off: detected after {detected['t'] - t_cut:.2f}s, recovery rto {rec['rto_s']:.2f}s")
    assert detected["t"] - t_cut <= hb + 1.5, f"detected {detected['t'] - t_cut:.2f}s after the cut"
    # the survivors' collectives with the frozen host were aborted, not waited out to the collective timeout
    assert rec["rto_s"] < COLLECTIVE_TIMEOUT_S / 5, rec
    assert all(p.status() == psutil.STATUS_STOPPED for p in frozen)  # no process of host 1 ever ran again
    t_end = time.monotonic()
    for tree in survivors:  # node 0 arrived in torchrun's exit barrier for host 1's agent: nobody waits for it
        assert tree.wait(timeout=30) == 0, job.output()
    print(f"the surviving hosts' torchruns ended {time.monotonic() - t_end:.1f}s after the summary")


def start_hosts(job: Job, hosts: netns.Hosts, *layout: str) -> list:
    """A per_host torchrun tree on each of the three hosts, training: host 0 (torchrun's rendezvous store and the
    controller), host 1 (ranks 2 and 3), host 2 (the spare host)."""
    head = hosts.address(0)
    port = free_port()
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={job.token[:8]}"]
    overrides = ["launcher.mode=per_host", *layout, f"launcher.control_host={head}"]
    env = {**SECRET, "GLOO_SOCKET_IFNAME": hosts.IFNAME}  # gloo on the host's own link, not the hostname's address
    trees: list = []
    for i in range(3):
        # host 0 hosts torchrun's rendezvous store and, started first, gets node rank 0 (ranks follow pids)
        # (the hosts share one host name: --local-addr is what torchrun hands out as MASTER_ADDR)
        conf = [f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={hosts.address(i)}"]
        trees.append(job.torchrun(3, 1, rdzv + conf, 0, *overrides, extra_env=env, prefix=tuple(hosts.exec_prefix(i))))
        if i == 0:
            wait_for("the rendezvous store", lambda: _listens(trees[0].pid, port), procs=trees, timeout_s=60)
    wait_for("training", lambda: max_step(job.run_dir) >= 3, procs=trees)
    joined = {e["node"]: e["pid"] for e in events(job.run_dir, "host_joined")}
    assert sorted(joined) == [0, 1, 2]
    for node, tree in enumerate(trees):
        assert joined[node] in _tree_pids(tree.pid), f"node {node} is not the tree started on host {node}"
    return trees


def _listens(pid: int, port: int) -> bool:
    """Whether a socket listens on ``port`` in the network namespace of ``pid`` (psutil sees only its own)."""
    tables = [open(f"/proc/{pid}/net/{t}").read().splitlines()[1:] for t in ("tcp", "tcp6")]
    rows = [line.split() for table in tables for line in table]
    return any(int(local.rsplit(":", 1)[1], 16) == port and state == "0A" for _, local, _, state, *_ in rows)


def _tree_pids(pid: int) -> set[int]:
    root = psutil.Process(pid)
    return {root.pid} | {c.pid for c in root.children(recursive=True)}
