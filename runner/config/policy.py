"""The policy table: for each fault class, the recovery actions to try, in order.

The controller classifies every fault into one class and takes the first action of that class's
row that can act now (runner/decision.py). A row left null in ``policy`` follows the seeds: the
FlashRecovery tree, DeadPool for permanent loss while spares remain, NDB when none remain, the
flash checkpoint as the last resort, each restricted to the strategies in ``ft``. A row the user
sets is taken as written and checked here: known actions, allowed for the class, provided by a
strategy in ``ft``.
"""

from __future__ import annotations

from omegaconf import DictConfig

FAULT_CLASSES = ("transient", "process_crash", "hang", "node_loss_spare_free", "node_loss_no_spare", "replica_lost",
                 "silent_corruption", "straggler")

_RANK_LOSS = ("process_crash", "hang")
_WITH_SURVIVORS = ("transient", *_RANK_LOSS, "node_loss_spare_free", "node_loss_no_spare")
# action -> (the classes it can handle, the strategies that carry it out)
ACTIONS = {
    "retry": (("transient",), ("flashrecovery", "deadpool")),
    "restart_rank": ((*_RANK_LOSS, "straggler"), ("flashrecovery", "deadpool")),
    "swap_spare": ((*_RANK_LOSS, "node_loss_spare_free", "straggler"), ("deadpool",)),
    "takeover": ((*_RANK_LOSS, "node_loss_spare_free", "node_loss_no_spare"), ("ndb",)),
    "restart_all": ((*_WITH_SURVIVORS, "replica_lost"), ("flash_ckpt",)),
    "recompute": (("silent_corruption",), ()),  # the gradient guard (trainer.sdc_factor > 0), no strategy
    "report": (("straggler",), ()),  # the controller's straggler detection: an event and a console line, no strategy
}

SEED_TABLE = {
    "transient": ["retry", "restart_all"],
    "process_crash": ["restart_rank", "takeover", "restart_all"],
    "hang": ["restart_rank", "takeover", "restart_all"],
    "node_loss_spare_free": ["swap_spare", "takeover", "restart_all"],
    "node_loss_no_spare": ["takeover", "restart_all"],
    "replica_lost": ["restart_all"],
    "silent_corruption": ["recompute"],
    "straggler": ["report"],  # also with spares: a swap spends a spare a node loss may need (docs/recovery.md)
}


def providers(action: str, cfg: DictConfig, ft: list[str]) -> list[str]:
    """The strategies in ``ft`` that carry ``action`` out (FlashRecovery retries only with retry_transient)."""
    if action == "recompute":
        return ["guard"] if _guard_on(cfg) else []
    if action == "report":
        return ["controller"]
    found = [s for s in ACTIONS[action][1] if s in ft]
    if action == "retry" and "flashrecovery" in found and not cfg.ft.flashrecovery.get("retry_transient", True):
        found.remove("flashrecovery")
    return found


def table(cfg: DictConfig, ft: list[str]) -> dict[str, list[str]]:
    """The effective table: the user's rows as written, the others the seeds' rows restricted to ``ft``.
    ``ft.deadpool.crash_action=swap`` puts swap_spare first in the seeds' crash and hang rows."""
    rows = cfg.get("policy") or {}
    swap_first = "deadpool" in ft and cfg.ft.deadpool.get("crash_action") == "swap"
    out = {}
    for cls in FAULT_CLASSES:
        if rows.get(cls) is not None:
            out[cls] = list(rows[cls])
            continue
        seed = (["swap_spare"] if swap_first and cls in _RANK_LOSS else []) + SEED_TABLE[cls]
        out[cls] = [a for a in seed if providers(a, cfg, ft)]
    return out


def row_problems(cfg: DictConfig, ft: list[str]) -> list[str]:
    """Rows the user set: every action known, able to handle its class, and carried out by ``ft``."""
    out = [f"policy.{key} is not a fault class; use any of {', '.join(FAULT_CLASSES)} (or reject_unhandled)."
           for key in cfg.policy if key not in (*FAULT_CLASSES, "reject_unhandled")]
    for cls in FAULT_CLASSES:
        row = cfg.policy.get(cls)
        if row is None:
            continue
        for action in row:
            where = f"policy.{cls} lists {action}"
            if action not in ACTIONS:
                out.append(f"{where}, which is not an action; use any of {', '.join(ACTIONS)}.")
            elif cls not in ACTIONS[action][0]:
                able = [a for a, (classes, _) in ACTIONS.items() if cls in classes]
                out.append(f"{where}, which cannot handle {cls} faults; use any of {', '.join(able)}.")
            elif action == "recompute" and not _guard_on(cfg):
                out.append(f"{where}, which needs the corruption guard: set trainer.sdc_factor > 0 (default 100).")
            elif not providers(action, cfg, ft):
                need = " or ".join(f"ft={s}" for s in ACTIONS[action][1])
                extra = " with ft.flashrecovery.retry_transient=true" if action == "retry" else ""
                out.append(f"{where}, which needs {need}{extra}: add it to ft or take {action} out of the row.")
        if cls == "straggler" and "swap_spare" in row and "deadpool" in ft and _spares(cfg) < _host_ranks(cfg):
            out.append(f"policy.straggler lists swap_spare, which moves every rank of the straggler's host to a warm "
                       f"spare host, but parallel.spares={_spares(cfg)} is fewer than the {_host_ranks(cfg)} rank(s) "
                       f"of a host: set parallel.spares={_host_ranks(cfg)} (a spare host) or take swap_spare out of "
                       "the row.")
        if len(set(row)) != len(row):
            out.append(f"policy.{cls}={list(row)} lists an action twice; list each once, in the order to try them.")
    if cfg.policy.get("silent_corruption") == [] and _guard_on(cfg):
        out.append("policy.silent_corruption=[] but the corruption guard still recomputes corrupted steps: set "
                   "trainer.sdc_factor=0 to turn it off, or leave the row null.")
    return out


def _guard_on(cfg: DictConfig) -> bool:
    trainer = cfg.get("trainer")
    return trainer is None or trainer.get("sdc_factor", 1.0) > 0


def _spares(cfg: DictConfig) -> int:
    return int(cfg.get("parallel", {}).get("spares", 0))


def _host_ranks(cfg: DictConfig) -> int:
    return int(cfg.get("parallel", {}).get("procs_per_node", 1))
