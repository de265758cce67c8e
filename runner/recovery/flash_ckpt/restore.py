"""Pick and load the newest snapshot of a rank that verifies: own memory, a partner's backup
copy in memory, or a file on disk. Corrupt or partial snapshots are skipped and reported, never
loaded; what is returned is always a private copy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .disk import list_checkpoints, read_verified, sidecar_path
from .events import EventSink, emit
from .prefetch import Prefetch
from .segment import CorruptSnapshot
from .shm import backup_names, segment_name
from .slots import SlotWriter, committed_steps, load_slot

_PREFERENCE = {"memory": 0, "partner": 1, "disk": 2}
_PREFETCH_WAIT_S = 30.0  # mapping and faulting in a few GB takes seconds at most; after that, go on without


@dataclass(frozen=True)
class Candidate:
    step: int
    source: str  # "memory" | "partner" | "disk"
    location: Path


@dataclass(frozen=True)
class Skipped:
    candidate: Candidate
    reason: str


@dataclass
class Restored:
    state: Any
    candidate: Candidate
    skipped: list[Skipped] = field(default_factory=list)
    written_by: dict | None = None  # a partner's copy: host and pid of the holder's process that wrote it


class NoSnapshot(LookupError):
    """No candidate verified; `skipped` says why each one was refused."""

    def __init__(self, message: str, skipped: list[Skipped]) -> None:
        super().__init__(message)
        self.skipped = skipped


def list_snapshots(job_id: str, rank: int, ckpt_dir: str | Path | None = None) -> list[Candidate]:
    """Snapshots of `rank` by header or file name (not verified yet), newest step first and,
    at equal steps, memory before a partner's copy before disk."""
    found = [Candidate(step, "memory", p) for step, p in committed_steps(segment_name(job_id, rank))]
    for name in backup_names(job_id, rank):
        found += [Candidate(step, "partner", p) for step, p in committed_steps(name)]
    if ckpt_dir is not None:
        found += [Candidate(step, "disk", p) for step, p in list_checkpoints(Path(ckpt_dir), rank)]
    return sorted(found, key=lambda c: (-c.step, _PREFERENCE[c.source]))


def load_newest(job_id: str, rank: int, ckpt_dir: str | Path | None = None, *, step: int | None = None,
                into: Any = None, on_event: EventSink = None, prefetch: Prefetch | None = None) -> Restored:
    """Load the newest candidate that verifies (only copies of `step` if given).

    `into` is a state of the same structure (e.g. the live checkpoint dict after an in-process
    restart): memory snapshots are copied straight into its tensors where shape and dtype match.
    With a `prefetch` made for this rank at process start, memory snapshots are read through its
    mappings and other tensors carved out of its memory. Raises NoSnapshot when nothing verifies.
    """
    new = prefetch.new_tensor if prefetch is not None and prefetch.ready(_PREFETCH_WAIT_S) else None
    skipped = []
    for cand in list_snapshots(job_id, rank, ckpt_dir):
        if step is not None and cand.step != step:
            continue
        meta: dict = {}
        try:
            if cand.source == "disk":
                state = read_verified(cand.location)
            else:
                if prefetch is not None and new is not None:  # new comes from the prefetch
                    prefetch.rewind()
                meta, state = load_slot(cand.location, step=cand.step, into=into, new=new)
        except (CorruptSnapshot, OSError) as e:
            skipped.append(Skipped(cand, str(e)))
            emit(on_event, "skipped", cand.step, str(cand.location), str(e))
            continue
        return Restored(state, cand, skipped, meta.get("written_by"))
    wanted = "any step" if step is None else f"step {step}"
    raise NoSnapshot(f"no valid snapshot of rank {rank} for {wanted}: {[s.reason for s in skipped]}", skipped)


def newest_common_step(per_rank_steps: Iterable[Iterable[int]]) -> int | None:
    """The newest step that every rank holds (the input of the collective agreement), or None."""
    sets = [set(steps) for steps in per_rank_steps]
    common = set.intersection(*sets) if sets else set()
    return max(common, default=None)


def invalidate_newer(job_id: str, rank: int, step: int, ckpt_dir: str | Path | None = None) -> list[Candidate]:
    """After the job resumed at `step`: drop `rank`'s snapshots of later steps everywhere (own
    memory, partner copies, disk), so a later restore can never mix in the abandoned timeline."""
    dropped = []
    for name, source in [(segment_name(job_id, rank), "memory")] + [(b, "partner") for b in backup_names(job_id, rank)]:
        writer = SlotWriter(name)
        try:
            dropped += [Candidate(s, source, Path(name)) for s in writer.invalidate_after(step)]
        finally:
            writer.close()
    if ckpt_dir is not None:
        for held, path in list_checkpoints(Path(ckpt_dir), rank):
            if held > step:
                path.unlink(missing_ok=True)
                sidecar_path(path).unlink(missing_ok=True)
                dropped.append(Candidate(held, "disk", path))
    return dropped
