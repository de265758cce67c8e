"""The control plane's cost of a recovery, counted at its source (``runner.plumbing.store_counts``), against world size.

Two real jobs, of 4 and 8 ranks, each lose a rank to SIGKILL with ``RUNNER_STORE_COUNTS`` set: every process
records its store operations and new connections, and the counts over the recovery and over fault-free steps
are checked: recorded, nothing rebuilt or reconnected while healthy, and per member of the rebuilt groups the
group rebuild's store operations and connections constant in N (our arrivals, gloo's batched address read, gloo's
lazily connected pairs: a ring collective's two neighbours), over the recovery and from the fault to the end of the
run. Once more with DeadPool's shard replication, whose side group (a second group per generation, point to point
to a rank on the next node) is lazily connected too: its pairs connect at its first exchange, after the recovery's
first commit, so only the second window sees them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.plumbing import store_counts
from tests.conftest import run_cli


def _counted_kill(tmp_path: Path, n: int, monkeypatch,
                  ft: tuple[str, ...]) -> tuple[dict, dict, dict[str, int], int]:
    """One kill in a job of ``n`` ranks with the ``ft`` overrides: the recovery's counts, the counts from the fault
    to the end of the run, the fault-free steps' counts, the members of the two generations the recovery built
    (survivors-only, complete)."""
    counts = tmp_path / f"counts{n}"
    counts.mkdir()
    monkeypatch.setenv(store_counts.ENV, str(counts))
    run = run_cli("+recipe=gpt_tiny", "parallel.nodes=2", f"parallel.procs_per_node={n // 2}", "model.d_model=32",
                  "model.n_layer=1", f"trainer.global_batch_size={n}", *ft, "trainer.max_steps=8",
                  "fault=kill_rank", f"fault.rank={n - 1}", "fault.step=5", "logger=none",
                  run_dir=tmp_path / f"run{n}")
    assert run.summary["status"] == "completed", run.output[-3000:]
    rec = run.only_recovery()
    assert rec["decide_reason"] in ("conclusive_exit", "window")  # the window when the host is too busy to beat
    records = store_counts.load(counts)
    commits = {m["step"]: m["t"] for m in run.metrics() if m["gen"] == 0}
    whole = store_counts.by_phase(records, rec)["recovery"]
    since = store_counts.tally(records, rec["t_fault"], float("inf"))
    return whole, since, store_counts.tally(records, commits[2], commits[4]), 2 * n - 1


@pytest.mark.slow
@pytest.mark.parametrize("ft", [("ft=[flashrecovery]",), ("ft=[flashrecovery,deadpool]", "parallel.zero=1")],
                         ids=["world", "with_side_group"])
def test_recovery_counts_are_recorded_and_constant_per_member(tmp_path, monkeypatch, ft):
    small, small_since, small_steady, small_members = _counted_kill(tmp_path, 4, monkeypatch, ft)  # 4: a ring's
    large, large_since, large_steady, large_members = _counted_kill(tmp_path, 8, monkeypatch, ft)  # two neighbours
    for whole, steady in ((small, small_steady), (large, large_steady)):
        assert whole["arrival_ops"] and whole["gloo_ops"] and whole["other_ops"] and whole["group_sockets"]
        assert whole["store_clients"] >= 1  # the replacement's own connections to the store
        assert steady["store_ops"] and steady["group_ops"] == 0 and steady["connections"] == 0  # healthy: no rebuild
    assert large["store_clients"] == small["store_clients"]  # one replacement, whatever N
    for low, high in ((small, large), (small_since, large_since)):
        per_member = {key: (low[key] / small_members, high[key] / large_members)
                      for key in ("arrival_ops", "group_ops", "group_sockets")}
        for key in ("arrival_ops", "group_ops", "group_sockets"):  # O(1) per member (a full mesh's sockets: 2.1x)
            assert per_member[key][1] <= 1.5 * per_member[key][0], per_member
