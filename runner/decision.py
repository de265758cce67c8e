"""Fault classification and the action the configured fault-tolerance mix allows.

A pure function of what the controller observed, so the tree is unit-tested without processes:
transient error -> retry in a rebuilt group, nobody restarts; process crash or hang -> restart
that process in place (FlashRecovery), state from a surviving replica, or without FlashRecovery let
a neighbour take over its micro-batch (NDB); node loss -> NDB takeover. Whatever those cannot
handle (no surviving replica, a lost node, FlashRecovery not in ft) restarts every rank from the
newest flash snapshot when ft has flash_ckpt (restart_all); anything else fails with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Decision:
    fault: str  # transient | process_crash | hang | node_loss (the controller relabels partition)
    action: str  # retry | restart_rank | swap_spare | takeover | restart_all | fail
    victims: list[int] = field(default_factory=list)  # logical ranks
    reason: str = ""


def decide(*, ft: list[str], cfg, can_restart: bool = True, dead: list[int], hung: bool, lost_nodes: list[int],
           lost_ranks: list[int], survivors: list[int], restarts_left: int, spares: int = 0,
           full_restarts_left: int = 0) -> Decision:
    first = _decide(ft=ft, cfg=cfg, can_restart=can_restart, dead=dead, hung=hung, lost_nodes=lost_nodes,
                    lost_ranks=lost_ranks, survivors=survivors, restarts_left=restarts_left, spares=spares)
    if first.action != "fail" or "flash_ckpt" not in ft or not can_restart:
        return first
    if lost_nodes and len(lost_nodes) >= cfg.parallel.nodes:
        return Decision(first.fault, "fail", first.victims, f"every node {lost_nodes} was lost: there is no node "
                        "left to restart the ranks on")
    if full_restarts_left < 1:
        return Decision(first.fault, "fail", first.victims, f"{first.fault} of logical rank(s) {first.victims}: restart "
                        f"budget spent (ft.flash_ckpt.max_restarts={cfg.ft.flash_ckpt.max_restarts} restarts of every "
                        "rank); raise it if failures are expected this often")
    return Decision(first.fault, "restart_all", first.victims, f"{first.fault} of logical rank(s) "
                    f"{first.victims or 'none (all alive)'} and no faster strategy in ft={ft} handles it: restart every "
                    "rank from the newest flash snapshot all of them hold (flash_ckpt)")


def _decide(*, ft: list[str], cfg, can_restart: bool, dead: list[int], hung: bool, lost_nodes: list[int],
            lost_ranks: list[int], survivors: list[int], restarts_left: int, spares: int) -> Decision:
    """The tree without snapshots: what the in-memory strategies (FlashRecovery, DeadPool, NDB) can do."""
    if lost_nodes:
        victims = sorted(set(lost_ranks) | set(dead))
        if "deadpool" in ft and survivors and spares >= len(victims):
            return Decision("node_loss", "swap_spare", victims, f"node(s) {lost_nodes} lost with logical ranks "
                            f"{victims}: warm spares take their places ({spares} ready)")
        if "ndb" in ft and survivors:
            return Decision("node_loss", "takeover", victims, f"node(s) {lost_nodes} lost with logical ranks "
                            f"{victims} and no spare: live neighbours take over their micro-batches (NDB)")
        if "deadpool" in ft:
            return Decision("node_loss", "fail", victims,
                            f"node(s) {lost_nodes} lost with logical ranks {victims}, but DeadPool has only {spares} "
                            "ready spare(s) and nothing after it in ft handles node loss: raise parallel.spares or "
                            "add ft=ndb")
        return Decision("node_loss", "fail", victims,
                        f"node(s) {lost_nodes} lost with logical ranks {victims}; a process restart in place needs "
                        "the node, and no strategy in ft handles node loss: add hot spares (parallel.spares with "
                        "ft=deadpool) or a takeover strategy (ft=ndb)")
    if dead:
        fault = "hang" if hung else "process_crash"
        if "deadpool" in ft and survivors and cfg.ft.deadpool.crash_action == "swap" and spares >= len(dead):
            return Decision(fault, "swap_spare", dead, f"{fault} of logical rank(s) {dead}: warm spares take their "
                            "places (ft.deadpool.crash_action=swap)")
        if "deadpool" in ft and "flashrecovery" not in ft and survivors and restarts_left >= len(dead):
            return Decision(fault, "restart_rank", dead, f"{fault} of logical rank(s) {dead} on a healthy node: "
                            "restart in place (ft.deadpool.crash_action=restart_in_place), state from a replica")
        if "flashrecovery" not in ft and "ndb" in ft and survivors:
            return Decision(fault, "takeover", dead, f"{fault} of logical rank(s) {dead}: live neighbours take "
                            "over their micro-batches (NDB); nobody restarts")
        if "flashrecovery" not in ft:
            return Decision(fault, "fail", dead, f"logical rank(s) {dead} failed ({fault}) and ft={ft or '[]'} has no "
                            "strategy for it; add ft=flashrecovery to restart the failed rank in place")
        if not survivors:
            return Decision(fault, "fail", dead, "every data-parallel replica of the model and optimizer state was "
                            f"lost (logical ranks {dead}); FlashRecovery rebuilds from a surviving replica, so there "
                            "is nothing to restore from: add ft=flash_ckpt for a snapshot to fall back on")
        if not can_restart:
            return Decision(fault, "fail", dead, f"{fault} of logical rank(s) {dead}: under torchrun/SLURM the "
                            "launcher owns the processes, so the job ends here for the launcher to restart it "
                            "(torchrun --max-restarts); run without torchrun/srun for in-place restarts")
        if restarts_left < len(dead):
            return Decision(fault, "fail", dead, "restart budget spent (ft.flashrecovery.max_restarts); raise it "
                            "if failures are expected this often")
        return Decision(fault, "restart_rank", dead,
                        f"{fault} of logical rank(s) {dead}: restart in place, state from a surviving replica")
    if ("flashrecovery" in ft and cfg.ft.flashrecovery.retry_transient) or "deadpool" in ft:
        return Decision("transient", "retry", [], "collective error with every process alive: rebuild the group and retry the step")
    return Decision("transient", "fail", [], f"a collective failed and ft={ft or '[]'} does not retry transient errors")
