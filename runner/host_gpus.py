"""How many GPUs this host gives the run, asked of the NVIDIA driver rather than of torch.

The plan needs the count before anything decides to train, and a refused config or a recipe this host
cannot run should not pay for importing torch. ``torch.cuda.device_count()`` itself asks NVML before CUDA
is initialised; this does the same: the driver's devices, narrowed by ``CUDA_VISIBLE_DEVICES`` (its
entries up to the first index the driver does not have; GPU UUIDs and MIG ids count one each). No
NVIDIA driver (``libnvidia-ml``) or a failing one: no GPUs.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache


def gpu_count() -> int:
    """The GPUs a process started now with this environment sees (0 without an NVIDIA driver)."""
    found = _driver_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        index = int(entry) if entry.lstrip("+-").isdigit() else None
        if not entry or (index is not None and not 0 <= index < found):
            break
        count += 1
    return min(count, found)


@cache
def _driver_gpus() -> int:
    """Every GPU the driver has (asked once: ``fitting_change`` plans many layouts)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:  # no NVIDIA driver on this host
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    found = ctypes.c_uint(0)
    ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(found)) == 0
    nvml.nvmlShutdown()
    return found.value if ok else 0
