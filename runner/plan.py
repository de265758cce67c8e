"""The training plan: parameters, memory per rank and layout, computed from the config alone.

Printed before every run, and instead of the run when the host lacks the GPUs a recipe needs.
Memory model (bytes per parameter): fp32 weights 4 + fp32 gradients 4 + AdamW moments 8, the
moments divided over the data-parallel group under ZeRO-1, everything divided by tp*pp;
activations per layer and sample follow Korthikanti et al. (2022): seq*d*(34 + 5*heads*seq/d)
bytes in 16-bit. Models above runner.cpu_max_params are planned for GPUs with one sample per
micro-step and full recomputation (only layer inputs kept); smaller ones as the runner trains them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from omegaconf import DictConfig, open_dict

from runner.config.validate import dp_size, world_size, zero_problems
from runner.model import GPTConfig, count_params, flops_per_token

GiB = 2**30


@dataclass
class Plan:
    params: int
    world: int
    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int
    state_bytes_per_rank: float
    activation_bytes_per_rank: float
    flops_per_token: float
    gpus_available: int

    @property
    def bytes_per_rank(self) -> float:
        return self.state_bytes_per_rank + self.activation_bytes_per_rank

    def render(self, cfg: DictConfig) -> str:
        p = cfg.parallel
        gib = f"{self.state_bytes_per_rank / GiB:.1f} GiB states + {self.activation_bytes_per_rank / GiB:.1f} GiB"
        return "\n".join([
            f"plan for recipe {cfg.recipe_name}:",
            f"  model       {scaled(self.params)} parameters, {scaled(self.flops_per_token, giga='G')}FLOP per token "
            "(training)",
            f"  layout      {p.nodes} node(s) x {p.procs_per_node} rank(s) = {self.world} ranks: dp={self.dp} "
            f"tp={self.tp} pp={self.pp} zero={self.zero}, spares={p.spares}",
            f"  batch       {cfg.trainer.global_batch_size} samples/step = {self.micro_batch} per rank x {self.dp} "
            f"ranks, seq {cfg.model.seq_len}",
            f"  memory/rank {gib} activations = {self.bytes_per_rank / GiB:.1f} GiB",
            f"  devices     needs {self.world} GPU(s); this host has {self.gpus_available}",
        ])


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
    gpt = gpt_config(cfg)
    n = count_params(gpt)
    shard = p.tp * p.pp
    moments = 8 * n / shard / (dp if p.zero >= 1 else 1)
    states = (8 * n) / shard + moments
    micro = max(1, cfg.trainer.global_batch_size // dp)
    per_layer = gpt.seq_len * gpt.d_model * (34 + 5 * gpt.n_head * gpt.seq_len / gpt.d_model)
    if n > cfg.runner.cpu_max_params:  # GPU scale: one sample at a time, layers recomputed in backward
        activations = (2 * gpt.seq_len * gpt.d_model * gpt.n_layer + per_layer) / shard
    else:  # what this runner does today: the whole micro-batch, every activation kept
        activations = micro * per_layer * gpt.n_layer / shard
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Plan(n, world_size(cfg), dp, p.tp, p.pp, p.zero, micro, states, activations, flops_per_token(gpt), gpus)


def needs_gpus(cfg: DictConfig, plan: Plan) -> bool:
    """True when this host cannot run the recipe: too big for CPU training and not enough GPUs."""
    return plan.gpus_available < plan.world and plan.params > cfg.runner.cpu_max_params


def apply_smoke(cfg: DictConfig) -> list[str]:
    """Shrink the model (and, above runner.smoke_max_ranks, the layout) so the recipe trains on CPU."""
    changes = []
    p, limit = cfg.parallel, cfg.runner.smoke_max_ranks
    with open_dict(cfg):
        cfg.model.update(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, ffn_mult=4)
        changes.append("model shrunk to the gpt_tiny shape")
        if cfg.trainer.precision != "32-true":
            changes.append(f"precision {cfg.trainer.precision} -> 32-true")
            cfg.trainer.precision = "32-true"
        if p.dp_group_size:
            changes.append(f"parallel.dp_group_size {p.dp_group_size} -> 0 (not available yet)")
            p.dp_group_size = 0
        if p.nodes * p.procs_per_node > limit:
            nodes = min(p.nodes, limit)
            per = max(1, limit // nodes)
            changes.append(f"layout {p.nodes}x{p.procs_per_node} -> {nodes}x{per} (runner.smoke_max_ranks={limit})")
            p.nodes, p.procs_per_node = nodes, per
        if p.zero and zero_problems(cfg):
            changes.append(f"parallel.zero {p.zero} -> 0 (not usable with ft={list(cfg.ft.keys())} on this layout)")
            p.zero = 0
        dp = dp_size(cfg)
        cfg.trainer.global_batch_size = 2 * dp
        if cfg.trainer.max_steps > 20:
            changes.append(f"trainer.max_steps {cfg.trainer.max_steps} -> 20")
            cfg.trainer.max_steps = 20
        cfg.trainer.warmup_steps = min(cfg.trainer.warmup_steps, 2)
        cfg.runner.peak_flops_per_rank = 1.0e11
    return changes
