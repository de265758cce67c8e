"""Get a restarting rank's restore ready while its process starts.

A fresh process that restores from /dev/shm pays twice before it copies at memory speed: mapping
a slot costs page-table work for every 4 KiB page (~0.4x of a copy of it here) and new tensors
page-fault fresh memory (~3x). Neither has to wait for the restore: a restarted rank knows its
segments as soon as it starts, so ``Prefetch`` maps them and faults in memory for the tensors to
come, in a background thread, while the process imports, builds its model and joins its group.
``load_newest(..., prefetch=)`` then reads through those mappings and carves its new tensors out
of that memory. The work is moved, not saved: on a host whose cores are all busy starting ranks it
still competes with them.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .segment import ALIGN, PAGE, map_for_reading, read_header, unmap_for_reading
from .shm import backup_names, segment_name
from .slots import committed_steps


class Prefetch:
    """Mappings of one rank's committed slots (own and partner copies) and memory for its new
    tensors, prepared in a background thread from construction on."""

    def __init__(self, job_id: str, rank: int) -> None:
        self.job_id, self.rank = job_id, rank
        self._mappings: list = []
        self._arena: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()  # the thread hands over its results, or drops them after close()
        self._closed = False
        self._thread = threading.Thread(target=self._prepare, name=f"flash-prefetch-r{rank}", daemon=True)
        self._thread.start()

    def ready(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the preparation; False: go on without it (nothing is lost)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def new_tensor(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in the prepared memory while it lasts (64-byte aligned), else a new one."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._arena is None or nbytes <= 0 or start + nbytes > self._arena.numel():
            return torch.empty(shape, dtype=dtype)
        self._used = start + nbytes
        return self._arena[start : start + nbytes].view(dtype).view(shape)

    def rewind(self) -> None:
        """Start carving from the beginning again: the tensors of a refused candidate are dropped."""
        self._used = 0

    def close(self) -> None:
        """Drop the mappings (freed once no view is left); tensors handed out keep their memory."""
        with self._lock:
            self._closed = True
            for mapping in self._mappings:
                unmap_for_reading(mapping)
            self._mappings.clear()
            self._arena = None

    def _prepare(self) -> None:
        names = [segment_name(self.job_id, self.rank), *backup_names(self.job_id, self.rank)]
        paths = [path for name in names for _, path in committed_steps(name)]
        headers = [h for h in map(read_header, paths) if h is not None]
        arena = None
        if headers:
            arena = torch.empty(max(h.data_cap for h in headers), dtype=torch.uint8)
            arena.numpy()[::PAGE] = 0  # fault every page in now
        for path in paths:
            with self._lock:
                mapping = None if self._closed else map_for_reading(path)
                if mapping is None:
                    continue
                self._mappings.append(mapping)
            np.frombuffer(mapping, dtype=np.uint8)[::PAGE].sum()  # map every page now
        with self._lock:
            self._arena = None if self._closed else arena
