"""What the plan and the summary say about the model being trained, the built-in GPT or a user's LightningModule.

The GPT's size and cost follow from its shape (``runner.planning.model_cost``). A user's module states nothing of
the kind, so its parameters are counted by building it on torch's ``meta`` device (no memory, no data) and its
cost is unknown unless the module says it: a ``flops_per_sample`` attribute (training FLOPs of one sample,
forward and backward) gives MFU, a ``tokens_per_sample`` attribute says its batches are tokens (the throughput is
then also given in tokens/s; without it, in samples/s only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from runner.config.errors import ConfigError
from runner.planning.model_cost import count_params, flops_per_token

GPT_NAME = "GPT"


@dataclass(frozen=True)
class ModuleFacts:
    """The model's class name, parameter count and, where known, its training FLOPs and tokens per sample."""

    name: str
    params: int
    flops_per_sample: Optional[float]
    tokens_per_sample: Optional[int]

    @property
    def is_user_module(self) -> bool:
        return self.name != GPT_NAME

    @property
    def flops_per_token(self) -> Optional[float]:
        """Training FLOPs per token, where both the FLOPs and the tokens of a sample are known."""
        if self.flops_per_sample is None or not self.tokens_per_sample:
            return None
        return self.flops_per_sample / self.tokens_per_sample


def subject_name(cfg: DictConfig) -> str:
    """What a run is named after, from the config alone (no import): the recipe for the built-in GPT, else the
    user module's class."""
    target = cfg.model._target_
    return cfg.recipe_name if target is None else str(target).rsplit(".", 1)[-1]


def module_facts(cfg: DictConfig) -> ModuleFacts:
    """The facts for ``cfg.model``; a user's module is imported and built on the meta device once per process."""
    if cfg.model._target_ is None:
        from runner.planning.plan import gpt_config  # plan imports this module

        gpt = gpt_config(cfg)
        return ModuleFacts(GPT_NAME, count_params(gpt), flops_per_token(gpt) * gpt.seq_len, gpt.seq_len)
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True) or {}
    return _user_module_facts(str(cfg.model._target_), tuple(sorted(kwargs.items())))  # type: ignore[union-attr]


@lru_cache(maxsize=8)
def _user_module_facts(target: str, kwargs: tuple) -> ModuleFacts:
    import torch  # here only: a GPT's plan never imports torch
    from hydra.utils import instantiate

    spec = {"_target_": target, **dict(kwargs)}
    try:
        with torch.device("meta"):  # parameters without storage: a module of any size is counted in milliseconds
            module = instantiate(spec)
    except Exception:  # noqa: BLE001 - a module whose __init__ needs real tensors: build it for real
        try:
            module = instantiate(spec)
        except Exception as err:  # noqa: BLE001 - the user's constructor failing is the answer, before any worker
            cause = err.__cause__ or err  # Hydra wraps the constructor's own error
            raise ConfigError(
                f"Invalid configuration: model._target_={target} cannot be built with model.kwargs={dict(kwargs)}: "
                f"{type(cause).__name__}: "
                f"{str(cause).strip().splitlines()[0] if str(cause).strip() else 'no message'}. Give the keyword "
                "arguments its __init__ takes (+model.kwargs.NAME=VALUE), or fix the constructor.") from None
    params = sum(p.numel() for p in module.parameters())
    flops = getattr(module, "flops_per_sample", None)
    tokens = getattr(module, "tokens_per_sample", None)
    return ModuleFacts(type(module).__name__, params, None if flops is None else float(flops),
                       None if tokens is None else int(tokens))
