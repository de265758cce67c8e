"""The health check a worker runs before it is (re)used: a spare, or a replacement started on a host.

A host that failed once, or one never seen before, should not take a rank until it proved it can: the device
answers, a small matmul finishes within the expected time, enough memory is free, and the control plane
(the store every peer rendezvouses through) is reachable. On CPU the device parts fall away: the matmul runs on
the CPU and host memory is read. Each check is real (no check can be told to fail); a test makes one fail
with an impossible threshold (``health.matmul_max_s``, ``health.min_free_memory_gib``). A worker that fails it logs
``health_check_failed`` and exits ``EXIT_UNHEALTHY``; the controller never gives it a rank (``runner.training.worker``).
"""

from __future__ import annotations

import socket
import time

import torch

EXIT_UNHEALTHY = 72  # the worker failed its health check before it was used (70, 71: controller lost, fenced)

GIB = 1024**3


def free_host_memory_bytes() -> int:
    """MemAvailable: what this host can still give a new process without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def check(health, device: torch.device, store_address: tuple[str, int]) -> tuple[dict, list[str]]:
    """Run every check: (what was measured, the failures as sentences; empty when healthy)."""
    measured: dict = {"device": str(device)}
    failures: list[str] = []
    try:  # the device answers: a first matmul (on a GPU: its context is created), synchronised
        size = health.matmul_size
        a = torch.randn(size, size, device=device)
        (a @ a).sum().item()
        t0 = time.perf_counter()  # the second one is timed: what the device computes, not its start-up
        (a @ a).sum().item()
        measured["matmul_s"] = round(time.perf_counter() - t0, 6)
    except Exception as err:  # a device that does not answer raises (CUDA error, driver gone)
        return measured, [f"the device {device} does not answer: {type(err).__name__}: {err}"]
    if measured["matmul_s"] > health.matmul_max_s:
        failures.append(f"a {size}x{size} matmul took {measured['matmul_s']:.4g}s, over health.matmul_max_s="
                        f"{health.matmul_max_s:g}")
    free = {"host": free_host_memory_bytes()}
    if device.type == "cuda":
        free["device"] = torch.cuda.mem_get_info(device)[0]
    for where, bytes_free in free.items():
        measured[f"free_{where}_gib"] = round(bytes_free / GIB, 3)
        if bytes_free < health.min_free_memory_gib * GIB:
            failures.append(f"{where} memory free {bytes_free / GIB:.3g} GiB, under health.min_free_memory_gib="
                            f"{health.min_free_memory_gib:g}")
    t0 = time.perf_counter()
    try:  # the network path to the peers: a TCP connection to the store they all rendezvous through
        socket.create_connection(store_address, timeout=health.connect_timeout_s).close()
        measured["connect_s"] = round(time.perf_counter() - t0, 6)
    except OSError as err:
        failures.append(f"no TCP connection to the control-plane store {store_address[0]}:{store_address[1]} "
                        f"within health.connect_timeout_s={health.connect_timeout_s:g}: {err}")
    return measured, failures
