"""Where was everyone? Before the controller kills a hung rank, each live rank's stacks and collective state.

The controller signals every live rank to dump the Python stacks of all its threads (``runner.training.stack_dumps``),
reads each one's last heartbeat (phase, step, generation, collectives in flight), and writes into
``<run dir>/diagnosis/<recovery id>/``: ``rank<r>.stacks.txt`` per rank that answered, ``state.json`` (every
rank's state) and ``verdict.txt``, a line such as "rank 0 stuck in all_reduce of step 20 (gen 0) waiting for
rank 1; rank 1 silent, its last heartbeat (1.0 s before) in compute of step 20: no stack (a stopped process
cannot dump)". A
stopped (SIGSTOP) process cannot dump: its part of the verdict comes from the others' state and its own last
heartbeat. The verdict is a pure function of the states (``verdict``), unit-tested on its own.
"""

from __future__ import annotations

import json
import re
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from runner.control.beats import AgentBeats, StoreBeats
from runner.control.membership import Membership
from runner.control.records import Recovery, Worker
from runner.plumbing.events import EventLog
from runner.training.stack_dumps import DUMP_SIGNAL, stack_file

DUMP_WAIT_S = 1.0  # the ranks that beat dump within milliseconds; a rank that does not answer is not waited for longer
POLL_S = 0.01
# the phases in which a rank is inside a collective with its peers (WorkerStatus.phase), as the verdict names them
COLLECTIVES = {"reduce": "all_reduce", "sync": "the ZeRO-1 parameter all-gather", "rendezvous": "the rendezvous",
               "takeover": "the takeover's all_reduce"}
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_FRAMEWORK = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                   | {str(Path(__file__).resolve().parents[2])})  # the runner's own tree: runner/, callbacks/


@dataclass
class RankState:
    """One live rank at the moment of the kill: its last heartbeat and, if it answered, where its threads were."""

    rank: int
    wid: int
    node: int
    phase: str
    step: int
    gen: int
    in_flight: int
    silent_s: float  # since its last heartbeat
    where: Optional[str] = None  # its training thread's innermost frame, user code first; None: no stack


def training_frame(dump: str) -> Optional[str]:
    """In a faulthandler dump of every thread, the training thread's (the one running ``runner/training/worker.py``)
    innermost frame of user code, else its innermost frame: ``file.py:44 (function)``."""
    threads: list[list[tuple[str, str, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], m["line"], m["func"]))
    training = next((t for t in threads if any(f.endswith("runner/training/worker.py") for f, _, _ in t)), None)
    if not training:
        return None
    user = [f for f in training if not f[0].startswith((*_FRAMEWORK, "<"))]  # <string>: the fork server's start
    file, line, func = (user or training)[0]
    return f"{'user code: ' if user else ''}{file}:{line} ({func})"


def verdict(hung: Optional[int], states: dict[int, RankState]) -> str:
    """One line: who waits in which collective for whom, and where the hung rank was (``hung`` None: no one rank is
    blamed, a generation stuck as a whole)."""
    parts = []
    waiting: dict[tuple[str, int, int], list[int]] = {}
    for s in states.values():
        if s.rank != hung and s.phase in COLLECTIVES:
            waiting.setdefault((s.phase, s.step, s.gen), []).append(s.rank)
    for (phase, step, gen), ranks in sorted(waiting.items(), key=lambda item: -len(item[1])):
        absent = sorted(r for r, s in states.items() if (s.phase, s.step, s.gen) != (phase, step, gen))
        parts.append(f"{_ranks(ranks)} stuck in {COLLECTIVES[phase]} of step {step} (gen {gen}) waiting for "
                     f"{_ranks(absent) if absent else 'no live rank'}")
    if hung is None and not parts:  # no rank in a collective (a regroup): where each one is
        where: dict[tuple[str, int, int], list[int]] = {}
        for s in states.values():
            where.setdefault((s.phase, s.step, s.gen), []).append(s.rank)
        parts = [f"{_ranks(ranks)} in {phase} of step {step} (gen {gen})"
                 for (phase, step, gen), ranks in where.items()]
    if hung is None:
        return "; ".join(parts)
    h = states[hung]
    if h.where is not None:
        parts.append(f"rank {hung} in {h.phase} of step {h.step}, at {h.where}")
    else:
        parts.append(f"rank {hung} silent, its last heartbeat ({h.silent_s:.1f} s before) in {h.phase} of step "
                     f"{h.step}: no stack (a stopped process cannot dump)")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


