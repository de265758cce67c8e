"""Flash checkpoint: per-rank snapshots in /dev/shm, persisted to disk by another process.

See docs/checkpointing.md for the segment format, the protocol and the failure cases. The worker's
side: ``worker`` (the snapshot callback and a restarted rank's ``snapshot_restore``).
"""

from .events import Event
from .hygiene import cleanup, cleanup_stale
from .persister import (
    PersistClient,
    Persister,
    PersistError,
    PersistOutcome,
    connect_persister,
    persist_latest,
    persister_address,
    spawn_persister,
)
from .prefetch import Prefetch
from .replica import backup_to_partner, exchange_with_partners
from .restore import (
    Candidate,
    NoSnapshot,
    Restored,
    Skipped,
    invalidate_newer,
    list_snapshots,
    load_newest,
    newest_common_step,
)
from .segment import CorruptSnapshot
from .shm import ShmSpaceError, segment_name
from .snapshotter import Snapshotter

__all__ = [
    "Candidate",
    "CorruptSnapshot",
    "Event",
    "NoSnapshot",
    "PersistClient",
    "PersistError",
    "PersistOutcome",
    "Persister",
    "Prefetch",
    "Restored",
    "ShmSpaceError",
    "Skipped",
    "Snapshotter",
    "backup_to_partner",
    "cleanup",
    "cleanup_stale",
    "connect_persister",
    "exchange_with_partners",
    "invalidate_newer",
    "list_snapshots",
    "load_newest",
    "newest_common_step",
    "persist_latest",
    "persister_address",
    "segment_name",
    "spawn_persister",
]
