"""What recovery code may read and change of a replica's training state: typed interfaces, so that it
depends on neither the strategy nor Lightning (``runner.training.transfer.TrainerState`` implements them).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from runner.training.zero import ZeroOne


class ShardedState(Protocol):
    """ZeRO-1: no rank holds another's optimizer state, so laggards and joiners are served shard by shard."""

    @property
    def zero(self) -> ZeroOne: ...

    @property
    def replicator(self) -> Any:
        """Where the replicas of other ranks' shards are (``ShardReplicator``), or None."""

    def final_gradients(self) -> dict:
        """The gradients the last update used (and the guard's history), for a laggard."""

    def finish_update(self, final: dict) -> None:
        """A laggard applies the update it missed with ``final`` (``final_gradients`` of a peer)."""

    def own_shard(self) -> dict:
        """This rank's shard as ``{"params", "state"}``: the tensors its optimizer steps, in that optimizer's order
        (``ZeroOne.own_optimizer_params``: the fp32 masters with master weights), and that optimizer's state.
        With DP replica groups the rank at the same shard index in another group holds the same shard, and hands
        it to a restarted rank."""

    def adopt_shard_state(self, ckpt: dict, shard_state: dict) -> None:
        """Put a joiner's own shard's optimizer state into a peer's checkpoint ``ckpt`` before it is restored."""


class ReplicaState(Protocol):
    """One data-parallel replica's committed state, as a recovery reads, hands over and adopts it."""

    @property
    def global_step(self) -> int:
        """Lightning's committed step count; -1 before the module is attached."""

    def committed_steps(self) -> int:
        """Steps whose update this replica holds (a laggard that already adopted the newest one counts it)."""

    def dump_state(self) -> dict:
        """This replica's full checkpoint, for a peer to restore or adopt (``UPDATE_APPLIED`` set in it when its model
        and optimizer already hold the update of the step Lightning has yet to count: a laggard's or a rolled-forward
        member's)."""

    def awaiting_agreement(self) -> bool:
        """tp*pp > 1: the in-flight step's reduced gradients are in place, but its agreement failed here."""

    def step_norm(self) -> Any:
        """tp*pp > 1: the full model's gradient norm of the newest committed step (from its agreement)."""

    def roll_forward(self, norm: Any) -> None:
        """tp*pp > 1: the in-flight step committed elsewhere: apply its update here with this rank's own reduced
        gradients, clipped by the full model's gradient norm ``norm`` of that step, and skip the own update."""

    def adopt_committed_state(self, ckpt: dict) -> None:
        """A lagging survivor takes a peer's post-step state and skips its own update."""

    def adopt_replica_state(self, ckpt: dict) -> None:
        """A replica found diverged takes a majority member's state in place of its own; its update of the
        step still comes (the step is recomputed)."""

    def adopt_guard_history(self, state: Optional[dict]) -> None:
        """The corruption guard's history from a peer's ``state``, if it carries one."""

    def live_weights(self) -> Optional[dict]:
        """``{"state_dict": ...}`` of the module as allocated now (a restore copies into it), or None."""

    @property
    def sharded(self) -> Optional[ShardedState]:
        """The ZeRO-1 view of this state, None without sharding."""
