"""The runner's Lightning Strategy: it owns the process group and the gradient all-reduce.

Why not DDP: DDP's reducer lives in hooks on a process group fixed at construction. Here the
reduction (``runner.reducer``: buckets launched from the step's own backward) is waited for and
committed inside ``optimizer_step``, where a failed collective surfaces, so that it can be
abandoned, the group rebuilt for the next generation, state handed to newcomers, and the very
same step retried. ``optimizer_step`` returns only once the step is committed, so
Lightning's ``global_step``, schedulers and loop counters count each committed step exactly once.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from runner.comm import CollectiveFailure, Comm, RunFailedError
from runner.data import IndexedDatasetSource, StepLoader, derive_seed, seed_step
from runner.environment import RunnerEnvironment
from runner.events import EventLog
from runner.recovery.deadpool.replicator import ShardReplicator
from runner.recovery.deadpool.shard_state import ShardState
from runner.reducer import GradReducer
from runner.status import WorkerStatus
from runner.topology import Topology
from runner.zero import ZeroOne

PEER_CKPT = "peer://replica"  # ckpt_path a replacement passes to fit(): state comes from a live replica
SNAPSHOT_CKPT = "flash://snapshot"  # ckpt_path of a restarted rank: the newest flash snapshot every rank holds
SDC_HISTORY = "resilient_sdc_norms"  # the corruption guard's history, in state handed to a replacement or laggard


class ResilientStrategy(ParallelStrategy):
    strategy_name = "resilient"

    def __init__(
        self,
        comm: Comm,
        *,
        seed: int,
        micro_batch: int,
        bucket_mb: float,
        events: EventLog,
        status: WorkerStatus,
        recover: Callable[[ResilientStrategy, str], None] | None = None,
        restore_snapshot: Callable[[ResilientStrategy], dict] | None = None,
        on_commit: Callable[[int, Tensor, float], None] | None = None,
        joining: bool = False,
        ndb=None,
        guard=None,
        first_gen: int = 0,
        start_timeout_s: float = 120.0,
        zero_stage: int = 0,
        replicate_shards: bool = False,
        topology: Optional[Topology] = None,
    ) -> None:
        super().__init__(
            accelerator=None,
            parallel_devices=[comm.device],
            cluster_environment=RunnerEnvironment(comm, status),
            checkpoint_io=None,
            precision_plugin=None,
        )
        self.comm = comm
        self.seed = seed
        self.micro_batch = micro_batch
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.events = events
        self.status = status
        self._recover_hook = recover
        self._restore_snapshot = restore_snapshot
        self._on_commit = on_commit
        self.joining = joining  # a replacement: Lightning's setup collectives stay local until it is in sync
        self.ndb = ndb  # NDBRuntime when ft has ndb: this process may compute failed ranks' micro-batches too
        self.guard = guard  # GradientGuard: silent-corruption check of every committed reduction
        self._source = None  # the step-indexed batch source, for taken-over micro-batches
        self._extra_done: dict[int, tuple[float, list[int]]] = {}  # this step: taken-over rank -> (loss, sample)
        self._own_grads: Optional[list] = None  # this step's own gradients, before any taken-over micro-batch
        self._t_batch = 0.0
        self.first_gen = first_gen  # the first generation this worker may belong to
        self.start_timeout_s = start_timeout_s
        self._skip_update = False
        self._reducer: Optional[GradReducer] = None  # built at the first step, once the module is set up
        self._batch_sample: Optional[Tensor] = None
        self._batch_loss: Optional[float] = None
        self.zero_stage = zero_stage
        self.replicate_shards = replicate_shards  # DeadPool: copy this rank's shard to a neighbour every step
        self.topology = topology  # who holds whose shard replica (ZeRO-1 replication)
        self.zero: Optional[ZeroOne] = None  # built in setup(), once the optimizer exists
        self.replicator: Optional[ShardReplicator] = None
        self._replication_failed_in: Optional[int] = None  # group generation of the last failed exchange
        self._inner_step: Optional[Callable[[], Any]] = None  # the optimizer's own step, under the gate
        self._failed = False

    # -- identity -------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.comm.device

    @property
    def logical_rank(self) -> int:
        return self.comm.logical_rank

    @property
    def dp_size(self) -> int:
        return self.comm.layout.dp

    @property
    def is_global_zero(self) -> bool:
        return self.comm.logical_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.dp_size, "rank": self.logical_rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- set-up: the group of the current generation --------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        self.status.phase = "rendezvous"
        if self.joining:
            self.comm.store.set(f"ready/{self.comm.wid}", str(time.time()))
        newer_than = self.first_gen - 1
        while True:  # a replacement whose generation broke before it formed waits for the next one
            layout = self.comm.await_layout(self.start_timeout_s, newer_than=newer_than)
            try:
                self.comm.join(layout, timeout_s=None if self.joining else self.start_timeout_s)
                break
            except CollectiveFailure:
                if not self.joining or self._recover_hook is None:
                    raise
                newer_than = layout.gen
        self.status.logical_rank = self.comm.logical_rank  # a spare learns its rank here
        rank_zero_only.rank = self.comm.logical_rank  # Lightning's rank-zero prints follow the logical rank
        self.events.emit("group_formed", gen=layout.gen, members=len(layout.members), joining=self.joining)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """ZeRO-1: a replacement restores after setup(), so its optimizer is already sharded when its shard comes."""
        return self.zero_stage > 0

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.zero_stage:
            self._shard_optimizer()
        for opt in self.optimizers:
            _gate_optimizer_step(opt, self)
        if not self.joining:  # replicas start identical whatever the module's init did (as DDP does)
            for p in self.lightning_module.state_dict().values():
                if isinstance(p, Tensor):
                    self.comm.broadcast(p.data, src=0)
            if self.replicator is not None:  # a replica of the initial shard too: nothing is ever unprotected
                self.replicator.start(self.comm, trainer.global_step)
        # every process (a replacement too) builds the user's dataloader from the same RNG state
        torch.manual_seed(derive_seed(self.seed, 0xDA7A))

    def _shard_optimizer(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(f"parallel.zero=1 supports a module with one optimizer; configure_optimizers() returned "
                             f"{len(self.optimizers)}: use one optimizer or parallel.zero=0")
        self.zero = ZeroOne(self.lightning_module, self.optimizers[0], self.dp_size)
        self.zero.shard_for(self.logical_rank)
        # Lightning clips the gradients of the optimizer's parameters (main_params); the norm must stay the whole
        # gradient's (every rank holds it after the full all-reduce), summed in the same order as unsharded.
        self.precision_plugin.main_params = lambda optimizer: self.zero.unsharded
        if self.replicate_shards:
            self.replicator = ShardReplicator(self.zero, self.topology, self.comm.collective_timeout.total_seconds())

    # -- per-step seeding and the committed, failure-aware reduction ----------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = self.lightning_module.trainer.global_step
        seed_step(derive_seed(self.seed, step, self.logical_rank, 1), self.root_device)
        batch = args[0] if args else kwargs.get("batch")
        self._batch_sample = batch.get("sample") if isinstance(batch, dict) else None
        self._extra_done = {}
        self._own_grads = None
        self._t_batch = time.perf_counter()
        if self.status.latest_gen > self.comm.gen and self._recover_hook is not None and not self.joining:
            self.status.phase = "recovering"
            self.reducer.disarm()  # the new layout may take over micro-batches: reduce after backward
            self._recover_hook(self, "planned")  # regroup at the step boundary, before any compute
        if self.zero is not None and self.zero.stale:
            self._sync_params()
        self.status.phase = "compute"
        out = super().training_step(*args, **kwargs)
        loss = out["loss"] if isinstance(out, dict) else out
        self._batch_loss = float(loss.detach()) if isinstance(loss, Tensor) else None
        return out

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def reduced_closure() -> Any:
            if not self.comm.layout.extra_of(self.comm.wid):  # NDB micro-batches join after backward
                self.reducer.arm()  # this step's own backward launches the buckets as they fill
            loss = closure()
            self._commit_step(closure)
            return loss

        return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    def _commit_step(self, closure: Callable[[], Any]) -> None:
        """All-reduce this step's gradients; on a failure recover and retry until committed; a
        reduction the corruption guard rejects is recomputed from the same batch and seed."""
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        t0 = time.perf_counter()
        while True:
            self._take_over(step)
            self.status.phase = "reduce"
            try:
                grads, extras = self.reducer.reduce()
                if self.guard is None or self._guard_accepts(grads, step):
                    break
                closure()  # recompute this rank's gradients (every rank reached the same verdict)
                self._extra_done, self._own_grads = {}, None
                continue
            except CollectiveFailure as err:
                self._recover_from(err)
                if self._skip_update:
                    return  # a lagging survivor received the committed state of this step
        self.joining = False
        takeovers = self.comm.layout.takeovers
        divisor = (lambda p: self.ndb.divisor(p, self.dp_size, takeovers)) if self.ndb and takeovers else None
        self.reducer.write_back(self.dp_size, divisor)
        if self.ndb is not None:
            self.ndb.record_step(time.perf_counter() - self._t_batch, taking_over=bool(self._extra_done))
        self.status.step = step + 1
        self.status.phase = "compute"
        if self._on_commit is not None:
            self._on_commit(step, extras, time.perf_counter() - t0)

    # -- ZeRO-1: each rank updates its own shard; everyone's parameters are synced at the next step --
    def apply_update(self, inner: Callable[[], Any]) -> None:
        """The optimizer update of a committed step (called by the gated ``optimizer.step``)."""
        if self.consume_skip():
            return
        if self.zero is None:
            inner()
            return
        gen = self.lightning_module.trainer.global_step + 1  # updates applied once this one is
        if self.replicator is not None:
            self._await_replication()
            self.replicator.record(self.logical_rank, gen)
        inner()
        self.zero.stale = True
        if self.replicator is not None:
            self.replicator.start(self.comm, gen)

    def _await_replication(self) -> None:
        """The previous exchange must be complete before the shard changes again. A failed one is logged
        only: the main group's next collective meets the same fault, and recovery starts there, at a
        point where every rank agrees on the step. A second failure in a row in the same group
        generation is no peer's fault (every collective between them succeeded): the run fails, as
        its shards would go on without a replica."""
        try:
            self.replicator.wait()
        except CollectiveFailure as err:
            self.events.emit("replication_failed", gen=self.comm.gen, error=str(err))
            if self._replication_failed_in == self.comm.gen:
                raise RunFailedError(
                    f"the replication of logical rank {self.logical_rank}'s ZeRO-1 optimizer shard to its neighbour "
                    f"failed twice in a row while every rank was alive ({err}); its replica would stay stale and a "
                    "node loss could not be recovered from it. This is not a peer failure: check the side group's "
                    "network (the same interface as the main group's) and the worker's events.jsonl, or run "
                    "without ft=deadpool's ZeRO-1 replication (parallel.zero=0) until it is fixed.") from None
            self._replication_failed_in = self.comm.gen
        else:
            self._replication_failed_in = None

    def _sync_params(self) -> None:
        while self.zero.stale:  # a recovery ends with a sync of its own, so it is not retried after one
            try:
                self.status.phase = "sync"
                self.zero.sync(self.comm)
            except CollectiveFailure as err:
                self._recover_from(err)

    def _recover_from(self, err: CollectiveFailure) -> None:
        """A collective of this step failed: regroup (the run's recovery), or end the worker without one."""
        self.status.phase = "recovering"
        self.events.emit("collective_failed", gen=self.comm.gen, error=str(err))
        if self._recover_hook is None:
            raise err
        self._recover_hook(self, str(err))

    def final_gradients(self) -> dict:
        """The gradients the last update used: kept in ``.grad`` until the next backward, which no rank can
        have started while a laggard still misses that update (it waits in the parameter sync)."""
        return {"grads": [p.grad for p in self.zero.params],
                **({SDC_HISTORY: list(self.guard.norms)} if self.guard is not None else {})}

    def finish_update(self, final: dict) -> None:
        """A laggard applies the update it missed, with the final gradients every other rank used."""
        self._adopt_guard_history(final)
        for p, g in zip(self.zero.params, final["grads"]):
            p.grad = g
        gen = self.lightning_module.trainer.global_step + 1
        if self.replicator is not None:
            self.replicator.record(self.logical_rank, gen)
        self._inner_step()
        self.zero.stale = True
        self._skip_update = True

    def adopt_shard_state(self, ckpt: dict, shard: ShardState) -> None:
        """A joiner's Lightning state from the source, with its own shard's optimizer state in it (the
        source's is the source's shard; the parameters are everyone's, synced before the source dumped them)."""
        mine = self.optimizers[0].state_dict()["param_groups"]
        source = ckpt["optimizer_states"][0]["param_groups"]
        ckpt["optimizer_states"] = [{"state": shard.state,
                                     "param_groups": [{**s, "params": m["params"]} for s, m in zip(source, mine)]}]

    def _guard_accepts(self, flats: list[Tensor], step: int) -> bool:
        accepted, norm, median = self.guard.verdict(flats)
        if not accepted and self.logical_rank == 0:
            self.events.emit("sdc_detected", gen=self.comm.gen, grad_norm=norm, recent_median=median,
                             action="recompute_step", reason="reduced gradient norm non-finite or above "
                             "trainer.sdc_factor x the recent median: recompute the step [policy.silent_corruption]")
        return accepted

    def _take_over(self, step: int) -> None:
        """NDB: add the micro-batches of the failed ranks this process covers in the current generation.

        If a regroup mid-step took a rank away again (it rejoined), its contribution is removed by
        going back to this process's own gradients, kept aside before the first extra micro-batch.
        """
        wanted = self.comm.layout.extra_of(self.comm.wid)
        if set(self._extra_done) - set(wanted):
            for p, g in zip(self._grad_params(), self._own_grads):
                p.grad = None if g is None else g.clone()
            self._extra_done = {}
        for lrank in wanted:
            if lrank not in self._extra_done:
                if self._own_grads is None:
                    self._own_grads = [None if p.grad is None else p.grad.clone() for p in self._grad_params()]
                self.status.phase = "takeover"
                self._extra_done[lrank] = self.ndb.backward(self._source, step, lrank, self.root_device)

    def _grad_params(self) -> list[Tensor]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @property
    def reducer(self) -> GradReducer:
        if self._reducer is None:
            self._reducer = GradReducer(self.comm, self.lightning_module, self.bucket_bytes, self.dp_size + 2,
                                        self._accounting)
        return self._reducer

    def _accounting(self) -> Tensor:
        """One count per logical rank whose micro-batch went in, the loss sum, misplaced batches."""
        step = self.lightning_module.trainer.global_step
        extras = torch.zeros(self.dp_size + 2, dtype=torch.float64)
        sample_step, sample_rank = (step, self.logical_rank)
        if self._batch_sample is not None:
            sample_step, sample_rank = (int(v) for v in self._batch_sample.tolist())
        extras[sample_rank] += 1
        extras[-2] = self._batch_loss if self._batch_loss is not None else float("nan")
        extras[-1] = float(sample_step != step)
        for loss, (extra_step, extra_rank) in self._extra_done.values():
            extras[extra_rank] += 1
            extras[-2] += loss
            extras[-1] += float(extra_step != step)
        return extras

    # -- state transfer between replicas --------------------------------------------------------
    def dump_state(self) -> dict:
        """This replica's full Lightning checkpoint, with the corruption guard's history (its verdicts must
        stay the same on every rank, a replacement's too)."""
        ckpt = self.lightning_module.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if self.guard is not None:
            ckpt[SDC_HISTORY] = list(self.guard.norms)
        return ckpt

    def _adopt_guard_history(self, state: Optional[dict]) -> None:
        if self.guard is not None and state and SDC_HISTORY in state:
            self.guard.adopt(state[SDC_HISTORY])

    def exchange(self, obj: Any, src_pg_rank: int, *, receive: bool) -> Any:
        """Broadcast ``obj`` (given on the source only) over the current group; receivers get a copy."""
        dev = self.root_device
        size = torch.zeros(1, dtype=torch.int64, device=dev)
        payload = None
        if self.comm.rank == src_pg_rank:
            payload = _to_bytes(obj).to(dev)
            size[0] = payload.numel()
        self.comm.broadcast(size, src_pg_rank)
        if payload is None:
            payload = torch.empty(int(size[0]), dtype=torch.uint8, device=dev)
        self.comm.broadcast(payload, src_pg_rank)
        if not receive:
            return None
        return _from_bytes(payload, map_location=dev)

    def adopt_committed_state(self, ckpt: dict) -> None:
        """A lagging survivor takes the replica's post-step model and optimizer state, skips its own update."""
        self.lightning_module.load_state_dict(ckpt["state_dict"])
        for opt, state in zip(self.optimizers, ckpt["optimizer_states"]):
            opt.load_state_dict(state)
        self._adopt_guard_history(ckpt)
        self._skip_update = True

    def committed_steps(self) -> int:
        """Steps whose update this replica holds: a laggard that already adopted or finished the newest one
        counts it, so a recovery that is retried never applies it twice."""
        return self.lightning_module.trainer.global_step + int(self._skip_update)

    def consume_skip(self) -> bool:
        skip, self._skip_update = self._skip_update, False
        return skip

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if checkpoint_path == PEER_CKPT:
            assert self._recover_hook is not None
            ckpt = self._recover_hook(self, "join")
            self._adopt_guard_history(ckpt)
            return ckpt  # type: ignore[return-value]
        if checkpoint_path == SNAPSHOT_CKPT:
            assert self._restore_snapshot is not None
            ckpt = self._restore_snapshot(self)
            if self.zero is not None:  # a snapshot's other shards may be one update old: every rank restored, all sync
                self.zero.stale = True
            return ckpt
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    # -- data: every loader follows the (seed, step, logical rank) contract ---------------------
    def process_dataloader(self, dataloader: object) -> object:
        if isinstance(dataloader, StepLoader):
            self._source = dataloader.source
            return dataloader
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                "The training dataloader is not map-style (no dataset with __len__/__getitem__), so the runner "
                "cannot give each (step, logical rank) a fixed batch; return a DataLoader over a map-style dataset "
                "or a runner.data.StepLoader from train_dataloader()."
            )
        trainer = self.lightning_module.trainer
        collate = getattr(dataloader, "collate_fn", None) or torch.utils.data.default_collate
        source = IndexedDatasetSource(dataset, self.micro_batch, self.dp_size, collate)
        self._source = source
        return StepLoader(source, lambda: trainer.global_step, lambda: self.logical_rank)

    # -- Lightning's own collectives (logging, barriers) ---------------------------------------
    def barrier(self, name: Optional[str] = None) -> None:
        if not self.joining:
            self.comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.joining:
            return obj
        dev = self.root_device
        data = _to_bytes(obj).to(dev)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        self.comm.allreduce([size], op=torch.distributed.ReduceOp.MAX)
        padded = torch.zeros(int(size[0]), dtype=torch.uint8, device=dev)
        if self.comm.rank == src:
            padded[: data.numel()] = data
        self.comm.broadcast(padded, src)
        return _from_bytes(padded)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
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
        if self.joining:
            return decision
        t = torch.tensor([int(decision)], dtype=torch.float32, device=self.root_device)
        self.comm.allreduce([t])
        return bool(t.item() == self.comm.size) if all else bool(t.item() > 0)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.zero is not None and self.zero.stale and not self._failed:
            self._sync_params()  # the last update's shards, before the group goes
        if self.replicator is not None:
            self.replicator.close()
        super().teardown()
        self.comm.abort()


def _to_bytes(obj: Any) -> Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _from_bytes(data: Tensor, map_location: Any = "cpu") -> Any:
    """Bytes from a replica of this job: tensors and plain containers only (weights_only)."""
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True, map_location=map_location)


def _gate_optimizer_step(optimizer: torch.optim.Optimizer, strategy: ResilientStrategy) -> None:
    """Route ``optimizer.step`` through the strategy: it skips the update when the step's committed state was
    adopted instead, and under ZeRO-1 surrounds it with the shard's replication."""
    inner = optimizer.step
    strategy._inner_step = inner

    def step(closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        strategy.apply_update(inner)
        return loss

    # The gate calls the scheduler-wrapped step, so torch's "step before scheduler" bookkeeping holds.
    step._wrapped_by_lr_sched = getattr(inner, "_wrapped_by_lr_sched", True)  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]
