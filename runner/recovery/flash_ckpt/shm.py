"""Where flash-checkpoint segments live in /dev/shm, how they are named, and whether they fit.

Names carry the job id, the rank that owns the state, the rank that holds a backup copy (if
any) and the slot, so a restarted process, a persister in another process or a cleanup at the
end of a run can find every segment of a job by name alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path(os.environ.get("RR_FLASH_SHM_DIR", "/dev/shm"))
# caps the free space the size check sees, to try a small /dev/shm without remounting one
FREE_BYTES_ENV = "RR_FLASH_SHM_FREE_BYTES"
PREFIX = "rrflash"
SLOTS = (0, 1)
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the snapshot; raised before anything is written."""


def check_job_id(job_id: str) -> str:
    """Job ids become part of file names and globs, so dots, slashes and wildcards are refused."""
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"flash checkpoint job id {job_id!r} must match [A-Za-z0-9_-]{{1,64}}")
    return job_id


def segment_name(job_id: str, owner: int, holder: int | None = None) -> str:
    """Name of the slot pair with `owner`'s state; `holder` set means a neighbour's backup copy."""
    base = f"{PREFIX}.{check_job_id(job_id)}.r{int(owner)}"
    return base if holder is None else f"{base}.b{int(holder)}"


def slot_paths(name: str) -> tuple[Path, ...]:
    """The two double-buffer slot files of a segment."""
    return tuple(SHM_DIR / f"{name}.s{slot}" for slot in SLOTS)


def job_files(job_id: str) -> list[Path]:
    """Every slot file of a job (own snapshots and backups of every rank)."""
    return sorted(SHM_DIR.glob(f"{PREFIX}.{check_job_id(job_id)}.r*"))


def backup_names(job_id: str, owner: int) -> list[str]:
    """Names of the backup segments that other ranks hold for `owner`."""
    pattern = f"{segment_name(job_id, owner)}.b*.s*"
    return sorted({p.name.rsplit(".", 1)[0] for p in SHM_DIR.glob(pattern)})


def free_bytes() -> int:
    """Bytes an unprivileged writer can still allocate in the shm filesystem (at most
    $RR_FLASH_SHM_FREE_BYTES when that is set)."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    cap = os.environ.get(FREE_BYTES_ENV)
    if cap is None:
        return free
    try:
        return min(free, int(cap))
    except ValueError:
        raise ValueError(f"{FREE_BYTES_ENV}={cap!r} must be a whole number of bytes (or unset)") from None


def ensure_space(nbytes: int, what: str) -> None:
    """Fail with an actionable message instead of a SIGBUS halfway through a copy."""
    free = free_bytes()
    if nbytes > free:
        raise space_error(nbytes, free, what)


def space_error(nbytes: int, free: int, what: str) -> ShmSpaceError:
    """The one-paragraph explanation shared by the statvfs check and a failed fallocate."""
    capped = f" (capped by {FREE_BYTES_ENV}={os.environ[FREE_BYTES_ENV]})" if FREE_BYTES_ENV in os.environ else ""
    return ShmSpaceError(
        f"Flash checkpoint needs {_size(nbytes)} in {SHM_DIR} for {what}, but only {_size(free)} is free "
        f"there{capped}. The snapshot is kept in two shared-memory slots of the size of the whole "
        "checkpoint, per rank on this host. Give the container a larger shared-memory mount (docker run "
        "--shm-size=..., or a Kubernetes emptyDir volume with medium: Memory mounted at /dev/shm), remove "
        "segments left by crashed runs (runner.recovery.flash_ckpt.hygiene.cleanup_stale), snapshot fewer ranks "
        "per host, or turn flash checkpointing off for this run."
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
