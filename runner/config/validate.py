"""Validation in one place: every key against the schema, then everything a type cannot express, before launch.

First the schema check: an unknown key (also one added with ``+``, which Hydra lets through), a
value outside its closed set (``runner.config.schema.choices``) or outside the range its type states
(``runner.config.schema.value_range``). Then the rules that span several fields: layouts, keys the
chosen options would ignore, and the fault-tolerance mix against the faults it faces. Last, only for
a config with no other problem, a user's ``_target_`` is imported and checked to be a LightningModule
or LightningDataModule (it costs torch and Lightning, which no other refusal imports). Each problem
becomes one sentence that says what to change; all of them are reported together in one
``ConfigError``.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields, is_dataclass
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config import callbacks
from runner.config.coverage import mix_problems
from runner.config.errors import ConfigError, imported
from runner.config.registry import recipe_names
from runner.config.schema import (
    ChaosKind,
    DataConfig,
    FaultConfig,
    FaultKind,
    LoggerConfig,
    PolicyConfig,
    RootConfig,
    choices,
    value_range,
)
from runner.control.phase_timeouts import config_problems as phase_timeout_problems
from runner.control.stragglers import config_problems as straggler_config_problems
from runner.launch.objective import LOGGED
from runner.planning.topology import Topology, spare_count
from runner.recovery.registry import TECHNIQUES, offering, options_schemas, titles, with_

RANK_FAULTS = ("kill_rank", "hang_rank", "transient", "slow_rank", "bitflip", "param_bitflip", "slow_link", "partition",
               "kill_all", "wipe_shm", "corrupt_snapshot")
_TIMED = tuple(k for k in choices(FaultKind) or () if k not in ("none", "chaos"))  # injected at a step or time
# fault keys -> the kinds that read them; any other kind ignores them
_FAULT_KEY_USERS = {
    "rank": RANK_FAULTS,
    "node": ("kill_node",),
    "step": _TIMED, "after_s": _TIMED, "during": _TIMED,
    "delay_s": ("slow_rank", "slow_link"),
    "hang": ("hang_rank",),
    "duration_s": ("partition", "chaos"),
    "kinds": ("chaos",), "mtbf_s": ("chaos",), "max_faults": ("chaos",), "until_s": ("chaos",),
}


def world_size(cfg: DictConfig) -> int:
    return int(cfg.parallel.nodes) * int(cfg.parallel.procs_per_node)


def dp_size(cfg: DictConfig) -> int:
    return world_size(cfg) // (int(cfg.parallel.tp) * int(cfg.parallel.pp))


def ft_names(cfg: DictConfig) -> list[str]:
    return list(cfg.ft.keys()) if cfg.ft else []


def all_faults(cfg: DictConfig) -> list[DictConfig]:
    """The main fault plus ``fault.extra`` entries, each a full FaultConfig."""
    extra = [OmegaConf.merge(OmegaConf.structured(FaultConfig), e) for e in cfg.fault.extra]
    return [cfg.fault] + extra


def validate(cfg: DictConfig, *, for_training: bool = True) -> None:
    """Raise ConfigError listing every problem; ``for_training=False`` checks only what a plan needs."""
    problems: list[str] = []
    if "recipe" in cfg:
        problems.append(f"'recipe={cfg.recipe}' is not a known recipe; choose one with +recipe=NAME from: "
                        f"{', '.join(recipe_names())}.")
    if cfg.recipe_name == "none" and cfg.model._target_ is None:
        problems.append(f"No recipe chosen: add +recipe=NAME, one of: {', '.join(recipe_names())}, or train your own "
                        "LightningModule with model._target_=package.module.Class.")
    schema = schema_problems(cfg)
    if schema:  # the rules below read the keys the schema declares, with values in range
        raise ConfigError("Invalid configuration: " + " ".join(problems + schema))
    problems += layout_problems(cfg, for_training)
    problems += _ft_problems(cfg, for_training)
    problems += _misc_problems(cfg)
    problems += straggler_config_problems(cfg)
    problems += ignored_key_problems(cfg)
    problems += callbacks.entry_problems(cfg)
    if for_training and not problems:  # the replay of the faults needs every value above in range
        problems += mix_problems(cfg, ft_names(cfg), all_faults(cfg), world_size(cfg))  # logical ranks, not replicas
    if not problems:  # a user's module imports torch and Lightning: only once nothing else refuses the config
        problems += _target_problems(cfg) + callbacks.target_problems(cfg)
    if problems:
        raise ConfigError("Invalid configuration: " + " ".join(problems))


def layout_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    """The layout rules (also for a candidate layout ``runner.planning.plan`` tries)."""
    p = cfg.parallel
    out: list[str] = []
    if p.nodes < 1 or p.procs_per_node < 1:
        out.append(f"parallel.nodes ({p.nodes}) and parallel.procs_per_node ({p.procs_per_node}) must be >= 1.")
        return out
    if p.tp < 1 or p.pp < 1:
        out.append(f"parallel.tp ({p.tp}) and parallel.pp ({p.pp}) must be >= 1.")
        return out
    world = world_size(cfg)
    if world % (p.tp * p.pp):
        out.append(
            f"tp*pp = {p.tp}*{p.pp} = {p.tp * p.pp} does not divide the world size {world} "
            f"(= parallel.nodes {p.nodes} x parallel.procs_per_node {p.procs_per_node}); "
            "change tp/pp or the number of ranks so that tp*pp*dp equals the world size."
        )
        return out
    dp = world // (p.tp * p.pp)
    if p.dp_group_size < 0 or (p.dp_group_size and dp % p.dp_group_size):
        out.append(
            f"parallel.dp_group_size={p.dp_group_size} must be 0 (one group) or divide the data-parallel size {dp}."
        )
    if spare_count(cfg) < 0:
        out.append(f"parallel.spares={p.spares} is negative; use 0 or more hot spares.")
    if not out:  # the placement: the order names each dimension once, and TP placed innermost stays in a node
        try:
            Topology.from_cfg(cfg)
        except ValueError as err:
            out.append(f"parallel.order={p.order}, tp={p.tp}, pp={p.pp}: {err}")
    if p.backend == "nccl" and cfg.runner.device == "cpu":
        out.append("parallel.backend=nccl needs GPUs: use runner.device=cuda (or auto on a GPU host), or backend=gloo.")
    m = cfg.model
    if m._target_ is None:
        if m.n_head < 1 or m.d_model % m.n_head:
            out.append(f"model.d_model={m.d_model} must be a multiple of model.n_head={m.n_head}.")
        if m.n_head % p.tp:
            out.append(f"parallel.tp={p.tp} must divide model.n_head={m.n_head}.")
        if m.n_layer % p.pp:
            out.append(f"parallel.pp={p.pp} must divide model.n_layer={m.n_layer}.")
    gbs = cfg.trainer.global_batch_size
    if gbs < dp:
        out.append(
            f"The recipe's trainer.global_batch_size={gbs} gives no sample to some of the {dp} data-parallel "
            f"ranks: use at most {gbs} data-parallel ranks or raise the global batch size."
        )
    elif gbs % dp:
        out.append(f"trainer.global_batch_size={gbs} must be divisible by the data-parallel size {dp}.")
    elif cfg.trainer.accumulate_grad_batches >= 1 and gbs % (dp * cfg.trainer.accumulate_grad_batches):
        k = cfg.trainer.accumulate_grad_batches
        out.append(f"trainer.global_batch_size={gbs} must be divisible by the data-parallel size {dp} x "
                   f"trainer.accumulate_grad_batches={k}: each rank's {gbs // dp} samples per step are split into "
                   f"{k} equal micro-batches.")
    if for_training:
        out += replica_group_problems(cfg)
        out += zero_problems(cfg)
        out += master_weight_problems(cfg)
        if spare_count(cfg) and not with_(ft_names(cfg), "uses_spares"):
            users = " or ".join(f"ft={n}" for n in offering("uses_spares"))
            out.append(f"parallel.spares={p.spares} starts hot spares that only {users.removeprefix('ft=')} uses: add "
                       f"{users} or set parallel.spares=0.")
    if for_training:
        out += tp_problems(cfg)
        out += pp_problems(cfg)
        if p.pp > 1 and not out:
            out += _pipeline_batch_problems(cfg, dp)
    if p.pp == 1 and cfg.trainer.micro_batches:
        out.append(f"trainer.micro_batches={cfg.trainer.micro_batches} splits a pipeline's step, but parallel.pp=1 has "
                   "no pipeline: set trainer.micro_batches=0 (trainer.accumulate_grad_batches splits a step without "
                   "one) or parallel.pp > 1.")
    return out


def pp_problems(cfg: DictConfig) -> list[str]:
    """What training with parallel.pp > 1 does not do yet, each with the change that makes the run train."""
    p, t = cfg.parallel, cfg.trainer
    if p.pp <= 1:
        return []
    out = _split_model_problems(
        cfg, "pp", split="cuts the runner's own GPT into stages", lacks="pipeline stages",
        dropout="the stages draw no dropout stream per micro-batch yet")
    if t.accumulate_grad_batches > 1:
        out.append(f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} with parallel.pp={p.pp}: the pipeline "
                   "splits each step's batch into trainer.micro_batches itself; set trainer.accumulate_grad_batches=1 "
                   "and trainer.micro_batches instead.")
    return out


def _pipeline_batch_problems(cfg: DictConfig, dp: int) -> list[str]:
    """The replica's batch must split into the pipeline's equal micro-batches."""
    per_replica, micro = cfg.trainer.global_batch_size // dp, cfg.trainer.micro_batches or cfg.parallel.pp
    if micro < 0 or per_replica % micro:
        return [f"trainer.micro_batches={micro} with parallel.pp={cfg.parallel.pp}: each replica's "
                f"{per_replica} samples per step (global_batch_size / dp) must split into that many equal "
                "micro-batches; choose a divisor of it."]
    return []


def trained_pp(cfg: DictConfig) -> int:
    """The largest pp this config's mix trains with: its own when ``pp_problems`` has nothing against it, else 1."""
    return int(cfg.parallel.pp) if not pp_problems(cfg) else 1


