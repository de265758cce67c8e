"""Persist snapshots from /dev/shm to disk in a process other than the trainer.

A ``Persister`` lives in a per-node process the node agent owns (``start_node_persister``), or
in a daemon the trainer spawns when no node persister listens (``spawn_persister``). It copies a
committed slot out under a shared lock, verifies it, and writes a Lightning-loadable file with
a checksum sidecar (disk.py). Ordering is strict: the trainer's ``PersistClient`` pins the slot
holding step k when it asks for k, and the snapshot writer cannot reuse a pinned slot, so a
newer memory save waits for the persister's copy instead of overwriting k. Every outcome,
failures included, is sent back and surfaces in ``PersistClient.drain``.

The node persister serves every trainer of its node over a Unix socket. A trainer whose
connection ends without its goodbye has died, and the persister then writes the newest snapshot
of its segment that verifies, unless that step is already on disk ("persist at breakpoint").
A restarted trainer first asks it to settle (``settle_node_persister``): to finish what it was
writing for trainers that have exited, so that the restart lists their files as they will stay
(DLRover's agent likewise saves to storage before it restarts its workers); what is not finished in
time is called off, never put in place afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any, Literal

import psutil

from runner.recovery.actions import NodePersist

from .disk import always_publish, apply_retention, checkpoint_path, sidecar_path, write_atomic
from .events import EventSink, emit
from .shm import PREFIX, check_job_id
from .slots import committed_steps, find_step, load_slot, newest_verified, pin_step

if TYPE_CHECKING:
    from runner.agents.fork_server import ForkedProcess, ForkServer

# the contexts that can start a process (the stubs give BaseContext no Process, rightly)
ProcessContext = mp.context.SpawnContext | mp.context.ForkServerContext | mp.context.ForkContext
FAILED = "failed"  # a trainer's last message when its fit failed: persist at breakpoint, as after a crash
SETTLE = "settle"  # a restarted trainer's first and only message: wait for the work of trainers that exited


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

    def __init__(self, out_dir: str | Path, keep: int = 3, *, on_event: EventSink = None,
                 gate: Callable[[], AbstractContextManager[bool]] = always_publish) -> None:
        """``gate``: what lets a written file into place, and retention run (``write_atomic``)."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.out_dir = Path(out_dir)
        self.keep = keep
        self.on_event = on_event
        self.gate = gate

    def persist(self, segment: str, step: int | None = None) -> Path:
        """Persist `step` of `segment` (None: its newest committed snapshot); raise PersistError."""
        outcome = self._run(segment, step)
        if outcome.error is not None:
            raise PersistError(outcome.error, [outcome])
        assert outcome.path is not None  # an outcome without an error names the file it wrote
        return Path(outcome.path)

    def serve(self, requests: Connection, results: Connection,
              on_unreported: Callable[[PersistOutcome], None] = lambda outcome: None) -> bool:
        """Handle ``(segment, step)`` requests in order until ``None`` or the trainer's end closes.

        Sends ``("captured", segment, step)`` once the slot is copied out (the trainer may
        reuse it from then on) and ``("done", PersistOutcome)`` for every request; an outcome the
        trainer can no longer receive goes to ``on_unreported``. Returns True after the trainer's
        goodbye (``None``), False after ``FAILED`` or if its end closed.
        """
        try:
            while True:
                try:
                    msg = requests.recv()
                except (EOFError, OSError):
                    return False
                if msg is None or msg == FAILED:
                    return msg is None
                segment, step = msg
                outcome = self._run(segment, step, partial(_notify, results, ("captured", segment, step)))
                if not _notify(results, ("done", outcome)):
                    on_unreported(outcome)
        finally:
            results.close()

    def _run(self, segment: str, step: int | None, on_captured: Callable[[], object] = lambda: None) -> PersistOutcome:
        t0 = perf_counter()
        try:
            meta, state = _capture(segment, step)
            on_captured()
            path = checkpoint_path(self.out_dir, meta["owner"], meta["step"])
            write_atomic(state, path, {"job_id": meta["job_id"], "rank": meta["owner"], "step": meta["step"]},
                         self.gate)
            with self.gate() as allowed:  # called off since: a restart listed the older files, they stay
                if allowed:
                    apply_retention(self.out_dir, meta["owner"], meta["step"], self.keep)
            outcome = PersistOutcome(segment, meta["step"], str(path), None, perf_counter() - t0)
        except Exception as e:  # every failure is reported, never dropped
            outcome = PersistOutcome(segment, step, None, f"{type(e).__name__}: {e}", perf_counter() - t0)
        emit(self.on_event, "persisted" if outcome.ok else "persist_failed", outcome.step, outcome.path or segment,
             outcome.error or "")
        return outcome


