"""The committed-step protocol: a step's reduction is retried until committed, exactly once.

Every attempt first lets a ``MicroBatchTakeover`` add the micro-batches of failed ranks this process
covers, then all-reduces the gradients with the step's accounting (``GradReducer``). A failed
collective hands over to the run's recovery (regroup, reconcile, state to newcomers) and the very
same step is retried; a reduction the corruption guard rejects is recomputed from the same batch and
seed, and so is one whose replica check (``runner.training.divergence``) restored a diverged replica.
Once committed, the sums become means in ``.grad``, and ``on_commit`` learns the step's accounting
(one count per logical rank whose micro-batch went in, whether any member was asked to stop (a signal to the
controller, or ``trainer.should_stop`` set by a callback: ``request_stop``), the
validation loss sum and batch count when the step carries a validation, the loss sum, misplaced
batches), and the step's validation values (``validated``: each DP rank's row of what its share
logged, ``runner.training.eval_logs``, resolved alike on every rank). The stop flag lets every member learn
a stop at the same committed step (``stop_agreed``).

What the module's ``training_step`` logs with ``self.log(..., sync_dist=True)`` rides in the same
reduction (``defer_sync``): a collective of its own inside the step would pair with another member's
gradient reduction when a recovery has survivors re-reduce and a replacement compute the step. Each DP
rank fills its row of the synced slots, and once the step commits the tensors Lightning holds for those
values get the reduced value (``reduce_fx``: mean, sum, max or min over the ranks that filled their row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from runner.data import BatchSource
from runner.plumbing.events import EventLog
from runner.recovery.common.hooks import MicroBatchTakeover
from runner.recovery.sdc import GradientGuard
from runner.training.comm import CollectiveFailure, Comm
from runner.training.divergence import ReplicaDivergence
from runner.training.epoch_sums import EpochSums
from runner.training.eval_logs import ROW, EvalShare, Evaluated
from runner.training.reducer import GradReducer
from runner.training.state import ReplicaState
from runner.training.status import WorkerStatus
from runner.training.update import CommittedUpdate

Recover = Callable[[ReplicaState, str], Optional[dict]]  # the run's recovery: (this replica's state, why)
# (step, accounting, seconds from reduce to commit, the values of the validation the step carried)
OnCommit = Callable[[int, Tensor, float, Optional[Evaluated]], None]
# the accounting vector after the one count per logical rank: these entries, indexed from its end
VAL_LOSS_SUM, VAL_BATCHES, LOSS_SUM, MISPLACED = -4, -3, -2, -1
SYNCED_PER_STEP = 16  # values a training_step may log with sync_dist=True; each DP rank's row has a flag first
_REDUCE: dict[str, Callable[[Tensor], Tensor]] = {"mean": torch.mean, "avg": torch.mean, "sum": torch.sum,
                                                  "max": torch.amax, "min": torch.amin}


class StepCommit:
    def __init__(self, comm: Comm, events: EventLog, status: WorkerStatus, state: ReplicaState,
                 update: CommittedUpdate, module: Callable[[], LightningModule], *, bucket_bytes: int,
                 guard: Optional[GradientGuard] = None, takeover: Optional[MicroBatchTakeover] = None,
                 recover: Optional[Recover] = None, on_commit: Optional[OnCommit] = None,
                 agree: Optional[Callable[[], None]] = None,
                 replica_check: Optional[ReplicaDivergence] = None, epoch_sums: Optional[EpochSums] = None) -> None:
        """``agree``: with tp*pp > 1, a collective over the world group after the reduction (``commit``);
        ``replica_check``: the replicas' fingerprints ride in the accounting every N steps; ``epoch_sums``: the
        increments of synced epoch values ride in the synced slots after the step's synced values."""
        self.comm, self.events, self.status = comm, events, status
        self.agree = agree
        self.state, self.update, self._module = state, update, module
        self.bucket_bytes = bucket_bytes
        self.guard, self.takeover = guard, takeover
        self.recover, self.on_commit = recover, on_commit
        self.replica_check = replica_check
        self.epoch_sums = epoch_sums
        self._reducer: Optional[GradReducer] = None  # built at the first step, once the module is set up
        self._batch_sample: Optional[Tensor] = None
        self._batch_loss: Optional[float] = None
        self._validation: Optional[EvalShare] = None  # this rank's share of the current step's validation
        self.validated: Optional[Evaluated] = None  # the values of the validation the last committed step carried
        self._synced: list[tuple[Tensor, str]] = []  # what the step's training_step logged with sync_dist
        self._committed = False  # the current step's reduction is done: nothing more can ride in it
        self._t_batch = 0.0
        self._t_reduced: Optional[float] = None  # when the previous reduction ended; None: the next step is not timed
        self._sync_s = 0.0  # this step's time in ZeRO-1's parameter sync (a collective, not compute)
        self.stop_agreed = False  # a member was asked to stop (protocol.STOP) by the last committed step
        self._stop_requested = False  # a callback or the module set trainer.should_stop here (``request_stop``)

    @property
    def dp_size(self) -> int:
        return self.comm.dp_size

    # -- one step ----------------------------------------------------------------------------------
    def begin(self, batch: Any) -> None:
        """A new step's batch: its sample id (for the accounting) and a clean slate."""
        self._batch_sample = batch.get("sample") if isinstance(batch, dict) else None
        self._validation, self.validated = None, None
        self._batch_loss = None
        self._synced, self._committed = [], False
        if self.epoch_sums is not None:
            self.epoch_sums.begin_step(self._module().trainer.global_step)
        if self.takeover is not None:
            self.takeover.reset()
        self._t_batch = time.perf_counter()

    def regroup(self) -> None:
        """The controller published a new generation: regroup at the step boundary, before any compute."""
        self.status.phase = "recovering"
        self._t_reduced = None  # the regroup is no compute of this rank's
        self.reducer.disarm()  # the new layout may take over micro-batches: reduce after backward
        assert self.recover is not None
        self.recover(self.state, "planned")

    def record_loss(self, out: Any, micro: int = 0, micros: int = 1) -> None:
        """The step's loss: with accumulation, the mean of its ``micros`` micro-batches' losses."""
        loss = out["loss"] if isinstance(out, dict) else out
        value = float(loss.detach()) / micros if isinstance(loss, Tensor) else None
        if micro == 0 or self._batch_loss is None or value is None:
            self._batch_loss = value
        else:
            self._batch_loss += value

    def request_stop(self) -> None:
        """A callback or the module set ``trainer.should_stop`` on this rank: the next reduction carries the stop flag,
        so every member stops at the step it commits, as after a SIGTERM (the earliest step every member can agree
        on: this one's reduction is behind it)."""
        if not self._stop_requested:
            self._stop_requested = True
            self.events.emit("stop_requested_by_callback", at_step=self._module().trainer.global_step)

    def record_validation(self, share: EvalShare) -> None:
        """This rank's share of a validation, carried by the step's reduction (however often it is retried)."""
        self._validation = share

    def clear_synced(self, first_micro: bool = True) -> None:
        """A (re)computation of the step's forward logs its synced values anew (from the step's epoch
        accumulations when it is the step's first micro-batch)."""
        self._synced = []
        if first_micro and self.epoch_sums is not None:
            self.epoch_sums.before_compute()

    def defer_sync(self, value: Tensor, reduce_op: Any) -> Tensor:
        """A value logged with ``sync_dist=True``: the tensor Lightning keeps for it, reduced in place once the step
        commits."""
        op = str(reduce_op).lower().rsplit(".", 1)[-1]
        name = type(self._module()).__name__
        if op not in _REDUCE:
            raise ValueError(f"{name} logs with sync_dist=True and reduce_fx={reduce_op!r}; the runner reduces "
                             f"synced values with one of {sorted(_REDUCE)}: use one of them, or sync_dist=False.")
        if self._committed:
            raise ValueError(f"{name}.training_step logs with sync_dist=True after its optimizer.step(): the "
                             "runner reduces synced values in the step's own reduction; log them before the step.")
        if len(self._synced) == SYNCED_PER_STEP:
            raise ValueError(f"{name}.training_step logs more than {SYNCED_PER_STEP} values with sync_dist=True "
                             "in one step; log the others without sync_dist (or stack them into fewer values).")
        if value.numel() != 1:
            raise ValueError(f"{name} logs a tensor of {value.numel()} elements with sync_dist=True: log scalars.")
        out = value.detach().clone().float()
        self._synced.append((out, op))
        return out

    def arm(self) -> None:
        """Before the step's own backward: its buckets launch as they fill (not when micro-batches of others
        join after backward)."""
        if not self.comm.joined.extra_of(self.comm.wid):
            self.reducer.arm()

    def commit(self, closure: Callable[[], Any], source: Optional[BatchSource],
               failed: Optional[CollectiveFailure] = None) -> bool:
        """All-reduce this step's gradients; on a failure recover and retry until committed; a reduction the
        corruption guard rejects is recomputed with ``closure``. ``failed``: a collective of the step's own
        forward or backward failed (tensor parallelism), so its gradients are recomputed after the recovery.
        False: a lagging survivor received the committed state of this step instead.

        With tp*pp > 1 every rank recomputes its gradients after a recovery: the ranks of a replica compute
        them together, and a replacement (or a survivor whose TP collective failed) computes them anew. Each
        TP slice is reduced in a DP group of its own, so one group may complete while another fails; the
        ``agree`` collective over the world group after it fails on every rank unless every group completed.
        Like any all-reduce it can complete on some members and fail on others; a member whose agreement failed
        keeps its reduced gradients (``awaiting_agreement``), and the recovery rolls its step forward if another
        member committed it (``runner.recovery.common.roll_forward``), so every slice commits the step or none does."""
        step = self._module().trainer.global_step
        t0 = time.perf_counter()
        launched_s = self.reducer.launch_s  # launched from backward: in the reduction, not in compute
        timed = self._t_reduced is not None and failed is None
        compute_s = t0 - (self._t_reduced or t0) - launched_s - self._sync_s
        redo = False
        if failed is not None:
            self.reducer.disarm()  # armed before the failed forward; the new layout may take over micro-batches
            self.recover_from(failed)
            if self.update.skip_pending:
                return False
            redo = True
        while True:
            self.update.awaiting_agreement = False  # reduced (again) before any agreement
            try:
                if redo:  # the own gradients first: the closure zeroes every gradient, a taken-over one too
                    self.status.phase = "compute"
                    closure()
                    redo = False
                    if self.takeover is not None:
                        self.takeover.reset()
                if self.takeover is not None:
                    wanted = self.comm.joined.extra_of(self.comm.wid)
                    self.takeover.take_over(step, wanted, source, self._grad_params())
                self.status.phase = "reduce"
                grads, extras = self.reducer.reduce()
                if self.replica_check is not None and self.replica_check.inspect(step, extras[self._check_slots]):
                    closure()  # a diverged replica was restored: every rank's gradients again, from agreeing state
                    if self.takeover is not None:
                        self.takeover.reset()
                    continue
                if self.guard is None or self._guard_accepts(grads):
                    if self.agree is not None:  # the DP groups reduce apart: every model slice commits the step
                        self._write_back()
                        self.update.awaiting_agreement = True  # a recovery may roll this step forward
                        self.agree()
                        self.update.awaiting_agreement = False
                    break
                closure()  # recompute this rank's gradients (every rank reached the same verdict)
                if self.takeover is not None:
                    self.takeover.reset()
                continue
            except CollectiveFailure as err:
                timed = False
                self.recover_from(err)
                if self.update.skip_pending:
                    return False
                redo = self.comm.replica_size > 1
        if self.agree is None:
            self._write_back()
        self._resolve_synced(extras)
        self._resolve_validation(extras)
        if self.takeover is not None:
            self.takeover.record_step(time.perf_counter() - self._t_batch)
        self.stop_agreed = bool(extras[self.dp_size] > 0)
        self.status.step = step + 1
        self.status.phase = "compute"
        t_end = time.perf_counter()
        if timed:
            self.status.record_timing(step, compute_s, t_end - t0 + launched_s + self._sync_s, self.reducer.launch_s)
        self._t_reduced, self._sync_s = t_end, 0.0
        if self.on_commit is not None:
            self.on_commit(step, extras, t_end - t0, self.validated)
        return True

    def _write_back(self) -> None:
        """The reduced sums become means in ``.grad`` (before the agreement: a member whose agreement failed updates
        with them if the step committed elsewhere, else it redoes the step)."""
        divisor = None
        if self.takeover is not None:
            divisor = self.takeover.divisor(self.dp_size, self.comm.covered_replicas)
        self.reducer.write_back(self.dp_size, divisor)

    def sync_params(self) -> None:
        """ZeRO-1: bring every owner's updated shard to everyone, through recoveries if need be."""
        zero = self.update.zero
        assert zero is not None
        t0 = time.perf_counter()
        while zero.stale:  # a recovery ends with a sync of its own, so it is not retried after one
            try:
                self.status.phase = "sync"
                zero.sync(self.comm)
            except CollectiveFailure as err:
                self.reducer.disarm()  # armed before the step began; the new layout may take over micro-batches
                self._t_reduced = None
                self.recover_from(err)
        self._sync_s += time.perf_counter() - t0

    def recover_from(self, err: CollectiveFailure) -> None:
        """A collective of this step failed: regroup (the run's recovery), or end the worker without one."""
        self.status.phase = "recovering"
        self.events.emit("collective_failed", gen=self.comm.gen, error=str(err), stranded=self.comm.stranded)
        if self.recover is None:
            raise err
        self.recover(self.state, str(err))

    def _guard_accepts(self, flats: list[Tensor]) -> bool:
        assert self.guard is not None
        accepted, norm, median = self.guard.verdict(flats)
        if not accepted and self.comm.logical_rank == 0:
            self.events.emit("sdc_detected", gen=self.comm.gen, grad_norm=norm, recent_median=median,
                             action="recompute_step", reason="reduced gradient norm non-finite or above "
                             "trainer.sdc_factor x the recent median: recompute the step [policy.silent_corruption]")
        return accepted

    def _grad_params(self) -> list[Tensor]:
        return [p for p in self._module().parameters() if p.requires_grad]

    def _resolve_synced(self, extras: Tensor) -> None:
        """The committed step's synced values, reduced over the DP ranks whose row is filled (a rank whose
        micro-batch another member took over logged nothing), into the tensors Lightning holds."""
        self._committed = True
        rows = extras[self._synced_slots].view(self.dp_size, SYNCED_PER_STEP + 1)
        filled = rows[rows[:, 0] > 0, 1:]
        for i, (value, op) in enumerate(self._synced):
            value.fill_(float(_REDUCE[op](filled[:, i])))
        if self.epoch_sums is not None:
            start = len(self._synced)
            self.epoch_sums.resolve(filled[:, start: start + self.epoch_sums.size].double())

    def _resolve_validation(self, extras: Tensor) -> None:
        """The committed step's validation values, from every DP rank's row and the summed loss."""
        share = self._validation
        if share is None:
            return
        rows = extras[self._val_slots].view(self.dp_size, ROW)
        self.validated = share.resolve(rows, float(extras[VAL_LOSS_SUM]), int(extras[VAL_BATCHES]))

    # -- the reduction and its accounting --------------------------------------------------------
    @property
    def _check_slots(self) -> slice:
        """The replica check's slots: after the stop flag, before the synced values."""
        size = self.replica_check.size if self.replica_check is not None else 0
        return slice(self.dp_size + 1, self.dp_size + 1 + size)

    @property
    def _synced_slots(self) -> slice:
        """A row per DP rank of its synced values (a flag, then ``SYNCED_PER_STEP`` values): before the four sums."""
        start = self._check_slots.stop
        return slice(start, start + self.dp_size * (SYNCED_PER_STEP + 1))

    @property
    def _val_slots(self) -> slice:
        """A row per DP rank of what its validation share logged (``runner.training.eval_logs``): after the synced
        values, before the four sums. Reserved whether the run validates or not, as the synced values' are: the
        accounting's size decides how the all-reduce splits the bucket it rides in, and with it the order its
        gradient sums are added in, so validating changes no bit of the training."""
        start = self._synced_slots.stop
        return slice(start, start + self.dp_size * ROW)

    @property
    def _extras_size(self) -> int:
        """The counts per logical rank, the stop flag, the replica check's slots, the synced values, the validation
        rows, and the four sums from ``VAL_LOSS_SUM`` to the end."""
        return self._val_slots.stop - VAL_LOSS_SUM

    @property
    def reducer(self) -> GradReducer:
        if self._reducer is None:
            self._reducer = GradReducer(self.comm, self._module(), self.bucket_bytes, self._extras_size,
                                        self._accounting)
        return self._reducer

    def _accounting(self) -> Tensor:
        """One count per logical rank whose micro-batch went in, the stop flag (at ``dp_size``), the replica check's
        slots, then (from ``VAL_LOSS_SUM`` on) the validation loss sum and batches, the loss sum, misplaced
        batches."""
        step = self._module().trainer.global_step
        extras = torch.zeros(self._extras_size, dtype=torch.float64)
        extras[self.dp_size] = float(self.status.stop_requested or self._stop_requested)
        if self.replica_check is not None:
            extras[self._check_slots] = self.replica_check.slots(step)
        sample_step, sample_rank = (step, self.comm.dp_rank)
        if self._batch_sample is not None:
            sample_step, sample_rank = (int(v) for v in self._batch_sample.tolist())
        extras[sample_rank] += 1
        values = [float(v) for v, _ in self._synced] + (self.epoch_sums.row() if self.epoch_sums is not None else [])
        if values:
            if len(values) > SYNCED_PER_STEP:
                raise ValueError(f"{type(self._module()).__name__}.training_step logs too many values with "
                                 f"sync_dist=True: {len(self._synced)} per step and {len(values) - len(self._synced)}"
                                 f" slots of epoch values (2 each) exceed the {SYNCED_PER_STEP} the step's reduction "
                                 "carries; log the others without sync_dist.")
            row = self._synced_slots.start + self.comm.dp_rank * (SYNCED_PER_STEP + 1)
            extras[row] = 1.0
            extras[row + 1: row + 1 + len(values)] = torch.tensor(values)
        share = self._validation
        if share is not None:
            row = self._val_slots.start + self.comm.dp_rank * ROW
            extras[row: row + ROW] = torch.tensor(share.row(), dtype=torch.float64)
            extras[VAL_LOSS_SUM], extras[VAL_BATCHES] = share.loss_sum, share.batches
        extras[LOSS_SUM] = self._batch_loss if self._batch_loss is not None else float("nan")
        extras[MISPLACED] = float(sample_step != step)
        for loss, (extra_step, extra_rank) in self.takeover.contributions() if self.takeover is not None else ():
            extras[extra_rank] += 1
            extras[LOSS_SUM] += loss
            extras[MISPLACED] += float(extra_step != step)
        return extras
