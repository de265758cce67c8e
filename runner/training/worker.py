"""One training process: builds the module, data and Trainer from the resolved config and fits.

Workers never run Hydra: the controller resolves the config once and hands it over as a plain
dict. Heavy imports happen at module import so that the launcher's fork server pays them once and
replacements start in a fraction of a second.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing.util
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.callbacks.evaluation import EvaluationHooks
from runner.callbacks.fault_injection import FaultTrigger
from runner.callbacks.heartbeat import Heartbeat
from runner.callbacks.lightning_checkpoint import LightningCheckpoint
from runner.callbacks.metrics import CommitMetrics, StepValues
from runner.callbacks.progress import StepProgressBar
from runner.config.schema import HeartbeatConfig
from runner.config.validate import all_faults, dp_size, ft_names, world_size
from runner.data import BatchSource, HeldOutSplit, MemmapTokens, SyntheticTokens
from runner.faults.comm_faults import FaultInjectingComm
from runner.lightning_module import GPTModule, StepDataModule
from runner.parallel.generation_group import GenerationGroup
from runner.parallel.pipeline import GPTStage
from runner.parallel.tensor import shard_gpt_for_tp
from runner.planning.plan import gpt_config
from runner.planning.topology import Topology
from runner.plumbing import protocol
from runner.plumbing.beat_socket import BEAT_SOCKET_ENV
from runner.plumbing.events import EventLog, JsonLines
from runner.recovery.common.hooks import WorkerContext
from runner.recovery.common.rejoin import ReplicaRecovery
from runner.recovery.registry import with_
from runner.recovery.worker_registry import combine, technique_workers
from runner.training import health, stack_dumps
from runner.training.agreed_stop import AgreedStopTrainer
from runner.training.checksum import param_checksum
from runner.training.comm import Comm, RunAborted, RunFailedError, WorkerReleased
from runner.training.status import WorkerStatus
from runner.training.strategy import PEER_CKPT, SNAPSHOT_CKPT, ResilientStrategy, StrategyOptions
from runner.training.user_callbacks import configured_callbacks
from runner.training.validation import warn_unscheduled

EXIT_ABORTED = 3  # the controller ended the run
EXIT_FAILED = 4  # recovery impossible


class Unhealthy(Exception):
    """This worker's host failed its health check (``runner.training.health``): it is not used."""


@dataclass
class WorkerSpec:
    run_dir: str
    wid: int
    node: int
    local_rank: int
    logical_rank: int
    role: str  # initial | joiner (state from a live replica) | spare (a joiner once given a rank) | restore (snapshots)
    first_gen: int
    host: str
    port: int
    namespace: str = ""  # key prefix inside a store shared with a launcher (torchrun's agent store)


def main(spec: WorkerSpec, cfg_dict: dict) -> None:
    """Process entry point (run by the fork server); exits with a code the controller understands."""
    # A session of its own, as torchrun gives each rank: where the kernel groups scheduling by
    # session (autogroup), a busy host then shares its CPUs per rank rather than per job. Ctrl-C
    # reaches only the controller, which ends the workers itself.
    os.setsid()
    quiet_console()
    code = run_reporting(spec, OmegaConf.create(cfg_dict))
    sys.stdout.flush()
    sys.stderr.flush()
    # release semaphores (tqdm's lock) as a normal exit would; typeshed leaves this private function out
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    os._exit(code)  # no waiting on logger threads: the controller already has the result


