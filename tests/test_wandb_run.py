"""The job's W&B run, read back from its offline ``.wandb`` file: one run, complete and live, in every ending.

The runs are real (2 nodes x 2 ranks of gpt_tiny, a SIGKILLed rank restarted in place, W&B offline); the
file is read with the record format wandb-core writes (below), so what is checked is what ``wandb sync``
would upload.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from runner.report.loggers import flatten
from tests.conftest import KILL_RANK, ROOT, Run, assert_nothing_left, run_cli

MAX_STEPS, LOG_EVERY = 30, 5  # KILL_RANK's (tests/conftest.py)


@dataclass
class LoggedRun:
    """What an experiment logger holds at the end of a job, in one shape for W&B and CSV."""

    config: dict
    rows: list[dict]
    summary: dict  # flat: nested keys joined by "/"
    alerts: list[tuple[str, str]]  # (title, level)
    exit_code: int | None = None
    files: list[Path] = field(default_factory=list)


# -- reading an offline run ----------------------------------------------------------------------------------
BLOCK, HEADER = 32768, 7  # wandb-core's transaction log: LevelDB's log format behind a 7-byte file header
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of a ``.wandb`` file, checked against its CRC."""
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    records, pos, chunks = [], HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break  # zeros after the last record
        chunk = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad record at offset {pos} of {path}"
        pos += HEADER + length
        chunks += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_run(run_dir: Path) -> LoggedRun:
    """The job's one offline run under ``<run dir>/wandb``: config, history rows, summary, alerts, exit code."""
    dirs = sorted(Path(run_dir).glob("wandb/offline-run-*"))
    assert len(dirs) == 1, f"expected one offline run, found {dirs}"
    files = sorted(dirs[0].glob("*.wandb"))
    assert len(files) == 1, files
    run = LoggedRun(config={}, rows=[], summary={}, alerts=[], files=dirs)
    summary: dict = {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.rows.append({_key(i): json.loads(i.value_json) for i in record.history.item
                             if not _key(i).startswith("_")})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "alert":
            run.alerts.append((record.alert.title, record.alert.level))
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.summary = flatten({k: v for k, v in summary.items() if not k.startswith("_")})
    return run


# -- what a complete run holds ----------------------------------------------------------------------------------
def assert_complete(logged: LoggedRun, run: Run, victim: int) -> None:
    """Every logged step, the recovery's events live on the step axis, the full config, the summary, the end."""
    s = run.summary
    assert s["status"] == "completed", run.output[-3000:]
    train = [r for r in logged.rows if "train/loss" in r]
    assert [r["global_step"] for r in train] == list(range(0, MAX_STEPS, LOG_EVERY))
    assert all({"train/tokens_per_s", "train/step_time_s", "wall_time"} <= set(r) for r in train)
    metrics = {m["step"]: m for m in run.metrics()}
    assert all(r["train/loss"] == pytest.approx(metrics[r["global_step"]]["loss"]) for r in train)

    events = {r["event/kind"]: r for r in logged.rows if "event/kind" in r}
    assert {"fault_injected", "fault_detected", "recovery_decided", "replacement_ready"} <= set(events), events
    assert events["fault_injected"]["global_step"] == 12
    assert json.loads(events["fault_injected"]["event/text"])["victims"] == [victim]
    assert json.loads(events["recovery_decided"]["event/text"])["action"] == "restart_rank"
    (recovered,) = [r for r in logged.rows if "recovery/id" in r]
    (entry,) = s["recoveries"]
    assert recovered["recovery/rto_s"] == pytest.approx(entry["rto_s"]) and recovered["recovery/rto_s"] > 0
    assert recovered["recovery/rpo_steps"] == entry["rpo_steps"] == 0
    assert 12 <= recovered["global_step"] <= 13  # the step the recovered world committed first
    # live: in the order they happened, among the training rows of the steps around them
    order = [r.get("event/kind") or ("recovery" if "recovery/id" in r else r["global_step"]) for r in logged.rows]
    assert order.index(10) < order.index("fault_injected") < order.index("recovery_decided")
    assert order.index("recovery_decided") < order.index("recovery") < order.index(20)
    assert logged.alerts == [("recovery 0: restart_rank", "WARN")]

    assert logged.config["trainer"]["max_steps"] == MAX_STEPS and logged.config["parallel"]["nodes"] == 2
    assert logged.config["fault"]["rank"] == victim and list(logged.config["ft"]) == ["flashrecovery"]
    for key in ("status", "effective_training_time_ratio", "samples_committed", "samples_lost", "param_checksum",
                "recoveries/0/rto_s", "recoveries/0/restore_s", "recoveries/0/rpo_steps"):
        assert logged.summary[key] == flatten(s)[key], key
    assert logged.exit_code in (None, 0)  # CSV has no exit record; W&B's is checked by its test


@pytest.mark.parametrize("victim", [pytest.param(2, marks=pytest.mark.slow), 0])  # run time: victim 2 in the slow tier
def test_one_complete_wandb_run_per_job_whichever_rank_dies(tmp_path, victim, request):
    run = request.getfixturevalue("rank0_killed") if victim == 0 else run_cli(  # the default logger
        *KILL_RANK, f"fault.rank={victim}", run_dir=tmp_path / "run", quiet=False)
    logged = read_wandb_run(run.dir)
    assert_complete(logged, run, victim)
    assert logged.exit_code == 0


@pytest.mark.slow
def test_a_failed_run_is_finished_with_its_reason(run_dir):
    run = run_cli(*[o for o in KILL_RANK if not o.startswith("ft=")], "fault.rank=1", "logger=wandb",
                  run_dir=run_dir, quiet=False)
    assert run.returncode == 1 and run.summary["status"] == "failed"
    logged = read_wandb_run(run_dir)
    assert logged.exit_code == 1
    assert logged.summary["status"] == "failed" and logged.summary["error"] == run.summary["error"]
    assert [r["event/kind"] for r in logged.rows if r.get("event/kind") == "run_failed"] == ["run_failed"]
    assert ("run failed", "ERROR") in logged.alerts
    assert [r["global_step"] for r in logged.rows if "train/loss" in r] == [0, 5, 10]


@pytest.mark.slow
def test_ctrl_c_finishes_the_run(run_dir):
    """SIGINT to the launching process mid-run (what Ctrl-C sends): the run still ends with its rows,
    its summary and an exit record."""
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "RR_TEST_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "runner", "+recipe=gpt_tiny", "trainer.max_steps=100000",
                             f"trainer.log_every_n_steps={LOG_EVERY}", "trainer.progress_bar=false",
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 180
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 2 * LOG_EVERY) and proc.poll() is None:
        assert time.monotonic() < deadline, "no steps committed in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    run = Run(subprocess.CompletedProcess(proc.args, proc.returncode, output, ""), run_dir)
    assert_nothing_left(token, run)
    logged = read_wandb_run(run_dir)
    assert logged.summary["status"] == run.summary["status"] != "completed", output[-3000:]
    assert logged.exit_code not in (None, 0)
    logged_steps = [r["global_step"] for r in logged.rows if "train/loss" in r]
    committed = [m["step"] for m in run.metrics()]
    assert logged_steps == [s for s in committed if s % LOG_EVERY == 0] and logged_steps