class Diagnoser:
    """Collects the diagnosis of a hang into the recovery's directory and record (``collect``)."""

    def __init__(self, run_dir: Path, members: Membership, fleet, beats: StoreBeats | AgentBeats, interval_s: float,
                 events: EventLog) -> None:
        """``beats``: the workers' heartbeats (``Detector.beats``): each rank's last phase, step and collectives."""
        self.run_dir, self.members, self.fleet, self.beats = Path(run_dir), members, fleet, beats
        self.interval_s, self.events = interval_s, events

    def collect(self, rec: Recovery, hung: Optional[Worker]) -> None:
        """``hung``: the rank about to be killed; None: a generation stuck as a whole (every rank waits)."""
        live = [w for w in self.members.live() if not w.done and w.hb_seq >= 0]
        if hung is not None and hung not in live:
            return
        now = time.monotonic()
        beats = {w.wid: beat for w, (_, beat) in zip(live, self.beats.read(live))}
        starts = {w.wid: _size(stack_file(self.run_dir, w.wid)) for w in live}
        try:  # all at once: one signal command per rank in turn would take N acknowledgements' time
            self.fleet.notify([(w.wid, w.node) for w in live], DUMP_SIGNAL)
        except Exception:
            pass  # an agent is gone: no stack from its ranks, their heartbeats still tell
        answering = [w for w in live if now - w.hb_change <= 2 * self.interval_s]  # a silent rank cannot dump
        dumps = self._read_dumps(answering, starts)
        out = self.run_dir / "diagnosis" / str(rec.id)
        out.mkdir(parents=True, exist_ok=True)
        states = {}
        for w in live:
            hb = beats[w.wid]
            dump = dumps.get(w.wid)
            if dump:
                (out / f"rank{w.logical}.stacks.txt").write_text(dump)
            states[w.logical] = RankState(w.logical, w.wid, w.node, hb["phase"], hb["step"], hb.get("gen", -1),
                                          hb.get("in_flight", 0), round(now - w.hb_change, 3),
                                          training_frame(dump) if dump else None)
        line = verdict(hung.logical if hung is not None else None, states)
        (out / "state.json").write_text(json.dumps({"hung": hung.logical if hung is not None else None, "verdict": line,
                                                    "ranks": [asdict(s) for s in states.values()]}, indent=1))
        (out / "verdict.txt").write_text(line + "\n")
        rec.diagnosis, rec.verdict = str(out.relative_to(self.run_dir)), line
        self.events.emit("hang_diagnosed", recovery=rec.id, dir=rec.diagnosis, verdict=line,
                         stacks=sorted(s.rank for s in states.values() if s.where is not None))

    def _read_dumps(self, answering: list[Worker], starts: dict[int, int]) -> dict[int, str]:
        """What each answering rank appended to its stack file, once its size holds still (or the wait ends)."""
        sizes = dict(starts)
        done: set[int] = set()
        deadline = time.monotonic() + DUMP_WAIT_S
        while len(done) < len(answering) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            for w in answering:
                size = _size(stack_file(self.run_dir, w.wid))
                if size > starts[w.wid] and size == sizes[w.wid]:
                    done.add(w.wid)
                sizes[w.wid] = size
        out = {}
        for w in answering:
            path = stack_file(self.run_dir, w.wid)
            if sizes[w.wid] > starts[w.wid]:
                with open(path, "rb") as f:
                    f.seek(starts[w.wid])
                    out[w.wid] = f.read().decode(errors="replace")
        return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
