"""The training plan: parameters, layout, batch and memory per rank, computed from the config alone.

Printed before every run, and instead of the run when the host lacks the GPUs a recipe needs. The
plan is a promise: a layout whose rank needs more than ``runner.gpu_memory_gib`` is refused, with the
smallest change of tp, pp and zero that fits (``fitting_change``). Memory per rank is itemised by
``runner.planning.memory``. Models above runner.cpu_max_params are planned for GPUs with one sample per
micro-batch (the per-rank batch as that many micro-batches); smaller ones as the runner trains them,
the per-rank batch in one forward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Optional

from omegaconf import DictConfig, open_dict

from runner.config.schema import GPTConfig
from runner.config.validate import (
    dp_size,
    ft_names,
    layout_problems,
    pp_problems,
    replica_group_problems,
    tp_problems,
    trained_pp,
    trained_tp,
    world_size,
    zero_problems,
)
from runner.planning.memory import GiB, Layout, RankMemory, precision_of, rank_memory, state_memory
from runner.planning.module_facts import ModuleFacts, module_facts, subject_name
from runner.planning.topology import spare_count
from runner.recovery.registry import replicates_shards, with_


@dataclass
class Plan:
    params: int
    world: int
    layout: Layout
    precision: str
    memory: RankMemory
    facts: ModuleFacts
    gpus_available: int
    spares: int
    spares_by_default: bool  # parallel.spares unset and a technique in ft uses spares: one spare node

    @property
    def bytes_per_rank(self) -> float:
        return self.memory.total

    def render(self, cfg: DictConfig) -> str:
        p, lay, mem = cfg.parallel, self.layout, self.memory
        spares = f"spares={self.spares}"
        if self.spares_by_default:
            users = " or ".join(f"ft={n}" for n in with_(list(cfg.ft), "uses_spares"))
            spares += f" (one spare node by default for {users}; parallel.spares=0 for none)"
        where = "" if lay.pp == 1 else f", pipeline stage {mem.stage} of {lay.pp}"
        return "\n".join([
            f"plan for recipe {cfg.recipe_name}:" if not self.facts.is_user_module else
            f"plan for {subject_name(cfg)} ({cfg.model._target_}):",
            f"  model       {self.model_line()}",
            f"  layout      {p.nodes} node(s) x {p.procs_per_node} rank(s) = {self.world} ranks: dp={lay.dp} "
            f"tp={lay.tp} pp={lay.pp} zero={lay.zero}"
            + (f" dp_group_size={lay.dp_group_size} ({lay.dp // lay.dp_group_size} replica groups)"
               if lay.dp_group_size else "") + f", {spares}",
            f"  batch       {cfg.trainer.global_batch_size} samples/step = {lay.micro_batch * lay.micro_batches} per "
            f"rank x {lay.dp} replicas, as {lay.micro_batches} micro-batch(es) of {lay.micro_batch}"
            + (f", seq {self.facts.tokens_per_sample}" if self.facts.tokens_per_sample else ""),
            f"  memory/rank {self.bytes_per_rank / GiB:.{1 if self.bytes_per_rank >= GiB else 3}f} GiB of "
            f"runner.gpu_memory_gib={cfg.runner.gpu_memory_gib:g}"
            f" ({self.precision}{where}):",
            *(f"              {line}" for line in mem.items()),
            f"  devices     needs {self.world} GPU(s); this host has {self.gpus_available}",
        ])


    def model_line(self) -> str:
        """Size and cost: the GPT's from its shape, a user module's parameters and the FLOPs it states, if any."""
        f = self.facts
        if not f.is_user_module:
            return (f"{scaled(self.params)} parameters, {scaled(f.flops_per_token or 0.0, giga='G')}"
                    "FLOP per token (training)")
        cost = (f"{scaled(f.flops_per_sample, giga='G')}FLOP per sample (training, its flops_per_sample)"
                if f.flops_per_sample else "FLOPs unknown (give the module a flops_per_sample attribute for MFU)")
        return f"{scaled(self.params)} parameters, {cost}"


def scaled(value: float, giga: str = "B") -> str:
    """``value`` with the prefix that fits, three significant digits: 70.6 K, 124 M, 13 B (or 13 G with giga="G")."""
    for scale, unit in ((1e12, "T"), (1e9, giga), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} "


def gpt_config(cfg: DictConfig) -> GPTConfig:
    """The built-in GPT's shape: the ``GPTConfig`` fields of ``cfg.model`` (a ``ModelConfig``)."""
    return GPTConfig(**{f.name: cfg.model[f.name] for f in fields(GPTConfig)})


