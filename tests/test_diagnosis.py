"""Where was everyone when a rank hung (runner/control/diagnosis.py): the verdict from the ranks' states and stacks.
The real hang (a SIGSTOPped rank of 4) is checked by ``assert_diagnosed`` in test_flashrecovery.py's hang test."""

from __future__ import annotations

import json
import sysconfig

import runner
from runner.control.diagnosis import RankState, training_frame, verdict

DUMP = """Thread 0x00007f4bc1fff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/repo/callbacks/heartbeat.py", line 81 in _run

Current thread 0x00007f4be0633b80 (most recent call first):
  File "/home/me/mymodule.py", line 44 in training_step
  File "{site}/lightning/pytorch/core/module.py", line 1368 in step
  File "{runner}/training/worker.py", line 190 in run
  File "<string>", line 1 in <module>
"""


def test_the_training_threads_innermost_user_frame_is_where_it_is():
    site = sysconfig.get_paths()["purelib"]
    dump = DUMP.format(runner=runner.__path__[0], site=site)
    assert training_frame(dump) == "user code: /home/me/mymodule.py:44 (training_step)"
    framework_only = dump.replace('  File "/home/me/mymodule.py", line 44 in training_step\n', "")
    assert training_frame(framework_only) == f"{site}/lightning/pytorch/core/module.py:1368 (step)"
    assert training_frame("Thread 0x1 (most recent call first):\n  File \"x.py\", line 1 in f\n") is None


def state(rank: int, phase: str, step: int, where: str | None = "comm.py:462 (_wait_one)", silent_s=0.0) -> RankState:
    return RankState(rank, wid=rank, node=0, phase=phase, step=step, gen=0, in_flight=1, silent_s=silent_s, where=where)


def test_the_verdict_names_who_waits_for_the_hung_rank_and_where_it_was():
    states = {0: state(0, "reduce", 8), 1: state(1, "compute", 7, where=None, silent_s=1.04),
              2: state(2, "reduce", 8), 3: state(3, "reduce", 8)}
    assert verdict(1, states) == ("ranks 0, 2, 3 stuck in all_reduce of step 8 (gen 0) waiting for rank 1; rank 1 "
                                  "silent, its last heartbeat (1.0 s before) in compute of step 7: no stack (a stopped "
                                  "process cannot dump)")
    states[1] = state(1, "compute", 8, where="user code: mymodule.py:44 (training_step)")  # a stall: it answered
    assert verdict(1, states).endswith("; rank 1 in compute of step 8, at user code: mymodule.py:44 (training_step)")


def test_a_generation_stuck_as_a_whole_blames_no_rank():
    """Before a stuck generation is cut off (runner.control.phase_timeouts' reduction and recovery rules)."""
    states = {r: state(r, "reduce", 25) for r in range(4)}
    assert verdict(None, states) == "ranks 0, 1, 2, 3 stuck in all_reduce of step 25 (gen 0) waiting for no live rank"
    regroup = {r: state(r, "recovering", 20) for r in range(2)}
    assert verdict(None, regroup) == "ranks 0, 1 in recovering of step 20 (gen 0)"


def assert_diagnosed(run, recovery: dict, hung: int, answering: list[int]) -> None:
    """A hang's recovery entry names its diagnosis directory, which holds a stack for every rank that could dump,
    every live rank's state, and the verdict naming the hung rank."""
    out = run.dir / recovery["diagnosis"]
    assert recovery["diagnosis"] == f"diagnosis/{recovery['id']}" and out.is_dir()
    assert sorted(p.name for p in out.glob("rank*.stacks.txt")) == [f"rank{r}.stacks.txt" for r in answering]
    for r in answering:
        assert "runner/training/worker.py" in (out / f"rank{r}.stacks.txt").read_text()  # every thread, training too
    state = json.loads((out / "state.json").read_text())
    assert state["hung"] == hung and sorted(s["rank"] for s in state["ranks"]) == sorted([*answering, hung])
    assert recovery["verdict"] == state["verdict"] == (out / "verdict.txt").read_text().strip()
    waiting = ", ".join(map(str, answering))
    assert recovery["verdict"].startswith(f"rank{'s' if len(answering) > 1 else ''} {waiting} stuck in all_reduce")
    assert f"waiting for rank {hung}; rank {hung} silent" in recovery["verdict"]
    assert [e["verdict"] for e in run.events("hang_diagnosed")] == [recovery["verdict"]]