def tp_problems(cfg: DictConfig) -> list[str]:
    """What training with parallel.tp > 1 does not do yet, each with the change that makes the run train."""
    if cfg.parallel.tp <= 1:
        return []
    return _split_model_problems(
        cfg, "tp", split="slices the runner's own GPT", lacks="tensor-parallel layers",
        dropout="the tensor-parallel layers keep no dropout stream per TP rank yet")


def _split_model_problems(cfg: DictConfig, dim: str, *, split: str, lacks: str, dropout: str) -> list[str]:
    """The refusals a model split along ``dim`` (tp or pp) shares: a user's model the runner cannot split, and
    dropout. (Every ft technique places its work and state by (pp, tp) coordinate.)"""
    key = f"parallel.{dim}"
    size = cfg.parallel[dim]
    out = []
    if cfg.model._target_:
        out.append(f"{key}={size} {split}; {cfg.model._target_} has no {lacks}: set {key}=1.")
    elif cfg.model.dropout:
        out.append(f"model.dropout={cfg.model.dropout} with {key}={size}: {dropout}; set model.dropout=0 or {key}=1.")
    return out


def layout_topology(cfg: DictConfig) -> Optional[Topology]:
    """The config's Topology, or None when its layout is invalid (reported by the layout checks)."""
    try:
        return Topology.from_cfg(cfg)
    except ValueError:
        return None


