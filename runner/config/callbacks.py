"""The ``callbacks`` group: what a configured Lightning callback must be for the runner to run it as configured.

Each entry is ``NAME: {_target_: package.module.Class, KEY: VALUE...}``. The shape is checked with the other rules;
the import (it costs torch and Lightning) only once nothing else refuses the config, as a model's ``_target_`` is.
What the runner refuses, and why: ``LearningRateMonitor`` (``train/lr`` is logged at every committed step; its
values come before the step's record exists), a progress bar (the runner draws its own, ``trainer.progress_bar``), a
``Timer`` (its stop is a broadcast outside a step, which no recovery can complete: give ``trainer.max_steps``), and a
``ModelCheckpoint`` that would write ``last.ckpt`` beside the runner's own (``save_last``), on wall-clock time
(``train_time_interval``: not the same steps in a recovered run) or, with ZeRO-1 or tp*pp > 1, the writing rank's
shard of the model only. ``RichModelSummary`` needs the ``rich`` package.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from runner.config.errors import imported

ADVICE = ("give the import path of a lightning.pytorch.Callback subclass (package.module.Class) with its keyword "
          "arguments beside it, e.g. +callbacks.NAME._target_=lightning.pytorch.callbacks.EarlyStopping "
          "+callbacks.NAME.monitor=train/loss, or drop callbacks.NAME")


def entry_problems(cfg: DictConfig) -> list[str]:
    """Every entry is a mapping with a ``_target_`` string."""
    out = []
    for name, entry in (cfg.get("callbacks") or {}).items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("_target_"), str):
            out.append(f"callbacks.{name} has no _target_: {ADVICE}.")
    return out


# Lightning's own callbacks that import and that the runner runs as configured, whatever their arguments: no import
# at config time (Lightning's costs seconds, which the default group's model summary must not add to every run)
STOCK = frozenset({"lightning.pytorch.callbacks.ModelSummary", "lightning.pytorch.callbacks.EarlyStopping"})


def target_problems(cfg: DictConfig) -> list[str]:
    """Each ``_target_`` imports here and is a Lightning callback the runner can run as configured, before any worker
    starts: each worker would fail the same way."""
    out = []
    for name, entry in (cfg.get("callbacks") or {}).items():
        target = entry["_target_"]
        if target in STOCK:
            continue
        obj, reason = imported(target)
        if reason is not None:
            out.append(f"callbacks.{name}._target_={target} cannot be imported ({reason}): {ADVICE}, "
                       "and make sure its package is on PYTHONPATH.")
            continue
        import lightning.pytorch as pl  # here only: a config without callbacks is refused without Lightning

        if not isinstance(obj, type) or not issubclass(obj, pl.Callback):
            what = "a plain class" if isinstance(obj, type) else f"a {type(obj).__name__}"
            out.append(f"callbacks.{name}._target_={target} is {what}, not a lightning.pytorch.Callback: {ADVICE}.")
            continue
        out += [f"callbacks.{name} ({target}): {p}" for p in refusals(cfg, obj, entry)]
    return out


def refusals(cfg: DictConfig, cls: type, entry: Mapping[str, Any]) -> list[str]:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, RichModelSummary, Timer

    if issubclass(cls, LearningRateMonitor):
        return ["the runner logs train/lr at every committed step already (metrics.jsonl and the experiment logger); "
                "LearningRateMonitor logs before its step is committed, which no record takes: drop this entry."]
    if issubclass(cls, ProgressBar):
        return ["the runner draws its own progress bar on logical rank 0; drop this entry and use "
                "trainer.progress_bar=true|false."]
    if issubclass(cls, Timer):
        return ["its stop is a broadcast outside a committed step, which a recovery cannot complete; bound the run "
                "with trainer.max_steps instead, or stop it from a callback that sets trainer.should_stop."]
    if issubclass(cls, RichModelSummary) and importlib.util.find_spec("rich") is None:
        return ["RichModelSummary needs the rich package, which is not installed: pip install rich, or use "
                "lightning.pytorch.callbacks.ModelSummary."]
    if not issubclass(cls, ModelCheckpoint):
        return []
    out = []
    if entry.get("save_last"):
        out.append("save_last would write last.ckpt beside the runner's own checkpoints/last.ckpt, which every run "
                   "writes (checkpoint.every_n_steps for more often); drop save_last.")
    if entry.get("train_time_interval") is not None:
        out.append("train_time_interval saves on wall-clock time, at other steps in a recovered run; use "
                   "every_n_train_steps.")
    p = cfg.parallel
    if p.zero or p.tp * p.pp > 1:
        out.append(f"with parallel.zero={p.zero}, tp={p.tp}, pp={p.pp} a rank holds only its shard of the model and "
                   "optimizer, which is all this callback would write; use the runner's checkpoints/last.ckpt "
                   "(checkpoint.every_n_steps), which gathers the whole state, or parallel.zero=0, tp=pp=1.")
    return out
