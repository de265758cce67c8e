"""``bench/control_scale.py``: the real controller and store against simulated hosts. No timing is asserted here
(benchmarks are never timed asserts); what is checked is that a recovery's store traffic is what the protocol's
O(N) model says, counted at its source, at two sizes, and that the bench ends leaving nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("route", ["store", "agent"])
def test_a_recoverys_store_operations_match_the_protocols_model_at_16_and_64_hosts(tmp_path, route):
    out = tmp_path / "scale.json"
    before = {p.pid for p in psutil.process_iter()}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "control_scale.py"), "--hosts", "16,64",
                          "--ranks-per-host", "4", "--steady-s", "1", "--json", str(out), "--route", route,
                          "--emit-calibration", str(tmp_path / "calibration.json"),
                          # counts, not times: a busy machine's late generators must not read as hangs or losses
                          "--heartbeat-misses", "50", "--saturation", "0"], cwd=ROOT,
                         # its directory, named on its processes' command lines, is this test's own: under
                         # pytest -n 2 the other route's bench may be running beside it
                         env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["hosts"] for r in results] == [16, 64] and [r["ranks"] for r in results] == [64, 256]
    for r in results:
        assert [f["fault"] for f in r["faults"]] == ["crash", "silent", "hang"]
        assert [f["action"] for f in r["faults"]] == ["restart_rank", "swap_spare", "restart_rank"]
        for f in r["faults"]:
            counted = f["ops"]
            modelled = {k: f["model"][k] for k in counted}
            assert counted == modelled, (r["hosts"], f)
    # O(N): the generation traffic grows with the ranks; the agents' does not, but for a hang's stack-dump signals
    # and, with route=agent, the notice of each generation to 48 more agents (posted and read)
    small, large = ([f["ops"] for f in r["faults"]] for r in results)
    assert all(b["gen"] > 3 * a["gen"] for a, b in zip(small, large))
    (crash, silent, hang), (crash_4x, silent_4x, hang_4x) = small, large
    notices = 0 if route == "store" else 2 * (64 - 16)  # per generation published
    assert crash_4x["agent"] - crash["agent"] == 2 * notices  # two generations: survivors, then complete
    assert silent_4x["agent"] - silent["agent"] == notices  # one: the spare host's
    assert hang_4x["agent"] - hang["agent"] == 5 * (256 - 64) + 2 * notices
    assert f"N=16 hosts x 4 = 64 ranks, heartbeat.route={route}" in run.stdout
    _the_simulator_takes_the_measured_phases_with_their_source(tmp_path / "calibration.json", results[-1])
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


def _the_simulator_takes_the_measured_phases_with_their_source(path, largest: dict) -> None:
    from runner.sim import calibration, report
    from tests.test_sim import load_cfg

    cfg = load_cfg()
    overrides = calibration.apply(cfg, str(path))
    crash, silent = (next(f for f in largest["faults"] if f["fault"] == kind) for kind in ("crash", "silent"))
    assert overrides == {"flashrecovery": {"detect": crash["detect_s"], "decide": crash["decide_s"]},
                         "deadpool": {"detect": silent["detect_s"], "decide": silent["decide_s"]}}
    source = report.constants(cfg, overrides)["phases.flashrecovery.detect_s"]["source"]
    assert source.startswith("measured: ") and "bench/control_scale.py, control plane at 64 hosts x 4 ranks" in source


def test_both_routes_at_one_size_print_their_ratio():
    """``--route store,agent`` measures each N under both routes in one invocation and prints agent over store."""
    sys.path.insert(0, str(ROOT / "bench"))
    from control_scale import route_ratio

    store = {"hosts": 16, "controller_cpu": 0.2, "store_ops_per_s": 4000.0, "generators_cpu": 0.5}
    agent = {"hosts": 16, "controller_cpu": 0.05, "store_ops_per_s": 500.0, "generators_cpu": 0.1}
    line = route_ratio(store, agent)
    assert line.startswith("N=16: route=agent / route=store, same run")
    assert "0.05 / 0.20 core = 0.25x" in line and "500 / 4000 = 0.12x" in line
    assert "= n/a" in route_ratio({**store, "controller_cpu": 0.0}, agent)
