"""Checkpoint files on disk: atomic write with a checksum sidecar, verified read, retention.

The file is exactly what Lightning writes (the unflattened checkpoint dict through torch.save),
so ``Trainer.fit(ckpt_path=...)`` loads it. The sidecar ``<file>.sum`` holds the file's digest
and size; it is renamed into place before the file, so a file without a matching sidecar is
either half-published or damaged and is never loaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from runner.plumbing.durable import fsync_dir, save_synced, temp_name

from .checksum import ALGORITHM, digest_file
from .segment import CorruptSnapshot

_NAME = re.compile(r"step(\d+)-rank(\d+)\.ckpt")


def checkpoint_path(out_dir: Path, rank: int, step: int) -> Path:
    return Path(out_dir) / f"step{step:09d}-rank{rank}.ckpt"


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".sum")


def every_ranks_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every rank's checkpoint files, newest first; not yet verified."""
    found = [(int(m.group(1)), path) for path in Path(out_dir).glob("step*-rank*.ckpt")
             if (m := _NAME.fullmatch(path.name))]
    return sorted(found, reverse=True)


def list_checkpoints(out_dir: Path, rank: int) -> list[tuple[int, Path]]:
    """(step, path) of `rank`'s checkpoint files, newest first; not yet verified."""
    return [(step, path) for step, path in every_ranks_checkpoints(out_dir) if path.name.endswith(f"-rank{rank}.ckpt")]


class PublishRefused(RuntimeError):
    """A written file that its gate did not let into place (``write_atomic``): nothing of it was published."""


def always_publish() -> AbstractContextManager[bool]:
    """The gate of a writer nothing calls off."""
    return nullcontext(True)


def write_atomic(state: Any, path: Path, info: dict[str, Any],
                 gate: Callable[[], AbstractContextManager[bool]] = always_publish) -> None:
    """torch.save to a temp file, fsync, write the sidecar, rename both, fsync the directory. The renames happen
    inside ``gate()``, and only if it yields True (else ``PublishRefused``): a node persister's settle calls off the
    writes it stopped waiting for, which must then never land (``persister._NodeClients``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    side = sidecar_path(path)
    tmp, side_tmp = temp_name(path), temp_name(side)
    try:
        save_synced(state, tmp)
        info = {**info, "algorithm": ALGORITHM, "digest": digest_file(tmp), "bytes": tmp.stat().st_size}
        with open(side_tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        with gate() as allowed:
            if not allowed:
                raise PublishRefused(f"{path.name} was written but not put in place: a restart stopped waiting for "
                                     "it (launcher.start_timeout_s) and chose its step from the files there then")
            os.replace(side_tmp, side)
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)


def read_verified(path: Path) -> Any:
    """Load a checkpoint file after checking it against its sidecar; tensors-and-primitives only."""
    verify(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler's errors have no common base class
        raise CorruptSnapshot(f"{path.name}: verified but not loadable with weights_only=True ({e})") from e


def verify(path: Path) -> None:
    """Check a checkpoint file against its sidecar (CorruptSnapshot if it does not match)."""
    try:
        info = json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError) as e:
        raise CorruptSnapshot(f"{path.name}: no readable checksum sidecar ({e})") from e
    if info.get("algorithm") != ALGORITHM or info.get("bytes") != path.stat().st_size:
        raise CorruptSnapshot(f"{path.name}: size or checksum algorithm differs from its sidecar")
    if digest_file(path) != info.get("digest"):
        raise CorruptSnapshot(f"{path.name}: checksum mismatch")


def apply_retention(out_dir: Path, rank: int, newest: int, keep: int) -> list[Path]:
    """After persisting `newest`: drop `rank`'s files from abandoned timelines (steps above it)
    and all but the `keep` newest of the rest. Returns the removed files."""
    removed = []
    kept = 0
    for step, path in list_checkpoints(out_dir, rank):
        if step <= newest and kept < keep:
            kept += 1
            continue
        for p in (path, sidecar_path(path)):
            p.unlink(missing_ok=True)
        removed.append(path)
    return removed
