"""What a user sees on the console: the smoke plan's parameter count, rank 0's progress bar, one
readable line per recovery, and no worker banners or deprecation warnings."""

from __future__ import annotations

import io
import re

import pytest
from conftest import run_cli

from runner.control.console import RecoveryConsole
from runner.planning.plan import scaled

BANNERS = ("GPU available", "TPU available", "LitLogger", "LOCAL_RANK", "Warning", "deprecated")


@pytest.mark.parametrize("value, text", [(70_592, "70.6 K"), (410_000, "410 K"), (124_000_000, "124 M"),
                                         (12_900_000_000, "12.9 B"), (500, "500 ")])
def test_counts_are_printed_with_a_unit_that_fits(value, text):
    assert scaled(value) == text


@pytest.mark.slow
def test_a_smoke_run_with_a_killed_rank_reads_as_plan_bar_one_recovery_line_and_summary(run_dir):
    run = run_cli("+recipe=gpt_tiny", "runner.smoke=true", "logger=none", "parallel.nodes=2",
                  "parallel.procs_per_node=2", "ft=[flashrecovery]", "fault=kill_rank", "fault.rank=2",
                  "fault.step=10", run_dir=run_dir, quiet=False)
    assert run.returncode == 0, run.output[-3000:]
    lines = run.output.split("\n")
    # the plan counts the shrunk model's parameters, not "0.000 B"
    assert any(re.fullmatch(r"  model +\d[\d.]* K parameters, \d[\d.]* KFLOP per token \(training\)", x) for x in lines)
    # the recovery: one line of its own, readable, not the events' JSON
    recovery = [x for x in lines if "(SIGKILL)" in x]
    assert len(recovery) == 1, run.output[-3000:]
    assert re.fullmatch(r"\[runner\] step 10: rank 2 killed \(SIGKILL\) -> restarted in place; "
                        r"full world ready in \d+\.\d\d s \(detect\+decide\+replace\), 0 steps lost",
                        recovery[0]), recovery[0]
    assert '"recovery":' not in run.output
    # the progress bar: committed step, loss and tokens/s, no v_num
    assert re.search(r"step=20, loss=\d\.\d{4}, tokens/s=[\d,]+\]", run.output), run.output[-3000:]
    assert "v_num" not in run.output
    # the summary block: the same phases as the recovery line, rounded, the interval named
    assert re.search(r"RTO \d\.\d{3} s \(fault to first full-world commit: detect \d\.\d{3} \+ decide \d\.\d{3} \+ "
                     r"replace \d\.\d{3} \+ rebuild \d\.\d{3} \+ restore \d\.\d{3}\), RPO 0 steps", run.output)
    assert re.search(r"loss \d+\.\d{4} -> \d+\.\d{4}\n", run.output), run.output[-3000:]
    # no banners or warnings from any of the five workers
    assert not [b for b in BANNERS if b in run.output], run.output[-3000:]


def _feed(events: list[dict], progress_bar: bool = False) -> list[str]:
    out = io.StringIO()
    console = RecoveryConsole(progress_bar, out)
    for t, (kind, details) in enumerate(events):
        console({"t": 100.0 + t / 10, "step": -1, "rank": "controller", "kind": kind, **details})
    return out.getvalue().split("\n")


def test_a_node_loss_taken_over_by_spares_is_one_line_when_the_full_world_is_back():
    lines = _feed([
        ("fault_injected", {"fault": "kill_node", "victims": [2, 3], "t_fault": 100.0, "at_step": 20}),
        ("fault_detected", {"recovery": 0, "symptom": "node_silent", "node": 1}),
        ("recovery_decided", {"recovery": 0, "fault": "node_loss", "fault_class": "node_loss_spare_free",
                              "action": "swap_spare", "victims": [2, 3]}),
        ("generation", {"gen": 1, "members": [0, 1], "pending": [2, 3], "recovery": 0}),
        ("generation", {"gen": 2, "members": [0, 1, 4, 5], "pending": [], "recovery": 0}),
    ])
    assert lines == ["[runner] step 20: node lost (ranks 2, 3) -> warm spare took over; full world ready in 0.40 s "
                     "(detect+decide+replace), 0 steps lost", ""]


def test_an_uninjected_crash_and_a_failed_run_are_lines_too_each_starting_a_line_of_its_own_under_a_bar():
    lines = _feed([
        ("generation", {"gen": 0, "members": [0, 1], "pending": [], "recovery": -1}),
        ("fault_detected", {"recovery": 0, "symptom": "exit", "wid": 1, "code": 1}),
        ("recovery_decided", {"recovery": 0, "fault": "process_crash", "action": "restart_all", "victims": [1]}),
        ("run_failed", {"error": "no snapshot step is common to every rank"}),
    ], progress_bar=True)
    assert lines == ["", "[runner] run failed: no snapshot step is common to every rank", ""]
    lines = _feed([
        ("fault_detected", {"recovery": 3, "symptom": "exit", "wid": 1, "code": 1}),
        ("recovery_decided", {"recovery": 3, "fault": "process_crash", "action": "restart_all", "victims": [1]}),
        ("generation", {"gen": 5, "members": [4, 5], "pending": [], "recovery": 3}),
    ])
    assert lines == ["[runner] rank 1 exited with code 1 -> every rank restarted from the newest flash snapshot; "
                     "full world ready in 0.20 s (detect+decide+replace), steps lost in summary.json", ""]


def test_an_injected_hang_is_named_a_hang_though_its_worker_is_then_killed():
    lines = _feed([
        ("fault_injected", {"fault": "hang_rank", "victims": [1], "t_fault": 100.0, "at_step": 7}),
        ("fault_detected", {"recovery": 0, "symptom": "exit", "wid": 1, "code": -9}),
        ("recovery_decided", {"recovery": 0, "fault": "hang", "fault_class": "hang", "action": "restart_rank",
                              "victims": [1]}),
        ("generation", {"gen": 1, "members": [0, 2], "pending": [], "recovery": 0}),
    ])
    assert lines[0] == ("[runner] step 7: hang on rank 1 (injected hang_rank) -> restarted in place; "
                        "full world ready in 0.30 s (detect+decide+replace), 0 steps lost")


def test_a_failed_run_prints_its_reason_not_placeholders(tmp_path):
    from runner.cli import render_summary

    recovery = {"id": 0, "fault": "node_loss", "victims": [2, 3], "step": 7, "action": "fail", "rto_s": None,
                "detect_s": 1.0312, "decide_s": 0.0021, "replace_s": None, "rebuild_s": None, "restore_s": None,
                "rpo_steps": None}
    summary = {"status": "failed", "run_name": "gpt_tiny-x", "error": "no spare host is left", "global_step": 7,
               "initial_loss": 5.54321987, "final_loss": None, "steps_per_s": 3.0, "tokens_per_s": 900.0, "mfu": 0.0,
               "wall_s": 9.0, "train_s": 2.0, "effective_training_time_ratio": 1.0, "samples_committed": 28,
               "samples_lost": 0, "samples_duplicated": 0, "param_checksum": None, "recoveries": [recovery]}
    text = render_summary(summary, tmp_path)
    assert "error        no spare host is left" in text
    assert "loss 5.5432 -> n/a" in text
    assert "no ETTR: the run failed" in text and "ETTR 1.000" not in text
    assert "no RTO: the full world never committed again (reached: detect 1.031 + decide 0.002)" in text
    assert "None" not in text