@pytest.mark.slow  # run time: a variant of what the default tier covers
def test_csv_is_as_complete(tmp_path):
    import csv

    from omegaconf import OmegaConf

    run = run_cli(*KILL_RANK, "fault.rank=0", "logger=csv", run_dir=tmp_path / "run", quiet=False)
    root = run.dir / "csv"

    def table(name: str) -> list[dict]:
        with open(root / name, newline="") as f:
            return [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]

    (summary,) = table("summary.csv")
    logged = LoggedRun(config=OmegaConf.to_container(OmegaConf.load(root / "hparams.yaml")), rows=table("metrics.csv"),
                       summary=summary, alerts=[(a["title"], a["level"]) for a in table("alerts.csv")])
    assert_complete(logged, run, victim=0)
    assert not list(run.dir.glob("wandb"))


def _number(text: str):
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text and "e" not in text else value


class Recorder:
    """An experiment logger backend that keeps its rows and alerts."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.alerts: list[tuple[str, str, str]] = []

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def alert(self, title: str, text: str, level: str) -> None:
        self.alerts.append((title, text, level))


def commit(step: int, t: float, gen: int) -> dict:
    """A line of metrics.jsonl: ``step`` committed at ``t`` by generation ``gen``."""
    return {"step": step, "t": t, "loss": 1.0 / (step + 1), "step_time_s": 0.1, "tokens_per_s": 10.0,
            "counts": [1, 1], "misplaced": 0, "gen": gen}


def test_the_run_logger_follows_the_files_from_where_they_ended(tmp_path):
    """Lines written before the logger was built (an earlier torchrun attempt) are not logged again; a line
    still being written waits; a recovery's row comes with the first step its complete generation commits."""
    from omegaconf import OmegaConf

    from runner.control.records import Recovery, RunRecord
    from runner.control.run_logger import RunLogger
    from runner.plumbing.events import JsonLines

    metrics, events = JsonLines(tmp_path / "metrics.jsonl"), JsonLines(tmp_path / "events.jsonl")
    metrics.write(commit(0, 99.0, 0))  # an earlier attempt's
    cfg = OmegaConf.create({"trainer": {"log_every_n_steps": 2}, "logger": {"kind": "csv"}})
    record = RunRecord(ft=["flashrecovery"], dp=2, t_start=100.0)
    logger = RunLogger(cfg, tmp_path, record)
    logger.backend = backend = Recorder()
    for step in range(4):
        metrics.write(commit(step, 101.0 + step, 0))
    events.write({"t": 104.5, "step": -1, "rank": "controller", "kind": "fault_injected", "fault": "kill_rank",
                  "victims": [1], "at_step": 4, "t_fault": 104.5})
    os.write(metrics.fd, b'{"step": 4, "t": 106.0, ')  # half a line: step 4, committed after the recovery
    logger.follow()
    assert [(r["global_step"], r["wall_time"]) for r in backend.rows] == [(0, 1.0), (2, 3.0), (4, 4.5)]
    assert backend.rows[-1]["event/kind"] == "fault_injected"

    record.recoveries.append(Recovery(id=0, t_detect=104.6, t_detect_mono=0.0, fault="process_crash", victims=[1],
                                      action="restart_rank", reason="restart in place", t_decide=104.7,
                                      t_ready=104.8, full_gen=1))
    os.write(metrics.fd, b'"loss": 0.2, "step_time_s": 0.1, "tokens_per_s": 10.0, "gen": 1}\n')
    logger.follow()
    assert [(r["global_step"], "train/loss" in r) for r in backend.rows[3:]] == [(4, True), (4, False)]
    recovered = backend.rows[-1]
    assert recovered["recovery/id"] == 0 and recovered["wall_time"] == 6.0
    assert recovered["recovery/rto_s"] == pytest.approx(1.5) and recovered["recovery/rpo_steps"] == 0
    assert backend.alerts[0][:1] == ("recovery 0: restart_rank",) and backend.alerts[0][2] == "WARN"
    logger.follow()
    assert len(backend.rows) == 5  # nothing twice


