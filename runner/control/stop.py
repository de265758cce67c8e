"""SIGINT/SIGTERM/SIGUSR2 to the launching process: a checkpoint at the next committed step, then a clean stop.

SIGUSR2 is the warning signal of submitit and SLURM (``--signal=USR2@90``) before a time limit.

The first signal sets ``protocol.STOP`` in the store. Every worker's heartbeat thread sees it, the
members learn it at one and the same committed step through that step's all-reduce
(``StepCommit.stop_agreed``), write ``checkpoints/last.ckpt`` there and end their fit; the run then
ends with status ``stopped`` (exit code 75, for a SLURM requeue: docs/outputs.md). The handler raises
nothing, so the controller's loop and its ``finally`` run as on any other ending. A second signal
ends the run at once: it raises ``KeyboardInterrupt``, the controller's "interrupted" path.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from runner.checkpoint import last_checkpoint
from runner.plumbing import protocol
from runner.plumbing.events import EventLog, read_jsonl

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


class StopOnSignal:
    """A context: while inside, SIGINT, SIGTERM and SIGUSR2 ask the workers to checkpoint and stop (only in the main
    thread, where Python delivers signals; elsewhere it changes nothing)."""

    def __init__(self, store: Any, events: EventLog, notify: Callable[[dict], None]) -> None:
        """``notify``: posts a notice to every node agent (``AgentFleet.post_notice``: ``heartbeat.route=agent``)."""
        self.store, self.events, self.notify = store, events, notify
        self.requested: Optional[str] = None  # the signal's name, once one came
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt  # the second one: end now
        self.requested = signal.Signals(signum).name
        self.store.set(protocol.STOP, self.requested)
        self.notify({"stop": True})
        self.events.emit("stop_requested", signal=self.requested)

    def stopped_early(self, done: dict[int, dict], max_steps: int) -> bool:
        """A stop was asked for and the workers ended before max_steps (a stop at the last step is a completion)."""
        return self.requested is not None and bool(done) and min(d["global_step"] for d in done.values()) < max_steps

    def last_line(self, run_dir: Path) -> str:
        """Where the checkpoint is, and how to continue from it."""
        saved = [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e["kind"] == "checkpoint_saved"]
        if not saved:
            return f"[runner] {self.requested}: no checkpoint was saved ({last_checkpoint(run_dir)} does not exist)"
        return (f"checkpoint saved: {saved[-1]['path']} (step {saved[-1]['at_step']}); continue it with the same "
                f"command plus runner.resume=auto (in this run dir), or runner.resume={run_dir} (in a new one)")