def _notify(results: Connection, msg: tuple) -> bool:
    """A trainer that died after asking still gets its snapshot written: only the report is lost (False)."""
    try:
        results.send(msg)
    except OSError:
        return False
    return True


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

    def close(self, failed: bool = False, timeout_s: float = 60.0) -> None:
        """Drain, say goodbye (`failed`: that the fit failed, so a node persister persists at
        breakpoint), wait for the persister to close its end (a spawned one exits); raises
        PersistError for failures not drained yet."""
        try:
            self.drain()
        finally:
            try:
                self._requests.send(FAILED if failed else None)
            except OSError:
                pass  # the persister is already gone; its outcomes were settled by the listener
            self._listener.join(timeout_s)  # ends on the persister's EOF, before our end closes
            self._requests.close()
            self._results.close()
            if self._process is not None:
                self._process.join(timeout_s)

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
        emit(self._on_event, "persisted" if outcome.ok else "persist_failed", outcome.step,
             outcome.path or outcome.segment, outcome.error or "")


def persister_address(job_id: str, node: int) -> str:
    """Where node `node`'s persister listens: a Linux abstract Unix socket (no file to clean up)."""
    return f"\0{PREFIX}-persister.{check_job_id(job_id)}.n{int(node)}"


def connect_persister(address: str, segment: str, rank: int, *, on_event: EventSink = None) -> PersistClient | None:
    """A client of the node persister at `address` for `rank`'s `segment`; None if none listens."""
    try:
        conn = Client(address, family="AF_UNIX", authkey=mp.current_process().authkey)
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    conn.send(("hello", segment, rank))
    return PersistClient(conn, conn, on_event=on_event)


class NodePersisterHandle:
    """The agent's side of a node persister process: stop it at the end, kill it with its node."""

    def __init__(self, process: ForkedProcess, control: Connection) -> None:
        self.process, self._control = process, control

    def stop(self, timeout_s: float = 30.0) -> None:
        """Let breakpoint persists in flight finish, then end the process (killed after `timeout_s`)."""
        try:
            self._control.send(None)
        except OSError:
            pass  # already gone
        self.process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(5)
        self._control.close()


def start_node_persister(server: ForkServer, spec: NodePersist, node: int,
                         timeout_s: float = 120.0) -> NodePersisterHandle:
    """Start node `node`'s persister from its host's fork server and return once it listens
    (RuntimeError if it does not within `timeout_s`), so that no trainer of the node can miss it."""
    control, child_control = mp.Pipe()
    proc = server.start(_node_main, (spec, node), connections=(child_control,))
    child_control.close()
    handle = NodePersisterHandle(proc, control)
    try:
        ready = control.poll(timeout_s) and control.recv() == "listening"
    except (EOFError, OSError):
        ready = False  # it died on the way; its traceback is on stderr
    if not ready:
        handle.kill()
        raise RuntimeError(f"the flash-checkpoint persister of node {node} did not start listening "
                           f"within {timeout_s:.0f} s")
    return handle


def _node_main(spec: NodePersist, node: int, control: Connection) -> None:
    from runner.plumbing.events import EventLog  # the node persister reports breakpoint persists in the run's log

    log = EventLog(spec.events_path, rank=lambda: f"persister-n{node}", step=lambda: -1)
    clients = _NodeClients()
    persister = Persister(spec.out_dir, spec.keep, gate=clients.publishing)
    address, authkey = persister_address(spec.job_id, node), mp.current_process().authkey
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    stopping = threading.Event()

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError, mp.AuthenticationError):
                if stopping.is_set():
                    return
                continue  # a peer that failed the handshake; the others keep being served
            if stopping.is_set():
                conn.close()
                return
            t = threading.Thread(target=_serve_node_client, args=(persister, conn, log, clients), daemon=True)
            clients.add(t, _peer_process(conn))
            t.start()

    acceptor = threading.Thread(target=accept, name="flash-persister-accept", daemon=True)
    acceptor.start()
    control.send("listening")
    try:
        control.recv()  # None: stop; EOFError: the agent is gone
    except EOFError:
        pass
    stopping.set()
    Client(address, family="AF_UNIX", authkey=authkey).close()  # wakes accept(), which then returns
    acceptor.join(10)
    listener.close()
    clients.join(30)


def _serve_node_client(persister: Persister, conn: Connection, log, clients: _NodeClients) -> None:
    """One trainer's requests; after its death, persist at breakpoint. Or one restarted trainer's settle."""
    try:
        first = conn.recv()
        if first[0] == SETTLE:
            _settle(conn, clients, float(first[1]))
            return
        _, segment, rank = first
    except (EOFError, OSError, ValueError, TypeError, IndexError):
        conn.close()
        return

    def unreported(outcome: PersistOutcome) -> None:
        log.emit("snapshot_persist_unreported", snapshot_rank=rank, snapshot_step=outcome.step, ok=outcome.ok,
                 path=outcome.path, error=outcome.error)

    if persister.serve(conn, conn, unreported):
        return
    held = committed_steps(segment)
    if not held:
        log.emit("snapshot_breakpoint_skipped", snapshot_rank=rank, reason=f"no committed snapshot in {segment}")
        return
    on_disk = checkpoint_path(persister.out_dir, rank, held[0][0])
    if on_disk.exists() and sidecar_path(on_disk).exists():
        log.emit("snapshot_breakpoint_skipped", snapshot_rank=rank, snapshot_step=held[0][0],
                 reason=f"already on disk: {on_disk}")
        return
    outcome = persister._run(segment, None)
    if outcome.ok:
        log.emit("snapshot_breakpoint_persisted", snapshot_rank=rank, snapshot_step=outcome.step, path=outcome.path,
                 seconds=outcome.seconds)
    else:
        log.emit("snapshot_breakpoint_failed", snapshot_rank=rank, reason=outcome.error)


