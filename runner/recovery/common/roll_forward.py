"""Rolling a step forward on the members whose agreement failed while another member's completed (tp*pp > 1).

At tp*pp > 1 a step commits after an all-reduce over the world group that follows the DP reductions (the
agreement, ``StepCommit.commit``). Like any all-reduce it can complete on some members and fail on others (gloo's
ring fails on a member whose send to a dead peer fails although everything it needed had arrived). A member that
completed it committed the step; one whose agreement failed did not, and if every other holder of its model slice
was lost, no live member would hold that slice at the committed step. But an agreement that completed anywhere
means every member had finished its DP reduction (each enters the agreement only after its own), so a member whose
agreement failed holds its slice's fully reduced gradients of the step. It therefore applies the step's update
itself, with the full model's gradient norm of that step taken from a member that committed it: the very update
it would have made. It then holds the step like the others and serves its slice to a replacement; the state it
hands over says that the update is in and Lightning has yet to count the step (``UPDATE_APPLIED``), and the
replacement counts it without compute (``RunnerStrategy._finish_applied_step``). Under ZeRO-1
(``runner.recovery.common.reconcile``) the update is of the member's own shard (and any it carries), recorded for the
replica of another rank's shard it holds, and the reconcile's parameter sync spreads every owner's shard.
"""

from __future__ import annotations

from runner.plumbing.events import EventLog
from runner.training.comm import Comm
from runner.training.state import ReplicaState
from runner.training.transfer import exchange


def roll_forward(comm: Comm, state: ReplicaState, table: list[list[int]], events: EventLog) -> list[list[int]]:
    """``table``: every member's (committed steps, joining, awaiting agreement), in group-rank order. The members
    one step behind the newest that are awaiting their agreement roll that step forward; returns the table as it
    stands after (they hold the newest step). Every member takes part in the norm's broadcast, or none does."""
    newest = max(c for c, j, _ in table if not j)
    rolling = [r for r, (c, j, awaiting) in enumerate(table) if not j and awaiting and c == newest - 1]
    if not rolling:
        return table
    source = min(r for r, (c, j, _) in enumerate(table) if not j and c == newest)
    me = comm.rank
    norm = exchange(comm, {"norm": state.step_norm()} if me == source else None, source, receive=me in rolling)
    if me in rolling:
        state.roll_forward(norm["norm"])
        events.emit("step_rolled_forward", gen=comm.gen, step=newest - 1, norm_from=comm.joined.logical[source])
    return [[newest, j, 0] if r in rolling else [c, j, awaiting] for r, (c, j, awaiting) in enumerate(table)]
