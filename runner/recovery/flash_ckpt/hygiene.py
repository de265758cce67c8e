"""Removing segments: all of a job's at the end of a run, and stale ones of crashed runs.

A segment outlives its writer on purpose (a restarted worker or the persister needs it after a
crash), so nothing removes it implicitly. ``cleanup`` is for the end of a run;
``cleanup_stale`` is for the start of one, and removes other jobs' segments whose writer and
the writer's parent (the agent that would restart it) are both gone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .segment import read_header
from .shm import PREFIX, SHM_DIR, check_job_id, job_files

_CREATION_GRACE_S = 60.0  # a slot being created has no header for a moment


def cleanup(job_id: str) -> list[Path]:
    """Unlink every segment of `job_id` (own snapshots and backups, all ranks); returns them."""
    removed = []
    for path in job_files(job_id):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def cleanup_stale(keep_job_id: str | None = None) -> list[Path]:
    """Unlink segments of jobs other than `keep_job_id` that no live process can still use."""
    if keep_job_id is not None:
        check_job_id(keep_job_id)
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}.*"):
        if path.name.split(".")[1] == keep_job_id or not _stale(path):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _stale(path: Path) -> bool:
    header = read_header(path)
    if header is None:
        try:
            return time.time() - path.stat().st_mtime > _CREATION_GRACE_S
        except FileNotFoundError:
            return False
    # pid 1 as a parent only means the writer was orphaned (or runs under a container init)
    return not any(_alive(pid) for pid in (header.pid, header.ppid) if pid > 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
