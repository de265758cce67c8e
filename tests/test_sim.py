"""Properties of the cluster simulator (runner.sim), not snapshots of its output."""
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.sim import calibration, report, schema
from runner.sim.anchors import rank_restart_phases, requeue_phases
from runner.sim.cli import CONF_DIR
from runner.sim.costs import CostModel
from runner.sim.engine import make_plan, run_point
from runner.sim.errors import ConfigError
from runner.sim.failures import FailureModel, FaultClass
from runner.sim.pricing import Pricing
from runner.sim.sweep import check_mix, policy_for, simulate

REPO = Path(__file__).resolve().parents[1]
F = FaultClass


def load_cfg(*overrides):
    schema.register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


@pytest.fixture(scope="module")
def cfg():
    return load_cfg()


@pytest.fixture(scope="module")
def model(cfg):
    return CostModel(cfg.costs, cfg.model, cfg.cluster)


@pytest.fixture(scope="module")
def paper_model():
    paper = load_cfg("profile=flashrecovery_paper")
    return CostModel(paper.costs, paper.model, paper.cluster)


def test_restart_all_grows_with_n_and_faster_than_linear_from_512_to_4096_on_the_papers_stack(paper_model):
    sizes = [512, 1024, 4096, 10240, 16384]
    times = [requeue_phases(paper_model, g).restart for g in sizes]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[2] / times[0] > 4  # the paper: 8 min -> 72 min for 8x the cards


def test_restart_all_has_no_quadratic_term_unless_the_profile_asks(model):
    """The default (Llama 3) stack's requeue grows by a step per doubling, as ByteRobust's Table 7."""
    times = [requeue_phases(model, g).restart for g in (2048, 4096, 8192, 16384)]
    steps = [b - a for a, b in zip(times, times[1:])]
    assert max(steps) / min(steps) < 1.5


def test_flashrecovery_rto_flat_in_n(model):
    rtos = [rank_restart_phases(model, g).total for g in (512, 4096, 10240, 16384)]
    assert max(rtos) / min(rtos) < 1.25


def test_fast_paths_beat_full_restart_by_far_at_scale_on_the_papers_stack(paper_model):
    pricing = Pricing(paper_model, {}, 16384)
    restart = pricing.requeue(F.node_loss).phases.total
    fast = [pricing.price("restart_rank", "flashrecovery", F.process_crash), pricing.price("swap_spare", "deadpool",
            F.node_loss), pricing.price("takeover", "ndb", F.node_loss)]
    for rec in fast:
        assert rec.phases.total < restart / 50, rec


def test_bad_technique_name_is_a_config_error():
    with pytest.raises(ConfigError, match="Valid names: flashrecovery, deadpool, ndb, flash_ckpt"):
        check_mix(["flashrecovery", "flashrecover"])
    with pytest.raises(ConfigError, match="repeated"):
        check_mix(["ndb", "ndb"])


def small(*extra):
    return load_cfg("job.days=20", "runs=3", *extra)


def test_ettr_in_unit_interval_and_ordered(tmp_path):
    cfg = small(
        "cluster.gpus=[1024,16384]",
        "mixes=[[],[flashrecovery],[flashrecovery,deadpool,ndb,flash_ckpt]]",
    )
    summary = report.summarize(simulate(cfg, {}), cfg)
    ettr = {(p["gpus"], tuple(p["mix"])): p["ettr_mean"] for p in summary["points"]}
    assert all(0 < v <= 1 for v in ettr.values())
    full = ("flashrecovery", "deadpool", "ndb", "flash_ckpt")
    for g in (1024, 16384):
        assert ettr[(g, ())] < ettr[(g, ("flashrecovery",))] <= ettr[(g, full)]
    assert ettr[(16384, ())] < ettr[(1024, ())]  # more GPUs, more failures, slower restarts
    gap = {g: ettr[(g, full)] - ettr[(g, ())] for g in (1024, 16384)}
    assert gap[16384] > gap[1024]


def test_every_second_is_accounted_for():
    cfg = small("cluster.gpus=4096", "mixes=[[ndb,flash_ckpt]]")
    point = next(iter(simulate(cfg, {}).points.values()))
    for r in point.runs:
        parts = r.progress_s + r.rework_s + r.downtime_s + r.checkpoint_s + r.degraded_s + r.straggler_s
        assert math.isclose(parts, r.wall_s, rel_tol=1e-9)
        assert r.wall_s == pytest.approx(cfg.job.days * 86400)
    assert any(r.degraded_s > 0 for r in point.runs)  # NDB ran at reduced speed