def test_the_run_logger_keeps_a_bounded_history_over_many_recoveries(tmp_path):
    """Each of 40 recoveries (a fault injected, detected twice, a survivors' and a complete group formed) gets its
    own RTO and RPO, while what the logger keeps for recoveries still to come stays the same size."""
    from omegaconf import OmegaConf

    from runner.control.records import Recovery, RunRecord
    from runner.control.run_logger import RunLogger
    from runner.plumbing.events import JsonLines

    metrics, events = JsonLines(tmp_path / "metrics.jsonl"), JsonLines(tmp_path / "events.jsonl")
    cfg = OmegaConf.create({"trainer": {"log_every_n_steps": 1000}, "logger": {"kind": "csv"}})
    record = RunRecord(ft=["flashrecovery"], dp=2, t_start=0.0)
    logger = RunLogger(cfg, tmp_path, record)
    logger.backend = backend = Recorder()
    kept = []
    for i in range(40):
        t, gen, step = 10.0 * i, 2 * i, 5 * i
        for k in range(3):
            metrics.write(commit(step + k, t + k, gen))
        events.write({"t": t + 3.0, "step": -1, "kind": "fault_injected", "at_step": step + 3, "t_fault": t + 3.0})
        for symptom in range(2):
            events.write({"t": t + 3.1 + symptom / 100, "step": -1, "kind": "fault_detected", "recovery": i})
        record.recoveries.append(Recovery(id=i, t_detect=t + 3.1, t_detect_mono=0.0, fault="process_crash",
                                          victims=[1], action="restart_rank", t_decide=t + 3.2, t_ready=t + 3.3,
                                          survivors_gen=gen + 1, full_gen=gen + 2))
        for g in (gen + 1, gen + 2):
            events.write({"t": t + 3.4, "step": step + 3, "kind": "group_formed", "gen": g, "members": 2})
        metrics.write(commit(step + 2 + i % 2, t + 4.0, gen + 2))  # every other recovery redoes one step
        logger.follow()
        kept.append((len(logger._phase_events), len(logger._first_commit)))
    recovered = [r for r in backend.rows if "recovery/id" in r]
    assert [r["recovery/id"] for r in recovered] == list(range(40))
    assert [r["recovery/rpo_steps"] for r in recovered] == [1, 0] * 20
    assert [r["recovery/rto_s"] for r in recovered] == pytest.approx([1.0] * 40)
    assert [r["recovery/rebuild_s"] for r in recovered] == pytest.approx([0.1] * 40)
    assert len(set(kept[1:])) == 1, kept  # the same size after every recovery
