"""The health check of spares and replacements (``runner.training.health``): what it measures on this host, and a spare
whose check fails is refused while the job trains on, exactly."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from omegaconf import OmegaConf

from runner.training import health
from tests.conftest import TWO_BY_TWO, run_cli

DEFAULTS = OmegaConf.create({"matmul_size": 64, "matmul_max_s": 5.0, "min_free_memory_gib": 0.0,
                             "connect_timeout_s": 2.0})


def test_a_healthy_cpu_passes_and_every_check_is_measured():
    with socket.create_server(("127.0.0.1", 0)) as server:
        measured, failures = health.check(DEFAULTS, torch.device("cpu"), server.getsockname())
    assert failures == []
    assert measured["matmul_s"] > 0 and measured["free_host_gib"] > 0 and measured["connect_s"] >= 0


def test_each_check_fails_with_its_reason():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    # the port is closed now: nothing listens there
    impossible = OmegaConf.merge(DEFAULTS, {"matmul_max_s": 1e-12, "min_free_memory_gib": 1e9})
    _, failures = health.check(impossible, torch.device("cpu"), ("127.0.0.1", port))
    assert [f.split()[0:2] for f in failures] == [["a", "64x64"], ["host", "memory"], ["no", "TCP"]], failures
    assert "health.matmul_max_s=1e-12" in failures[0] and "health.min_free_memory_gib=1e+09" in failures[1]


REFUSED = [*TWO_BY_TWO, "ft=[deadpool]", "health.matmul_max_s=1e-12"]  # a spare host whose matmul is never fast enough


def test_a_spare_that_fails_its_health_check_is_refused_and_the_job_trains_on(two_by_two, run_dir):
    """No matmul finishes within a picosecond: both spares of the spare host fail a real check, log why and exit;
    DeadPool never counts them, and the four training ranks end as the fault-free run does."""
    run = run_cli(*REFUSED, run_dir=run_dir)
    failed = assert_spares_refused(run, two_by_two.summary)
    assert all("over health.matmul_max_s=1e-12" in e["reason"] and e["measured"]["matmul_s"] > 0 for e in failed)


def assert_spares_refused(run, fault_free) -> list[dict]:
    """Both spares of the spare host (node 2) failed their check, logged it and exited; DeadPool never counted them,
    and the four training ranks ended as the fault-free run did. Returns the ``health_check_failed`` events."""
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    failed = run.events("health_check_failed")
    assert sorted(e["node"] for e in failed) == [2, 2] and {e["role"] for e in failed} == {"spare"}
    assert not run.events("spare_ready")
    assert sorted(e["wid"] for e in run.events("spare_lost")) == sorted(e["wid"] for e in failed)
    assert s["recoveries"] == [] and s["param_checksum"] == fault_free["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert s["samples_committed"] == fault_free["samples_committed"]
    return failed


def _trained_group(store_port: int, keep: set[int], n: int = 3) -> dict:
    """Generation 0 of ``n`` gloo members over a real store, after one all-reduce (a member publishes its listener on
    its group's first collective); the groups of the members in ``keep`` are returned alive, the others dropped (their
    listeners closed, as a host's that went away)."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    from runner.training.comm import _gloo_group

    clients = [TCPStore("127.0.0.1", store_port, is_master=False) for _ in range(n)]
    wait = timedelta(seconds=30)

    def member(rank: int):
        pg = _gloo_group(PrefixStore("pg/0/", clients[rank]), rank, n, wait, wait)
        pg.allreduce([torch.ones(1)]).wait()
        return pg if rank in keep else None

    with ThreadPoolExecutor(n) as pool:
        groups = list(pool.map(member, range(n)))
    return {rank: pg for rank, pg in enumerate(groups) if pg is not None}


def test_a_spare_reaches_every_peers_published_listener_and_a_refusal_is_no_broken_path():
    """Three gloo members train generation 0, their listeners published; a spare's check connects to each. Member 1's
    group gone (nothing listens at its address any more), its host still answers, refusing: the path to it works, so
    the check passes and counts the refusal (an unreachable peer host: tests/test_netns_health.py)."""
    from torch.distributed import TCPStore

    from runner.plumbing.gloo_rendezvous import published_address
    from runner.plumbing.protocol import Layout

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("gen/0", Layout(gen=0, members=[10, 11, 12], logical=[0, 1, 2], dp=3).to_json())
    store.set("gen", "0")
    alive = _trained_group(store.port, keep={0, 1, 2})
    measured, failures = health.check_peers(DEFAULTS, store, wait_s=10)
    assert failures == [] and (measured["peers_gen"], measured["peers"]) == (0, 3), (measured, failures)
    assert measured["peers_refused"] == 0
    _, ip, port = published_address(store.get("pg/0//0/1"))  # gloo's key under the group's prefix store
    del alive[1]  # rank 1's group dropped: its listener closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((ip, port), timeout=2)
    measured, failures = health.check_peers(DEFAULTS, store, wait_s=10)
    assert failures == [] and (measured["peers"], measured["peers_refused"]) == (3, 1), (measured, failures)


def test_a_spare_waits_for_the_first_generation_to_publish_and_gives_up_at_its_bound():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    measured, failures = health.check_peers(DEFAULTS, store, wait_s=1.0)
    assert time.monotonic() - t0 >= 1.0 and measured == {"peers": 0}
    assert failures == ["the peers published no gloo listener within 1s to check the path to"]
    store.set("abort", "the run completed")  # nobody is left to train with: nothing to check, nothing failed
    assert health.check_peers(DEFAULTS, store, wait_s=1.0) == ({"peers": 0}, [])
