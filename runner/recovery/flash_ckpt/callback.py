"""Flash checkpoints from Lightning: the trainer's checkpoint dict goes to /dev/shm every n steps
(about one memcpy of blocking, less with overlap) and every m-th snapshot is written to disk by a
persister in another process, as a file ``Trainer.fit(ckpt_path=...)`` loads.

The dict from ``dump_checkpoint`` references the live parameters and optimizer state. With
``overlap`` the copy runs in a background thread while the next forward/backward runs, and
``wait`` sits in ``on_before_optimizer_step``, the last moment before those tensors change.
This assumes nothing else writes them between two optimizer steps: modules whose buffers change
in forward (BatchNorm running stats) or callbacks that edit weights after this one (EMA) need
``overlap=False``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from time import perf_counter

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from runner.plumbing.protocol import Layout
from runner.recovery.common.hooks import ABANDON_AFTER_S
from runner.recovery.flash_ckpt.events import Event, emit
from runner.recovery.flash_ckpt.hygiene import cleanup_stale
from runner.recovery.flash_ckpt.persister import PersistClient, connect_persister, spawn_persister
from runner.recovery.flash_ckpt.replica import Abandonment, backup_to_partner, exchange_with_partners
from runner.recovery.flash_ckpt.snapshotter import Snapshotter
from runner.training.comm import Comm
from runner.training.status import checkpoint_phase

log = logging.getLogger(__name__)


# Resuming ignores hyper-parameters, and they may hold classes (an OmegaConf type) that neither
# JSON nor torch.load(weights_only=True) accepts, so snapshots leave them out by default.
HPARAM_KEYS = (
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
)


class FlashCheckpoint(Callback):
    """Snapshot every `every_n_steps` optimizer steps; persist every `persist_every_n_steps` into `dir`.

    `persister` is a client of a persister the caller runs; `persister_address` is where the node
    agent's persister listens (``persister_address(job, node)``), which also persists this rank's
    newest snapshot if the process dies. With neither, or nobody listening there, the callback
    spawns a persister of its own (only if this fit reaches a persist step). `job_id` must stay the same
    across restarts of a run for memory restores to find the snapshots (default:
    TORCHELASTIC_RUN_ID). `rank` names the segment (default: the trainer's global rank). With
    `partner` set (a rank, or a function of this rank), each committed snapshot is copied into the
    backup segment that rank keeps for this one (neighbour backup), in the background during the
    next step: with `comm` (then `partner` must be a function of the rank), over the generation's
    side group into the partner's own host memory, each rank sending its snapshot and receiving
    those of the ranks whose partner it is; without, by a copy on this host. A copy that fails or
    takes longer than the collective timeout is reported (``backup_failed``) and never stops
    training. Segments are unlinked after a successful fit and kept after a failure, for a restart
    or a breakpoint persist.
    """

    def __init__(
        self,
        every_n_steps: int,
        persist_every_n_steps: int | None,
        dir: str | Path,
        *,
        overlap: bool = True,
        job_id: str | None = None,
        keep: int = 3,
        persister: PersistClient | None = None,
        persister_address: str | None = None,
        exclude_keys: tuple[str, ...] = HPARAM_KEYS,
        unlink_on_success: bool = True,
        on_event=None,
        rank: int | None = None,
        partner: int | Callable[[int], int | None] | None = None,
        comm: Comm | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        if persist_every_n_steps is not None and (persist_every_n_steps < 1 or persist_every_n_steps % every_n_steps):
            raise ValueError("persist_every_n_steps must be a positive multiple of every_n_steps")
        if comm is not None and partner is not None and not callable(partner):
            raise ValueError("with comm, partner must be a function of the rank: each rank also receives copies")
        self.every_n_steps, self.persist_every_n_steps = every_n_steps, persist_every_n_steps
        self.dir, self.overlap, self.keep = Path(dir), overlap, keep
        self.job_id = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
        self.exclude_keys, self.unlink_on_success = exclude_keys, unlink_on_success
        self.rank, self.partner, self._comm = rank, partner, comm
        self._partner_rank: int | None = None  # ``partner`` resolved for this rank at setup
        self.blocked_s: list[float] = []  # per snapshot: time the training loop was held
        self._user_sink = on_event
        self._client, self._own_client = persister, persister is None
        self._persister_address = persister_address
        self._snap: Snapshotter | None = None
        self._last_step = -1
        self._to_persist: int | None = None
        self._to_backup: int | None = None
        self._to_backup_in: Layout | None = None  # the generation the snapshot to copy was taken in (with comm)
        self._backup: Future | None = None
        self._abandonment: Abandonment | None = None  # of the exchange in flight (with comm)
        self._backup_pool: ThreadPoolExecutor | None = None
        self._failed = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        cleanup_stale(self.job_id)
        if self.rank is None:
            self.rank = trainer.global_rank
        self._partner_rank = self.partner(self.rank) if callable(self.partner) else self.partner
        self._snap = Snapshotter(self.job_id, self.rank, on_event=self._on_event)
        persists = self.persist_every_n_steps and (
            trainer.max_steps < 0 or trainer.max_steps >= self.persist_every_n_steps)
        # the node's persister costs nothing to join and persists at breakpoint, even in a short fit
        if self.persist_every_n_steps and self._client is None and self._persister_address is not None:
            self._client = connect_persister(self._persister_address, self._snap.segment, self.rank,
                                             on_event=self._on_event)
            if self._client is None:
                log.warning("flash checkpoint: no node persister at %r; this rank spawns its own",
                            self._persister_address)
        if persists and self._client is None:
            self._client = spawn_persister(self.dir, self.keep, on_event=self._on_event)
        if self._partner_rank is not None:
            self._backup_pool = ThreadPoolExecutor(1, thread_name_prefix=f"flash-backup-r{self.rank}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dropped = self._snapshotter.invalidate_after(trainer.global_step)
        if dropped:
            log.warning("flash checkpoint: dropped snapshots of steps %s, newer than the resumed step %d",
                        dropped, trainer.global_step)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        waited = self._settle()
        if waited and self.blocked_s:
            self.blocked_s[-1] += waited

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps:
            return
        with checkpoint_phase(trainer):
            # under the runner's strategy its state: Lightning's checkpoint with what the runner keeps beside it (the
            # synced epoch values' accumulations, the corruption guard's history), which a restore adopts
            state = getattr(trainer.strategy, "state", None)
            checkpoint = (state.dump_state() if state is not None
                          else trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
            for key in self.exclude_keys:
                checkpoint.pop(key, None)
            snap = self._snapshotter
            save = snap.save_async if self.overlap else snap.save
            self.blocked_s.append(save(checkpoint, step))
        self._last_step = step
        self._to_backup = step
        self._to_backup_in = self._comm.layout if self._comm is not None else None
        if self.persist_every_n_steps and step % self.persist_every_n_steps == 0:
            self._to_persist = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._failed = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._snap is None:
            return
        keep_segments = self._failed or not self.unlink_on_success
        try:
            self._snap.wait()
            self._settle_backup()
            if self._own_client and self._client is not None:
                client, self._client = self._client, None  # a later fit spawns a fresh persister
                client.close(failed=self._failed)
            elif self._client is not None:
                self._client.drain()
        except Exception:
            keep_segments = True
            if not self._failed:
                raise
            log.exception("flash checkpoint: cleanup after a failed fit also failed")
        finally:
            if self._backup_pool is not None:
                self._backup_pool.shutdown(wait=True)
                self._backup_pool = None
            self._snap.close(unlink=not keep_segments)
            self._snap = None

    def _settle(self) -> float:
        """Finish the snapshot in flight, then hand a committed step to the partner copy and the persister."""
        # an exchange with the partners is never waited for here: a partner that does not take part
        # (restarted, hung) must not hold up training; a copy on this host (no comm) is a memcpy, waited for
        waited = self._snapshotter.wait() + (self._settle_backup() if self._comm is None else 0.0)
        if self._to_backup is not None and self._backup_pool is not None:
            step, self._to_backup = self._to_backup, None
            if self._backup is not None and not self._backup.done():
                emit(self._on_event, "backup_failed", step, f"rank {self._partner_rank}",
                     "the exchange of the previous snapshot is still in flight")
            elif self._comm is not None and not _all_took_it(self._to_backup_in, self._comm.layout):
                # a member that joined in the recovery since has no snapshot of this step: nothing would pair
                emit(self._on_event, "backup_failed", step, f"rank {self._partner_rank}",
                     f"a rank joined generation {self._comm.gen} after the snapshot: the exchange would not pair")
            else:
                copy = self._copy_to_partner if self._comm is None else self._exchange(self._comm, step)
                self._backup = self._backup_pool.submit(copy) if copy is not None else None
        if self._to_persist is not None:
            step, self._to_persist = self._to_persist, None
            # a persist step is only reached with a persister: setup joins or spawns one whenever the fit reaches one
            assert self._client is not None
            self._client.request(self._snapshotter.segment, step)
        return waited

    def _settle_backup(self) -> float:
        """Wait for the partner copy in flight (started one step earlier, normally long done). An
        exchange is waited for at most the collective timeout, and not at all after a failed fit; one
        still running then is given up: its thread ends once its own waits time out."""
        if self._backup is None:
            return 0.0
        t0 = perf_counter()
        backup, self._backup = self._backup, None
        timeout = None
        if self._comm is not None:
            timeout = 0.0 if self._failed else self._comm.collective_timeout.total_seconds()
        try:
            backup.result(timeout=timeout)
        except FutureTimeout:
            emit(self._on_event, "backup_failed", None, f"rank {self._partner_rank}",
                 f"the exchange with the partners did not end within {timeout:.0f}s")
            assert self._backup_pool is not None  # copies only start on the pool
            self._backup_pool.shutdown(wait=False)
            self._backup_pool = None  # no more copies after the fit's last one
        return perf_counter() - t0

    def _exchange(self, comm: Comm, step: int) -> Callable[[], None] | None:
        """The exchange of the snapshot of `step` on this generation's side group, its routes taken now
        (in the training thread, where the generation does not change under it); None, reported, if
        there is no group. A holder outside this generation gets nothing; the owners' copies still arrive."""
        assert callable(self.partner) and self.rank is not None  # checked in __init__, resolved in setup
        holder, pg = self._partner_rank, comm.side_pg
        if pg is None:
            emit(self._on_event, "backup_failed", None, f"rank {holder}", "no side group")
            return None
        group_rank = {logical: i for i, logical in enumerate(comm.joined.logical)}
        if holder not in group_rank:
            emit(self._on_event, "backup_failed", None, f"rank {holder}", "the partner is not in this generation")
        to = (holder, group_rank[holder]) if holder in group_rank else None
        owners = [(r, group_rank[r]) for r in comm.joined.logical if r != self.rank and self.partner(r) == self.rank]
        if to is None and not owners:
            return None
        job_id, rank, timeout, sink = self.job_id, self.rank, comm.collective_timeout, self._on_event
        abandonment = self._abandonment = Abandonment()

        def exchange() -> None:
            try:
                exchange_with_partners(pg, job_id, rank, to, owners, step, timeout, sink, abandonment)
            except Exception as e:
                emit(sink, "backup_failed", None, f"rank {holder}", f"{type(e).__name__}: {e}")

        return exchange

    def abandon_exchange(self, timeout_s: float = ABANDON_AFTER_S) -> None:
        """A recovery starts: the exchange in flight, on the generation it replaces, is waited for at
        most `timeout_s` (its peers are normally just finishing theirs), then abandoned: it commits
        nothing more and ends on its own once its waits do (a peer answers, or the collective timeout),
        and the next exchange starts on a thread of its own. The copies committed before stay current."""
        if self._backup is None or self._abandonment is None:  # none in flight, or a copy on this host
            return
        backup, self._backup = self._backup, None
        try:
            backup.result(timeout=timeout_s)
        except FutureTimeout:
            self._abandonment.abandon()
            assert self._backup_pool is not None  # copies only start on the pool
            self._backup_pool.shutdown(wait=False)
            self._backup_pool = ThreadPoolExecutor(1, thread_name_prefix=f"flash-backup-r{self.rank}")

    def _copy_to_partner(self) -> None:
        """A failed copy leaves the previous one in place: reported, never fatal to training."""
        rank, partner = self.rank, self._partner_rank
        assert rank is not None and partner is not None  # set in setup, which starts copies only with a partner
        try:
            step = backup_to_partner(self.job_id, rank, partner)
            emit(self._on_event, "backed_up", step, f"rank {partner}")
        except Exception as e:
            emit(self._on_event, "backup_failed", None, f"rank {partner}", f"{type(e).__name__}: {e}")

    @property
    def _snapshotter(self) -> Snapshotter:
        """This fit's snapshotter: the hooks that use it run between the fit's setup and its teardown."""
        assert self._snap is not None
        return self._snap

    def _on_event(self, event: Event) -> None:
        if event.kind in ("persist_failed", "skipped", "backup_failed"):
            log.error("flash checkpoint: %s step %s at %s: %s", event.kind, event.step, event.where, event.detail)
        if self._user_sink is not None:
            self._user_sink(event)


def _all_took_it(taken_in: Layout | None, now: Layout | None) -> bool:
    """Whether every member of generation `now` took the snapshot taken in `taken_in` too: each was a member
    there, computing the same logical rank (every member of a generation snapshots the same steps)."""
    if taken_in is None or now is None:
        return False
    return set(zip(now.members, now.logical)) <= set(zip(taken_in.members, taken_in.logical))
