"""Persist snapshots from /dev/shm to disk in a process other than the trainer.

A ``Persister`` lives in the node agent (or in a daemon the trainer spawns). It copies a
committed slot out under a shared lock, verifies it, and writes a Lightning-loadable file with
a checksum sidecar (disk.py). Ordering is strict: the trainer's ``PersistClient`` pins the slot
holding step k when it asks for k, and the snapshot writer cannot reuse a pinned slot, so a
newer memory save waits for the persister's copy instead of overwriting k. Every outcome,
failures included, is sent back and surfaces in ``PersistClient.drain``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from time import perf_counter
from typing import Any, Callable

from .disk import apply_retention, checkpoint_path, write_atomic
from .events import EventSink, emit
from .slots import find_step, load_slot, newest_verified, pin_step


class PersistError(RuntimeError):
    """A persist that did not produce a verified file; carries every outcome of the batch."""

    def __init__(self, message: str, outcomes: list[PersistOutcome] | None = None) -> None:
        super().__init__(message)
        self.outcomes = outcomes or []


@dataclass(frozen=True)
class PersistOutcome:
    segment: str
    step: int | None
    path: str | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


def _capture(segment: str, step: int | None) -> tuple[dict, Any]:
    """Private, verified copy of `step` (None: of the newest committed slot that verifies)."""
    if step is not None:
        return load_slot(find_step(segment, step), step=step)
    return newest_verified(segment, lambda path, held: load_slot(path, step=held))


class Persister:
    """Long-lived disk writer for snapshots; meant for a process other than the trainer."""

    def __init__(self, out_dir: str | Path, keep: int = 3, *, on_event: EventSink = None) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.out_dir = Path(out_dir)
        self.keep = keep
        self.on_event = on_event

    def persist(self, segment: str, step: int | None = None) -> Path:
        """Persist `step` of `segment` (None: its newest committed snapshot); raise PersistError."""
        outcome = self._run(segment, step)
        if not outcome.ok:
            raise PersistError(outcome.error, [outcome])
        return Path(outcome.path)

    def serve(self, requests: Connection, results: Connection) -> None:
        """Handle ``(segment, step)`` requests in order until ``None`` or the trainer's end closes.

        Sends ``("captured", segment, step)`` once the slot is copied out (the trainer may
        reuse it from then on) and ``("done", PersistOutcome)`` for every request.
        """
        try:
            while True:
                try:
                    msg = requests.recv()
                except EOFError:
                    return
                if msg is None:
                    return
                segment, step = msg
                outcome = self._run(segment, step, lambda: _notify(results, ("captured", segment, step)))
                _notify(results, ("done", outcome))
        finally:
            results.close()

    def _run(self, segment: str, step: int | None, on_captured: Callable[[], None] = lambda: None) -> PersistOutcome:
        t0 = perf_counter()
        try:
            meta, state = _capture(segment, step)
            on_captured()
            path = checkpoint_path(self.out_dir, meta["owner"], meta["step"])
            write_atomic(state, path, {"job_id": meta["job_id"], "rank": meta["owner"], "step": meta["step"]})
            apply_retention(self.out_dir, meta["owner"], meta["step"], self.keep)
            outcome = PersistOutcome(segment, meta["step"], str(path), None, perf_counter() - t0)
        except Exception as e:  # every failure is reported, never dropped
            outcome = PersistOutcome(segment, step, None, f"{type(e).__name__}: {e}", perf_counter() - t0)
        emit(self.on_event, "persisted" if outcome.ok else "persist_failed", outcome.step, outcome.path or segment, outcome.error or "")
        return outcome


def _notify(results: Connection, msg: tuple) -> None:
    """A trainer that died after asking still gets its snapshot written: only the report is lost."""
    try:
        results.send(msg)
    except OSError:
        pass


def persist_latest(segment_name: str, out_dir: str | Path, keep: int = 3, *, on_event: EventSink = None) -> Path:
    """Persist at breakpoint: write the newest committed, verified snapshot of a segment whose
    trainer may be dead. Raises PersistError if none verifies."""
    return Persister(out_dir, keep, on_event=on_event).persist(segment_name)


class PersistClient:
    """Trainer-side handle of a persister: pins the requested slot, sends the request, and
    collects outcomes on a listener thread that releases each pin once its slot is copied out."""

    def __init__(self, requests: Connection, results: Connection, *, on_event: EventSink = None,
                 process: mp.process.BaseProcess | None = None) -> None:
        self._requests, self._results, self._process = requests, results, process
        self._on_event = on_event
        self._cond = threading.Condition()
        self._pins: dict[tuple[str, int], int] = {}
        self._pending: set[tuple[str, int]] = set()
        self._outcomes: list[PersistOutcome] = []
        self._listener = threading.Thread(target=self._listen, name="flash-persist-results", daemon=True)
        self._listener.start()

    def request(self, segment: str, step: int) -> None:
        """Ask for `step` of `segment` to be persisted; it must be committed in memory."""
        key = (segment, step)
        with self._cond:
            if key in self._pending:
                return
        try:
            fd = pin_step(segment, step)
        except LookupError as e:
            raise PersistError(f"cannot persist: {e}") from e
        with self._cond:
            self._pins[key] = fd
            self._pending.add(key)
        try:
            self._requests.send(key)
        except OSError as e:
            self._finish(PersistOutcome(segment, step, None, f"persister unreachable: {e}", 0.0))
            raise PersistError(f"persister unreachable: {e}") from e

    def drain(self) -> list[PersistOutcome]:
        """Block until every request has an outcome; return them, or raise PersistError if any failed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
            outcomes, self._outcomes = self._outcomes, []
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise PersistError("; ".join(f"step {o.step}: {o.error}" for o in failed), outcomes)
        return outcomes

    def close(self) -> None:
        """Drain, then stop the persister; raises PersistError for failures not drained yet."""
        try:
            self.drain()
        finally:
            try:
                self._requests.send(None)
            except OSError:
                pass  # the persister is already gone; its outcomes were settled by the listener
            self._requests.close()
            self._listener.join()
            if self._process is not None:
                self._process.join()

    def _listen(self) -> None:
        while True:
            try:
                kind, *payload = self._results.recv()
            except (EOFError, OSError):
                break
            if kind == "captured":
                self._unpin(tuple(payload))
            else:
                self._finish(payload[0])
        with self._cond:
            lost = list(self._pending)
        for segment, step in lost:
            self._finish(PersistOutcome(segment, step, None, "persister exited before reporting", 0.0))
        self._results.close()

    def _unpin(self, key: tuple) -> None:
        with self._cond:
            fd = self._pins.pop(key, None)
        if fd is not None:
            os.close(fd)

    def _finish(self, outcome: PersistOutcome) -> None:
        key = (outcome.segment, outcome.step)
        self._unpin(key)
        with self._cond:
            if key not in self._pending:
                return
            self._pending.discard(key)
            self._outcomes.append(outcome)
            self._cond.notify_all()
        emit(self._on_event, "persisted" if outcome.ok else "persist_failed", outcome.step, outcome.path or outcome.segment, outcome.error or "")


def _serve_in_child(out_dir: str, keep: int, requests: Connection, results: Connection) -> None:
    Persister(out_dir, keep).serve(requests, results)


def spawn_persister(out_dir: str | Path, keep: int = 3, *, on_event: EventSink = None,
                    start_method: str = "spawn") -> PersistClient:
    """Start a persister process of our own (when no agent provides one) and return its client."""
    ctx = mp.get_context(start_method)
    req_r, req_w = ctx.Pipe(duplex=False)
    res_r, res_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve_in_child, args=(str(out_dir), keep, req_r, res_w), name="flash-persister", daemon=True)
    proc.start()
    req_r.close()
    res_w.close()
    return PersistClient(req_w, res_r, on_event=on_event, process=proc)