def test_stragglers_cost_their_pace_until_a_swap_and_leave_the_failures_unchanged():
    """With stragglers on, ``report`` runs at the slow host's pace until a restart of every process brings fresh
    nodes; ``swap_spare`` hands it to warm spares once the window found it. The failures each mix meets are the same
    with and without stragglers (their own RNG stream)."""
    mix = ["mixes=[[flashrecovery,deadpool]]", "cluster.gpus=16384", "stragglers.enabled=true"]
    swap_row = "+decision.policy.straggler=[swap_spare,report]"
    runs = {name: next(iter(simulate(cfg, {}).points.values())).runs
            for name, cfg in {"off": small(*mix[:2]), "report": small(*mix),
                              "swap": small(*mix, swap_row)}.items()}
    for name, rs in runs.items():
        for r in rs:
            parts = r.progress_s + r.rework_s + r.downtime_s + r.checkpoint_s + r.degraded_s + r.straggler_s
            assert math.isclose(parts, r.wall_s, rel_tol=1e-9), name
    assert all(r.stragglers == r.straggler_s == 0 for r in runs["off"])
    assert all(r.stragglers > 0 and r.straggler_s > 0 and r.straggler_swaps == 0 for r in runs["report"])
    assert all(r.straggler_swaps > 0 for r in runs["swap"])
    for off, rep, swap in zip(runs["off"], runs["report"], runs["swap"]):
        n = min(len(off.events), len(rep.events), len(swap.events))
        assert [e.cause for e in off.events][:n] == [e.cause for e in rep.events][:n] == \
            [e.cause for e in swap.events][:n]
        assert rep.events[0].t_s == pytest.approx(off.events[0].t_s)
        assert swap.straggler_s < rep.straggler_s and swap.ettr > rep.ettr < off.ettr
    with pytest.raises(ConfigError, match="which needs ft=deadpool"):
        simulate(small("mixes=[[flashrecovery]]", "cluster.gpus=1024", swap_row), {})


@pytest.mark.slow
def test_same_seed_same_output_other_seed_differs():
    a = report.summarize(simulate(small("seed=7"), {}), small("seed=7"))
    b = report.summarize(simulate(small("seed=7"), {}), small("seed=7"))
    c = report.summarize(simulate(small("seed=8"), {}), small("seed=8"))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_deadpool_needs_spares():
    def deadpool_node_losses(spares):
        cfg = small("cluster.gpus=16384", f"cluster.spares_nodes={spares}", "mixes=[[deadpool]]")
        point = next(iter(simulate(cfg, {}).points.values()))
        return sum(e.technique == "deadpool" and e.fault == "node_loss"
                   for r in point.runs for e in r.events)

    assert deadpool_node_losses(0) == 0
    assert deadpool_node_losses(4) > 0


def test_failure_rate_matches_llama3_reference(cfg):
    failures = FailureModel(cfg.failures)
    assert failures.job_mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert sum(failures.class_shares().values()) == pytest.approx(1.0)


def test_young_daly_interval_used_when_interval_is_null(model):
    cfg = small("job.checkpoint_interval_min=null")
    failures = FailureModel(cfg.failures)
    plan = make_plan(cfg, model, failures, 16384, [])
    expected = math.sqrt(2 * model.storage_write(16384) * failures.job_mtbf_s(16384))
    assert plan.checkpoint_interval_s == pytest.approx(expected)
    run = run_point(plan, policy_for(cfg, 16384, []), Pricing(model, {}, 16384), failures, 0, 1)[0]
    assert 0 < run.ettr < 1


