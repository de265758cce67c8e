"""The runner's Lightning Strategy: it owns the process group and the gradient all-reduce.

Why not DDP: DDP's reducer lives in hooks on a process group fixed at construction. Here the
reduction (``runner.training.reducer``: buckets launched from the step's own backward) is waited for and
committed inside ``optimizer_step``, where a failed collective surfaces, so that it can be
abandoned, the group rebuilt for the next generation, state handed to newcomers, and the very
same step retried. ``optimizer_step`` returns only once the step is committed, so
Lightning's ``global_step``, schedulers and loop counters count each committed step exactly once.

This module is the glue to Lightning (what Lightning calls: group set-up, per-step seeding, the data
contract, Lightning's own collectives). The committed-step protocol is ``runner.training.commit``, the
update of a committed step ``runner.training.update``, state handed between replicas
``runner.training.transfer``; a recovery sees only ``runner.training.state.ReplicaState``.

Gradient accumulation is done here, not by Lightning: Lightning sees one batch per optimizer step (the
step's ``MicroBatches``) and the strategy runs the other micro-batches' forward and backward inside the
step's closure, the reducer armed before the last backward, so a step stays the unit that is committed,
retried and handed to a replacement. Validation (``runner.training.validation``) runs at the start of
the steps it is due at and rides in their reduction. With manual optimization (the module calls
``optimizer.step()`` itself) the step's loss is taken at ``manual_backward``, before the commit.

Pipeline parallelism (``parallel.pp`` > 1): the module's model is this rank's ``GPTStage``, and the step's
forward and backward are one 1F1B schedule over the step's batch in ``trainer.micro_batches`` micro-batches,
run where Lightning runs the backward (``training_step`` only keeps the batch); the reduction is launched after
the schedule, once the tied embedding's gradient is summed, never during it. A validation's batches run forward
only through the stages (``OneFOneB.forward_only``), and the last stage's loss sum is summed over the pipeline.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from runner.checkpoint import RUNNER_KEY
from runner.checkpoint.tp_state import optimizer_params, slice_model_state, slice_optimizer_state
from runner.checkpoint.zero_state import shard_of_full_state
from runner.data import (
    BatchSource,
    IndexedDatasetSource,
    MicroBatches,
    StepLoader,
    derive_seed,
    seed_step,
    shuffle_seed,
)
from runner.parallel.full_model import gather_model
from runner.parallel.generation_group import GenerationGroup
from runner.parallel.pipeline import GPTStage, OneFOneB
from runner.parallel.tensor import clip_grads_, grad_squares
from runner.plumbing.events import EventLog
from runner.recovery.common.hooks import WorkerHooks
from runner.recovery.sdc import GradientGuard
from runner.training.checksum import state_checksum
from runner.training.comm import CollectiveFailure, Comm
from runner.training.commit import OnCommit, Recover, StepCommit
from runner.training.divergence import ReplicaDivergence
from runner.training.environment import RunnerEnvironment
from runner.training.epoch_sums import EpochSums
from runner.training.eval_logs import ROW, EvalShare, Evaluated
from runner.training.packed import from_bytes, to_bytes
from runner.training.reducer import trainable_params
from runner.training.status import WorkerStatus
from runner.training.transfer import TrainerState
from runner.training.update import CommittedUpdate
from runner.training.validation import StepValidation, evaluate, loader_hook
from runner.training.zero import ZeroOne

# Lightning restores a checkpoint at the right moment of fit() (before or after setup, loops included) when
# given a path; these two name state that does not come from a file.
PEER_CKPT = "peer://replica"  # ckpt_path a replacement passes to fit(): state comes from a live replica
SNAPSHOT_CKPT = "flash://snapshot"  # ckpt_path of a restarted rank: the newest snapshot every rank holds



@dataclass(frozen=True)
class StrategyOptions:
    """What the strategy is told by the config and by the worker's role, built in one function
    (``runner.training.worker.strategy_options``)."""

    seed: int
    micro_batch: int  # samples per micro-batch on each rank
    bucket_mb: float  # gradient bucket size of the reduction
    first_gen: int = 0  # the first generation this worker may belong to
    joining: bool = False  # a replacement: Lightning's set-up collectives stay local until it is in sync
    join_after_setup: bool = False  # it builds its optimizer and Lightning's set-up before it joins a generation
    start_timeout_s: float = 120.0  # how long it waits for its first generation
    zero_stage: int = 0
    master_weights: bool = False  # ZeRO-1 keeps fp32 masters of 16-bit parameters (``runner.training.zero``)
    accumulate: int = 1  # micro-batches per optimizer step on each rank
    pipeline_micro_batches: int = 1
    replica_check_every_n_steps: int = 0  # 0: no replica check during training
    val_check_interval: float = 0  # steps between validations (an int; 0: never) or a fraction of an epoch (a float)
    limit_val_batches: int = 0  # validation batches over all DP ranks (0: all)
    sdc_factor: float = 0.0  # the gradient corruption guard's factor (0: no guard)
    sdc_window: int = 0
    max_epochs: Optional[int] = None  # with a finite dataset, the run ends after this many epochs (or max_steps)


class ResilientStrategy(ParallelStrategy):
    strategy_name = "resilient"

    def __init__(self, comm: Comm, options: StrategyOptions, hooks: WorkerHooks, *, events: EventLog,
                 status: WorkerStatus, recover: Recover | None = None, on_commit: OnCommit | None = None) -> None:
        """``hooks``: what the techniques in ``ft`` add to the step (``runner.recovery.worker_registry.combine``);
        ``recover``: the worker's recovery loop; ``on_commit``: what a committed step reports (metrics)."""
        super().__init__(
            accelerator=None,
            parallel_devices=[comm.device],
            cluster_environment=RunnerEnvironment(comm, status),
            checkpoint_io=None,
            precision_plugin=None,
        )
        self.comm = comm
        self.options = options
        self.seed, self.micro_batch = options.seed, options.micro_batch
        self.events = events
        self.status = status
        self._recover = recover
        self._restore_snapshot = hooks.restore_snapshot
        self.joining = options.joining  # a replacement: Lightning's setup collectives stay local until it is in sync
        self.join_after_setup = options.join_after_setup
        self.first_gen = options.first_gen  # the first generation this worker may belong to
        self.start_timeout_s = options.start_timeout_s
        self.zero_stage = options.zero_stage
        self.master_weights = options.master_weights  # ZeRO-1 keeps fp32 masters of 16-bit parameters
        self._shard_replication = hooks.shard_replication  # a technique copies each updated shard elsewhere
        self._source: Optional[BatchSource] = None  # the step-indexed batch source, for taken-over micro-batches
        # steps in one epoch of the training data (``runner.data.steps_per_epoch``), known once Lightning hands the
        # loader over (``process_dataloader``); None: endless step-indexed data, one epoch
        self.steps_per_epoch: Optional[int] = None
        self.accumulate = options.accumulate  # micro-batches per optimizer step on each rank
        self.validation = StepValidation(options.val_check_interval, options.limit_val_batches)
        guard = GradientGuard(options.sdc_factor, options.sdc_window) if options.sdc_factor > 0 else None
        self._micros: MicroBatches = MicroBatches()  # the current step's micro-batches (accumulation)
        self._batch_idx = 0
        self._in_module_step = False  # inside the module's training_step: a synced value is deferred to the commit
        self._failed = False
        self._training = False  # fit reached its training loop: Lightning's barriers are past (``barrier``)
        self.full_checksum: Optional[str] = None  # tp*pp > 1: the gathered model's, set at teardown
        self.pipeline_micro_batches = options.pipeline_micro_batches
        self._pipeline: Optional[OneFOneB] = None  # pp > 1: this stage's schedule, built at setup
        self._pipeline_batch: Any = None  # pp > 1: the step's batch, kept for the schedule
        self.update = CommittedUpdate(lambda: self._module.trainer.global_step)
        epoch_sums = EpochSums(lambda: self._module.trainer.fit_loop.epoch_loop._results, lambda: comm.size)
        self.state = TrainerState(lambda: self._module, lambda: self.optimizers, self.update, guard, epoch_sums)
        check = ReplicaDivergence(comm, events, self.state, options.replica_check_every_n_steps,
                                  lambda: trainable_params(self._module)[::-1],
                                  lambda: comm.replica_size == 1 and self.update.zero is None)
        self.commit = StepCommit(comm, events, status, self.state, self.update, lambda: self._module,
                                 bucket_bytes=int(options.bucket_mb * 2**20), guard=guard, takeover=hooks.takeover,
                                 recover=recover, on_commit=on_commit,
                                 agree=self._agree_on_step if comm.replica_size > 1 else None,
                                 replica_check=check if options.replica_check_every_n_steps > 0 else None,
                                 epoch_sums=epoch_sums)

    # -- identity -------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.comm.device

    @property
    def logical_rank(self) -> int:
        return self.comm.logical_rank

    @property
    def _module(self) -> pl.LightningModule:
        """The module under training: Lightning attaches it before any hook that asks for it."""
        module = self.lightning_module
        assert module is not None
        return module

    @property
    def dp_size(self) -> int:
        return self.comm.dp_size

    @property
    def data_rank(self) -> int:
        """The rank whose data this process reads and whose seeds it draws: its DP coordinate (the TP ranks of
        a replica read the same batch); the logical rank when every rank is a replica."""
        return self.comm.dp_rank

    @property
    def is_distributed(self) -> bool:
        """Lightning syncs ``self.log(..., sync_dist=True)`` values only on a strategy that says it is distributed."""
        return True

    @property
    def is_global_zero(self) -> bool:
        return self.comm.logical_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.dp_size, "rank": self.data_rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- set-up: the group of the current generation --------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        self.status.phase = "rendezvous"
        if not self.join_after_setup:
            self._join_first_generation()

    def _join_first_generation(self) -> None:
        """Join the first generation this worker belongs to; a replacement says it is ready first, and a spare
        waits here until a generation gives it a logical rank."""
        if self.joining:
            self.comm.store.set(f"ready/{self.comm.wid}", str(time.time()))
        newer_than = self.first_gen - 1
        while True:  # a replacement whose generation broke before it formed waits for the next one
            layout = self.comm.await_layout(self.start_timeout_s, newer_than=newer_than)
            try:
                self.comm.join(layout, timeout_s=None if self.joining else self.start_timeout_s)
                break
            except CollectiveFailure:
                if not self.joining or self._recover is None:
                    raise
                newer_than = layout.gen
        self.status.logical_rank = self.comm.logical_rank  # a spare learns its rank here
        # Lightning's rank-zero prints follow the logical rank; the rank is an attribute set on the function at run
        # time, which its overloaded stub does not declare
        rank_zero_only.rank = self.comm.logical_rank  # type: ignore[attr-defined]
        self.events.emit("group_formed", gen=layout.gen, members=len(layout.members), joining=self.joining)

    def connect(self, model: pl.LightningModule) -> None:
        """Before Lightning's own checks: what the committed step cannot do with manual optimization, said in
        the runner's config keys."""
        super().connect(model)
        if model.automatic_optimization:
            return
        manual = (f"{type(model).__name__} steps its optimizer itself (automatic_optimization=False), and the "
                  "runner commits exactly that step")
        if self.accumulate > 1:
            raise ValueError(f"trainer.accumulate_grad_batches={self.accumulate} needs automatic optimization: "
                             f"{manual}; accumulate in its training_step or set trainer.accumulate_grad_batches=1.")
        if model.trainer.gradient_clip_val:
            raise ValueError(f"trainer.grad_clip={model.trainer.gradient_clip_val} needs automatic optimization: "
                             f"{manual}; set trainer.grad_clip=0 (and clip in its training_step with "
                             "self.clip_gradients if it needs to).")

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """ZeRO-1: a replacement restores after setup(), so its optimizer is already sharded when its shard comes;
        a replacement that joins after its set-up restores where it joins."""
        return self.zero_stage > 0 or self.join_after_setup

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.zero_stage:
            self._shard_optimizer()
        if self.comm.pp > 1:
            stage = self._module.model
            assert isinstance(stage, GPTStage)  # the worker cut the model into this rank's stage
            self._pipeline = OneFOneB(stage, GenerationGroup(self.comm, "pp", self.comm.pp_rank, self.comm.pp),
                                      self.pipeline_micro_batches)
        if self.comm.replica_size > 1:
            self._clip_by_full_norm()
        self.validation.check(trainer, self._module)
        for opt in self.optimizers:
            self.update.gate(opt)
        if not self.joining:  # replicas start identical whatever the module's init did (as DDP does)
            for p in self._module.state_dict().values():
                if isinstance(p, Tensor):
                    self.comm.broadcast_replicas(p.data)
            if self.update.replication is not None:  # a replica of the initial shard too: nothing is unprotected
                self.update.replication.start(trainer.global_step)
        # every process (a replacement too) builds the user's dataloader from the same RNG state
        torch.manual_seed(derive_seed(self.seed, 0xDA7A))

    def _clip_by_full_norm(self) -> None:
        """Lightning's gradient clipping by the norm of the full model (``_agree_on_step``), not of this rank's TP
        slice (the plugin is whichever one Lightning chose for the precision: this one method is replaced on it)."""
        plugin = self.precision_plugin

        def clip(optimizer: Any, clip_val: float) -> None:
            clip_grads_(plugin.main_params(optimizer), clip_val, self.update.full_grad_norm)

        plugin.clip_grad_by_norm = clip  # type: ignore[method-assign]

    def _agree_on_step(self) -> None:
        """tp*pp > 1, after the step's reduction: one all-reduce over the world group, which fails on every rank
        unless every DP group's reduction completed. It carries the squares of the sharded gradients, so the
        full model's gradient norm comes with it: every rank sums each TP slice's squares once per live replica (NDB
        leaves replicas out). With pp > 1 each stage holds other parameters, so the replicated parameters' squares
        ride in it too, counted by TP slot 0 of each stage only, and the last stage's copy of the tied embedding is
        left out."""
        if self._pipeline is None:
            squares = grad_squares(self._module)
            sharded = squares[:1].to(self.root_device)
            self.comm.agree([sharded])
            self.update.full_grad_norm = (sharded.cpu()[0] / self.comm.live_replicas + squares[1]).sqrt()
            return
        stage = self._pipeline.stage
        copy = stage.tied_weight() if stage.is_last and not stage.is_first else None
        squares = grad_squares(self._module, skip=copy)
        if self.comm.tp_rank:
            squares[1] = 0.0
        summed = squares.to(self.root_device)
        self.comm.agree([summed])
        self.update.full_grad_norm = (summed.cpu().sum() / self.comm.live_replicas).sqrt()

    def _shard_optimizer(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(f"parallel.zero=1 supports a module with one optimizer; configure_optimizers() returned "
                             f"{len(self.optimizers)}: use one optimizer or parallel.zero=0")
        zero = ZeroOne(self._module, self.optimizers[0], self.comm.shard_size, master_weights=self.master_weights)
        zero.shard_for(self.comm.shard_rank)
        # Lightning clips the gradients of the optimizer's parameters (main_params); the norm must stay the whole
        # gradient's (every rank holds it after the full all-reduce), summed in the same order as unsharded.
        # The plugin is whichever one Lightning chose for the precision, so this one method is replaced on it.
        self.precision_plugin.main_params = lambda optimizer: iter(zero.unsharded)  # type: ignore[method-assign]
        self.update.zero = zero
        if self._shard_replication is not None:
            self.update.replication = self._shard_replication(zero)

    # -- per-step seeding and the committed, failure-aware reduction ----------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module
        step = module.trainer.global_step
        batch = args[0] if args else kwargs.get("batch")
        self._micros = batch if isinstance(batch, MicroBatches) else MicroBatches()
        seed_step(derive_seed(self.seed, step, self.data_rank, 1), self.root_device)
        self.commit.begin(self._micros[0] if self._micros else batch)
        if self.update.skip_pending:  # a replacement whose restored state already holds this step's update
            return self._finish_applied_step()
        if self.status.latest_gen > self.comm.gen and self._recover is not None and not self.joining:
            self.commit.regroup()
        if self.update.zero is not None and self.update.zero.stale:
            self.commit.sync_params()
        if self.validation.due(step):
            self.status.phase = "validate"
            self.commit.record_validation(self._validate())
            seed_step(derive_seed(self.seed, step, self.data_rank, 1), self.root_device)
        self.status.phase = "compute"
        if self._pipeline is not None:  # the schedule runs the step's forward and backward (``backward``)
            self._pipeline_batch = batch
            return torch.zeros((), device=self.root_device, requires_grad=True)
        if self._micros:  # the first micro-batch through Lightning's closure, the others in optimizer_step
            self._batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            out = self._module_step(self._micros[0], self._batch_idx)
            self.commit.record_loss(out, 0, len(self._micros))
            return _scaled(out, 1 / len(self._micros))
        out = self._module_step(*args, **kwargs)
        if module.automatic_optimization:
            self.commit.record_loss(out)
        elif module.trainer.global_step != step + 1:
            raise RuntimeError(f"{type(module).__name__}.training_step stepped its optimizer "
                               f"{module.trainer.global_step - step} times at step {step}; with manual optimization "
                               "the runner commits one optimizer.step() per training_step: call it exactly once.")
        return out

    def _module_step(self, *args: Any, first_micro: bool = True, **kwargs: Any) -> Any:
        """The module's training_step; what it logs with ``sync_dist=True`` rides in the step's reduction
        (``reduce``, ``runner.training.epoch_sums``)."""
        self.commit.clear_synced(first_micro)
        self._in_module_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_module_step = False

    def _finish_applied_step(self) -> Tensor:
        """The step whose update the restored state already holds (``TrainerState.adopt_restored``): no forward, no
        collective, the optimizer step through the gate (which skips the update) so that Lightning counts the step
        and steps the LR scheduler, as the member that handed the state over did after its recovery. With manual
        optimization the module's one ``optimizer.step()`` of the step is called here in its place."""
        module = self._module
        if not module.automatic_optimization:
            optimizers = module.optimizers()
            (optimizers[0] if isinstance(optimizers, list) else optimizers).step()
        return torch.zeros((), device=self.root_device, requires_grad=True)

    def _validate(self) -> EvalShare:
        """This rank's share of a validation: its DP coordinate's batches. With pp > 1 they run forward only through
        the replica's stages, and the last stage's loss sum is summed over the PP group in float64 (the other stages
        add 0, so every stage records that sum exactly, as the loss)."""
        module = self._module
        pipeline = self._pipeline
        if pipeline is None:
            return self.validation.run(module.trainer, module, self.data_rank, self.dp_size)
        share = self.validation.run(
            module.trainer, module, self.data_rank, self.dp_size,
            lambda batches: pipeline.forward_only((b["idx"], b["targets"]) for b in batches))
        summed = torch.tensor([share.loss_sum], dtype=torch.float64, device=self.root_device)
        pipeline.group.allreduce([summed])
        share.loss_sum = float(summed[0])
        return share

    def evaluate_after_fit(self, stage: str) -> Evaluated:
        """After the last step, with the final weights: this rank's share of a validation (``stage`` "validation") or
        of the test over the whole ``test_dataloader`` ("test"), then one all-reduce over the world of every DP
        coordinate's row (filled by its replica's TP rank and PP stage 0), resolved alike on every rank. No step's
        reduction remains to carry it, and the group still stands (``on_train_end``, before teardown)."""
        module = self._module
        if stage == "validation":
            share = self._validate()
        else:
            hook = loader_hook(module.trainer, module, "test")
            assert hook is not None  # checked at set-up
            share = evaluate(module.trainer, module, hook(), 0, self.data_rank, self.dp_size, "test", module.test_step)
        sums = torch.zeros(self.dp_size * ROW + 2, dtype=torch.float64)
        if self.comm.tp_rank == 0 and self.comm.pp_rank == 0:
            sums[self.data_rank * ROW: (self.data_rank + 1) * ROW] = torch.tensor(share.row(), dtype=torch.float64)
            sums[-2:] = torch.tensor([share.loss_sum, float(share.batches)], dtype=torch.float64)
        reduced = sums.to(self.root_device)
        self.comm.allreduce([reduced])
        sums = reduced.cpu()
        return share.resolve(sums[:-2].view(self.dp_size, ROW), float(sums[-2]), int(sums[-1]))

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.update.skip_pending:  # the step's update is already in the restored state: nothing to compute
            return closure_loss
        if self._pipeline is not None:
            return self._pipeline_backward(closure_loss)
        if not self._module.automatic_optimization:  # manual_backward: the step's loss, before it is committed
            self.commit.record_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _pipeline_backward(self, closure_loss: Tensor) -> Tensor:
        """pp > 1: the step's 1F1B schedule in place of Lightning's backward (its hooks run around it). The loss
        is the last stage's, summed over the pipeline so that every stage records it."""
        module, pipeline = self._module, self._pipeline
        assert pipeline is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        batch = self._pipeline_batch
        loss = pipeline.step(batch["idx"].to(self.root_device), batch["targets"].to(self.root_device))
        total = torch.zeros(1, device=self.root_device) if loss is None else loss.detach().reshape(1).float()
        pipeline.group.allreduce([total])
        self.commit.record_loss(total[0])
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def local_gradients(arm: bool) -> Any:
            """This rank's gradients of the step; armed, the reducer launches buckets during the last backward."""
            if arm and self.accumulate == 1 and self._pipeline is None:  # a schedule's backward is not the last
                self.commit.arm()
            loss = closure()  # training_step (the first micro-batch when accumulating), zero_grad, backward
            last = len(self._micros) - 1
            for micro in range(1, last + 1):
                if arm and micro == last:
                    self.commit.arm()
                self._accumulate_micro(micro, optimizer)
            return loss

        loss: Any = None

        def recompute() -> None:
            nonlocal loss
            loss = local_gradients(arm=False)

        def reduced_closure() -> Any:
            nonlocal loss
            if self.update.skip_pending:  # Lightning's closure runs, without compute; the gate skips the update
                return closure()
            failed = None
            try:
                loss = local_gradients(arm=True)
            except CollectiveFailure as err:  # a tensor-parallel collective of the forward or backward
                failed = err
            if self.commit.commit(recompute, self._source, failed=failed):
                self.joining = False
            return loss

        return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    def _accumulate_micro(self, micro: int, optimizer: Any) -> None:
        """Forward and backward of the step's micro-batch ``micro`` (> 0), seeded by (step, micro)."""
        step = self._module.trainer.global_step
        seed_step(derive_seed(self.seed, step, self.data_rank, 1, micro), self.root_device)
        out = self._module_step(self._micros[micro], self._batch_idx, first_micro=False)
        self.commit.record_loss(out, micro, len(self._micros))
        loss = _scaled(out, 1 / len(self._micros))
        self.backward(loss["loss"] if isinstance(loss, dict) else loss, optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if checkpoint_path == PEER_CKPT:
            assert self._recover is not None
            if self.join_after_setup:
                self._join_first_generation()
            ckpt = self._recover(self.state, "join")
            self.state.adopt_restored(ckpt)
            return ckpt  # type: ignore[return-value]
        if checkpoint_path == SNAPSHOT_CKPT:
            assert self._restore_snapshot is not None
            ckpt = self._restore_snapshot(self.state)
            self.state.adopt_guard_history(ckpt)
            if self.update.zero is not None:  # a snapshot's other shards may be one update old: all ranks sync
                self.update.zero.stale = True
            return ckpt
        ckpt = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # runner.resume, a user's file
        if self.comm.replica_size > 1:  # the file holds the full model: this rank's slice of it
            ckpt["state_dict"] = slice_model_state(ckpt["state_dict"], self._module)
        self.state.adopt_guard_history(ckpt)
        if self.logical_rank == 0:
            self.events.emit("resumed", path=str(checkpoint_path), at_step=int(ckpt.get("global_step", 0)))
        return ckpt

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A checkpoint file's unsharded optimizer state cut to the state of this rank's tensor-parallel slice (of
        its pipeline stage) of the parameters, then to its ZeRO-1 shard (either cut alone when the run has only one
        of the two)."""
        zero = self.update.zero
        if checkpoint.get(RUNNER_KEY, {}).get("optimizer") == "unsharded":
            full = checkpoint["optimizer_states"]
            orders = [zero.unsharded] if zero is not None else [optimizer_params(opt) for opt in self.optimizers]
            if self.comm.replica_size > 1:
                full = [slice_optimizer_state(state, self._module, order) for state, order in zip(full, orders)]
            if zero is not None:
                full = [shard_of_full_state(zero, zero.rank, full[0])]
            checkpoint = {**checkpoint, "optimizer_states": full}
        super().load_optimizer_state_dict(checkpoint)

    # -- data: every loader follows the (seed, step, logical rank) contract ---------------------
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader as a ``StepLoader``: a user's DataLoader over a map-style dataset becomes one in epochs
        of ``steps_per_epoch`` steps (``IndexedDatasetSource``), its sampler's order followed (``shuffle_seed``)."""
        if isinstance(dataloader, StepLoader):
            self._source = dataloader.source
            self.steps_per_epoch = dataloader.steps_per_epoch
            if self.accumulate > 1 and not hasattr(dataloader.source, "micro_batches"):
                raise TypeError(f"trainer.accumulate_grad_batches={self.accumulate}: the StepLoader's source "
                                f"{type(dataloader.source).__name__} has no micro_batches(step, rank, k); add one "
                                "(the step's batch in k slices) or set trainer.accumulate_grad_batches=1.")
            dataloader.accumulate = self.accumulate
            if self.validation.fraction and self.validation.enabled:
                if self.steps_per_epoch is None:
                    raise ValueError(f"trainer.val_check_interval={self.validation.interval} is a fraction of an "
                                     "epoch, and the training dataloader is an endless StepLoader: give an int number "
                                     "of steps, or give the StepLoader steps_per_epoch.")
                self.validation.set_epoch_steps(self.steps_per_epoch)
            self._end_after_epochs(self._module.trainer)
            return dataloader
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                "The training dataloader is not map-style (no dataset with __len__/__getitem__), so the runner "
                "cannot give each (step, logical rank) a fixed batch; return a DataLoader over a map-style dataset "
                "or a runner.data.StepLoader from train_dataloader()."
            )
        trainer = self._module.trainer
        collate = getattr(dataloader, "collate_fn", None) or torch.utils.data.default_collate
        source = IndexedDatasetSource(dataset, self.micro_batch, self.dp_size, collate,
                                      shuffle_seed(dataloader, self.seed))
        self.validation.set_epoch_steps(source.steps_per_epoch)
        self._source = source
        loader = StepLoader(source, lambda: trainer.global_step, lambda: self.data_rank, source.steps_per_epoch,
                            getattr(dataloader, "sampler", None))
        loader.accumulate = self.accumulate
        self.steps_per_epoch = source.steps_per_epoch
        self._end_after_epochs(trainer)
        return loader

    def _end_after_epochs(self, trainer: Any) -> None:
        """``trainer.max_epochs``: Lightning's step limit becomes the step the last epoch ends at when that comes
        first, so that ``trainer.max_steps`` is the run's last step for every callback (the final checkpoint, the
        metrics) and the final record the controller reads, as Lightning's own epoch limit ends the fit there."""
        epochs = self.options.max_epochs
        if epochs is None:
            return
        if self.steps_per_epoch is None:
            raise TypeError("trainer.max_epochs needs a finite training set, but train_dataloader() returned an "
                            "endless runner.data.StepLoader (no steps_per_epoch); give it steps_per_epoch, return a "
                            "DataLoader over a map-style dataset, or set trainer.max_epochs=null and end the run "
                            "with trainer.max_steps.")
        loop = trainer.fit_loop.epoch_loop
        if loop.max_steps < epochs * self.steps_per_epoch and self.logical_rank == 0 and not self.joining:
            print(f"[runner] warning: trainer.max_steps={loop.max_steps} ends the run before trainer.max_epochs="
                  f"{epochs} ({epochs} x {self.steps_per_epoch} steps): raise trainer.max_steps to train every epoch",
                  file=sys.stderr, flush=True)
        loop.max_steps = min(loop.max_steps, epochs * self.steps_per_epoch)

    # -- Lightning's own collectives (logging, barriers) ---------------------------------------
    def on_train_start(self) -> None:
        self._training = True
        super().on_train_start()

    def barrier(self, name: Optional[str] = None) -> None:
        """Lightning's barriers of set-up. Once training runs the committed steps keep the members in step, and a
        barrier outside a step (``Trainer.save_checkpoint``'s after a ModelCheckpoint's save) is none: a collective
        no step's recovery would complete."""
        if not self.joining and not self._training:
            self.comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.joining:
            return obj
        dev = self.root_device
        data = to_bytes(obj, dev)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        self.comm.allreduce([size], op=torch.distributed.ReduceOp.MAX)
        padded = torch.zeros(int(size[0]), dtype=torch.uint8, device=dev)
        if self.comm.rank == src:
            padded[: data.numel()] = data
        self.comm.broadcast(padded, src)
        return from_bytes(padded)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``sync_dist``. Inside the module's training_step the value rides in the step's reduction
        (``StepCommit.defer_sync``): no collective there, whatever recovery the step goes through."""
        if isinstance(tensor, Tensor) and self._in_module_step:
            return self.commit.defer_sync(tensor, reduce_op)
        if not isinstance(tensor, Tensor) or self.joining:
            return tensor
        out = tensor.detach().clone().float()
        self.comm.allreduce([out])
        if reduce_op in ("mean", "avg") or str(reduce_op).lower().endswith("mean"):
            out /= self.comm.size
        return out

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self.joining:
            return tensor.unsqueeze(0)
        return torch.stack(self.comm.allgather(tensor.detach().contiguous()))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A callback's decision (EarlyStopping's stop, ModelCheckpoint's save), taken by each rank from its own values
        with no collective: one outside a step cannot be recovered. A stop is agreed through the next step's
        reduction instead (``request_stop``); a save is the same on every rank when the monitored value is (logged
        with ``sync_dist=True``, or validation's), and only process-group rank 0 writes (``save_checkpoint``)."""
        return decision

    def request_stop(self) -> None:
        """``trainer.should_stop`` set by a callback or the module: the request rides in the next step's reduction,
        and every member stops at that committed step (``runner.training.agreed_stop``)."""
        self.commit.request_stop()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """``Trainer.save_checkpoint`` (a ModelCheckpoint's file): written by the member at process-group rank 0, the
        one that writes last.ckpt, even while a neighbour covers logical rank 0."""
        if self.comm.rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.comm.rank == 0:
            self.checkpoint_io.remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        zero = self.update.zero
        if zero is not None and zero.stale and not self._failed:
            self.commit.sync_params()  # the last update's shards, before the group goes
        if self.update.replication is not None:
            self.update.replication.close()
        if self.comm.replica_size > 1 and not self._failed:  # the slices gathered while the groups still stand
            self.full_checksum = state_checksum(gather_model(self._module, self.comm))
        super().teardown()
        self.comm.abort()


def _scaled(out: Any, factor: float) -> Any:
    """A training_step's output with its loss times ``factor`` (a micro-batch's share of the step's mean)."""
    if isinstance(out, dict):
        return {**out, "loss": out["loss"] * factor}
    return out * factor
