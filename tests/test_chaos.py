"""fault=chaos: seeded draws, and real runs that survive every fault drawn, exactly and without leaks.

The soak test (``pytest -m soak``, not in the default run) keeps chaos runs going for ten minutes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.faults.chaos import Chaos
from runner.recovery.flash_ckpt.shm import SHM_DIR
from runner.recovery.flash_names import flash_job_id
from tests.conftest import run_cli

MIX = ["+recipe=gpt_tiny", "parallel.nodes=3", "parallel.procs_per_node=2", "parallel.spares=2",
       "ft=[flashrecovery,deadpool,ndb,flash_ckpt]", "trainer.global_batch_size=12", "fault=chaos"]
ALL_KINDS = "fault.kinds=[transient,kill_rank,hang_rank,kill_node,bitflip,partition,kill_all]"
RECOVERED = {"transient", "kill_rank", "hang_rank", "kill_node", "partition", "kill_all"}


def _chaos(seed: int, **keys) -> Chaos:
    fault = {"kinds": ["transient", "kill_rank", "kill_node"], "mtbf_s": 10.0, "max_faults": 3, "until_s": 100.0,
             **keys}
    return Chaos(OmegaConf.create(fault), seed)


def test_draws_are_reproducible_from_the_seed_and_only_among_what_can_be_handled():
    offer = {"transient": [0, 1, 2], "kill_rank": [0, 1, 2], "kill_node": []}  # no node loss can be handled now

    def sequence(seed: int) -> list:
        chaos, now, out = _chaos(seed), 0.0, []
        chaos.start(now)
        while not chaos.over:
            now = chaos.next_at
            assert chaos.due(now) and not chaos.due(now - 1e-6)
            draw = chaos.draw(now, offer)
            assert not chaos.due(now + 1e6)  # nothing until this one settled
            chaos.settled(now + 1.0)
            out.append((draw.kind, draw.victim, round(now, 6)))
        return out

    first = sequence(1)
    assert first == sequence(1) and first != sequence(2)
    assert len(first) == 3 and all(kind in ("transient", "kill_rank") for kind, _, _ in first)
    assert _chaos(1).draw(0.0, {"kill_node": []}) is None  # nothing to draw: no number is used up either


def test_chaos_stops_at_its_time_bound():
    chaos = _chaos(3, mtbf_s=50.0, max_faults=100, until_s=60.0)
    chaos.start(0.0)
    drawn = 0
    while not chaos.over:
        chaos.draw(chaos.next_at, {"transient": [0]})
        chaos.settled(chaos.next_at or 0.0)
        drawn += 1
    assert drawn < 100 and chaos.next_at - chaos.t0 > 60.0


def _assert_survived(run, max_steps: int) -> list[dict]:
    s = run.summary
    assert s["status"] == "completed", run.output[-4000:]
    assert (s["samples_lost"], s["samples_duplicated"], s["samples_misplaced"]) == (0, 0, 0)
    assert s["samples_committed"] == max_steps * 12 and s["global_step"] == max_steps
    assert s["param_checksum"]
    drawn = run.events("chaos_drawn")
    assert drawn and all(d["reason"] for d in drawn)
    decided = run.events("recovery_decided")
    assert all(d["action"] != "fail" and d["fault_class"] and d["reason"] for d in decided)
    assert all(k["reason"] for k in run.events("worker_killed"))  # every decision says why
    recovered = [d for d in drawn if d["fault"] in RECOVERED]
    assert len(s["recoveries"]) >= len(recovered)  # every fault but a bitflip made a recovery
    left = list(SHM_DIR.glob(f"*{flash_job_id(run.dir)}*"))
    assert not left, f"shared-memory segments left behind: {left}"
    return drawn


@pytest.mark.slow
def test_chaos_run_survives_every_fault_it_draws(run_dir):
    run = run_cli(*MIX, "trainer.max_steps=150", "fault.mtbf_s=2", "fault.max_faults=4", "seed=11",
                  run_dir=run_dir, timeout=300)
    drawn = _assert_survived(run, 150)
    assert len(drawn) <= 4


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_soak_chaos_for_ten_minutes(tmp_path: Path):
    """Chaos runs back to back until ten minutes have passed; each must end exact and leave nothing behind."""
    deadline, seed, faults = time.monotonic() + 600, 0, 0
    while time.monotonic() < deadline:
        run = run_cli(*MIX, ALL_KINDS, "trainer.max_steps=1200", "fault.mtbf_s=4", "fault.max_faults=1000",
                      f"seed={seed}", run_dir=tmp_path / f"soak{seed}", timeout=1200)
        faults += len(_assert_survived(run, 1200))
        print(f"soak run {seed}: {run.summary['wall_s']:.0f}s, {len(run.summary['recoveries'])} recoveries")
        seed += 1
    print(f"soak: {seed} runs, {faults} faults drawn")
