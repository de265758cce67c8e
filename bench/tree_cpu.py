"""CPU time of every process of a run (controller, fork servers, node agents, ranks, spares, persisters), sampled
while it runs.

Where the ranks outnumber the cores (the bench hosts), the cores are always busy and steps/s is about the number
of cores over the CPU seconds all the run's processes spend per step: a ratio of CPU per step says what a ratio of
steps/s would on a quiet host, with the time other jobs take from the run left out (the caches and preemption
they bring still cost the run CPU, so under heavy load the same work still reads a few % apart).
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import psutil

_TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.1  # how often every known process's CPU time is read
DISCOVER_S = 1.0  # how often the process tree is walked for new processes (walking it costs more)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of all of ``pid``'s threads (its reaped children not included)."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def threads_cpu_s(pid: int, name: str) -> float:
    """User + system CPU seconds of ``pid``'s threads called ``name`` (``/proc/<pid>/task/<tid>/comm``)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    total += _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:
            continue  # the thread ended
    return total


def _stat_cpu_s(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class TreeCPU:
    """Samples the CPU time of a process and all its descendants until it exits; ``seconds_between`` sums what
    they spent between two wall-clock times (``time.time()``, the clock of metrics.jsonl's ``t``)."""

    def __init__(self) -> None:
        self._samples: dict[int, tuple[list[float], list[float]]] = {}  # pid -> (times, CPU seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, pid: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(pid,), name="tree-cpu", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, root: int) -> None:
        pids: set[int] = {root}
        discovered = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - discovered >= DISCOVER_S:
                try:
                    pids |= {p.pid for p in psutil.Process(root).children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
                discovered = now
            t = time.time()
            for pid in list(pids):
                try:
                    cpu = process_cpu_s(pid)
                except (FileNotFoundError, ProcessLookupError):
                    pids.discard(pid)  # exited: its last sample stands
                    continue
                times, values = self._samples.setdefault(pid, ([], []))
                times.append(t)
                values.append(cpu)
            self._stop.wait(SAMPLE_S)

    def seconds_between(self, t0: float, t1: float) -> float:
        """CPU seconds all the processes spent from ``t0`` to ``t1`` (each interpolated between its samples)."""
        return sum(_at(times, values, t1) - _at(times, values, t0) for times, values in self._samples.values())


def _at(times: list[float], values: list[float], t: float) -> float:
    """A process's CPU time at ``t``: 0 before its first sample, its last one after it exited."""
    i = bisect.bisect_left(times, t)
    if i == 0:
        return 0.0 if t < times[0] else values[0]
    if i == len(times):
        return values[-1]
    t_a, t_b = times[i - 1], times[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (t - t_a) / (t_b - t_a)
