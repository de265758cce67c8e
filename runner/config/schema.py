"""Structured schema for every config group, registered in Hydra's ConfigStore.

Hydra rejects unknown keys and wrong types against these dataclasses before any process starts;
cross-field rules (layouts, ranges) live in ``runner.config.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ParallelConfig:
    """Process layout: nodes x procs_per_node ranks, plus spares on their own nodes."""

    nodes: int = 1
    procs_per_node: int = 2
    tp: int = 1  # tensor-parallel degree (planning only; training supports tp=1)
    pp: int = 1  # pipeline-parallel degree (planning only; training supports pp=1)
    dp_group_size: int = 0  # size of a data-parallel replica group; 0 = the whole DP world
    spares: int = 0  # hot spare processes (DeadPool)
    zero: int = 0  # ZeRO stage: 0 = replicated optimizer, 1 = sharded optimizer state
    backend: str = "auto"  # auto | gloo | nccl


@dataclass
class HeartbeatConfig:
    """Detection knobs: worker heartbeats, hang (stall) detection and the decision window."""

    interval_s: float = 0.1
    misses: int = 10
    stall_timeout_s: float = 10.0
    decide_window_s: float = 0.05


@dataclass
class FaultConfig:
    """Which fault to inject, where and when (``recipes/fault/*.yaml``)."""

    kind: str = "none"
    rank: int = 0  # victim logical rank (rank faults)
    node: int = 0  # victim node (node faults)
    step: int = -1  # inject at the start of this step; -1 = use after_s
    during: str = "step"  # step: at the start of `step`; recovery: when the victim enters its next recovery;
    #   replication: while the victim's ZeRO-1 shard copy after `step`'s update is in flight (DeadPool);
    #   after_reduce (transient): the victim's link fails just after `step`'s reduction completed everywhere
    after_s: float = -1.0  # or after this many seconds of training
    delay_s: float = 0.0  # slow_rank: delay per step; slow_link: delay per collective
    duration_s: float = -1.0  # partition: how long the rank's connections stay cut; -1 = for good
    extra: list[dict[str, Any]] = field(default_factory=list)  # further faults: same keys
    # chaos: faults of random kinds and victims, drawn and injected by the controller
    kinds: list[str] = field(default_factory=lambda: ["transient", "kill_rank", "hang_rank", "kill_node", "bitflip"])
    mtbf_s: float = 20.0  # mean time between faults (exponential inter-arrival times)
    max_faults: int = 10  # no more faults than this
    until_s: float = 600.0  # no fault after this many seconds of training


@dataclass
class PolicyConfig:
    """The ordered recovery actions per fault class (``runner/config/policy.py``); null = the seeds' row."""

    transient: Optional[list[str]] = None
    process_crash: Optional[list[str]] = None
    hang: Optional[list[str]] = None
    node_loss_spare_free: Optional[list[str]] = None
    node_loss_no_spare: Optional[list[str]] = None
    replica_lost: Optional[list[str]] = None
    silent_corruption: Optional[list[str]] = None
    reject_unhandled: bool = True  # refuse a config whose mix cannot handle a fault it is configured to face


@dataclass
class LoggerConfig:
    """Where metrics go besides the local files; one rank logs."""

    kind: str = "wandb"  # wandb | csv | none
    project: str = "resilient-runner"
    mode: str = "offline"  # wandb: offline | online | disabled
    group: Optional[str] = None  # W&B group; default: the sweep directory


@dataclass
class LauncherConfig:
    """How processes start and how long every wait may last."""

    kind: str = "auto"  # auto | local | torchrun | slurm
    start_timeout_s: float = 120.0  # a worker's first heartbeat must come within this
    collective_timeout_s: float = 30.0  # gloo/NCCL operation timeout
    rendezvous_timeout_s: float = 15.0  # forming a process group of a new generation
    recovery_timeout_s: float = 60.0  # waiting at the controller for the next generation
    run_timeout_s: float = 3600.0  # the whole run
    threads_per_rank: int = 0  # torch intra-op threads per worker; 0 = cores // ranks


@dataclass
class TrainerConfig:
    """Optimisation settings shared by every rank."""

    max_steps: int = 50
    global_batch_size: int = 8  # samples per optimizer step, split across DP ranks
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    precision: str = "32-true"
    bucket_mb: float = 25.0  # gradient all-reduce bucket size
    sdc_factor: float = 100.0  # reject a reduced gradient whose norm exceeds this x the recent median; 0 = off
    sdc_window: int = 20  # accepted steps the median is taken over
    log_every_n_steps: int = 1
    progress_bar: bool = True


@dataclass
class ModelConfig:
    """GPT shape, or a user's LightningModule through ``_target_``."""

    _target_: Optional[str] = None
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    ffn_mult: int = 4
    dropout: float = 0.0
    bias: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to a user's _target_


@dataclass
class DataConfig:
    """Step-indexed data source, or a user's LightningDataModule through ``_target_``."""

    _target_: Optional[str] = None
    kind: str = "synthetic"  # synthetic | memmap
    path: Optional[str] = None  # memmap: a nanoGPT-style uint16 .bin token file
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to a user's _target_


@dataclass
class RunnerConfig:
    """Run-level switches."""

    smoke: bool = False  # shrink the model (and the layout, see smoke_max_ranks) to train on CPU
    smoke_max_ranks: int = 4
    device: str = "auto"  # auto | cpu | cuda
    peak_flops_per_rank: float = 1.0e12  # for MFU; the recipes set the GPU's bf16 peak
    cpu_max_params: int = 400_000_000  # bigger models only print their plan on a GPU-less host
    console_events: bool = True


@dataclass
class RootConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ft: dict[str, Any] = field(default_factory=dict)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    recipe_name: str = "none"
    seed: int = 1234


def register_schema() -> None:
    """Store the schema as ``base_config``; ``conf/config.yaml`` lists it first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
