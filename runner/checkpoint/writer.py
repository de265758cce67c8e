"""Write a checkpoint off the training thread, atomically: a crash never leaves a half file in place of a good one.

The training thread hands over a CPU copy of the checkpoint dict (``cpu_copy``) and goes on; one
background thread ``torch.save``s it to a temporary file beside the target, fsyncs it, renames it over
the target and fsyncs the directory. At most one write is in flight: a second ``submit`` waits for the
first, so memory holds at most two copies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from runner.plumbing.durable import fsync_dir, save_synced, temp_name

OnWritten = Callable[[int, Path, float], None]  # (step, path, seconds the write took)


def cpu_copy(ckpt: dict) -> dict:
    """Every tensor copied to the CPU: the live parameters and optimizer state change at the next step."""
    return apply_to_collection(ckpt, Tensor, lambda t: t.detach().to("cpu", copy=True))


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temporary name in the same directory, fsync, rename over ``path``, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        save_synced(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


class CheckpointWriter:
    """One background thread of the writing rank that saves checkpoints to ``path``, in submission order."""

    def __init__(self, path: Path, on_written: OnWritten) -> None:
        self.path, self.on_written = Path(path), on_written
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._pending: Optional[Future] = None

    def submit(self, step: int, ckpt: dict) -> None:
        """``ckpt`` must not share tensors with the training state (``cpu_copy``)."""
        self.wait()
        self._pending = self._pool.submit(self._write, step, ckpt)

    def wait(self) -> None:
        """Until the write in flight, if any, is on disk; its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _write(self, step: int, ckpt: dict) -> None:
        t0 = time.perf_counter()
        save_atomic(ckpt, self.path)
        self.on_written(step, self.path, time.perf_counter() - t0)
