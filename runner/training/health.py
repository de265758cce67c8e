"""The health check a worker runs before it is (re)used: a spare, or a replacement started on a host.

A host that failed once, or one never seen before, should not take a rank until it proved it can: the device
answers, a small matmul finishes within the expected time, enough memory is free, the control plane (the store
every peer rendezvouses through) is reachable, and (a spare) so is every peer it will train with: a TCP connection to
the listener each member of the running generation published for its gloo group (``check_peers``). On CPU the
device parts fall away: the matmul runs on the CPU and host memory is read. Each check is real (no check can be
told to fail); a test makes one fail with an impossible threshold (``health.matmul_max_s``,
``health.min_free_memory_gib``) or a route to a peer's host taken away. A worker that fails it logs
``health_check_failed`` and exits ``EXIT_UNHEALTHY``; the controller never gives it a rank (``runner.training.worker``).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
from torch.distributed import PrefixStore

from runner.plumbing import protocol
from runner.plumbing.gloo_rendezvous import published_address

EXIT_UNHEALTHY = 72  # the worker failed its health check before it was used (70, 71: controller lost, fenced)

GIB = 1024**3
PARALLEL_CONNECTS = 64  # a spare's connections to its peers open this many at a time


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


def check_peers(health, store, wait_s: float) -> tuple[dict, list[str]]:
    """The network path to the peers a spare will train with: a TCP connection, within ``health.connect_timeout_s``,
    to the listener every member of the newest generation published for each device of its gloo group (where its
    peers connect to it). A member publishes on its group's first collective, so at start-up this waits, up to
    ``wait_s``, for the first generation to train. A refused connection is no failure (the peer's host answered);
    a peer unreachable when its generation was replaced meanwhile (a host lost silently) is checked again in the new
    one. Returns (what was measured, the failures as sentences)."""
    deadline = time.monotonic() + wait_s
    while True:
        published = _published_listeners(store, deadline)
        if published is None:
            return {"peers": 0}, [f"the peers published no gloo listener within {wait_s:g}s to check the path to"]
        gen, listeners = published
        if not listeners:  # the run ended
            return {"peers": 0}, []
        with ThreadPoolExecutor(min(PARALLEL_CONNECTS, len(listeners))) as pool:  # a dead path costs one timeout
            outcomes = list(pool.map(lambda address: _connect(address, health.connect_timeout_s), listeners))
        # a refused connection came back from the peer's host: the path works, only its process left (a recovery's
        # business, not this host's)
        measured: dict = {"peers_gen": gen, "peers": len(listeners),
                          "peers_refused": sum(isinstance(o, ConnectionRefusedError) for o in outcomes),
                          "peer_connect_s": max((o for o in outcomes if isinstance(o, float)), default=0.0)}
        failures = [f"no TCP connection to peer rank {rank} on host {host} at {ip}:{port} (its gloo listener of gen "
                    f"{gen}) within health.connect_timeout_s={health.connect_timeout_s:g}: {outcome}"
                    for ((ip, port), (rank, host)), outcome in zip(listeners.items(), outcomes)
                    if isinstance(outcome, OSError) and not isinstance(outcome, ConnectionRefusedError)]
        if not failures or int(store.get("gen")) == gen or time.monotonic() > deadline:
            return measured, failures


def _connect(address: tuple[str, int], timeout_s: float) -> float | OSError:
    """How long a TCP connection to ``address`` took to open, or why it did not."""
    t0 = time.perf_counter()
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as err:
        return err
    return round(time.perf_counter() - t0, 6)


def _published_listeners(store, deadline: float) -> tuple[int, dict[tuple[str, int], tuple[int, str]]] | None:
    """(the newest generation, {(ip, port): (logical rank, host name)} of every member's listener on every device of
    its main group) once all its members published; none when the run ended first; None when ``deadline`` passed."""
    while time.monotonic() < deadline:
        if store.check(["abort"]):  # nobody is left to train with: the spare reads why when it waits for a rank
            return -1, {}
        waiting, keys = store, ["gen"]  # what to wait for next: the first generation, then its members' listeners
        if store.check(["gen"]):
            layout = protocol.latest_layout(store)
            group = PrefixStore(f"pg/{layout.gen}/", store)  # the keys the members' gloo rendezvous wrote
            ranks = range(len(layout.members))
            listeners: dict[tuple[str, int], tuple[int, str]] = {}
            device = 0
            while group.check(keys := [f"{device}/{r}" for r in ranks]):
                for r, blob in zip(ranks, group.multi_get(keys)):  # one read for every member
                    host, ip, port = published_address(blob)
                    listeners[(ip, port)] = (layout.logical[r], host)
                device += 1
            if listeners:
                return layout.gen, listeners
            waiting, keys = group, [f"0/{r}" for r in ranks]
        try:  # a slice at a time: the run may end, or the generation be replaced, meanwhile
            waiting.wait(keys, timedelta(seconds=max(0.01, min(0.5, deadline - time.monotonic()))))
        except Exception:
            pass  # the slice ran out
    return None