def trained_tp(cfg: DictConfig) -> int:
    """The largest tp this config's mix trains with: its own when ``tp_problems`` has nothing against it, else 1."""
    return int(cfg.parallel.tp) if not tp_problems(cfg) else 1


def replica_groups(cfg: DictConfig) -> int:
    """How many DP replica groups ``parallel.dp_group_size`` makes (1 when it is 0 or the whole DP size)."""
    size = int(cfg.parallel.dp_group_size)
    return dp_size(cfg) // size if size > 0 and dp_size(cfg) % size == 0 else 1


def replica_group_problems(cfg: DictConfig) -> list[str]:
    """``parallel.dp_group_size``: replica groups (HSDP) exist for ZeRO-1's shards (a technique that replicates
    shards itself refuses them in its own checks)."""
    p = cfg.parallel
    if not p.dp_group_size or p.zero == 1:
        return []
    return [f"parallel.dp_group_size={p.dp_group_size} splits the data-parallel replicas into groups within "
            f"which ZeRO-1 shards the optimizer state, but parallel.zero={p.zero} shards nothing: set "
            "parallel.zero=1 or parallel.dp_group_size=0."]


def zero_problems(cfg: DictConfig) -> list[str]:
    """ZeRO-1 state lives in one place per shard within a DP replica group: a failed rank's shard comes back only
    from the same shard in another replica group (``parallel.dp_group_size`` below dp), from a technique's per-step
    replica on a neighbour (DeadPool's), or, with every rank restarting, from its snapshot (the flash checkpoint's)."""
    p, names = cfg.parallel, ft_names(cfg)
    if p.zero != 1 or not names:
        return []
    out = []
    grouped = replica_groups(cfg) > 1
    replicating, covering = with_(names, "replicates_shards"), with_(names, "covers_ranks")
    snapshots, alone = with_(names, "restarts_from_snapshots"), with_(names, "restarts_rank_alone")
    replicator = " or ".join(offering("replicates_shards"))  # what to add, and in prose
    replicas, snapshotter = titles(offering("replicates_shards")), " or ".join(offering("restarts_from_snapshots"))
    groups = (f"set parallel.dp_group_size to a divisor of the data-parallel size {dp_size(cfg)} below it (each "
              "replica group of that many ranks then holds a copy of every shard"
              + (f"; parallel.dp_group_size={p.dp_group_size} is the whole DP dimension, one group)"
                 if p.dp_group_size else ")"))
    if covering and not replicating:
        out.append(f"parallel.zero=1 with ft={covering[0]}: a neighbour taking over a failed rank's micro-batches "
                   "leaves that rank's ZeRO-1 optimizer shard (its Adam moments, and fp32 masters with "
                   f"trainer.master_weights) without an owner, and only {replicas}'s per-step replica keeps a copy of "
                   f"it: add {replicator} to ft (the holder of the replica then updates the shard in the failed rank's "
                   "place), or set parallel.zero=0.")
    if not replicating and not snapshots and not (grouped and alone):
        out.append(f"parallel.zero=1 shards the optimizer state, so a failed rank's shard exists nowhere else and "
                   f"ft={names} cannot rebuild it: add {replicator} to ft (it replicates every shard to a neighbour "
                   f"each step), or {snapshotter} (every rank restarts from its snapshot), or {groups}, or set "
                   "parallel.zero=0.")
    elif not replicating and alone and not grouped:
        out.append(f"ft={alone[0]} restarts a failed rank alone, and with parallel.zero=1 only {replicas}'s replicas "
                   f"hold its optimizer shard: add {replicator} to ft, or {groups}, or leave {snapshotter} alone to "
                   "restart every rank from its snapshot.")
    if replicating and p.nodes < 2:
        out.append(f"parallel.zero=1 with ft={replicating[0]} keeps each shard's replica on another node, but "
                   "parallel.nodes=1: use parallel.nodes >= 2 (e.g. parallel.nodes=2 parallel.procs_per_node=1).")
    elif replicating and (topology := layout_topology(cfg)) is not None and not topology.replicas_off_node:
        out.append(f"parallel.zero=1 with ft={replicating[0]} keeps each shard's replica at the same (pp, tp) "
                   "coordinate in another data-parallel replica on another node, but with "
                   f"parallel.tp={p.tp} parallel.pp={p.pp} on {p.nodes} x {p.procs_per_node} ranks no shift of the "
                   "replicas puts every replica on another node: make tp*pp a divisor or a multiple of "
                   "parallel.procs_per_node.")
    return out


