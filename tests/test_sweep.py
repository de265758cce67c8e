"""What Hydra's launchers see of a ``-m`` sweep: each job's final ``runner.optimized_metric``, a failed job raised
(so a launcher records it failed), and a non-zero exit once every job ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local"])
def test_a_sweep_with_a_refused_job_runs_the_others_and_exits_non_zero(tmp_path, launcher):
    """Job 0 is refused (trainer.lr=-1), job 1 trains beside or after it: Hydra's launcher (its own, joblib's
    processes, submitit's local jobs) records job 0 FAILED with the runner's error and job 1 COMPLETED with its final
    train/loss, and the sweep exits non-zero."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "-m", f"hydra/launcher={launcher}", "+recipe=gpt_tiny", "trainer.lr=-1,3e-3",
         "trainer.max_steps=3", "logger=none", "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}",
         "+hydra.callbacks.record._target_=tests.hydra_jobs.RecordJobReturn"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    refused, trained = (json.loads((sweep / job / "job_return.json").read_text()) for job in ("0", "1"))
    assert refused["status"] == "FAILED"
    assert refused["value"].startswith(f"JobFailed: the job in {sweep / '0'} was refused (bad config): exit code 2")
    # submitit's jobs write their output to logs of their own
    jobs_output = output + "".join(log.read_text() for log in sweep.glob(".submitit/*/*_log.*"))
    assert "trainer.lr=-1 must be > 0." in jobs_output
    assert not (sweep / "0" / "summary.json").exists()
    summary = json.loads((sweep / "1" / "summary.json").read_text())
    assert (summary["status"], summary["global_step"]) == ("completed", 3)
    assert trained == {"status": "COMPLETED", "value": summary["final_loss"]}  # train/loss at the last step


def test_the_final_value_is_the_newest_steps_last_record(tmp_path):
    """A step committed again after a restart has two records: the last one is the committed value; val/loss is
    read from the newest step that validated."""
    from runner.launch.objective import final_metric

    rows = [{"step": 1, "loss": 3.0, "val/loss": 3.5}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert final_metric(tmp_path, "train/loss") == 2.0
    assert final_metric(tmp_path, "val/loss") == 3.5
    assert final_metric(tmp_path / "elsewhere", "train/loss") is None  # no metrics.jsonl in this process's run dir
