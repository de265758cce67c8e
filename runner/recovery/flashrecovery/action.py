"""FlashRecovery's controller side: retry a transient collective error; restart a failed rank in place.

A retry publishes a new generation of the same members; a restart spawns the failed rank again where
it last ran (a joiner: its state comes from a live replica). In-place restarts are bounded by
``max_restarts`` of the strategy that owns the budget (FlashRecovery, else DeadPool, which restarts a
crashed rank the same way).
"""

from __future__ import annotations

from typing import Optional

from runner.recovery.actions import LAUNCHER_OWNS, RecoveryAction, Situation

BUDGET_OWNERS = ("flashrecovery", "deadpool")


def restart_owner(ft: list[str]) -> Optional[str]:
    """The strategy whose ``max_restarts`` bounds in-place restarts."""
    return next((n for n in BUDGET_OWNERS if n in ft), None)


class Retry(RecoveryAction):
    """A collective failed with every process alive: rebuild the group and retry the step."""

    name = "retry"
    does = "rebuild the group and retry the step; nobody restarts"


class RestartRank(RecoveryAction):
    """Restart each failed rank in place, on the node and slot of whoever computed it last."""

    name = "restart_rank"
    does = "restart in place, state from a surviving replica"

    def __init__(self, cfg, topo, run_dir) -> None:
        super().__init__(cfg, topo, run_dir)
        self.restarts = 0

    @staticmethod
    def obstacle(s: Situation) -> Optional[str]:
        if not s.can_restart:
            return LAUNCHER_OWNS
        if s.restarts_left < len(s.victims):
            return (f"restart budget spent (ft.{restart_owner(s.ft)}.max_restarts); raise it if failures are expected "
                    "this often")
        return None

    def decide_inputs(self, ctx, lost_nodes: list[int]) -> dict:
        owner = restart_owner(ctx.ft)
        return {"restarts_left": (self.cfg.ft[owner].max_restarts if owner else 0) - self.restarts}

    def act(self, ctx, decision, lost_nodes: list[int]) -> None:
        members = ctx.members
        for lrank in decision.victims:
            home = members.workers[members.covered_by.pop(lrank, members.assigned[lrank])]  # who computed it last
            self.restarts += 1
            members.spawn(lrank, home.node, home.local_rank, role="joiner", first_gen=members.gen + 1)
