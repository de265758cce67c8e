"""The built-in GPT's size and compute from its shape alone: parameter count, training FLOPs per token, MFU.

Arithmetic on ``GPTConfig`` only, kept out of ``runner.model`` (which builds the modules with torch) so that
the plan counts a recipe without importing torch.
"""

from __future__ import annotations

from runner.config.schema import GPTConfig


def count_params(cfg: GPTConfig) -> int:
    """Parameter count computed from the shape alone (no allocation), embeddings tied."""
    d, h, L = cfg.d_model, cfg.ffn_mult * cfg.d_model, cfg.n_layer
    b = 1 if cfg.bias else 0
    ln = 2 * d if cfg.bias else d
    attn = d * 3 * d + 3 * d * b + d * d + d * b
    ffn = d * h + h * b + h * d + d * b
    per_block = attn + ffn + 2 * ln
    return cfg.vocab_size * d + cfg.seq_len * d + L * per_block + ln


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12*L*d*T for attention (PaLM appendix B)."""
    n = count_params(cfg) - cfg.seq_len * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def mfu(flops_per_item: float, items_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s (FLOPs per token or sample times tokens or samples per
    second) over the hardware peak (all ranks)."""
    if peak_flops <= 0:
        return 0.0
    return flops_per_item * items_per_s / peak_flops