def make_plan(cfg: DictConfig) -> Plan:
    p = cfg.parallel
    dp = dp_size(cfg)
    facts = module_facts(cfg)
    n = facts.params
    per_rank = max(1, cfg.trainer.global_batch_size // dp)
    if n > cfg.runner.cpu_max_params:  # GPU scale: one sample per micro-batch
        micro_batch, micro_batches = 1, per_rank
    else:  # as this runner trains it: the per-rank batch in one forward, or in the pipeline's micro-batches
        micro_batches = (cfg.trainer.micro_batches or int(p.pp)) if p.pp > 1 else 1
        micro_batch = max(1, per_rank // micro_batches)
    groups = int(p.dp_group_size) if p.dp_group_size > 0 and dp % p.dp_group_size == 0 else 0
    ft = ft_names(cfg)
    layout = Layout(int(p.tp), int(p.pp), dp, int(p.zero), micro_batch, micro_batches,
                    replicates_shards(ft), groups, bool(with_(ft, "covers_ranks")))
    name, precision = precision_of(cfg.trainer.precision, bool(cfg.trainer.master_weights))
    memory = state_memory(n, precision, layout) if facts.is_user_module else rank_memory(gpt_config(cfg), precision,
                                                                                        layout)
    return Plan(n, world_size(cfg), layout, precision.describe(name), memory,
                facts, host_gpus(cfg.runner.device), spare_count(cfg),
                p.spares is None and spare_count(cfg) > 0)


def host_gpus(device: str) -> int:
    """The GPUs torch sees on this host (none asked for with ``runner.device=cpu``). torch is imported here, not at
    the top: a config refused before its plan is made never pays for importing it."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def memory_problem(cfg: DictConfig, plan: Plan) -> Optional[str]:
    """One paragraph when a rank needs more than ``runner.gpu_memory_gib``, naming the smallest change that fits.

    Only for a run on GPUs: one that uses this host's, or one too big for CPU training (it prints the
    plan for a GPU cluster); a run that trains on CPU here has no GPU memory to fit."""
    limit = cfg.runner.gpu_memory_gib
    on_gpus = cfg.runner.device != "cpu" and (plan.gpus_available > 0 or needs_gpus(cfg, plan))
    if not on_gpus or plan.bytes_per_rank <= limit * GiB:
        return None
    lay = plan.layout
    head = (f"The plan needs {plan.bytes_per_rank / GiB:.1f} GiB per GPU at tp={lay.tp} pp={lay.pp} "
            f"zero={lay.zero}, more than runner.gpu_memory_gib={limit:g}.")
    found = fitting_change(cfg)
    if found is None:
        return (f"{head} No tp, pp and zero of these {plan.world} ranks fits (tp at most parallel.procs_per_node="
                f"{cfg.parallel.procs_per_node}): shorten model.seq_len, use a smaller model, or raise "
                "runner.gpu_memory_gib if the GPUs have more.")
    change, fitted = found
    return (f"{head} The smallest change that fits: set {change} ({fitted.bytes_per_rank / GiB:.1f} GiB per GPU); "
            "or raise runner.gpu_memory_gib if the GPUs have more.")


def fitting_change(cfg: DictConfig) -> Optional[tuple[str, Plan]]:
    """The first layout that fits, as the overrides that make it, and its plan.

    Candidates only add sharding: tp, pp and zero at least the config's, tp dividing procs_per_node
    (a tensor-parallel group stays inside a node) and every layout rule holding (``layout_problems``,
    and ``zero_problems`` for zero=1 with the config's ft). They are tried by the model-parallel degree
    tp*pp, smallest first (the most data parallelism); at equal degree tp before pp (larger tp first:
    it also divides the activations, which pipeline stages do not); at each (tp, pp) the config's zero
    before zero=1. So ZeRO-1 alone comes before any larger tp, and tp=4 before tp=2 pp=2.
    """
    p = cfg.parallel
    tps = [t for t in range(p.tp, p.procs_per_node + 1) if p.procs_per_node % t == 0]
    pps = [q for q in range(p.pp, cfg.model.n_layer + 1) if cfg.model.n_layer % q == 0]
    zeros = sorted({int(p.zero), 1})
    order = sorted(((t, q, z) for t in tps for q in pps for z in zeros), key=lambda c: (c[0] * c[1], -c[0], c[2]))
    for tp, pp, zero in order:
        if (tp, pp, zero) == (p.tp, p.pp, p.zero) or world_size(cfg) % (tp * pp):
            continue
        trial = copy.deepcopy(cfg)
        with open_dict(trial):
            trial.parallel.update(tp=tp, pp=pp, zero=zero)
        if layout_problems(trial, for_training=False) or (zero and zero_problems(trial)):
            continue
        plan = make_plan(trial)
        if plan.bytes_per_rank <= cfg.runner.gpu_memory_gib * GiB:
            change = [f"parallel.{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("zero", zero)) if v != p[k]]
            return " ".join(change), plan
    return None


def needs_gpus(cfg: DictConfig, plan: Plan) -> bool:
    """True when this host cannot run the recipe: too big for CPU training and not enough GPUs."""
    return plan.gpus_available < plan.world and plan.params > cfg.runner.cpu_max_params


def apply_smoke(cfg: DictConfig) -> list[str]:
    """Shrink the model (and, above runner.smoke_max_ranks, the layout; tp and pp to what training runs) so
    the recipe trains on CPU with its ft mix."""
    changes = []
    p, limit = cfg.parallel, cfg.runner.smoke_max_ranks
    with open_dict(cfg):
        cfg.model.update(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, ffn_mult=4)
        changes.append("model shrunk to the gpt_tiny shape")
        if cfg.trainer.precision != "32-true":
            changes.append(f"precision {cfg.trainer.precision} -> 32-true")
            cfg.trainer.precision = "32-true"
        if cfg.trainer.master_weights:
            changes.append("trainer.master_weights true -> false (32-true weights are the optimizer's own)")
            cfg.trainer.master_weights = False
        if p.nodes * p.procs_per_node > limit:
            nodes = min(p.nodes, limit)
            per = max(1, limit // nodes)
            changes.append(f"layout {p.nodes}x{p.procs_per_node} -> {nodes}x{per} (runner.smoke_max_ranks={limit})")
            p.nodes, p.procs_per_node = nodes, per
        if p.zero and zero_problems(cfg):
            changes.append(f"parallel.zero {p.zero} -> 0 (not usable with ft={list(cfg.ft.keys())} on this layout)")
            p.zero = 0
        top_tp = trained_tp(cfg)
        tp = max(t for t in range(1, min(p.tp, top_tp) + 1) if cfg.model.n_head % t == 0 == p.procs_per_node % t)
        top_pp = trained_pp(cfg)
        pp = max(q for q in range(1, min(p.pp, top_pp) + 1) if cfg.model.n_layer % q == 0 == world_size(cfg) // tp % q)
        why = []
        if tp < p.tp:
            why.append(f"parallel.tp {p.tp} -> {tp} (" + ("the smoke model's heads and the ranks per node allow no more"
                       if top_tp >= p.tp else f"training runs tp <= 1 here: {tp_problems(cfg)[0]}") + ")")
        if pp < p.pp:
            why.append(f"parallel.pp {p.pp} -> {pp} (" + ("the smoke model's layers and the ranks allow no more"
                       if top_pp >= p.pp else f"training runs pp <= 1 here: {pp_problems(cfg)[0]}") + ")")
        if why:
            changes.append(", ".join(why))
            p.tp, p.pp = tp, pp
        if p.dp_group_size and (dp_size(cfg) % p.dp_group_size or replica_group_problems(cfg)):
            changes.append(f"parallel.dp_group_size {p.dp_group_size} -> 0 (not usable with parallel.zero={p.zero} "
                           f"ft={ft_names(cfg)} on {dp_size(cfg)} data-parallel ranks)")
            p.dp_group_size = 0
        dp = dp_size(cfg)
        micro = (cfg.trainer.micro_batches or p.pp) if p.pp > 1 else 1
        cfg.trainer.global_batch_size = 2 * dp * micro  # with pp > 1, pipeline micro-batches of 2
        if cfg.trainer.max_steps > 20:
            changes.append(f"trainer.max_steps {cfg.trainer.max_steps} -> 20")
            cfg.trainer.max_steps = 20
        cfg.trainer.warmup_steps = min(cfg.trainer.warmup_steps, 2)
        cfg.runner.peak_flops_per_rank = 1.0e11
    return changes