def master_weight_problems(cfg: DictConfig) -> list[str]:
    """trainer.master_weights: fp32 masters of bf16 parameters, kept in the ZeRO-1 shard (``runner.training.zero``)."""
    t = cfg.trainer
    if not t.master_weights:
        return []
    out = []
    if cfg.parallel.zero != 1:
        out.append(f"trainer.master_weights=true keeps the fp32 master weights and Adam moments in each rank's ZeRO-1 "
                   f"shard, but parallel.zero={cfg.parallel.zero}: set parallel.zero=1.")
    if t.precision != "bf16-true":
        out.append(f"trainer.master_weights=true keeps fp32 masters of bf16 parameters and gradients, but "
                   f"trainer.precision={t.precision}: set trainer.precision=bf16-true (16-true would need loss "
                   "scaling, which the runner does not do; under 32-true or a -mixed precision the fp32 weights are "
                   "already the optimizer's own).")
    return out


def _ft_problems(cfg: DictConfig, for_training: bool) -> list[str]:
    """Each technique's options against its schema, then its own checks (its descriptor's ``checks``)."""
    out: list[str] = []
    for name in ft_names(cfg):
        restarts = cfg.ft[name].get("max_restarts", 0)
        if restarts < 0:
            out.append(f"ft.{name}.max_restarts={restarts} must be >= 0.")
        try:
            OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(options_schemas()[name]), cfg.ft[name]))
        except (OmegaConfBaseException, ValueError) as err:
            out.append(f"ft.{name}: {str(err).splitlines()[0].rstrip('.')}; see docs/configuration.md for its keys.")
        else:
            out += TECHNIQUES[name].config_problems()(cfg, for_training)
    return out


def _agreement_fault_problems(cfg: DictConfig, f: DictConfig, where: str) -> list[str]:
    """``during: agreement`` strikes inside a step's agreement, which only a split model has."""
    split = cfg.parallel.tp * cfg.parallel.pp
    missing = ([f"parallel.tp or parallel.pp above 1 (this run has tp*pp = {split})"] if split <= 1 else []) + (
        ["a fault.step"] if f.step < 0 else []) + (
        [f"kind transient, kill_rank or kill_node (not {f.kind})"]
        if f.kind not in ("transient", "kill_rank", "kill_node") else [])
    if not missing:
        return []
    return [f"{where}: during=agreement strikes inside a step's agreement, the all-reduce over every rank that follows "
            f"the gradient reductions when the model is split: it needs {' and '.join(missing)}."]


