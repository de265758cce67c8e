"""``bench/store_costs.py``: the store's unit costs and the heartbeat protocols projected from them. No timing is
asserted (benchmarks are never timed asserts); what is checked is the accounting: the operations each protocol sends
host 0 follow from the protocol at every N, the reads were done at the sizes named, and the bench leaves nothing
behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
from pytest import approx

from runner.config.schema import HeartbeatConfig
from tests.conftest import ROOT


def test_each_protocols_store_traffic_follows_from_the_protocol_at_every_size(tmp_path):
    out = tmp_path / "costs.json"
    mark = {"STORE_COSTS_TEST": str(tmp_path)}  # inherited by the bench's store and client processes
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "store_costs.py"), "--hosts", "2,16",
                          "--ranks-per-host", "4", "--seconds", "0.3", "--repeats", "2", "--json", str(out)],
                         cwd=ROOT, env={**os.environ, **mark}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(result["units"][kind]["ops"] > 0 for kind in ("set", "round_trip"))
    assert [(p["hosts"], p["ranks"]) for p in result["projections"]] == [(2, 8), (16, 64)]
    hb = HeartbeatConfig()  # the defaults the bench projects for; a step a second (--step-s): two row changes
    beats, lost_trips = 1 / hb.interval_s, 4 / hb.controller_lost_after_s
    for p in result["projections"]:
        agents, world = p["hosts"] + 1, (p["hosts"] + 1) * 4  # the spare host beats too
        reads = result["reads"][str(p["hosts"])]
        assert (reads["per_worker"]["keys"], reads["per_host"]["keys"]) == (world, agents)
        # a worker: its beat set, gen and stop read; an agent: a set and a fence check every agent_beat_s
        assert p["per_worker"]["sets_per_s"] == approx(world * beats + agents / hb.agent_beat_s)
        assert p["per_worker"]["round_trips_per_s"] == approx(2 * world * beats + agents / hb.agent_beat_s)
        assert p["per_host"]["sets_per_s"] == approx(agents * beats)
        assert p["per_host"]["round_trips_per_s"] == approx(agents * lost_trips)
        assert p["per_host_changes"]["sets_per_s"] == approx(agents * (beats + 2))
        for name in ("per_worker", "per_host", "per_host_changes"):
            q = p[name]
            assert q["host0_cores"] == q["store_ops_cores"] + q["heartbeat_read_cores"]
            assert q["host0_vs_per_worker"] == approx(q["host0_cores"] / p["per_worker"]["host0_cores"])
        assert p["per_worker"]["host0_vs_per_worker"] == 1.0
    assert "16 x 4 (    64)" in run.stdout
    assert not [p for p in psutil.process_iter() if _environ(p).get("STORE_COSTS_TEST") == str(tmp_path)]


def _environ(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}
