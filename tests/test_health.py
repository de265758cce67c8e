"""The health check of spares and replacements (``runner.training.health``): what it measures on this host, and a spare
whose check fails is refused while the job trains on, exactly."""

from __future__ import annotations

import socket

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


def test_a_spare_that_fails_its_health_check_is_refused_and_the_job_trains_on(two_by_two, run_dir):
    """No matmul finishes within a picosecond: both spares of the spare host fail a real check, log why and exit;
    DeadPool never counts them, and the four training ranks end as the fault-free run does."""
    run = run_cli(*TWO_BY_TWO, "ft=[deadpool]", "health.matmul_max_s=1e-12", run_dir=run_dir)
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    failed = run.events("health_check_failed")
    assert sorted(e["node"] for e in failed) == [2, 2] and {e["role"] for e in failed} == {"spare"}
    assert all("over health.matmul_max_s=1e-12" in e["reason"] and e["measured"]["matmul_s"] > 0 for e in failed)
    assert not run.events("spare_ready")
    assert sorted(e["wid"] for e in run.events("spare_lost")) == sorted(e["wid"] for e in failed)
    assert s["recoveries"] == [] and s["param_checksum"] == two_by_two.summary["param_checksum"]
    assert (s["samples_lost"], s["samples_duplicated"]) == (0, 0)
    assert s["samples_committed"] == two_by_two.summary["samples_committed"]