def _chaos_problems(f: DictConfig, where: str) -> list[str]:
    out = []
    if where != "fault":
        out.append(f"{where}.kind=chaos: chaos is the main fault (fault=chaos); fault.extra takes fixed faults.")
    kinds = choices(ChaosKind) or ()
    if not f.kinds or any(k not in kinds for k in f.kinds):
        out.append(f"fault.kinds={list(f.kinds)}: chaos draws from a non-empty list of {', '.join(kinds)}.")
    if f.mtbf_s <= 0 or f.max_faults < 1 or f.until_s <= 0:
        out.append(f"fault.mtbf_s ({f.mtbf_s}) and fault.until_s ({f.until_s}) must be > 0 and fault.max_faults "
                   f"({f.max_faults}) >= 1.")
    return out


def _misc_problems(cfg: DictConfig) -> list[str]:
    out: list[str] = []
    hb = cfg.heartbeat
    if hb.interval_s <= 0 or hb.misses < 1:
        out.append(f"heartbeat.interval_s ({hb.interval_s}) must be > 0 and heartbeat.misses ({hb.misses}) >= 1.")
    if hb.decide_window_s < 0:
        out.append(f"heartbeat.decide_window_s ({hb.decide_window_s}) must be >= 0.")
    if hb.stall_timeout_s <= hb.interval_s:
        out.append(f"heartbeat.stall_timeout_s ({hb.stall_timeout_s}) must exceed heartbeat.interval_s "
                   f"({hb.interval_s}).")
    out += phase_timeout_problems(cfg)
    try:
        faults = all_faults(cfg)
    except OmegaConfBaseException as err:
        return out + [f"fault.extra: {str(err).splitlines()[0]}; each entry takes the keys of recipes/fault/*.yaml."]
    for i, one in enumerate(faults):
        where = "fault" if i == 0 else f"fault.extra[{i - 1}]"
        if one.kind in RANK_FAULTS and not 0 <= one.rank < world_size(cfg):
            out.append(f"{where}.rank={one.rank} is not a rank of this {world_size(cfg)}-rank job; use "
                       f"0..{world_size(cfg) - 1}.")
        if one.kind == "kill_node" and not 0 <= one.node < cfg.parallel.nodes:
            out.append(f"{where}.node={one.node} is not a node of this job; use 0..{cfg.parallel.nodes - 1}.")
        if one.delay_s < 0 or (one.duration_s < 0 and one.duration_s != -1):
            out.append(f"{where}: delay_s ({one.delay_s}) must be >= 0 and duration_s ({one.duration_s}) -1 (for good) "
                       "or >= 0.")
        if one.during == "after_reduce" and one.kind != "transient":
            out.append(f"{where}: during=after_reduce is for transient faults (the victim alone misses a reduction "
                       "that completed everywhere else).")
        if one.during == "reduction" and (one.kind != "transient" or one.step < 0):
            out.append(f"{where}: during=reduction wedges the reduction of a step (the victim's part never leaves it): "
                       "it needs kind=transient and a fault.step.")
        if one.during == "agreement":
            out += _agreement_fault_problems(cfg, one, where)
        if one.during == "recovery" and one.kind not in ("kill_rank", "hang_rank"):
            out.append(f"{where}: during=recovery is for kill_rank and hang_rank faults.")
        if one.hang == "stall" and one.during != "step":
            out.append(f"{where}: hang=stall blocks the victim's training thread at a step: it needs during=step "
                       "(a stalled recovery only waits, which the recovery's own timeout bounds).")
        if one.during == "replication" and (one.kind != "kill_rank" or one.step < 0 or not cfg.parallel.zero
                                            or not with_(ft_names(cfg), "replicates_shards")):
            replicator = " or ".join(f"ft={n}" for n in offering("replicates_shards"))
            out.append(f"{where}: during=replication kills a rank while its ZeRO-1 shard is being copied: it needs "
                       f"kind=kill_rank, a fault.step, parallel.zero=1 and {replicator}.")
        if one.kind == "param_bitflip" and (cfg.parallel.zero or dp_size(cfg) < 2 or one.during != "step"):
            out.append(f"{where}: param_bitflip makes one data-parallel replica's parameters differ from the others'; "
                       f"it needs parallel.zero=0 (ZeRO-1's parameter sync overwrites or spreads the flipped element), "
                       f"at least 2 replicas (this layout has {dp_size(cfg)}) and during=step.")
        if one.kind == "chaos":
            out += _chaos_problems(one, where)
        elif (one.kind not in ("none", "slow_rank") and one.during in ("step", "after_reduce") and one.step < 0
              and one.after_s < 0):
            out.append(f"{where}: set fault.step (a step) or fault.after_s (seconds) to say when to inject.")
        if one.kind != "none" and 0 <= cfg.trainer.max_steps <= one.step:
            out.append(f"{where}.step={one.step} is not before trainer.max_steps={cfg.trainer.max_steps}; the fault "
                       "would never fire.")
    metric = cfg.runner.optimized_metric
    if metric is not None and (metric not in LOGGED or (metric == "val/loss" and cfg.trainer.val_check_interval <= 0)):
        out.append(f"runner.optimized_metric={metric} is not a metric this run logs, so the job could return no "
                   f"value for it: use one of {', '.join(n for n in LOGGED if n != 'val/loss')}, or val/loss with "
                   "trainer.val_check_interval=N (or null to return nothing).")
    secret = cfg.launcher.secret_file
    if secret and not os.path.isfile(secret):
        out.append(f"launcher.secret_file={secret} is not a file: point it at the job's secret (one line, the same "
                   "file on every host), or drop it to have the local launcher generate one.")
    return out + _loop_problems(cfg) + _join_problems(cfg)


