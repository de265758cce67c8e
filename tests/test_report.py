"""``python -m runner.report``: report.md and plots from a hand-made sweep, and from a real one (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

CHECKSUM = "ab" * 32
PHASES = {"detect_s": 0.02, "decide_s": 0.03, "replace_s": 0.05, "rebuild_s": 0.01, "restore_s": 0.14}
T0 = 1_800_000_000.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _python(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def _jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _fake_job(job_dir: Path, fault: str, ft: tuple[str, ...] = ("flashrecovery",), step_s: float = 0.02) -> None:
    """A 12-step, 2-rank gpt_tiny run following docs/outputs.md; kill_rank loses rank 1 at step 6."""
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(f"- +recipe=gpt_tiny\n- ft=[{','.join(ft)}]\n- fault={fault}\n")
    (job_dir / ".hydra" / "config.yaml").write_text("recipe_name: gpt_tiny\nseed: 1234\n")
    faulty = fault != "none"
    metrics, t = [], T0 + 1.0
    for step in range(12):
        step_time = 0.3 if faulty and step == 6 else step_s
        t += step_time
        metrics.append({"step": step, "t": t, "loss": 5.5 - 0.03 * step, "step_time_s": step_time, "reduce_s": 0.004,
                        "tokens_per_s": 1024 / step_time, "counts": [1, 1], "misplaced": 0,
                        "gen": 2 if faulty and step >= 6 else 0})
    _jsonl(job_dir / "metrics.jsonl", metrics)
    events = [{"t": T0, "step": -1, "rank": "controller", "kind": "run_start", "world_size": 2, "nodes": 1,
               "ft": list(ft), "recipe": "gpt_tiny", "store_port": 40000}]
    recoveries = []
    if faulty:
        t_fault = metrics[5]["t"] + 0.005
        events += [
            {"t": t_fault, "step": -1, "rank": "controller", "kind": "fault_injected", "fault": fault, "index": 0,
             "victims": [1], "at_step": 6, "t_fault": t_fault},
            {"t": t_fault + 0.02, "step": -1, "rank": "controller", "kind": "fault_detected", "recovery": 0,
             "symptom": "exit", "wid": 1, "code": -9},
            {"t": t_fault + 0.05, "step": -1, "rank": "controller", "kind": "recovery_decided", "recovery": 0,
             "fault": "process_crash", "action": "restart_rank", "victims": [1], "reason": "restart in place"},
            {"t": t_fault + 0.25, "step": 7, "rank": 0, "kind": "step_committed_after_recovery", "gen": 2,
             "committed_step": 6},
        ]
        recoveries = [{"id": 0, "fault": "process_crash", "victims": [1], "step": 6, "action": "restart_rank",
                       "reason": "process_crash of logical rank(s) [1]: restart in place", "rpo_steps": 0,
                       "rto_s": 0.25, **PHASES, "survivors_ready_s": 0.06, "t_fault": t_fault}]
    train_s = metrics[-1]["t"] - metrics[0]["t"] + metrics[0]["step_time_s"]
    summary = {"status": "completed", "recipe": "gpt_tiny", "run_name": f"gpt_tiny-{'+'.join(ft)}-{fault}-w1x2",
               "ft": list(ft), "fault": fault, "world_size": 2, "nodes": 1, "global_step": 12,
               "initial_loss": 5.5, "final_loss": 5.17, "tokens_per_s": 12 * 1024 / train_s,
               "steps_per_s": 12 / train_s, "mfu": 0.05, "wall_s": train_s + 1.0, "train_s": train_s,
               "param_checksum": CHECKSUM, "recoveries": recoveries, "samples_committed": 96, "samples_lost": 0,
               "samples_duplicated": 0, "samples_misplaced": 0, "tokens_committed": 12 * 1024,
               "effective_training_time_ratio": (train_s - sum(r["rto_s"] for r in recoveries)) / train_s}
    (job_dir / "summary.json").write_text(json.dumps(summary))
    _jsonl(job_dir / "events.jsonl", events)


def _rows(report: str) -> dict[tuple[str, str], dict[str, str]]:
    """The main table's rows, keyed by (strategy, fault), as cells keyed by column."""
    section = report.split("## Strategy x fault")[1].split("## Recoveries")[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    header, body = cells[0], cells[2:]
    return {(row[header.index("strategy")], row[header.index("fault")]): dict(zip(header, row)) for row in body}


def _assert_report(sweep: Path) -> str:
    report = (sweep / "report.md").read_text()
    for line in report.splitlines():
        if line.startswith("|"):
            assert all(c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]), f"empty cell in: {line}"
    for name in ("progress.png", "rto_phases.png", "throughput.png", "loss.png"):
        data = (sweep / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    return report


def test_report_on_a_hand_made_sweep(tmp_path):
    _fake_job(tmp_path / "0", "none")
    _fake_job(tmp_path / "1", "kill_rank")
    _fake_job(tmp_path / "2", "none", ft=(), step_s=0.019)
    proc = _python("-m", "runner.report", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = _assert_report(tmp_path)
    rows = _rows(report)
    assert set(rows) == {("flashrecovery", "none"), ("flashrecovery", "kill_rank"), ("none", "none")}
    killed, clean = rows["flashrecovery", "kill_rank"], rows["flashrecovery", "none"]
    assert killed["strategy"] == clean["strategy"] == "flashrecovery"
    assert killed["status"] == "completed" and killed["recoveries"] == "1"
    assert killed["RTO (s)"] == "0.250" and killed["detect (s)"] == "0.020" and killed["restore (s)"] == "0.140"
    assert killed["RPO (steps)"] == "0"
    assert killed["checksum = fault-free"] == "yes"
    assert killed["fault-free overhead"].startswith("n/a[^") and "measures no fault-free overhead" in report
    assert clean["fault-free overhead"] == "+5.0% (vs 2)"  # 0.020 s against ft=[]'s 0.019 s per step
    ettr = json.loads((tmp_path / "1" / "summary.json").read_text())["effective_training_time_ratio"]
    assert killed["ETTR"] == f"{ettr:.3f}"
    assert clean["RTO (s)"].startswith("n/a[^") and "no recovery in this job" in report
    assert "| 1 | 0 | process_crash | 1 | 6 | restart_rank | 0.250 |" in report  # the per-recovery table


def test_report_without_any_summary_exits_2(tmp_path):
    (tmp_path / "0").mkdir()
    proc = _python("-m", "runner.report", str(tmp_path))
    assert proc.returncode == 2
    assert "No job with a summary.json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "report.md").exists()


def test_wandb_workspace_offline_exits_2_with_a_message():
    proc = _python("-m", "runner.report.wandb_workspace", "--entity", "e", "--project", "p", WANDB_MODE="offline")
    assert proc.returncode == 2
    assert "WANDB_MODE=offline" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_report_on_a_real_kill_rank_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _python("-m", "runner", "-m", "+recipe=gpt_tiny", "ft=[flashrecovery]", "fault=none,kill_rank",
                   "fault.rank=1", "fault.step=6", "trainer.max_steps=12", "logger=none",
                   "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}", timeout=240, WANDB_MODE="offline")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    proc = _python("-m", "runner.report", str(sweep))
    assert proc.returncode == 0, proc.stderr
    killed = _rows(_assert_report(sweep))["flashrecovery", "kill_rank"]
    assert killed["status"] == "completed" and killed["checksum = fault-free"] == "yes"
    assert float(killed["RTO (s)"]) > 0


def test_throughput_is_smoothed_and_a_pause_is_left_blank():
    from runner.report.plots import _with_gaps, smoothed

    assert smoothed([10, 10, 100, 10, 10], 3) == [10, 10, 10, 10, 10]  # one slow step draws no spike
    times, values = _with_gaps([0.0, 1.0, 2.0, 3.0, 30.0, 31.0], [1.0] * 6)
    assert times[:4] == [0.0, 1.0, 2.0, 3.0] and times[5:] == [30.0, 31.0]
    assert values[4] != values[4]  # NaN: matplotlib draws no line across the recovery
    assert _with_gaps([0.0, 1.0, 2.0, 3.0], [1.0] * 4) == ([0.0, 1.0, 2.0, 3.0], [1.0] * 4)


def test_progress_shades_each_recovery_and_every_rto_phase_is_written_out(tmp_path):
    from runner.report.collect import read_job
    from runner.report.plots import phase_text, recovery_spans

    _fake_job(tmp_path / "0", "kill_rank")
    _fake_job(tmp_path / "1", "none")
    killed, clean = read_job(tmp_path / "0", tmp_path), read_job(tmp_path / "1", tmp_path)
    t0 = killed.first_step_start()
    (rec,) = killed.recoveries
    ((start, end),) = recovery_spans(killed, t0)
    assert (start, end) == (rec["t_fault"] - t0, rec["t_fault"] - t0 + 0.25)
    assert recovery_spans(clean, clean.first_step_start()) == []  # a fault-free job's flats are not shaded
    assert phase_text(rec) == "detect 20 ms, decide 30 ms, replace 50 ms, rebuild 10 ms, restore 140 ms"
    assert phase_text({**rec, "restore_s": None}).endswith("restore n/a")
