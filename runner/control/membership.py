"""Membership: the worker processes, the logical rank each computes, and the generations published to them.

A generation (``protocol.Layout``) lists every ready worker that holds a logical rank, the ranks a
member computes on top of its own (``covered_by``: a neighbour's takeover), and the ranks nobody
computes yet (pending: a survivors-only generation). Workers read generations from the store.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

from runner.control.records import Worker
from runner.plumbing import protocol
from runner.plumbing.events import EventLog
from runner.plumbing.protocol import Layout


class Membership:
    """Spawns workers through the fleet and tracks them; publishes each generation to the store."""

    def __init__(self, cfg_dict: dict, run_dir: Path, dp: int, store, fleet, events: EventLog,
                 address: tuple[str, int], namespace: str) -> None:
        self.cfg_dict, self.run_dir, self.dp = cfg_dict, run_dir, dp
        self.store, self.fleet, self.events = store, fleet, events
        self.host, self.port = address
        self.namespace = namespace
        self.workers: dict[int, Worker] = {}
        self.assigned: dict[int, int] = {}  # logical rank -> wid
        self.covered_by: dict[int, int] = {}  # a logical rank without a process of its own -> the wid computing it too
        self.gen = -1
        self.layouts: dict[int, Layout] = {}
        self.published_at: dict[int, float] = {}
        self._done_seen = 0
        self._unready: set[int] = set()  # workers spawned that have not said they are ready (polled each round)
        self._fenced: set[int] = set()  # workers told they were written off (protocol.worker_fence_key)

    # -- processes ------------------------------------------------------------------------------
    def spawn(self, lrank: int, node: int, local: int, role: str, first_gen: int) -> Worker:
        from runner.training.worker import WorkerSpec, main  # imported lazily: the launching process stays light

        wid = len(self.workers)
        spec = WorkerSpec(str(self.run_dir), wid, node, local, lrank, role, first_gen, self.host, self.port,
                          self.namespace)
        self.fleet.spawn(main, (spec, self.cfg_dict), wid, node)
        worker = Worker(wid, node, local, lrank, role, t_spawn=time.monotonic())
        self.workers[wid] = worker
        self._unready.add(wid)
        if lrank >= 0:
            self.assigned[lrank] = wid
        return worker

    def live(self) -> list[Worker]:
        """Workers not written off that still hold their logical rank."""
        return [w for w in self.workers.values() if not w.dead and self.assigned.get(w.logical) == w.wid]

    def kill_all(self) -> list[int]:
        """SIGKILL every live worker (a stopped one too); returns their logical ranks."""
        live = [w for w in self.live() if not w.dead]
        for w in live:
            self.fleet.signal(w.wid, w.node, signal.SIGKILL)
        self.await_exit(live)
        return sorted(w.logical for w in live)

    def await_exit(self, workers: list[Worker], timeout_s: float = 5.0) -> None:
        """SIGKILL is asynchronous: a victim may still finish a system call (create a snapshot file) after
        os.kill returns. Wait until the node agents have reported every victim's exit (a lost node's are
        only seen), so that what follows (dropping a node's memory, restarting every rank, deciding on all
        the exits at once) sees their final state and every exit. Only the local fleet has agents; under
        torchrun/SLURM nothing here killed anyone."""
        agents = getattr(self.fleet, "agents", None)
        deadline = time.monotonic() + timeout_s
        while agents and time.monotonic() < deadline and not all(agents[w.node].exit_reported(w.wid) for w in workers):
            time.sleep(0.005)

    def fence_written_off(self) -> None:
        """Tell every worker written off since the last call so, in the store: one heard again (its host's link
        healed, a stopped process resumed) reads it with its next heartbeat and exits, never acting in the job
        again (``runner.callbacks.heartbeat``)."""
        for w in self.workers.values():
            if w.dead and w.wid not in self._fenced:
                self._fenced.add(w.wid)
                why = f"worker {w.wid} (logical rank {w.logical}) was written off after generation {self.gen}"
                fence = {"wid": w.wid, "logical": w.logical, "gen": self.gen, "reason": why}
                protocol.set_json(self.store, protocol.worker_fence_key(w.wid), fence)
                self.fleet.post_notice({"fence": fence}, [w.node])  # heartbeat.route=agent: its agent answers it

    def release(self, workers: list[Worker], recovery: int, reason: str) -> None:
        """A planned hand-over writes these workers off without killing them: each is told in the store before the
        generation that replaces it, and ends its training cleanly when it sees that generation (``Comm.await_layout``).
        The release stands in for the fence (``fence_written_off``), and their exits are no symptom (dead)."""
        for w in workers:
            w.dead = True
            self._fenced.add(w.wid)
            protocol.set_json(self.store, protocol.released_key(w.wid), {
                "wid": w.wid, "logical": w.logical, "gen": self.gen, "recovery": recovery, "reason": reason})

    def exited(self, wids: list[int]) -> bool:
        """Every one of these workers' exits was seen by its node agent (under a launcher that owns the processes
        nothing here can tell: True)."""
        agents = getattr(self.fleet, "agents", None)
        return not agents or all(agents[self.workers[w].node].exit_reported(w) for w in wids)

    def starting(self) -> bool:
        """Some worker holding a logical rank has not said it is ready yet (a replacement starting)."""
        return any(not w.ready for w in self.live())

    def poll_ready(self) -> bool:
        """Note workers that became ready or finished; True when one became ready."""
        changed = False
        for wid in sorted(self._unready):  # not a walk over every worker: a round comes 20 times a second
            w = self.workers[wid]
            if w.dead or w.ready:  # written off, or made ready by whoever started it (the first wave, a warm spare)
                self._unready.discard(wid)
            elif self.assigned.get(w.logical) == wid and self.store.check([f"ready/{wid}"]):
                self._unready.discard(wid)
                w.ready = True
                changed = True
                self.events.emit("replacement_ready", wid=w.wid, logical=w.logical,
                                 startup_s=time.monotonic() - w.t_spawn)
        done_count = self.store.add("done_count", 0)
        if done_count != self._done_seen:  # only then look at the individual keys
            self._done_seen = done_count
            for w in self.live():
                if not w.done and self.store.check([f"done/{w.wid}"]):
                    w.done = True
                    w.finished_ranks = protocol.get_json(self.store, f"done/{w.wid}")["computed_ranks"]
        return changed

    def all_done(self) -> bool:
        """Every logical rank is computed by a ready member, and every such member finished; or its rank was
        finished by the neighbour that computed it (NDB): a repaired rank's process published to rejoin while
        the training ended never joins (its neighbour's last generation still covered the rank) and is not
        waited for (the run's end releases it)."""
        if not self._done_seen:
            return False  # no worker finished yet (poll_ready reads their count): not a walk over every worker
        live = [w for w in self.live() if not w.dead and w.ready]  # a rejoining process still starting is no member
        covered = {w.logical for w in live} | set(self.covered_by)
        finished = {rank for w in live if w.done for rank in w.finished_ranks}
        return len(covered) == self.dp and all(w.done or w.logical in finished for w in live)

    def done_records(self) -> dict[int, dict]:
        """The done record of each logical rank's last worker, by wid."""
        out = {}
        for w in self.workers.values():
            key = f"done/{w.wid}"
            if self.assigned.get(w.logical) == w.wid and self.store.check([key]):
                out[w.wid] = protocol.get_json(self.store, key)
        return out

    # -- generations ----------------------------------------------------------------------------
    def publish(self, recovery: Optional[int] = None) -> Layout:
        """Publish the next generation: every ready assigned worker whose rank no neighbour covers (a repaired
        rank's process joins only when its takeover ends); the rest of the logical ranks pending."""
        self.fence_written_off()  # before the generation that replaces them
        self.gen += 1
        members = sorted((w for w in self.live() if w.ready and w.logical not in self.covered_by),
                         key=lambda w: w.logical)
        covering: dict[int, list[int]] = {}  # wid -> the ranks it computes besides its own
        for rank, wid in sorted(self.covered_by.items()):
            covering.setdefault(wid, []).append(rank)
        extra = [covering.get(w.wid, []) for w in members]
        covered = {w.logical for w in members} | set(self.covered_by)
        layout = Layout(
            gen=self.gen, members=[w.wid for w in members], logical=[w.logical for w in members], dp=self.dp,
            pending=sorted(set(range(self.dp)) - covered),
            joiners=[w.wid for w in members if w.role == "joiner"],
            recovery=recovery if recovery is not None else -1,
            extra=extra if any(extra) else [],
        )
        self.layouts[self.gen] = layout
        self.published_at[self.gen] = time.monotonic()
        self.store.set(f"gen/{self.gen}", layout.to_json())
        self.store.set("gen", str(self.gen))
        self.fleet.post_notice({"gen": self.gen})
        self.events.emit("generation", gen=self.gen, members=layout.members, pending=layout.pending,
                         recovery=layout.recovery, extra=layout.extra)
        return layout
