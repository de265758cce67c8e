"""Carrying out a decision: judge the open recovery once its symptoms are in, act, publish.

A recovery is decided once its decide window closes, or at once when its evidence is conclusive
(``Detector.conclusive_exit``); the rule that closed the decision is recorded as ``decide_reason``.

The decision itself is ``runner.control.decision.decide`` (pure); the resources it weighs (spares, restart
budgets, ranks without snapshots) come from the run's actions (``decide_inputs``), and the chosen
action carries itself out (``act``). Then generations follow: survivors-only while replacements
start, complete once every logical rank is computed again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runner.control.context import RunContext
from runner.control.decision import Decision, decide
from runner.plumbing import protocol
from runner.recovery.actions import RecoveryAction


class Executor:
    """Decides on the open recovery when it is due, carries the decision out and publishes."""

    def __init__(self, ctx: RunContext, actions: dict[str, RecoveryAction], fail: Callable[[str], None]) -> None:
        self.ctx, self.actions, self.fail = ctx, actions, fail
        self.cfg, self.members, self.incidents, self.detector = ctx.cfg, ctx.members, ctx.incidents, ctx.detector
        self.recheck_s = min(self.cfg.heartbeat.interval_s, 0.05)

    def decide_due(self, now: float) -> None:
        """The open recovery is due: decide now if its evidence is conclusive or its window closed, or look
        again shortly while the picture is incomplete. Every rule it asks sees one read of the agents' beats."""
        with self.detector.one_look():
            self._decide_due(now)

    def _decide_due(self, now: float) -> None:
        rec, members, detector, incidents = self.incidents.active, self.members, self.detector, self.incidents
        assert rec is not None  # a decision is due only while a recovery is open (decide_at is set with it)
        if now < incidents.window_ends and not detector.conclusive_exit(rec):
            incidents.hold(incidents.window_ends)  # faults arriving together are decided together
            return
        if detector.isolate_unreachable(rec, now):
            incidents.hold(now + self.recheck_s, "arrivals")
            return
        dead = detector.dead_workers(rec)
        lost_nodes = detector.silent_nodes(rec, now)
        hung = any(s["kind"] == "hang" for s in rec.symptoms)
        if not dead and not lost_nodes and not detector.all_proved_alive(rec.t_detect_mono):
            incidents.hold(now + self.recheck_s, "proof_of_life")  # a transient needs proof of life from everyone
            return
        decide_reason = incidents.decide_reason(now)
        incidents.decide_at = None
        detector.silent_reported |= set(lost_nodes)  # handled now: their silence is no new symptom later
        detector.nodes_lost |= set(lost_nodes)
        if self._runs_members(lost_nodes):  # a host cut off silently neither answers nor resets its connections:
            self.ctx.store.set(protocol.cut_off_key(members.gen), f"node(s) {lost_nodes} went silent")  # stop waiting
        for node in lost_nodes:  # once lost, a host stays lost: heard again, it is told so and halts
            self.ctx.fleet.fence(node, f"node {node} went silent and was declared lost in recovery {rec.id}",
                                 members.gen)
        for action in self.actions.values():
            action.on_nodes_lost(self.ctx, lost_nodes)
        lost = set(lost_nodes)
        lost_ranks = [w.logical for w in members.live() if w.node in lost]
        if not dead and not lost_ranks and not hung and lost_nodes:
            self.incidents.not_needed(f"node(s) {lost_nodes} held no rank")
            members.fence_written_off()  # its spares, say: no generation follows
            return
        decision = self.judge(dead, lost_nodes, hung)
        if any(s["kind"] == "unreachable" for s in rec.symptoms):
            decision.fault = "partition"
        rec.fault = decision.fault  # a recovery decided again (a crash that became a node loss): the newest class
        # every rank the fault killed, also those whose exit had not arrived when the decide window closed
        rec.victims = sorted(set(rec.victims) | set(decision.victims) | self.incidents.take_injected())
        rec.action, rec.reason, rec.decide_reason = decision.action, decision.reason, decide_reason
        rec.t_decide = time.time()
        self.ctx.events.emit("recovery_decided", recovery=rec.id, fault=decision.fault, action=decision.action,
                             victims=decision.victims, reason=decision.reason, fault_class=decision.fault_class,
                             decide_reason=decide_reason)
        if decision.action == "fail":
            self.fail(decision.reason)
            return
        for wid in dead:
            members.workers[wid].dead = True
        for node in lost_nodes:
            for w in members.live():
                if w.node == node:
                    w.dead = True
        self.actions[decision.action].act(self.ctx, decision, lost_nodes)
        self.after_change()

    def _runs_members(self, nodes: list[int]) -> bool:
        """Whether a member of the current generation's groups runs on one of ``nodes``. A lost spare host runs none:
        cutting the generation off would only make every member give its collective up and retry for nothing."""
        layout = self.members.layouts.get(self.members.gen)
        if layout is None:
            return bool(nodes)
        return any(self.members.workers[wid].node in nodes for wid in layout.members)

    def judge(self, dead: list[int], lost_nodes: list[int], hung: bool) -> Decision:
        """The policy's decision for these dead workers and newly lost nodes, everything else as it is now;
        the ranks a lost worker computed on top of its own are lost with it."""
        members, covered_by = self.members, self.members.covered_by
        live = members.live()
        gone = set(dead) | {w.wid for w in live if w.node in lost_nodes}
        dead_ranks = [members.workers[w].logical for w in dead] + [r for r, wid in covered_by.items() if wid in dead]
        lost_ranks = [members.workers[w].logical for w in gone - set(dead)]
        lost_ranks += [r for r, wid in covered_by.items() if wid in gone - set(dead)]
        inputs: dict = {"restarts_left": 0}
        for action in self.actions.values():
            inputs.update(action.decide_inputs(self.ctx, lost_nodes))
        return decide(
            ft=self.ctx.ft, cfg=self.cfg, can_restart=self.ctx.fleet.can_spawn, dead=sorted(dead_ranks), hung=hung,
            lost_nodes=lost_nodes, lost_ranks=sorted(lost_ranks),
            survivors=[w.logical for w in live if w.synced and w.wid not in gone],
            nodes_up=len(set(range(self.cfg.parallel.nodes)) - self.detector.nodes_lost - set(lost_nodes)),
            **inputs,
        )

    def after_change(self) -> None:
        """Publish survivors-only or complete generations as replacements become ready; an action that
        leaves nobody holding state (a restart of every rank) publishes only its complete generation."""
        rec = self.incidents.active
        assert rec is not None  # called for the open recovery, once decided
        if not self.actions[rec.action].publishes_survivors and not all(w.ready for w in self.members.live()):
            return
        layout = self.members.publish(rec.id)
        if layout.complete:
            rec.t_ready = rec.t_ready or time.time()
            rec.full_gen = layout.gen
            self.incidents.active = None
        elif rec.survivors_gen is None:
            rec.survivors_gen = layout.gen