def _join_problems(cfg: DictConfig) -> list[str]:
    """``launcher.join``: a host that joins a running per_host job, as a spare host (DeadPool's)."""
    join = cfg.launcher.join
    if not join:
        return []
    out: list[str] = []
    host, _, port = str(join).rpartition(":")
    if not host or not port.isdigit():
        out.append(f"launcher.join={join} is not HOST:PORT: give the control-plane store's address, which node 0 "
                   "logs (control_store in its host_joined event, and on its output).")
    if cfg.launcher.kind == "local" or cfg.launcher.mode != "per_host":
        out.append(f"launcher.join joins a running launcher.mode=per_host job as a spare host, but this command has "
                   f"launcher.kind={cfg.launcher.kind} launcher.mode={cfg.launcher.mode}: repeat the job's own "
                   "overrides (launcher.mode=per_host included); a launcher=local job cannot be joined (its control "
                   "plane listens on loopback and its controller starts its hosts' agents itself).")
    if not with_(ft_names(cfg), "uses_spares"):
        users = offering("uses_spares")
        out.append(f"launcher.join adds a spare host, and only {' or '.join(f'ft={n}' for n in users)} uses spare "
                   f"hosts (its warm spares take a lost host's ranks); this job's ft has no {' or '.join(users)}, so "
                   "a joining host would never be used.")
    return out


def _loop_problems(cfg: DictConfig) -> list[str]:
    """Epochs, validation and gradient accumulation."""
    t, d = cfg.trainer, cfg.data
    out: list[str] = []
    interval, own = t.val_check_interval, cfg.model._target_ or d._target_
    if t.max_epochs is not None and not own:
        out.append(f"trainer.max_epochs={t.max_epochs} counts passes over a finite training set, but the built-in "
                   f"data (data.kind={d.kind}) draws each step's batch afresh and has no end: end the run with "
                   "trainer.max_steps and set trainer.max_epochs=null, or train your own LightningModule or "
                   "DataModule (model._target_ or data._target_) over a map-style dataset.")
    if cfg.runner.test_after_fit and not cfg.model._target_:
        out.append("runner.test_after_fit=true runs your module's test_step, and the built-in GPT has none: train your "
                   "own LightningModule (model._target_=...) with a test_step and a test_dataloader, or set "
                   "runner.test_after_fit=false.")
    if cfg.runner.test_after_fit and cfg.parallel.pp > 1:
        out.append(f"runner.test_after_fit=true runs test_step on the whole model, and parallel.pp={cfg.parallel.pp} "
                   "cuts it into stages: set runner.test_after_fit=false or parallel.pp=1.")
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        return out + [f"trainer.val_check_interval={interval!r} is neither a number of steps (an int) nor a fraction "
                      "of an epoch (a float in (0, 1]): give one of those, or 0 for no validation."]
    if isinstance(interval, float) and not 0 < interval <= 1:
        out.append(f"trainer.val_check_interval={interval} is a float, which is a fraction of an epoch in (0, 1]: give "
                   f"a fraction, or an int number of steps (e.g. trainer.val_check_interval={max(1, int(interval))}).")
    elif isinstance(interval, float) and not own:
        out.append(f"trainer.val_check_interval={interval} is a fraction of an epoch, and the built-in data has no "
                   "epochs (its batches are drawn without end): give an int number of steps, or train on a finite "
                   "dataset of your own (data._target_=... or model._target_=...).")
    if interval <= 0 or own:
        return out
    if t.limit_val_batches == 0:  # the built-in data
        out.append(f"trainer.val_check_interval={t.val_check_interval} with the built-in data: set "
                   "trainer.limit_val_batches (validation batches over all DP ranks; its held-out split has no end).")
    if d.kind == "memmap" and not (d.val_path and os.path.isfile(d.val_path)):
        out.append(f"trainer.val_check_interval={t.val_check_interval} with data.kind=memmap reads data.val_path, but "
                   f"data.val_path={d.val_path} is not a file: point it at a held-out uint16 token .bin file.")
    return out


