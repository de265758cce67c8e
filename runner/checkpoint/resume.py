"""``runner.resume``: find and check the checkpoint a run continues from, in the launching process.

A run dir resumes from the newest state it holds: ``checkpoints/last.ckpt``, or a flash checkpoint persisted
after it (the hosts that outlive the controller's host persist their ranks' newest snapshots on the way out)
when each of the run's ranks held the whole model (tp = pp = 1, no ZeRO), so that one rank's file is every rank's
state.

A missing, unreadable or finished checkpoint is a ``ConfigError`` (exit 2) before any worker starts, and so is
one whose module was built with other arguments than this config gives it (its saved hyper-parameters): the
workers build the module from the config and load the checkpoint's weights into it, so other arguments would
fail there (another shape) or silently continue another run (another learning rate).
The check reads the file memory-mapped, so a large checkpoint costs little here; the workers read it
again through Lightning (``Trainer.fit(ckpt_path=...)``). The resumed run writes only into its own
new run dir.
"""

from __future__ import annotations

import inspect
import json
import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from runner.checkpoint import last_checkpoint
from runner.config import ConfigError
from runner.planning.plan import gpt_config
from runner.plumbing.protocol import AGENT_CONFIG_FILE
from runner.recovery.registry import offering, saved_states

REQUIRED = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step")


# the built-in GPT's hyper-parameters (runner.lightning_module.GPTModule) that the config sets; max_steps is left
# out: a resumed run may train further (the schedule's horizon)
_GPT_TRAINER_ARGS = ("lr", "min_lr", "warmup_steps", "weight_decay", "betas")


def module_arguments(cfg: DictConfig) -> dict[str, tuple[str, Any]]:
    """The arguments this config builds its module with, flattened (``model_cfg.n_layer``), each with the config
    key that sets it: what a checkpoint's saved hyper-parameters of the same names must equal. For a user's module,
    its constructor's defaults overlaid with ``model.kwargs``."""
    if cfg.model._target_ is None:
        trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
        assert isinstance(trainer, dict)
        args = {"model_cfg": asdict(gpt_config(cfg)), **{k: trainer[k] for k in _GPT_TRAINER_ARGS}}
        return {name: (f"model.{name[len('model_cfg.'):]}" if name.startswith("model_cfg.") else f"trainer.{name}",
                       value) for name, value in _flat(args).items()}
    try:
        params = inspect.signature(get_object(cfg.model._target_)).parameters.values()
        defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):  # no signature to read: only the given kwargs
        defaults = {}
    given = OmegaConf.to_container(cfg.model.kwargs, resolve=True)
    assert isinstance(given, dict)
    return {name: (f"model.kwargs.{name}", value) for name, value in _flat({**defaults, **given}).items()}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted names; tuples as lists (a checkpoint stores what a config gives as a list)."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): list(tree) if isinstance(tree, tuple) else tree}


def argument_problem(target: str, hparams: Any, expected: dict[str, tuple[str, Any]]) -> Optional[str]:
    """The refusal of a checkpoint whose saved hyper-parameters differ from the config's module arguments."""
    saved = _flat(dict(hparams)) if isinstance(hparams, dict) else {}
    differ = [(key, saved[name], value) for name, (key, value) in expected.items()
              if name in saved and saved[name] != value]
    if not differ:
        return None
    return (f"runner.resume={target}: the checkpoint's module was built with other arguments than this config "
            f"gives it ({'; '.join(f'{key}={old!r} in the checkpoint, {new!r} here' for key, old, new in differ)}); "
            "the resumed run builds the module from the config and loads the checkpoint into it: set "
            f"{' '.join(f'{key}={old!r}' for key, old, _ in differ)} to continue that run, or drop runner.resume to "
            "start a new one.")


