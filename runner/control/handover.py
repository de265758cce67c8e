"""A straggler's planned hand-over: its ranks move at a committed step, nothing lost, no detection delay.

A straggler fails nobody, so no symptom opens its recovery: when the policy's ``straggler`` row picks
``swap_spare`` or ``restart_rank`` (``runner.control.decision.decide_straggler``), the controller opens one itself and
carries it out with the very action a node loss or a crash takes (``SwapSpare.act``, ``RestartRank.act``).
The straggling workers are released, not killed: each is told so in the store (``protocol.released_key``)
before the generation that replaces it is published. The other members regroup at their next step boundary
(the planned regroup a repaired rank's rejoin uses), so the step they all committed last is the hand-over
step, and the replacements take that step's state from a live replica; the step in flight is retried by
everyone. A released worker ends its fit cleanly (exit code 0) once it sees the generation without it. A host
released by a swap holds no rank for ``straggler.quarantine_s``, then its slots get warm spares
(``on_host_joined``, as for a host joining the running job): it rejoins the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runner.control.context import RunContext
from runner.control.decision import Decision, decide_straggler
from runner.control.stragglers import Finding
from runner.recovery.actions import RecoveryAction


class Handover:
    """Decides what is done about a straggler and carries a hand-over out; paces the released hosts' quarantine."""

    def __init__(self, ctx: RunContext, actions: dict[str, RecoveryAction], publish: Callable[[], None]) -> None:
        """``publish``: the executor's ``after_change`` (the generations that follow a decision)."""
        self.ctx, self.actions, self.publish = ctx, actions, publish
        self.quarantine_s = float(ctx.cfg.straggler.quarantine_s)
        self.quarantined: dict[int, tuple[float, list[int]]] = {}  # host -> (rejoins at, monotonic; released wids)

    def decide(self, finding: Finding) -> Decision:
        """The straggler row's action for ``finding`` now (judged only while no recovery is open)."""
        members = self.ctx.members
        host_ranks = sorted(w.logical for w in members.live() if w.node == finding.host)
        inputs: dict = {"restarts_left": 0, "spares": 0}
        for action in self.actions.values():
            inputs.update(action.decide_inputs(self.ctx, []))
        return decide_straggler(ft=self.ctx.ft, cfg=self.ctx.cfg, kind=finding.kind, rank=finding.rank,
                                host_ranks=host_ranks, can_restart=self.ctx.fleet.can_spawn,
                                restarts_left=inputs["restarts_left"], spares=inputs["spares"])

    def act(self, finding: Finding, decision: Decision) -> None:
        """Release the straggler's workers and give their ranks to the decided action (nothing for ``report``)."""
        ctx = self.ctx
        if decision.action == "report":
            return
        members = ctx.members
        rec = ctx.incidents.planned("straggler", node=finding.host, why=finding.kind)
        rec.fault, rec.victims, rec.action = "straggler", list(decision.victims), decision.action
        rec.reason = decision.reason
        rec.decide_reason, rec.t_decide = "planned", time.time()
        ctx.events.emit("recovery_decided", recovery=rec.id, fault="straggler", action=decision.action,
                        victims=decision.victims, reason=decision.reason, fault_class="straggler",
                        decide_reason="planned")
        released = [members.workers[members.assigned[rank]] for rank in decision.victims]
        members.release(released, rec.id, f"released in recovery {rec.id}: {decision.reason}")
        self.actions[decision.action].act(ctx, decision, [])
        if decision.action == "swap_spare":
            self.quarantined[finding.host] = (time.monotonic() + self.quarantine_s, [w.wid for w in released])
            ctx.events.emit("host_released", node=finding.host, recovery=rec.id, quarantine_s=self.quarantine_s,
                            wids=[w.wid for w in released])
        self.publish()

    def poll(self, now: float) -> None:
        """A released host whose quarantine is over, and whose released workers have all exited, gets warm spares
        in its slots (once no recovery is open)."""
        ctx = self.ctx
        for host, (at, wids) in list(self.quarantined.items()):
            if now < at or ctx.incidents.active is not None or not ctx.members.exited(wids):
                continue
            del self.quarantined[host]
            if host in ctx.detector.nodes_lost:
                continue
            ctx.events.emit("host_rejoined", node=host, role="spare", quarantine_s=self.quarantine_s)
            for action in self.actions.values():
                action.on_host_joined(ctx, host)