@dataclass(frozen=True)
class Settled:
    """What a settle waited for: the connections of exited trainers that were still at work (``waited``), how
    many of them were still at work when its time ran out (``left``, their writes called off), and how long it
    took."""

    waited: int
    left: int
    seconds: float


def settle_node_persister(address: str, timeout_s: float) -> Settled | None:
    """Wait (at most `timeout_s`) until the node persister at `address` has finished every request and breakpoint
    persist of the trainers that have exited, so that a restart lists their files as they will stay: a write that
    lands after the restart chose its step would be missed, or outlive the step's invalidation. The writes still at
    work when the time runs out (``Settled.left``) are called off: none of their files lands afterwards. None if no
    persister listens there."""
    try:
        conn = Client(address, family="AF_UNIX", authkey=mp.current_process().authkey)
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    t0 = perf_counter()
    try:
        conn.send((SETTLE, timeout_s))
        if not conn.poll(timeout_s + 5.0):  # its own wait ends at timeout_s
            return Settled(-1, -1, perf_counter() - t0)
        waited, left = conn.recv()
    except (EOFError, OSError):
        return Settled(-1, -1, perf_counter() - t0)
    finally:
        conn.close()
    return Settled(waited, left, perf_counter() - t0)


def _settle(conn: Connection, clients: _NodeClients, timeout_s: float) -> None:
    waited, left = clients.settle(timeout_s)
    _notify(conn, (waited, left))
    conn.close()


def _peer_process(conn: Connection) -> psutil.Process | None:
    """The connecting process, from the Unix socket's credentials (psutil keeps its start time, so a reused pid is
    not taken for it); None if it is gone already."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _exited(peer: psutil.Process | None) -> bool:
    """The process at the other end has exited: gone, its pid reused, or a zombie."""
    try:
        return peer is None or not peer.is_running() or peer.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class _NodeClients:
    """The node persister's connections, each served by a thread, and the process at the other end of each; and the
    threads whose writes a settle called off (``publishing``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: list[tuple[threading.Thread, psutil.Process | None]] = []
        self._called_off: set[threading.Thread] = set()

    def add(self, thread: threading.Thread, peer: psutil.Process | None) -> None:
        with self._lock:
            self._served = [(t, p) for t, p in self._served if t.is_alive() or not t.ident] + [(thread, peer)]
            self._called_off = {t for t in self._called_off if t.is_alive()}

    @contextmanager
    def publishing(self) -> Iterator[bool]:
        """Whether the calling thread may put a file in place (or prune older ones) now: held while it does, so that
        a settle calling its writes off waits for a rename under way, and no rename follows."""
        with self._lock:
            yield threading.current_thread() not in self._called_off

    def settle(self, timeout_s: float) -> tuple[int, int]:
        """Wait for the threads still serving trainers that have exited (their last requests, their persist at
        breakpoint); returns how many there were and how many are still at work after `timeout_s`. The writes of
        those are called off: the restart lists the files there now, and none of theirs may land after it chose a
        step from them (or outlive that step's invalidation)."""
        me = threading.current_thread()
        with self._lock:
            owed = [t for t, peer in self._served
                    if t is not me and t.is_alive() and _exited(peer) and t not in self._called_off]
        deadline = monotonic() + timeout_s
        for t in owed:
            t.join(max(0.0, deadline - monotonic()))
        with self._lock:
            late = {t for t in owed if t.is_alive()}
            self._called_off |= late
        return len(owed), len(late)

    def join(self, timeout_s: float) -> None:
        with self._lock:
            threads = [t for t, _ in self._served]
        for t in threads:
            t.join(timeout_s)


def _serve_in_child(out_dir: str, keep: int, requests: Connection, results: Connection) -> None:
    Persister(out_dir, keep).serve(requests, results)


def spawn_persister(out_dir: str | Path, keep: int = 3, *, on_event: EventSink = None,
                    start_method: Literal["spawn", "forkserver", "fork"] = "spawn") -> PersistClient:
    """Start a persister process of our own (when no agent provides one) and return its client."""
    ctx = mp.get_context(start_method)
    assert isinstance(ctx, ProcessContext)  # a named start method's context (the stubs type it BaseContext)
    req_r, req_w = ctx.Pipe(duplex=False)
    res_r, res_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve_in_child, args=(str(out_dir), keep, req_r, res_w), name="flash-persister",
                       daemon=True)
    proc.start()
    req_r.close()
    res_w.close()
    return PersistClient(req_w, res_r, on_event=on_event, process=proc)
