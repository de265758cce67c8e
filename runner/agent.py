"""Node agent: supervises the worker processes of one (simulated) node and reports exits at once.

On a real cluster this is the per-node daemon (torchrun's elastic agent plays the part there);
in the single-host simulation each agent is a thread of the launching process. A lost node is
simulated by killing its workers and silencing its agent: nobody reports those exits, and the
controller learns of the loss from the agent's missing heartbeat.

With flash checkpoints persisted to disk, each agent also owns its node's persister process
(runner.recovery.flash_ckpt.persister): the node's trainers hand it snapshots to write, and it
persists a trainer's newest snapshot when that trainer dies. It goes down with a lost node.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from queue import Queue
from typing import Optional

from runner.recovery.flash_ckpt.persister import NodePersist, NodePersisterHandle, start_node_persister


class NodeAgent:
    def __init__(self, node: int, events: Queue, interval_s: float,
                 persister: Optional[NodePersisterHandle] = None) -> None:
        self.node, self.events, self.interval_s = node, events, interval_s
        self.persister = persister
        self.procs: dict[int, BaseProcess] = {}  # wid -> its started worker process
        self.reported: set[int] = set()  # wids whose exit this agent has reported (or, once lost, seen)
        self.lost = False
        self.last_beat = time.monotonic()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, name=f"agent-{node}", daemon=True)
        self._thread.start()

    def add(self, wid: int, proc: BaseProcess) -> None:
        with self._lock:
            self.procs[wid] = proc
        os.write(self._wake_w, b"x")

    def pids(self) -> dict[int, int]:
        with self._lock:
            return {wid: _pid(p) for wid, p in self.procs.items() if p.exitcode is None}

    def exit_reported(self, wid: int) -> bool:
        """The worker is gone and the controller has its exit in the queue (a lost node reports none)."""
        with self._lock:
            proc = self.procs.get(wid)
            return proc is None or wid in self.reported or (self.lost and proc.exitcode is not None)

    def signal(self, wid: int, sig: int) -> None:
        with self._lock:
            proc = self.procs.get(wid)
        if proc is not None and proc.exitcode is None:
            try:
                os.kill(_pid(proc), sig)
            except ProcessLookupError:
                pass

    def lose_node(self) -> list[int]:
        """Simulate the node going down: every worker SIGKILLed, the agent silent from now on."""
        self.lost = True
        victims = list(self.pids())
        for wid in victims:
            self.signal(wid, signal.SIGKILL)
        if self.persister is not None:
            self.persister.kill()
        return victims

    def stop(self) -> None:
        """Stop watching; the node persister finishes what its trainers' exits started, then ends."""
        if self.persister is not None:
            self.persister.stop()
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _watch(self) -> None:
        while not self._stop:
            # every worker whose exit is not reported yet, also one another thread already reaped (reading
            # ``exitcode`` reaps, as pids() does while the controller awaits a kill): its sentinel stays
            # readable, so its exit is reported on this round
            with self._lock:
                live = {p.sentinel: wid for wid, p in self.procs.items() if wid not in self.reported}
            ready = wait(list(live) + [self._wake_r], timeout=self.interval_s)
            if not self.lost:
                self.last_beat = time.monotonic()
            for r in ready:
                if r == self._wake_r:
                    os.read(self._wake_r, 64)
                    continue
                assert isinstance(r, int)  # wait() hands back the descriptors it was given
                wid = live[r]
                with self._lock:
                    proc = self.procs[wid]
                proc.join(timeout=1)
                if not self.lost:
                    self.events.put(("exit", wid, proc.exitcode, time.time()))
                with self._lock:
                    self.reported.add(wid)


def _pid(proc: BaseProcess) -> int:
    """A process is added to its agent once started, so it has a pid."""
    assert proc.pid is not None
    return proc.pid


class LocalFleet:
    """The simulated cluster's processes: a fork server that preloads the worker's imports (so a
    replacement starts in a fraction of a second), one NodeAgent per node and, with `persist`,
    one flash-checkpoint persister per node, listening before any worker starts."""

    can_spawn = True

    def __init__(self, nodes: int, events: Queue, interval_s: float, preload: list[str],
                 persist: Optional[NodePersist] = None) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(preload)
        self.agents: list[NodeAgent] = []
        try:
            for n in range(nodes):
                persister = start_node_persister(self.ctx, persist, n) if persist is not None else None
                self.agents.append(NodeAgent(n, events, interval_s, persister))
        except BaseException:
            for agent in self.agents:
                agent.stop()
            raise

    def spawn(self, target, args: tuple, wid: int, node: int) -> None:
        proc = self.ctx.Process(target=target, args=args, name=f"worker-{wid}", daemon=False)
        proc.start()
        self.agents[node].add(wid, proc)

    def signal(self, wid: int, node: int, sig: int) -> None:
        self.agents[node].signal(wid, sig)

    def lose_node(self, node: int) -> list[int]:
        return self.agents[node].lose_node()

    def node_beats(self) -> dict[int, float]:
        return {a.node: a.last_beat for a in self.agents}

    def shutdown(self, completed: bool) -> None:
        """Every worker ends (killed at once unless the run completed); every agent stops."""
        grace = time.monotonic() + (5.0 if completed else 2.0)
        for agent in self.agents:
            for wid in agent.pids():
                if not completed:
                    agent.signal(wid, signal.SIGKILL)
        for agent in self.agents:
            for wid in list(agent.pids()):
                proc = agent.procs[wid]
                proc.join(timeout=max(0.0, grace - time.monotonic()))
                if proc.exitcode is None:
                    agent.signal(wid, signal.SIGCONT)
                    agent.signal(wid, signal.SIGKILL)
                    proc.join(timeout=5)
            agent.stop()
