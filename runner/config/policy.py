"""The policy table: for each fault class, the recovery actions to try, in order.

The controller classifies every fault into one class and takes the first action of that class's
row that can act now (runner/control/decision.py). A row left null in ``policy`` follows the seeds: the
FlashRecovery tree, DeadPool for permanent loss while spares remain, NDB when none remain, the
flash checkpoint as the last resort, each restricted to the techniques in ``ft``. A row the user
sets is taken as written and checked here: known actions, allowed for the class, provided by a
technique in ``ft``. Which technique carries an action out is its descriptor's to say
(``runner/recovery/registry.py``).
"""

from __future__ import annotations

from omegaconf import DictConfig

from runner.planning.topology import spare_count
from runner.recovery import registry

FAULT_CLASSES = ("transient", "process_crash", "hang", "node_loss_spare_free", "node_loss_no_spare", "replica_lost",
                 "silent_corruption", "straggler")

_RANK_LOSS = ("process_crash", "hang")
# The actions no technique carries out, and the fault classes they handle: the gradient guard's recompute
# (trainer.sdc_factor > 0) and the controller's straggler report (an event and a console line).
OWN_ACTIONS = {"recompute": ("silent_corruption",), "report": ("straggler",)}


def actions() -> dict[str, tuple[str, ...]]:
    """Every action a policy row may list -> the fault classes it can handle: each registered technique's actions
    (their ``handles``), then the runner's own."""
    found = {cls.name: cls.handles for t in registry.TECHNIQUES.values() for cls in t.actions}
    return {**found, **OWN_ACTIONS}

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
    """The techniques in ``ft`` that carry ``action`` out with their options (FlashRecovery retries only with
    retry_transient)."""
    if action == "recompute":
        return ["guard"] if _guard_on(cfg) else []
    if action == "report":
        return ["controller"]
    return registry.providers(action, ft, cfg.get("ft") or {})


def table(cfg: DictConfig, ft: list[str]) -> dict[str, list[str]]:
    """The effective table: the user's rows as written, the others the seeds' rows restricted to ``ft``.
    A technique's options may put an action first in the seeds' crash and hang rows (``ft.deadpool.crash_action=swap``:
    swap_spare)."""
    rows = cfg.get("policy") or {}
    first = registry.rank_loss_first(ft, cfg.get("ft") or {})
    out = {}
    for cls in FAULT_CLASSES:
        if rows.get(cls) is not None:
            out[cls] = list(rows[cls])
            continue
        seed = list(dict.fromkeys((first if cls in _RANK_LOSS else []) + SEED_TABLE[cls]))
        out[cls] = [a for a in seed if providers(a, cfg, ft)]
    return out


def row_problems(cfg: DictConfig, ft: list[str]) -> list[str]:
    """Rows the user set: every action known, able to handle its class, and carried out by ``ft``."""
    out = [f"policy.{key} is not a fault class; use any of {', '.join(FAULT_CLASSES)} (or reject_unhandled)."
           for key in cfg.policy if key not in (*FAULT_CLASSES, "reject_unhandled")]
    known = actions()
    for cls in FAULT_CLASSES:
        row = cfg.policy.get(cls)
        if row is None:
            continue
        for action in row:
            where = f"policy.{cls} lists {action}"
            if action not in known:
                out.append(f"{where}, which is not an action; use any of {', '.join(known)}.")
            elif cls not in known[action]:
                able = [a for a, classes in known.items() if cls in classes]
                out.append(f"{where}, which cannot handle {cls} faults; use any of {', '.join(able)}.")
            elif action == "recompute" and not _guard_on(cfg):
                out.append(f"{where}, which needs the corruption guard: set trainer.sdc_factor > 0 (default 100).")
            elif not providers(action, cfg, ft):
                need = " or ".join(f"ft={s}" for s in registry.able(action))
                extra = "".join(f" with ft.{n}.{registry.TECHNIQUES[n].switched_by[action]}=true"
                                for n in registry.able(action) if action in registry.TECHNIQUES[n].switched_by)
                out.append(f"{where}, which needs {need}{extra}: add it to ft or take {action} out of the row.")
        spares, host = spare_count(cfg), _host_ranks(cfg)
        if cls == "straggler" and "swap_spare" in row and providers("swap_spare", cfg, ft) and spares < host:
            out.append(f"policy.straggler lists swap_spare, which moves every rank of the straggler's host to a warm "
                       f"spare host, but parallel.spares={spares} is fewer than the {host} rank(s) "
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


def _host_ranks(cfg: DictConfig) -> int:
    return int(cfg.get("parallel", {}).get("procs_per_node", 1))