def schema_problems(cfg: DictConfig) -> list[str]:
    """Keys the schema does not declare (Hydra lets ``+key=value`` through) and values outside a closed set."""
    out = _walk(cfg, RootConfig, "")
    for i, entry in enumerate(cfg.fault.extra):
        if isinstance(entry, DictConfig):
            out += _walk(entry, FaultConfig, f"fault.extra[{i}].")
    return out


def _walk(node: DictConfig, schema: type, where: str) -> list[str]:
    hints = get_type_hints(schema, include_extras=True)
    names = [f.name for f in fields(schema)]
    out = []
    for key in node:
        key = str(key)
        if key not in hints:
            # validate() explains a stray recipe itself, and policy.row_problems a row that is not a fault class
            if not (schema is RootConfig and key == "recipe") and schema is not PolicyConfig:
                out.append(_unknown_key(f"{where}{key}", names, where))
            continue
        value = node.get(key)
        if schema is RootConfig and key == "ft":
            for name in value or {}:
                if name in options_schemas():
                    out += _walk(value[name], options_schemas()[name], f"ft.{name}.")
                else:
                    out.append(_unknown_key(f"ft.{name}", list(options_schemas()), "ft."))
        else:
            out += _value_problems(value, hints[key], f"{where}{key}")
    return out


def _value_problems(value: Any, hint: Any, where: str) -> list[str]:
    if get_origin(hint) is Union:  # Optional[X]
        if value is None:
            return []
        hint = next(a for a in get_args(hint) if a is not type(None))
    allowed = choices(hint)
    if allowed is not None and value not in allowed:
        return [f"{where}={value!r} is not one of {', '.join(str(a) for a in allowed)}."]
    bounds = value_range(hint)
    if bounds is not None and isinstance(value, (int, float)) and not bounds.holds(value):
        return [f"{where}={value:g} must be {bounds}."]
    if is_dataclass(hint) and isinstance(value, DictConfig):
        return _walk(value, hint, f"{where}.")  # type: ignore[arg-type]
    return []  # a list of a closed set (fault.kinds) is checked where it is used, with what it is for


# Lightning Trainer arguments a user may try, and the key that does their work here
_LIGHTNING_KEYS = {"ckpt_path": "runner.resume (a run dir or a .ckpt file to continue)",
                   "trainer.gradient_clip_val": "trainer.grad_clip"}


def _unknown_key(path: str, names: list[str], where: str) -> str:
    if path in _LIGHTNING_KEYS:
        return f"{path} is not a config key: use {_LIGHTNING_KEYS[path]}."
    closest = difflib.get_close_matches(path.rsplit(".", 1)[-1], names, n=1, cutoff=0.0)
    section = where.rstrip(".") or "the top level"
    hint = f": the closest valid key is {where}{closest[0]}" if closest else ""
    return f"{path} is not a config key{hint} ({section} takes {', '.join(names)})."


def ignored_key_problems(cfg: DictConfig) -> list[str]:
    """Keys set away from their default that the chosen options would silently ignore."""
    out = []
    try:
        faults = all_faults(cfg)
    except OmegaConfBaseException:
        faults = []  # _misc_problems reports the bad fault.extra entry
    for i, f in enumerate(faults):
        if f.kind == "none":  # a sweep's fault-free job shares the fault keys of the others (fault=none,kill_rank)
            continue
        where = "fault" if i == 0 else f"fault.extra[{i - 1}]"
        for key in changed_keys(f, FaultConfig):
            users = _FAULT_KEY_USERS.get(key)
            if users is not None and f.kind not in users:
                out.append(f"{where}.{key}={shown(f[key])} is ignored by kind={f.kind}: it applies to "
                           f"{', '.join(users)}; drop it or change the kind.")
    d, own_data = cfg.data, cfg.model._target_ is not None or cfg.data._target_ is not None
    if own_data:
        out += [f"data.{key}={shown(d[key])} is ignored: with "
                f"{'data._target_' if d._target_ else 'model._target_'} set the built-in data is not used; drop it."
                for key in changed_keys(d, DataConfig) if key in ("kind", "path", "val_path")]
    elif d.kind == "memmap" and not (d.path and os.path.isfile(d.path)):
        out.append(f"data.kind=memmap reads data.path, but data.path={d.path} is not a file: point it at a "
                   "nanoGPT-style uint16 token .bin file.")
    elif d.kind != "memmap" and d.path is not None:
        out.append(f"data.path={d.path} is ignored with data.kind={d.kind}: add data.kind=memmap to train on that "
                   "file, or drop data.path.")
    if not own_data and d.val_path is not None and (d.kind != "memmap" or cfg.trainer.val_check_interval <= 0):
        out.append(f"data.val_path={d.val_path} is read only by validation of data.kind=memmap: set "
                   "trainer.val_check_interval and data.kind=memmap, or drop data.val_path.")
    if cfg.trainer.val_check_interval <= 0 and cfg.trainer.limit_val_batches != 0:
        out.append(f"trainer.limit_val_batches={cfg.trainer.limit_val_batches} is ignored without validation: set "
                   "trainer.val_check_interval=N, or drop limit_val_batches.")
    for group in ("model", "data"):
        if cfg[group].kwargs and not cfg[group]._target_:
            out.append(f"{group}.kwargs are passed to {group}._target_, which is not set: set it or drop the kwargs.")
    if cfg.logger.kind != "wandb":
        out += [f"logger.{key}={shown(cfg.logger[key])} is ignored with logger.kind={cfg.logger.kind}: it is a W&B "
                "setting; drop it or use logger=wandb."
                for key in changed_keys(cfg.logger, LoggerConfig) if key != "kind"]
    return out