def resume_checkpoint(target: str, run_dir: Path, max_steps: int,
                      expected: Optional[dict[str, tuple[str, Any]]] = None, in_place: bool = False) -> Path:
    """The checkpoint file ``runner.resume=target`` names (a run dir's checkpoints/last.ckpt, or a file);
    ``expected``: the config's module arguments (``module_arguments``) its hyper-parameters must match;
    ``in_place``: the run continues its own run dir's checkpoint (``runner.resume=auto``)."""
    given = Path(target).expanduser().resolve()
    path = given if given.is_file() else newest_checkpoint(given)
    snapshotting = " or ".join(f"ft={n}" for n in offering("restarts_from_snapshots"))
    why = ("There is nothing to continue from: give a run dir that holds checkpoints/last.ckpt (or snapshots "
           f"persisted by {snapshotting}) or a .ckpt file.")
    if not given.exists():
        raise ConfigError(f"runner.resume={target}: no such file or directory. {why}")
    if not path.is_file():
        raise ConfigError(f"runner.resume={target}: {path} does not exist (the run was stopped before its first "
                          f"checkpoint, or the directory is not a run dir). {why}")
    if path.parent.parent == Path(run_dir).resolve() and not in_place:
        raise ConfigError(f"runner.resume={target} is this run's own directory; a resumed run writes into a new run "
                          "dir and never into the old run's files: leave hydra.run.dir at its default or choose "
                          "another one.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:  # readable, but holds objects beyond tensors and plain containers
        raise ConfigError(f"runner.resume={target}: {path} holds objects that torch.load(weights_only=True) refuses "
                          f"({_culprit(err)}), which Lightning's "
                          "restore in the workers would refuse too: save hyper-parameters in plain types (numbers, "
                          "strings, lists, dicts) and write the checkpoint again.") from None
    except Exception as err:
        raise ConfigError(f"runner.resume={target}: {path} is not a readable checkpoint ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}). It is truncated or corrupt: resume from "
                          "another copy, or start the run again without runner.resume.") from None
    missing = [k for k in REQUIRED if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ConfigError(f"runner.resume={target}: {path} lacks {', '.join(missing)}, so it is not a training "
                          "checkpoint Lightning can resume (a weights-only file?): give a checkpoint written by "
                          "trainer.save_checkpoint or by this runner.")
    mismatch = argument_problem(target, ckpt.get("hyper_parameters"), expected or {})
    if mismatch:
        raise ConfigError(mismatch)
    step = int(ckpt["global_step"])
    if step >= max_steps:
        raise ConfigError(f"runner.resume={target}: the checkpoint is at step {step} and "
                          f"trainer.max_steps={max_steps}, so there is nothing left to train: set trainer.max_steps "
                          f"above {step} to continue it.")
    return path


def newest_checkpoint(run_dir: Path) -> Path:
    """The newest state ``run_dir`` holds: its last.ckpt, or a technique's verified file of a later step (a flash
    checkpoint) when each rank's file holds the whole model (``last_checkpoint``'s path, absent, when the run dir
    holds neither)."""
    last = last_checkpoint(run_dir)
    if not _ranks_hold_the_whole_model(run_dir):
        return last
    newest = _global_step(last) if last.is_file() else -1
    newer = (path for state in saved_states() if (path := state.newest_whole_model_file(last.parent, newest)))
    return next(newer, last)


def _global_step(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:  # unreadable: resume_checkpoint reports it, unless a newer flash file is the state
        return -1


def _ranks_hold_the_whole_model(run_dir: Path) -> bool:
    """The old run's config (the agents' copy in its run dir) split neither the model (tp, pp) nor the optimizer
    (ZeRO-1): one rank's flash checkpoint is then every rank's state."""
    try:
        p = json.loads((Path(run_dir) / AGENT_CONFIG_FILE).read_text())["config"]["parallel"]
        return (p["tp"], p["pp"], p["zero"]) == (1, 1, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no record of the layout: only last.ckpt is known to hold the whole model


def _culprit(err: Exception) -> str:
    """The line of torch's weights_only message that names the refused object."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if "Unsupported global" in line), lines[0] if lines else type(err).__name__)
