"""The control plane's cost of a recovery, counted at its source (``runner.store_counts``), against world size.

Two real jobs, of 4 and 8 ranks, each lose a rank to SIGKILL with ``RUNNER_STORE_COUNTS`` set: every process
records its store operations and new connections, and the counts over the recovery and over fault-free steps
are checked: recorded, nothing rebuilt or reconnected while healthy, and per member of the rebuilt groups the
group rebuild's store operations and connections constant in N (our arrivals, gloo's batched address read, gloo's
lazily connected pairs: a ring collective's two neighbours).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import store_counts
from tests.conftest import run_cli


def _counted_kill(tmp_path: Path, n: int, monkeypatch) -> tuple[dict, dict[str, int], int]:
    """One kill in a job of ``n`` ranks: the recovery's counts, the fault-free steps' counts, the members of the
    two groups the recovery built (survivors-only, complete)."""
    counts = tmp_path / f"counts{n}"
    counts.mkdir()
    monkeypatch.setenv(store_counts.ENV, str(counts))
    run = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", f"parallel.procs_per_node={n // 2}", "model.d_model=32",
                  "model.n_layer=1", f"trainer.global_batch_size={n}", "ft=[flashrecovery]", "trainer.max_steps=8",
                  "fault=kill_rank", f"fault.rank={n - 1}", "fault.step=5", "logger=none",
                  run_dir=tmp_path / f"run{n}")
    assert run.summary["status"] == "completed", run.output[-3000:]
    rec = run.only_recovery()
    assert rec["decide_reason"] in ("conclusive_exit", "window")  # the window when the host is too busy to beat
    records = store_counts.load(counts)
    commits = {m["step"]: m["t"] for m in run.metrics() if m["gen"] == 0}
    whole = store_counts.by_phase(records, rec)["recovery"]
    return whole, store_counts.tally(records, commits[2], commits[4]), 2 * n - 1


@pytest.mark.slow
def test_recovery_counts_are_recorded_and_constant_per_member(tmp_path, monkeypatch):
    small, small_steady, small_members = _counted_kill(tmp_path, 4, monkeypatch)  # 4: a ring's two neighbours
    large, large_steady, large_members = _counted_kill(tmp_path, 8, monkeypatch)
    for whole, steady in ((small, small_steady), (large, large_steady)):
        assert whole["arrival_ops"] and whole["gloo_ops"] and whole["other_ops"] and whole["group_sockets"]
        assert whole["store_clients"] >= 1  # the replacement's own connections to the store
        assert steady["store_ops"] and steady["group_ops"] == 0 and steady["connections"] == 0  # healthy: no rebuild
    assert large["store_clients"] == small["store_clients"]  # one replacement, whatever N
    per_member = {key: (small[key] / small_members, large[key] / large_members)
                  for key in ("arrival_ops", "group_ops", "group_sockets")}
    for key in ("arrival_ops", "group_ops", "group_sockets"):  # O(1) per member (a full mesh's sockets: 2.1x)
        assert per_member[key][1] <= 1.5 * per_member[key][0], per_member