def changed_keys(node: DictConfig, schema: type) -> list[str]:
    """The keys of ``node`` whose value differs from ``schema``'s default."""
    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(schema)}
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict)
    return [str(k) for k, v in plain.items() if k in defaults and v != defaults[k]]


def shown(value: Any) -> str:
    return str(OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value)


_TARGET_ADVICE = {
    "model": "the runner trains through Lightning, so give a LightningModule subclass (or a function that returns "
             "one); wrap a plain torch module in a LightningModule with a training_step and configure_optimizers.",
    "data": "give a LightningDataModule subclass (or a function that returns one) whose train_dataloader() returns a "
            "DataLoader over a map-style dataset, or drop data._target_ to use the module's own train_dataloader().",
}


def _described(obj: Any) -> str:
    """What a ``_target_`` that is not a Lightning class is, for the refusal."""
    if isinstance(obj, type):
        bases = [c.__name__ for c in obj.__mro__[1:-1]]
        return f"a class deriving from {', '.join(bases)}" if bases else "a plain class"
    return f"a {type(obj).__name__}"


def _target_problems(cfg: DictConfig) -> list[str]:
    """A user's ``_target_`` must import here and be a LightningModule / LightningDataModule class (or a function
    that builds one), before any worker starts: each worker would fail the same way."""
    out = []
    for group, kind in (("model", "LightningModule"), ("data", "LightningDataModule")):
        target: Optional[str] = cfg[group]._target_
        if target is None:
            continue
        obj, reason = imported(target)
        if reason is not None:
            out.append(f"{group}._target_={target} cannot be imported ({reason}): give the import path of "
                       f"your {kind} (package.module.Class) and make sure its package is on PYTHONPATH.")
            continue
        import lightning.pytorch as pl  # here only: a config without a _target_ is refused without Lightning

        base = pl.LightningModule if group == "model" else pl.LightningDataModule
        if (isinstance(obj, type) and not issubclass(obj, base)) or not callable(obj):
            out.append(f"{group}._target_={target} is {_described(obj)}, not a lightning.pytorch.{kind}: "
                       f"{_TARGET_ADVICE[group]}")
    return out + (_test_problems(cfg) if cfg.runner.test_after_fit and not out else [])


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(base, name)


def _test_problems(cfg: DictConfig) -> list[str]:
    """``runner.test_after_fit`` needs a test_step and a test_dataloader; a class says whether it has them (a
    function that builds the module is asked at the worker's set-up)."""
    import lightning.pytorch as pl

    module: Any = get_object(cfg.model._target_)
    data: Any = get_object(cfg.data._target_) if cfg.data._target_ else None
    if not isinstance(module, type) or (data is not None and not isinstance(data, type)):
        return []
    out = []
    if not _overrides(module, pl.LightningModule, "test_step"):
        out.append(f"runner.test_after_fit=true but {module.__name__} has no test_step(): add one (logging what it "
                   "measures with self.log) or set runner.test_after_fit=false.")
    holders = [c for c in (data, module) if c is not None]
    if not any(_overrides(c, pl.LightningDataModule if c is data else pl.LightningModule, "test_dataloader")
               for c in holders):
        out.append(f"runner.test_after_fit=true but neither {' nor '.join(c.__name__ for c in holders)} defines "
                   "test_dataloader(): add one or set runner.test_after_fit=false.")
    return out
