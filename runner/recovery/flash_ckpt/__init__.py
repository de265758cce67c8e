"""Flash checkpoint: per-rank snapshots in /dev/shm, persisted to disk by another process.

See docs/checkpointing.md for the segment format, the protocol and the failure cases. Each module is
imported by name (this package imports nothing, so the controller's ``action`` and the config check stay
free of torch): ``snapshotter`` writes, ``restore`` finds and loads, ``replica`` copies to the partner
node, ``persister`` writes to disk, ``prefetch`` maps ahead, ``hygiene`` removes segments, ``shm`` names
them. The worker's side: ``worker`` (the snapshot callback and a restarted rank's ``snapshot_restore``).
"""
