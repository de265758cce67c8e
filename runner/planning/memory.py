"""Memory per rank of a training layout, itemised, from the model's shape alone (``runner.planning.plan`` prints and
checks it).

What each ``trainer.precision`` keeps is what the training path does with it (Lightning's precision
plugins, the optimizer built in ``runner.lightning_module``):

- ``32-true``: fp32 weights, gradients and AdamW moments; fp32 activations.
- ``bf16-mixed`` / ``16-mixed``: autocast over fp32 weights: fp32 weights, gradients and moments, and
  16-bit activations. The fp32 weights are the optimizer's own, so there is no separate master copy.
- ``bf16-true`` / ``16-true``: 16-bit weights, gradients and moments (AdamW keeps its state in the
  parameter's dtype). ``64-true``: fp64 throughout. Any other string is counted as ``32-true``.
- ``bf16-true`` with ``trainer.master_weights`` (Megatron's distributed optimizer, ``MASTER_WEIGHTS``):
  bf16 weights and gradients (2 + 2 bytes per parameter), and fp32 master weights and fp32 moments (12
  bytes per parameter) inside the ZeRO-1 shard only.

ZeRO-1 (``runner.training.zero``) shards the Adam moments (and the fp32 masters) over the data-parallel ranks:
gradients are all-reduced in full and every rank keeps whole weights. Tensor parallelism (``runner.parallel.tensor``)
splits the attention and FFN matrices; embeddings, norms, the row-parallel biases and the head stay
replicated, and there is no sequence parallelism. Pipeline stage ``s`` (``runner.parallel.pipeline``)
holds blocks ``[s*L/pp, (s+1)*L/pp)``, stage 0 the embeddings, the last stage the final norm and (when
it is not stage 0) a copy of the tied head; 1F1B keeps up to ``pp - s`` micro-batches' activations.

Activations of one block for a micro-batch of b samples follow Korthikanti et al. (2022), tensor
parallel without sequence parallelism: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes at 16 bits (twice that
at 32); with full recomputation a block keeps only its input (``2*s*b*h``) and one block's activations
exist at a time. The last stage adds the fp32 logits of the loss, ``4*s*b*V``. DeadPool with ZeRO-1
(``runner.recovery.deadpool.replicator``) keeps a packed copy of the rank's own shard (weights and
moments), two replica slots of its partner's shard, and the partner's last gradients for a replay. With NDB
in the mix too (``ZeroOne.carry``), the holder of a covered rank's replica carries that rank's shard for as long
as a neighbour covers it: a second set of moments (and fp32 masters) of its own, cloned from the replica, which
it keeps. The plan counts the worst case, one carried shard on every rank that holds a replica.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from math import ceil

from runner.config.schema import GPTConfig
from runner.recovery.registry import offering, titles

GiB = 2**30


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what one ``trainer.precision`` keeps."""

    weights: int
    grads: int
    master: int  # a separate fp32 copy of the weights for the optimizer; 0 when the weights are its own
    moments: int  # both AdamW moments together
    activations: int

    def describe(self, name: str) -> str:
        kind = {4: "fp32", 2: "16-bit", 8: "fp64"}
        return (f"{name}: {kind[self.weights]} weights and gradients, {kind[self.moments // 2]} Adam moments, "
                f"{'no separate master weights' if not self.master else 'fp32 master weights'}, "
                f"{kind[self.activations]} activations")


PRECISIONS = {
    "32-true": Precision(4, 4, 0, 8, 4),
    "bf16-mixed": Precision(4, 4, 0, 8, 2),
    "16-mixed": Precision(4, 4, 0, 8, 2),
    "bf16-true": Precision(2, 2, 0, 4, 2),
    "16-true": Precision(2, 2, 0, 4, 2),
    "64-true": Precision(8, 8, 0, 16, 8),
}
ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}
MASTER_WEIGHTS = Precision(2, 2, 4, 8, 2)  # bf16-true with trainer.master_weights: fp32 masters and moments


def precision_of(name: str, master_weights: bool = False) -> tuple[str, Precision]:
    """The canonical name and byte sizes of a Lightning precision string (unknown ones as 32-true), or of
    ``bf16-true`` with fp32 master weights (``trainer.master_weights``)."""
    if master_weights:
        return f"{name} with trainer.master_weights", MASTER_WEIGHTS
    canonical = ALIASES.get(str(name), str(name))
    if canonical in PRECISIONS:
        return canonical, PRECISIONS[canonical]
    return f"{name} (counted as 32-true)", PRECISIONS["32-true"]


