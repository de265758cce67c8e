"""fault=chaos on the controller: when the job is steady and a fault is due, draw one and inject it.

The draws themselves are ``runner.faults.chaos`` (seeded, pure). Here the controller offers, for each
kind, the victims the mix can handle now (by asking the decision about each hypothetical fault), injects
the drawn fault (worker-side kinds through an order in the store and a signal to the victim, the others
through ``FaultInjector``), and waits until the fault has settled before the next gap starts.
"""

from __future__ import annotations

from collections.abc import Callable

from runner.control.context import RunContext
from runner.control.decision import Decision
from runner.control.detection import TRAINING_PHASES
from runner.faults import chaos
from runner.faults.injector import FaultInjector
from runner.plumbing import protocol
from runner.recovery.sdc import MIN_HISTORY

CHAOS_END_MARGIN_STEPS = 5  # no chaos fault this close to trainer.max_steps: it would hit ranks that are finishing


class ChaosInjector:
    """Draws and injects chaos faults one at a time, each once the previous one settled."""

    def __init__(self, cfg, ctx: RunContext, injector: FaultInjector,
                 judge: Callable[[list[int], list[int], bool], Decision]) -> None:
        self.cfg, self.ctx, self.injector, self.judge = cfg, ctx, injector, judge
        self.chaos = chaos.Chaos(cfg.fault, cfg.seed)
        self.wait: tuple[float, int, int] | None = None  # the last chaos fault: (when, recovery id, step)

    def poll(self, now: float) -> None:
        """Once the next fault is due and the job is steady, draw it among what the mix can handle now and
        inject it."""
        if self.chaos.over or not self._steady():
            return
        if self.chaos.t0 is None:
            self.chaos.start(now)
            return
        if self.wait is not None:
            self._settle(now, self.wait)
        if not self.chaos.due(now):
            return
        draw = self.chaos.draw(now, self._candidates())
        if draw is None:
            self.chaos.settled(now + 1.0)  # nothing the mix can handle now: look again a second later
            return
        members = self.ctx.members
        index = len(self.injector.faults) + draw.index
        causes = 0 if draw.kind == "bitflip" else 2 if draw.kind == "partition" and self.cfg.fault.duration_s < 0 else 1
        self.wait = (now, self.ctx.incidents.opened + causes, max(w.hb_step for w in members.live()) + 2)
        self.ctx.events.emit("chaos_drawn", index=index, fault=draw.kind, victim=draw.victim, reason=(
            f"fault {draw.index + 1} of at most {self.chaos.max_faults}, drawn among what the mix can handle now: "
            f"{ {k: v for k, v in draw.candidates.items() if v} }"))
        if draw.kind == "kill_node":
            victim = next(w for w in members.live() if w.node == draw.victim)
            self.injector.carry_out(index, draw.kind, victim, draw.victim)
            return
        w = members.workers[members.assigned[draw.victim]]
        if draw.kind in chaos.WORKER_SIDE:
            protocol.set_json(self.ctx.store, chaos.ORDER_KEY.format(wid=w.wid),
                              {"kind": draw.kind, "index": index, "duration_s": self.cfg.fault.duration_s})
            self.ctx.fleet.signal(w.wid, w.node, chaos.SIGNAL)
        else:
            self.injector.carry_out(index, draw.kind, w, w.node)

    def _settle(self, now: float, wait: tuple[float, int, int]) -> None:
        """The last chaos fault settled once the recoveries it causes are over (a bitflip causes none: the
        guard recomputes the step; a partition for good causes two: the retry, then the isolation) and every
        rank has committed two steps past it (a bitflip's recomputed step among them)."""
        since, until_id, until_step = wait
        timeout_s = self.cfg.launcher.recovery_timeout_s
        if min(w.hb_step for w in self.ctx.members.live()) < until_step:
            return
        if self.ctx.incidents.opened < until_id and now - since < timeout_s:
            return
        if self.ctx.incidents.opened < until_id:
            self.ctx.events.emit("chaos_fault_unseen", reason=f"no recovery within launcher.recovery_timeout_s="
                                 f"{timeout_s}s of the last chaos fault; drawing on")
        self.wait = None
        self.chaos.settled(now)

    def _steady(self) -> bool:
        """No recovery under way and every logical rank computed by a live member that is training, not
        finishing: a fault injected now is one fault, not part of another."""
        incidents, members = self.ctx.incidents, self.ctx.members
        if incidents.active is not None or incidents.decide_at is not None or any(a.busy() for a in self.ctx.actions):
            return False
        if not members.layouts[members.gen].complete:
            return False
        end = self.cfg.trainer.max_steps - CHAOS_END_MARGIN_STEPS
        return all(w.synced and not w.done and w.hb_phase in TRAINING_PHASES and w.hb_step < end
                   for w in members.live() if w.ready)

    def _candidates(self) -> dict[str, list[int]]:
        """For each chaos kind, the victims (logical ranks; nodes for kill_node) the mix can handle now."""
        members = [w for w in self.ctx.members.live() if w.ready]

        def handled(dead: list[int], lost: tuple[int, ...] = (), hung: bool = False) -> bool:
            return self.judge(dead, list(lost), hung).action != "fail"

        guard_ready = self.cfg.trainer.sdc_factor > 0 and all(
            w.hb_step - w.first_step >= max(self.cfg.trainer.sdc_window, MIN_HISTORY) for w in members)
        retried = handled([])
        out = {}
        for kind in self.chaos.kinds:
            if kind == "kill_node":
                out[kind] = [n for n in sorted({w.node for w in members}) if handled([], (n,))]
            elif kind in ("kill_rank", "hang_rank", "partition"):  # a partition is retried, then its rank isolated
                ok = retried or kind != "partition"
                out[kind] = [w.logical for w in members if ok and handled([w.wid], hung=kind == "hang_rank")]
            elif kind == "kill_all":
                out[kind] = [0] if handled([w.wid for w in members]) else []
            else:  # transient, bitflip
                out[kind] = [w.logical for w in members] if (retried if kind == "transient" else guard_ready) else []
        return out