def test_checkpoints_stall_the_job_as_often_as_the_interval_says():
    """Save cycles accounted in bulk cost exactly one save stall per interval of progress."""
    cfg = small("cluster.gpus=1024", "mixes=[[]]", "failures.rate_scale=0.000001", "job.checkpoint_interval_min=30")
    run = next(iter(simulate(cfg, {}).points.values())).runs[0]
    stall = CostModel(cfg.costs, cfg.model, cfg.cluster).storage_write(1024)
    saves = int(run.progress_s // (30 * 60))
    assert run.checkpoint_s == pytest.approx(saves * stall, rel=1e-6)


def test_calibration_file(tmp_path, cfg):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({
        "costs": {"heartbeat_s": 1.0},
        "phases": {"flashrecovery": {"rebuild_s": 2.0}},
    }))
    costs, overrides = calibration.load(str(path), cfg.costs)
    assert costs.heartbeat_s == 1.0 and overrides == {"flashrecovery": {"rebuild": 2.0}}
    model = CostModel(costs, cfg.model, cfg.cluster)
    phases = Pricing(model, overrides, 16384).price("restart_rank", "flashrecovery", F.process_crash).phases
    assert phases.rebuild == 2.0 and phases.detect == pytest.approx(2.5)
    other = Pricing(model, overrides, 16384).price("restart_rank", "deadpool", F.process_crash).phases
    assert other.rebuild != 2.0  # a measured phase replaces only its own technique's
    path.write_text(json.dumps({"costs": {"detect_seconds": 1}}))
    with pytest.raises(ConfigError, match="detect_seconds"):
        calibration.load(str(path), cfg.costs)


def test_calibrated_costs_are_labelled_measured_with_host_and_date(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"measured": {"host": "box1", "date": "2026-12-01", "by": "bench/recovery.py"},
                                "costs": {"process_start_s": 3.0}}))
    cfg = load_cfg()
    assert cfg.sources["costs.process_start_s"].startswith("guess")
    calibration.apply(cfg, str(path))
    assert cfg.costs.process_start_s == 3.0
    assert cfg.sources["costs.process_start_s"] == "measured: box1, 2026-12-01, bench/recovery.py"
    summary = report.summarize(simulate(small("cluster.gpus=1024", "mixes=[[]]"), {}), cfg)
    assert "costs.process_start_s" not in summary["guesses"] and "costs.decide_s" in summary["guesses"]


def test_bench_emits_a_calibration_file_the_simulator_reads(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    bench = importlib.import_module("recovery")
    ours = {"detected": [0.01, 0.02, 0.04], "replacement start-up": [1.0, 2.0, 3.0]}
    swaps = {"node loss, heartbeat.misses=10": {"detected": [1.1, 1.2, 1.4], "full world commits": [2.0]}}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(bench.calibration(ours, swaps)))
    cfg = load_cfg()
    overrides = calibration.apply(cfg, str(path))
    assert cfg.costs.process_start_s == 2.0
    assert overrides == {"flashrecovery": {"detect": 0.02}, "deadpool": {"detect": 1.2, "decide": 0.0}}
    assert cfg.sources["costs.process_start_s"].startswith(f"measured: {socket.gethostname()}, 20")


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "runner.sim", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_unknown_technique_fails_with_clear_message(tmp_path):
    proc = run_cli("ft=[flashrecovery,warp_drive]", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "warp_drive" in proc.stderr
    assert "Valid names: flashrecovery, deadpool, ndb, flash_ckpt" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_costs_set_on_the_command_line_are_labelled_guesses(tmp_path):
    proc = run_cli("ft=[]", "cluster.gpus=1024", "runs=1", "job.days=5", "costs.storage_gbps=500", "plots=false",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["constants"]["costs.storage_gbps"] == {
        "value": 500.0, "source": "guess: set on the command line (costs.storage_gbps=500)"}
    assert "costs.storage_gbps" in data["guesses"]


@pytest.mark.slow
def test_cli_default_run_prints_table_and_writes_json_fast(tmp_path):
    start = time.monotonic()
    proc = run_cli(f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 60
    for header in ("1,024 GPUs", "4,096 GPUs", "16,384 GPUs", "restart (ft=[])", "flashrecovery"):
        assert header in proc.stdout
    data = json.loads((tmp_path / "sim.json").read_text())
    assert {p["gpus"] for p in data["points"]} == {1024, 4096, 16384}
    assert all(0 < p["ettr_mean"] <= 1 for p in data["points"])
    assert data["profile"]["name"] == "llama3" and all(a["ok"] for a in data["anchors"])
    assert data["decisions"]["flashrecovery"]["node_loss_spare_free"]["action"] == "fail"
    assert "costs.decide_s" in data["guesses"] and "Guessed constants" in proc.stdout
    for png in ("ettr_vs_gpus.png", "rto_phases.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