def quiet_console() -> None:
    """No start-up banners (GPU/TPU available, Lightning's logger tip, LOCAL_RANK) and no deprecation
    warnings from any worker: every rank and replacement would print them again. The console is the plan,
    rank 0's progress bar, the controller's recovery lines and the summary."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def run_reporting(spec: WorkerSpec, cfg: DictConfig) -> int:
    """Train; turn every way of failing into an exit code and, where useful, a report to the controller."""
    try:
        run(spec, cfg)
        return 0
    except WorkerReleased:  # its ranks train elsewhere now (a planned hand-over): a clean end
        return 0
    except RunAborted:
        return EXIT_ABORTED
    except Unhealthy:
        return health.EXIT_UNHEALTHY
    except RunFailedError as err:
        _report_fatal(spec, cfg, str(err))
        return EXIT_FAILED
    except BaseException as err:  # any other crash: the controller sees the exit code and the report
        traceback.print_exc()
        _report_fatal(spec, cfg, f"{type(err).__name__}: {err}")
        return 1


def run(spec: WorkerSpec, cfg: DictConfig) -> None:
    dp = dp_size(cfg)
    torch.set_num_threads(_threads(cfg, world_size(cfg)))
    topology = Topology.from_cfg(cfg)
    store = protocol.connect(spec.host, spec.port, cfg.launcher.start_timeout_s, spec.namespace)
    status = WorkerStatus(spec.wid, spec.node, spec.local_rank, spec.logical_rank, dp)
    run_dir = Path(spec.run_dir)
    if cfg.runner.deterministic:
        deterministic_kernels()
    device, backend = select_device(cfg, spec.logical_rank)
    injected = [f for f in all_faults(cfg) if f.kind != "none"]
    comm = (FaultInjectingComm if injected else Comm)(store, spec.wid, backend, device, cfg.launcher,
                                                      topology=topology)
    events = EventLog(run_dir / "events.jsonl", rank=lambda: comm.logical_rank if comm.layout else spec.logical_rank,
                      step=lambda: status.step)
    if spec.role != "initial" and cfg.health.enabled:  # a spare or a replacement proves its host first
        measured, failures = health.check(cfg.health, device, (spec.host, spec.port))
        if spec.role == "spare" and backend == "gloo":  # a replacement's generation is built once it is ready
            peers, unreachable = health.check_peers(cfg.health, store, cfg.launcher.start_timeout_s)
            measured, failures = {**measured, **peers}, [*failures, *unreachable]
        if failures:
            events.emit("health_check_failed", wid=spec.wid, node=spec.node, role=spec.role,
                        reason="; ".join(failures), measured=measured)
            raise Unhealthy("; ".join(failures))
    stack_dumps.arm(run_dir, spec.wid)  # where everyone was, should a rank hang (runner.control.diagnosis)
    heartbeat = Heartbeat(spec.host, spec.port, spec.namespace, status, cfg.heartbeat.interval_s,
                          HeartbeatConfig.of(cfg.heartbeat).controller_lost_after_s, events, comm=comm,
                          beat_socket=beat_socket(cfg))
    heartbeat.start()
    events.emit("worker_started", wid=spec.wid, node=spec.node, role=spec.role, pid=os.getpid())
    # Workers never decide a run's fate: even without fault tolerance a failed collective is reported
    # and the controller answers (here: ends the run naming the fault).
    faults = FaultTrigger(injected, comm, status, events, release_timeout_s=cfg.launcher.recovery_timeout_s,
                          initial=spec.role == "initial")
    recovery = ReplicaRecovery(comm, events, status, cfg.launcher.recovery_timeout_s, on_start=faults.on_recovery_start)
    # before the model: a technique's worker side may start work that overlaps building it
    techniques = technique_workers(cfg.ft, WorkerContext(cfg, topology, spec.run_dir, spec.node, spec.logical_rank,
                                                         spec.role, spec.first_gen, comm, events, status,
                                                         recovery))
    micro_batch = cfg.trainer.global_batch_size // dp
    options = strategy_options(cfg, spec.role, spec.first_gen, micro_batch, set_up_before_rank(cfg, topology),
                               topology.pp)
    joining = options.joining
    module, datamodule = build_module_and_data(cfg, micro_batch)
    if spec.role == "spare" and device.type == "cpu":
        warm_up(module, micro_batch)
    placement: list[pl.Callback] = []
    if spec.role != "spare":
        place_model(module, comm, topology, spec.logical_rank)
    elif topology.tp * topology.pp > 1:  # a spare's coordinate comes with the logical rank a generation gives it
        placement.append(SparePlacement(lambda: place_model(module, comm, topology, comm.logical_rank)))
    hooks = combine(techniques, module)
    comm.want_side_group = hooks.side_group
    if cfg.model._target_ and spec.logical_rank == 0 and not joining:
        warn_unscheduled(module, cfg.trainer.val_check_interval)
    metrics = CommitMetrics(JsonLines(run_dir / "metrics.jsonl"), events, comm,
                            tokens_per_sample=getattr(module, "tokens_per_sample", None), micro_batch=micro_batch,
                            tp=topology.tp * topology.pp)
    strategy = ResilientStrategy(comm, options, hooks, events=events, status=status, recover=recovery,
                                 on_commit=metrics.on_commit)
    checkpoint = LightningCheckpoint(run_dir, cfg.checkpoint.every_n_steps, cfg.seed, events)
    is_rank0 = spec.logical_rank == 0
    progress_bar = bool(cfg.trainer.progress_bar and is_rank0 and not joining)
    trainer = AgreedStopTrainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index] if device.type == "cuda" else 1,
        strategy=strategy,
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,  # None: Lightning's -1 (epochs without end; max_steps ends the run)
        precision=cfg.trainer.precision,
        gradient_clip_val=cfg.trainer.grad_clip or None,
        # the controller owns the job's experiment logger (runner/control/run_logger.py): Lightning's logger connector
        # gives every step's logged values to the committed step's record in metrics.jsonl, which it follows
        logger=StepValues(metrics),
        # the configured ones first, so that a technique's snapshot after a step holds their state of that step;
        # then the techniques' (flash checkpoints: draining the persister runs while the heartbeat still beats);
        # Lightning moves checkpoint callbacks to the end, in order: a ModelCheckpoint's, then last.ckpt's, which so
        # holds every callback's state of its step. The metrics before the faults: a step's start writes the
        # previous step's record before a fault injected there can end every process holding it
        callbacks=[*placement, *configured_callbacks(cfg, run_dir, show_summary=is_rank0 and not joining),
                   *hooks.callbacks, heartbeat, metrics, faults,
                   EvaluationHooks(strategy, metrics, cfg.runner.test_after_fit),
                   *([StepProgressBar(metrics)] if progress_bar else []), checkpoint],
        enable_checkpointing=True,  # LightningCheckpoint is one: Lightning adds no ModelCheckpoint of its own
        enable_progress_bar=progress_bar,
        enable_model_summary=False,  # the callbacks group's model_summary, on logical rank 0 (user_callbacks)
        num_sanity_val_steps=0,
        limit_val_batches=0,  # the strategy validates inside the committed-step protocol (runner.training.validation)
        # what Lightning's own callbacks read to act at on_validation_end rather than at an epoch's end (EarlyStopping,
        # ModelCheckpoint), as they do when validation is scheduled by steps; Lightning's loop never validates here
        check_val_every_n_epoch=None if cfg.trainer.val_check_interval else 1,
        val_check_interval=1 if cfg.trainer.val_check_interval else None,
        use_distributed_sampler=False,
        log_every_n_steps=1,  # every record is complete; the run logger keeps trainer.log_every_n_steps
        default_root_dir=str(run_dir),
    )
    # an initial rank of a resumed run starts from the checkpoint file (runner.resume, checked by the launcher), as
    # does a restarted one when no rank held a snapshot to restart from (the fault struck before the first)
    ckpt_path = {"joiner": PEER_CKPT, "spare": PEER_CKPT}.get(spec.role, cfg.runner.resume)
    if spec.role == "restore" and hooks.restore_snapshot is not None:
        ckpt_path = SNAPSHOT_CKPT
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    status.phase = "done"
    checksum = strategy.full_checksum if strategy.full_checksum is not None else param_checksum(module)
    final = {"global_step": trainer.global_step, "checksum": checksum,
             "max_steps": trainer.max_steps,  # the run's last step (trainer.max_epochs may end it before max_steps)
             "logical_rank": strategy.logical_rank, "t": time.time(), **hooks.final_record(),
             # its own rank and those it computed too (NDB) to the end: the controller waits for no one else for them
             "computed_ranks": [strategy.logical_rank, *comm.joined.extra_of(spec.wid)]}
    protocol.set_json(store, f"done/{spec.wid}", final)
    store.add("done_count", 1)  # one counter for the controller to watch instead of a key per worker
    events.emit("worker_done", wid=spec.wid, **{k: v for k, v in final.items() if k != "checksum"})
    heartbeat.stop()


def place_model(module: Any, comm: Comm, topology: Topology, logical_rank: int) -> None:
    """Cut the full model (built with the run's seed) to ``logical_rank``'s part of it: its TP slice (tp > 1), then
    its pipeline stage (pp > 1)."""
    if topology.tp > 1:
        tp_rank = topology.coords(logical_rank)[2]
        shard_gpt_for_tp(module.model, GenerationGroup(comm, "tp", tp_rank, topology.tp))
    if topology.pp > 1:
        module.model = GPTStage(module.model, topology.coords(logical_rank)[1], topology.pp)


class SparePlacement(pl.Callback):
    """A hot spare learns its logical rank, and with it its (pp, tp) coordinate, only once a generation gives
    it one (``ResilientStrategy.setup_environment``); it cuts its part of the full model then, in Lightning's
    setup hook, before the strategy configures the optimizer over the model's parameters."""

    def __init__(self, place: Callable[[], None]) -> None:
        self.place = place

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.place()


def strategy_options(cfg: DictConfig, role: str, first_gen: int, micro_batch: int, set_up_first: bool,
                     pp: int) -> StrategyOptions:
    """The strategy's settings from the config and this worker's role: the one place they are read.
    ``set_up_first``: a replacement of this layout may build its optimizer and Lightning's set-up before it knows
    its logical rank (``set_up_before_rank``)."""
    t = cfg.trainer
    return StrategyOptions(
        seed=cfg.seed, micro_batch=micro_batch, bucket_mb=t.bucket_mb, first_gen=first_gen,
        joining=role in ("joiner", "spare", "restore"),  # none holds the state yet: set-up collectives stay local
        join_after_setup=role in ("joiner", "spare") and set_up_first,
        start_timeout_s=cfg.launcher.run_timeout_s if role == "spare" else cfg.launcher.start_timeout_s,
        zero_stage=cfg.parallel.zero, master_weights=t.master_weights, accumulate=t.accumulate_grad_batches,
        pipeline_micro_batches=t.micro_batches or pp, replica_check_every_n_steps=t.replica_check_every_n_steps,
        val_check_interval=t.val_check_interval, limit_val_batches=t.limit_val_batches,
        sdc_factor=t.sdc_factor, sdc_window=t.sdc_window, max_epochs=t.max_epochs)


def set_up_before_rank(cfg: DictConfig, topology: Topology) -> bool:
    """Whether a replacement can build its optimizer and Lightning's set-up before it knows its logical rank, and so
    join (a spare: wait for a rank) after them: only where nothing built at set-up depends on the rank. Not with
    tp*pp > 1 (the rank's part of the model is cut before the optimizer is built over it), ZeRO-1 (its optimizer is
    sharded for the rank), flash checkpoints (their snapshots are named by the rank at set-up), nor with a user's
    LightningModule or DataModule (their ``setup`` hooks may read the rank)."""
    return (topology.tp * topology.pp == 1 and not cfg.parallel.zero
            and not with_(ft_names(cfg), "restarts_from_snapshots")
            and not cfg.model._target_ and not cfg.data._target_)


def warm_up(module: Any, micro_batch: int) -> None:
    """A spare waits for a rank warm: a forward, backward and AdamW step of a copy of the runner's GPT on a random
    batch pays the process's one-time costs of a first step before it takes a rank (a user's module: nothing,
    its batches are its own). The copy is dropped and the random generator restored: what the spare computes
    once it has a rank stays the same."""
    if not isinstance(module, GPTModule):
        return
    shape = module.model_cfg
    with torch.random.fork_rng(devices=[]):
        model = copy.deepcopy(module.model)
        idx = torch.randint(0, shape.vocab_size, (micro_batch, shape.seq_len))
        model.loss(idx, idx).backward()
        torch.optim.AdamW(model.parameters()).step()


def select_device(cfg: DictConfig, logical_rank: int) -> tuple[torch.device, str]:
    """runner.device and parallel.backend: a GPU per rank with NCCL where there are GPUs, else CPU and gloo."""
    want = cfg.runner.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("runner.device=cuda but this host has no usable GPU; use runner.device=auto or cpu")
    device = torch.device("cuda", logical_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = cfg.parallel.backend if cfg.parallel.backend != "auto" else ("nccl" if use_cuda else "gloo")
    return device, backend


def beat_socket(cfg: DictConfig) -> str | None:
    """The socket of this host's node agent that the heartbeats go to under ``heartbeat.route=agent`` (the agent
    that started this worker names it), else None: they go to the store."""
    if cfg.heartbeat.route != "agent":
        return None
    name = os.environ.get(BEAT_SOCKET_ENV)
    if name is None:
        raise RuntimeError(f"heartbeat.route=agent, but {BEAT_SOCKET_ENV} is not set: this worker was not started by "
                           "a node agent (launcher.mode=per_rank starts none); set heartbeat.route=store.")
    return name


def deterministic_kernels() -> None:
    """runner.deterministic: the same bits in every run and every replacement. cuBLAS reads its workspace setting
    when its first handle is made, so this runs before the device is chosen; ops with no deterministic kernel warn
    (they would fail the run otherwise), the rest take their ordered variant (attention's backward on GPUs)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def build_module_and_data(cfg: DictConfig, micro_batch: int):
    """Our GPT with a step-indexed source, or a user's LightningModule / DataModule via ``_target_``."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (and in every replacement)
    if cfg.model._target_:
        module = instantiate({"_target_": cfg.model._target_, **cfg.model.kwargs})
    else:
        t = cfg.trainer
        module = GPTModule(gpt_config(cfg), t.lr, t.min_lr, t.warmup_steps, t.max_steps, t.weight_decay, tuple(t.betas))
    if cfg.data._target_:
        return module, instantiate({"_target_": cfg.data._target_, **cfg.data.kwargs})
    if cfg.model._target_:
        return module, None  # the user's module brings its own train_dataloader()
    m = cfg.model
    source: BatchSource
    held_out = None
    if cfg.data.kind == "memmap":
        source = MemmapTokens(cfg.data.path, cfg.seed, m.seq_len, micro_batch, m.vocab_size)
        if cfg.trainer.val_check_interval:
            val = MemmapTokens(cfg.data.val_path, cfg.seed, m.seq_len, micro_batch, m.vocab_size)
            held_out = HeldOutSplit(val, cfg.trainer.limit_val_batches)
    else:
        source = SyntheticTokens(cfg.seed, m.vocab_size, m.seq_len, micro_batch)
        if cfg.trainer.val_check_interval:
            held_out = HeldOutSplit(source, cfg.trainer.limit_val_batches)
    return module, StepDataModule(source, held_out)


def _threads(cfg: DictConfig, ranks: int) -> int:
    if cfg.launcher.threads_per_rank > 0:
        return cfg.launcher.threads_per_rank
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def _report_fatal(spec: WorkerSpec, cfg: DictConfig, reason: str) -> None:
    try:
        store = protocol.connect(spec.host, spec.port, 5.0, spec.namespace)
        protocol.report(store, {"wid": spec.wid, "fatal": True, "reason": reason, "t": time.time()})
    except Exception:  # the controller is gone; the exit code still tells
        pass
