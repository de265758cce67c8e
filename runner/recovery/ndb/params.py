"""Which parameters a taken-over micro-batch gives gradients to, so the strategy can average right.

With skip_attention the extra micro-batch gives no gradient to any block's attention branch
(``ln1`` and ``attn``: ``ln1`` only feeds attention in a pre-LN block). Averaging those
parameters over all micro-batches would shrink their gradient, so their mean is taken only over
the micro-batches that computed them: the denominator changes, and no zeros are padded in.
"""

from __future__ import annotations

from torch import nn

from runner.model import Block
from runner.recovery.ndb.config import NDBConfig

ATTENTION_BRANCH = ("ln1", "attn")


def attention_param_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters()`` gives them) of every block's ln1 and attn params."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, Block):
            for branch in ATTENTION_BRANCH:
                sub = getattr(module, branch)
                names.update(f"{prefix}.{branch}.{name}" for name, _ in sub.named_parameters())
    return names


def contributor_counts(
    model: nn.Module, microbatches: int, takeovers: int, cfg: NDBConfig
) -> dict[str, int]:
    """Per parameter, how many micro-batches of the global step contributed a gradient.

    ``microbatches`` counts every micro-batch computed in the step (each live rank's own plus the
    ``takeovers`` done by neighbours). Sum the gradients across ranks, then divide by this count.
    """
    if not 0 <= takeovers < microbatches:
        raise ValueError(
            f"takeovers={takeovers} must lie in [0, microbatches={microbatches}): "
            "at least one micro-batch must be a rank's own."
        )
    skipped = takeovers if cfg.attention_skipped else 0
    attention = attention_param_names(model)
    return {
        name: microbatches - skipped if name in attention else microbatches
        for name, _ in model.named_parameters()
    }