@dataclass(frozen=True)
class Layout:
    """The degrees the memory of a rank depends on."""

    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int  # samples in one forward
    micro_batches: int  # forwards per step and rank
    replicates_shards: bool  # a technique in ft replicates every ZeRO-1 shard (DeadPool, with zero=1)
    dp_group_size: int = 0  # ZeRO-1 shards within DP replica groups of this many ranks; 0 = one group of dp
    covers_ranks: bool = False  # a technique in ft covers failed ranks (NDB; with replicated shards and zero=1 a
    # replica's holder carries a covered rank's shard)

    @property
    def shards(self) -> int:
        """How many ZeRO-1 shards one copy of the optimizer state is cut into: the ranks of a DP replica group."""
        return self.dp_group_size or self.dp


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs, by item; ``activations`` as trained (no recomputation), ``recomputed`` for
    comparison only."""

    stage: int
    params: float
    grads: float
    master: float
    moments: float
    activations: float
    recomputed: float
    pipeline: float
    replicas: float
    carried: float = 0.0  # an NDB takeover's carried shard (moments and masters), worst case one per rank
    activations_known: bool = True  # false for a user's module: its activations are not in the total

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.master + self.moments + self.activations + self.pipeline
                + self.replicas + self.carried)

    def items(self) -> list[str]:
        """Two lines: the training state, then what the forward and backward hold (in GiB, or MiB when small); for a
        user's module the second says its activations are not counted."""
        unit, size = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        g = {f.name: getattr(self, f.name) / size for f in fields(self) if f.name not in ("stage", "activations_known")}
        state = [f"parameters {g['params']:.1f} + gradients {g['grads']:.1f} + master weights {g['master']:.1f} + "
                f"Adam moments {g['moments']:.1f} {unit}"]
        if not self.activations_known:
            return state + [f"+ {replicas_label()} {g['replicas']:.1f} + {carried_label()} "
                            f"{g['carried']:.1f} {unit}; activations not counted (the plan does not know the module's "
                            "shape)"]
        return state + [f"+ activations {g['activations']:.1f} ({g['recomputed']:.1f} with full recomputation, which "
                        f"training does not do) + pipeline buffers {g['pipeline']:.1f} + {replicas_label()} "
                        f"{g['replicas']:.1f} + {carried_label()} {g['carried']:.1f} {unit}"]


def replicas_label() -> str:
    """The plan's name for the shard replicas, after the techniques that keep them."""
    return f"{titles(offering('replicates_shards'))} shard replicas"


def carried_label() -> str:
    """The plan's name for a shard carried during a takeover, after the techniques that carry one."""
    return f"a shard carried for {titles(offering('covers_ranks'))}"


def stage_params(gpt: GPTConfig, tp: int, pp: int, stage: int) -> float:
    """Parameters one rank of pipeline stage ``stage`` holds (summed over stages at tp=1 it is ``count_params``
    plus the head's copy on the last stage)."""
    d, h, b = gpt.d_model, gpt.ffn_mult * gpt.d_model, int(gpt.bias)
    ln = 2 * d if gpt.bias else d
    split = 4 * d * d + 3 * d * b + 2 * d * h + h * b  # qkv, attention proj and FFN weights, qkv and fc biases
    whole = 2 * d * b + 2 * ln  # the row-parallel biases and the two norms
    blocks = ceil(gpt.n_layer / pp) * (split / tp + whole)
    first = gpt.vocab_size * d + gpt.seq_len * d if stage == 0 else 0
    last = ln + (gpt.vocab_size * d if pp > 1 else 0) if stage == pp - 1 else 0
    return blocks + first + last


def block_activations(gpt: GPTConfig, tp: int, micro_batch: int) -> float:
    """Korthikanti et al.'s bytes of one block's activations at 16 bits, tensor parallel without sequence
    parallelism."""
    s, h, a = gpt.seq_len, gpt.d_model, gpt.n_head
    return s * micro_batch * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def stage_memory(gpt: GPTConfig, precision: Precision, layout: Layout, stage: int) -> RankMemory:
    lay = layout
    scale = precision.activations / 2  # the formula counts 16-bit elements
    blocks = ceil(gpt.n_layer / lay.pp)
    one_block = block_activations(gpt, lay.tp, lay.micro_batch) * scale
    boundary = gpt.seq_len * lay.micro_batch * gpt.d_model * precision.activations  # a block's input or output
    logits = 4 * gpt.seq_len * lay.micro_batch * gpt.vocab_size if stage == lay.pp - 1 else 0
    in_flight = min(lay.pp - stage, lay.micro_batches)
    sends = (stage < lay.pp - 1) + (stage > 0)  # activations forward, gradients back: held until the step ends
    pipeline = (in_flight - 1) * blocks * one_block + sends * lay.micro_batches * boundary if lay.pp > 1 else 0
    state = state_memory(stage_params(gpt, lay.tp, lay.pp, stage), precision, layout, stage)
    return replace(state, activations=blocks * one_block + logits, recomputed=blocks * boundary + one_block + logits,
                   pipeline=pipeline, activations_known=True)


def state_memory(n: float, precision: Precision, layout: Layout, stage: int = 0) -> RankMemory:
    """The training state of a rank holding ``n`` parameters (weights, gradients, masters, moments, DeadPool's
    replicas, NDB's carried shard), no activations: all the plan knows of a user's module, whose shape it cannot
    see (``activations_known`` false)."""
    lay = layout
    sharded = lay.shards if lay.zero else 1  # ZeRO-1 keeps the moments and masters of the rank's own shard only
    replicas = carried = 0.0
    if lay.replicates_shards and lay.zero:
        shard = n / lay.shards  # the optimizer's own weights are the masters where there are any
        replicas = 3 * shard * ((precision.master or precision.weights) + precision.moments) + shard * precision.grads
        if lay.covers_ranks:  # the carried shard's moments and masters; without masters it steps the module's weights
            carried = shard * (precision.master + precision.moments)
    return RankMemory(
        stage=stage, params=n * precision.weights, grads=n * precision.grads, master=n * precision.master / sharded,
        moments=n * precision.moments / sharded, activations=0.0, recomputed=0.0, pipeline=0.0, replicas=replicas,
        carried=carried, activations_known=False,
    )


def rank_memory(gpt: GPTConfig, precision: Precision, layout: Layout) -> RankMemory:
    """The memory of the rank that needs the most (the first or the last pipeline stage)."""
    return max((stage_memory(gpt, precision, layout, s) for s in range(layout.pp)), key=lambda m: m.total)
