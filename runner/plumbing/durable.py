"""Files that survive a crash: a write reaches the disk before it replaces what was there.

Both the Lightning checkpoint (``runner/checkpoint/writer.py``) and flash_ckpt's persisted snapshots
(``runner/recovery/flash_ckpt/disk.py``) write to a temporary name, fsync it, rename it over the target
and fsync the directory, so a crash leaves either the old file or the new one, never half of one. The run's
summary.json is written the same way: a reader that sees the file sees all of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def temp_name(path: Path) -> Path:
    """A hidden name beside ``path``, private to this process."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def save_synced(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` and fsync it (``path`` is a temporary name the caller renames over its target).
    torch is imported here, not at the top: summary.json's writer imports this module, and a refused config must
    stay free of torch (its import took more than half of a refusal's time)."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or what it held before: written under a temporary name, fsynced, renamed."""
    tmp = temp_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
