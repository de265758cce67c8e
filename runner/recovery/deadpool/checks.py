"""DeadPool's own config checks (run by ``runner.config.validate`` when it is in ``ft``)."""

from __future__ import annotations

from omegaconf import DictConfig

from runner.config.validate import all_faults, changed_keys, layout_topology, replica_groups, shown
from runner.recovery.deadpool.config import DeadPoolConfig
from runner.recovery.registry import restart_owner


def config_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    out = _replication_problems(cfg)
    for i, one in enumerate(all_faults(cfg)):
        if one.during == "replication" and cfg.ft.deadpool.get("replication") != "copy":
            where = "fault" if i == 0 else f"fault.extra[{i - 1}]"
            out.append(f"{where}: during=replication kills a rank while its ZeRO-1 shard's copy after an update is in "
                       "flight, but ft.deadpool.replication=replay copies no shard after an update (its holder replays "
                       "the update): add ft.deadpool.replication=copy.")
    if for_training:
        out += _layout_problems(cfg)
        if cfg.parallel.dp_group_size and cfg.parallel.zero == 1 and replica_groups(cfg) > 1:
            out.append(f"parallel.dp_group_size={cfg.parallel.dp_group_size} with ft=deadpool: DeadPool replicates "
                       "each rank's shard to the rank one node on, which with DP replica groups holds another shard; "
                       "the replica groups already hold a copy of every shard (ft=flashrecovery restores a restarted "
                       "rank's shard from them): remove deadpool from ft or set parallel.dp_group_size=0.")
    return out


def _layout_problems(cfg: DictConfig) -> list[str]:
    """With tp*pp > 1 a spare takes each lost rank's state from the DP replica at the rank's (pp, tp) coordinate, so
    every coordinate needs a replica on another node; and a spare host takes a whole lost host's ranks, so a TP group
    stays on one host, which swapping a single crashed rank for a spare would break."""
    p = cfg.parallel
    if p.tp * p.pp <= 1:
        return []
    topology = layout_topology(cfg)
    if topology is None:
        return []  # the layout's own problem is reported where it is checked
    out = []
    if any(len({topology.node_of(r) for r in topology.dp_group(rank)}) < 2 for rank in range(topology.world)):
        out.append(f"ft=deadpool with parallel.tp={p.tp} parallel.pp={p.pp} gives a spare each lost rank's slice of "
                   "the model from the data-parallel replica at the same (pp, tp) coordinate, but with "
                   f"dp={topology.dp} on {p.nodes} node(s) some coordinate has no replica on another node: use "
                   "dp >= 2 replicas on parallel.nodes >= 2 (more ranks, or a smaller tp*pp).")
    if p.tp > 1 and cfg.ft.deadpool.crash_action == "swap":
        out.append(f"ft.deadpool.crash_action=swap with parallel.tp={p.tp}: a crashed rank would move alone to a spare "
                   "host and its tensor-parallel group would span two hosts; set ft.deadpool.crash_action="
                   "restart_in_place (a lost host's ranks still move to a spare host together).")
    return out


def _replication_problems(cfg: DictConfig) -> list[str]:
    """ft.deadpool.replication and verify_every_n_steps: how ZeRO-1 shards are replicated, so parallel.zero=1 only."""
    dp, out = cfg.ft.deadpool, []
    every = dp.get("verify_every_n_steps", 1)
    if not isinstance(every, int) or every < 1:
        out.append(f"ft.deadpool.verify_every_n_steps={every} must be >= 1 (the replicas kept by replay are compared "
                   "with their owners' shards every that many updates).")
    changed = [k for k in changed_keys(dp, DeadPoolConfig) if k in ("replication", "verify_every_n_steps")]
    if changed and cfg.parallel.zero != 1:
        out.append(f"ft.deadpool.{changed[0]}={shown(dp[changed[0]])} is about the replicas of ZeRO-1 optimizer "
                   f"shards, but parallel.zero={cfg.parallel.zero} shards nothing: set parallel.zero=1, or drop it.")
    elif "verify_every_n_steps" in changed and dp.get("replication") == "copy":
        out.append(f"ft.deadpool.verify_every_n_steps={every} verifies replicas kept by replay, but "
                   "ft.deadpool.replication=copy sends the whole shard every step: drop it, or use replication=replay.")
    owner = restart_owner(list(cfg.get("ft") or {}))
    if "max_restarts" in changed_keys(dp, DeadPoolConfig) and owner != "deadpool":
        out.append(f"ft.deadpool.max_restarts={dp.max_restarts} is ignored with {owner} in ft, "
                   f"whose ft.{owner}.max_restarts bounds in-place restarts: set that one instead.")
    return out
