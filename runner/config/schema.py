"""The config schema: one dataclass per group, the single source of every key, its type, default and meaning.

Hydra rejects unknown keys and wrong types against these dataclasses while it composes the config;
the YAML under ``conf/`` and ``recipes/`` holds only what differs from the defaults here. A closed
set of values is written ``Annotated[str, Literal[...]]``: OmegaConf 2.3 refuses ``Literal`` but
reads the ``Annotated`` base type, and ``runner.config.validate`` checks the value against the
``Literal`` (``choices``). A numeric key's bounds are written the same way, ``Annotated[int, Range(ge=1)]``
(``value_range``), and checked with the closed sets. Cross-field rules (layouts) live in ``runner.config.validate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

from hydra.core.config_store import ConfigStore

from runner.recovery.registry import options_schemas

Backend = Annotated[str, Literal["auto", "gloo", "nccl"]]
ZeroStage = Annotated[int, Literal[0, 1]]
FaultKind = Annotated[str, Literal["none", "kill_rank", "kill_node", "hang_rank", "transient", "slow_rank", "bitflip",
                                   "param_bitflip", "slow_link", "partition", "kill_all", "wipe_shm",
                                   "corrupt_snapshot", "chaos"]]
ChaosKind = Annotated[str, Literal["transient", "kill_rank", "hang_rank", "kill_node", "bitflip", "partition",
                                   "kill_all"]]
FaultMoment = Annotated[str, Literal["step", "recovery", "replication", "after_reduce", "agreement", "reduction"]]
HangMode = Annotated[str, Literal["sigstop", "stall"]]
LoggerKind = Annotated[str, Literal["wandb", "csv", "none"]]
WandbMode = Annotated[str, Literal["offline", "online", "disabled"]]
LauncherKind = Annotated[str, Literal["auto", "local", "torchrun", "slurm"]]
LauncherMode = Annotated[str, Literal["auto", "per_host", "per_rank"]]
HeartbeatRoute = Annotated[str, Literal["store", "agent"]]
DataKind = Annotated[str, Literal["synthetic", "memmap"]]
Device = Annotated[str, Literal["auto", "cpu", "cuda"]]
PrecisionName = Annotated[str, Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "32",
                                       "bf16", "16", "64"]]


@dataclass(frozen=True)
class Range:
    """The bounds of a numeric key, written ``Annotated[float, Range(gt=0)]``: OmegaConf reads the base type, and
    ``runner.config.validate`` checks the value with the schema, before any rule that reads it."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    lt: Optional[float] = None

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        bounds = ((">=", self.ge), (">", self.gt), ("<", self.lt))
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
Positive = Annotated[float, Range(gt=0)]
NonNegative = Annotated[float, Range(ge=0)]
StepsOrFraction = Annotated[Any, Range(ge=0)]  # an int number of steps, or a float fraction of an epoch


def choices(hint: Any) -> Optional[tuple[Any, ...]]:
    """The values a closed-set type accepts (the ``Literal`` inside its ``Annotated``), or None for an open type."""
    if get_origin(hint) is Annotated:
        for meta in hint.__metadata__:
            if get_origin(meta) is Literal:
                return get_args(meta)
    return None


def value_range(hint: Any) -> Optional[Range]:
    """The bounds a numeric type states (the ``Range`` inside its ``Annotated``), or None."""
    if get_origin(hint) is Annotated:
        return next((meta for meta in hint.__metadata__ if isinstance(meta, Range)), None)
    return None


@dataclass
class ParallelConfig:
    """Process layout: nodes x procs_per_node ranks, plus hot spares on nodes of their own."""

    nodes: int = 1
    """(Simulated) nodes; each is one failure domain with its own agent."""
    procs_per_node: int = 2
    """Worker processes per node (GPUs per node on a cluster)."""
    tp: int = 1
    """Tensor-parallel degree: ranks per model replica, inside a node (docs/parallelism.md for what trains)."""
    pp: int = 1
    """Pipeline-parallel degree: stages of whole blocks per model replica (docs/parallelism.md for what trains)."""
    order: str = "tp-pp-dp"
    """Placement of the layout's dimensions over the ranks, innermost first: the default puts each TP group inside a
    node, then the pipeline stages, and the DP replicas outermost (docs/parallelism.md)."""
    dp_group_size: int = 0
    """Data-parallel replicas per replica group (HSDP); 0 = all of them form one group. With zero=1 the optimizer is
    sharded within a group and every group holds each shard, so FlashRecovery restores a restarted rank's shard from
    another group when this is below dp (docs/parallelism.md)."""
    spares: Optional[int] = None
    """Hot spares on nodes of their own, which only DeadPool uses (needs ft=deadpool); null = one spare node
    (procs_per_node spares) when ft has deadpool, else none."""
    zero: ZeroStage = 0
    """0 = replicated optimizer state, 1 = ZeRO-1 (optimizer state sharded over the DP ranks, or within each replica
    group of dp_group_size)."""
    backend: Backend = "auto"
    """Collective backend; auto = NCCL on GPUs, gloo on CPU."""


@dataclass
class PhaseTimeoutsConfig:
    """Per-phase hang timeouts calibrated from the run (``runner/control/phase_timeouts.py``, docs/recovery.md): a
    worker that stays in one step's compute or checkpoint longer than ``max(floor_s, k x p99)`` of that phase's dwells
    in this run is hung (before ``warmup_steps``: ``heartbeat.stall_timeout_s``); a generation whose every member sits
    in one step's reduction that long (p99 of the reduction's dwells; before: ``launcher.collective_timeout_s``) is
    stuck and cut off; a worker not beating within ``max(floor_s, k x the slowest start-up)`` of its role is hung
    (before one was seen: ``launcher.start_timeout_s``); a recovery's generation in which no member trains within
    ``max(floor_s, k x the slowest regroup)`` of the same action is stuck and cut off (before: the workers'
    ``launcher.rendezvous_timeout_s`` and ``recovery_timeout_s``). The timeouts in effect are logged
    (``phase_timeouts``)."""

    enabled: bool = True
    """Calibrate each phase's timeout from the run; false = every phase keeps its fixed bound (stall_timeout_s, the
    launcher's collective, start and recovery timeouts)."""
    k: Annotated[float, Range(ge=1)] = 4.0
    """The timeout is k x the phase's p99 dwell (start-up, recovery: k x the slowest seen), at least floor_s; >= 1."""
    floor_s: Positive = 2.0
    """Never less than this many seconds; at least 2 x heartbeat.interval_s (a dwell is seen through heartbeats)."""
    warmup_steps: PositiveInt = 20
    """A phase (compute, checkpoint, reduction) is calibrated once it was seen at this many distinct steps; before, its
    fixed bound applies. A start-up or recovery is calibrated by the first one of its role or action."""


@dataclass
class HeartbeatConfig:
    """Detection: worker heartbeats, hang (stall) detection and the decision window."""

    interval_s: float = 0.1
    """Seconds between heartbeats (workers and agents)."""
    misses: int = 10
    """Missed intervals before a worker is declared hung and killed, or a node silent."""
    stall_timeout_s: float = 10.0
    """Heartbeats arrive but the step does not advance in phase compute or checkpoint for this long: a hang (with
    phase_timeouts on, only before a phase is calibrated)."""
    phase_timeouts: PhaseTimeoutsConfig = field(default_factory=PhaseTimeoutsConfig)
    """Per-phase hang timeouts calibrated from the run."""
    decide_window_s: float = 0.05
    """After the first symptom, gather others this long before classifying the fault."""
    decide_at_once: bool = True
    """Decide a recovery as soon as its evidence is conclusive (an exit an agent saw, every other member beating);
    false = always wait decide_window_s, e.g. when the hosts' clocks may disagree by more than interval_s (the
    early decision compares workers' heartbeat times across hosts)."""
    route: HeartbeatRoute = "store"
    """Where a worker's heartbeat goes. store: every worker writes its own record in the job's store and reads the
    generation and a stop from it every interval (host 0's load grows with the ranks: docs/recovery.md, "What a
    heartbeat costs host 0"). agent: every worker beats to its own host's node agent over a local socket; the agent
    judges its ranks' silence, writes one record for the host only when a rank's step or phase changed, and learns a
    new generation, a stop or a fence from blocking waits. Needs node agents (not launcher.mode=per_rank)."""

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> HeartbeatConfig:
        """The typed settings from the composed group, a DictConfig or the plain dict a node agent reads, so that
        every process derives its deadlines from the properties below and from nowhere else."""
        def typed(f: Any) -> Any:
            nested = f.default_factory
            return nested(**dict(group[f.name])) if isinstance(nested, type) and is_dataclass(nested) else group[f.name]

        return cls(**{f.name: typed(f) for f in fields(cls) if f.name in group})

    @property
    def silence_s(self) -> float:
        """A worker whose heartbeat has not changed, or an agent whose beat is older, for this long is hung or
        silent: ``interval_s × misses`` (the controller's detection and its view of each host)."""
        return self.interval_s * self.misses

    @property
    def controller_lost_after_s(self) -> float:
        """How long a node agent or a worker that cannot reach the controller goes on before it stops its processes
        and exits non-zero (``runner.plumbing.contact``): four times the controller's own silence rule, at least
        5 s, so that the controller always decides first."""
        return max(5.0, 4 * self.silence_s)

    @property
    def agent_beat_s(self) -> float:
        """How often a node agent beats: once an interval, as a worker does. Host 0's store handles one message per
        beat, so this is its largest steady load under ``route=agent`` (docs/recovery.md); a host is found silent after
        ``silence_s``, ``misses`` beats, and the decide-at-once check accepts a beat up to two of these old."""
        return self.interval_s

    @property
    def controller_wait_s(self) -> float:
        """The longest the controller's loop waits for an exit before a round: an interval, at most 50 ms (an exit
        an agent reports is looked at within that)."""
        return min(self.interval_s, 0.05)


@dataclass
class StragglerConfig:
    """Straggler detection from the per-step timings the heartbeats carry (``runner/control/stragglers.py``).

    A rank is a straggler when its compute time per step exceeds ``factor`` x its peers' median for
    ``window_steps`` consecutive steps; a host when all its ranks are; a link is slow when a rank's own
    collective launches take that much longer than its peers' and no slower peer's compute explains its
    wait. What is done about it is the policy table's ``straggler`` row.
    """

    enabled: bool = True
    """Judge the timings; false = no straggler is ever reported."""
    factor: float = 1.2
    """How much slower than the median of its peers a rank's compute (or link) time must be; > 1."""
    window_steps: int = 20
    """For this many consecutive committed steps; >= 1."""
    min_excess_s: float = 0.05
    """And by at least this many seconds per step, so that the jitter of a short step is no straggler (on a shared CPU
    host a process starved for a while ran 2x its peers' 27 ms for 20 steps); >= 0."""
    quarantine_s: float = 600.0
    """A host released by ``policy.straggler=[swap_spare]`` holds no rank for this many seconds, then its slots get
    warm spares again (it rejoins the pool); >= 0."""


@dataclass
class HealthConfig:
    """The health check a spare, or a replacement started on a host, runs before it is used
    (``runner/training/health.py``): the device, free memory, the control-plane store and (a spare) the network path to
    its peers; a worker that fails it logs ``health_check_failed`` with the reason and exits 72, and is never given a
    rank."""

    enabled: bool = True
    """Check spares and replacements before they are used; false = use them unchecked."""
    matmul_size: PositiveInt = 256
    """The side of the square matmul timed on the worker's device (the CPU without GPUs)."""
    matmul_max_s: Positive = 0.5
    """The matmul must finish within this many seconds (a throttled or failing device does not)."""
    min_free_memory_gib: NonNegative = 0.25
    """Free host memory (and free memory on the worker's GPU) must be at least this many GiB."""
    connect_timeout_s: Positive = 2.0
    """A TCP connection to the control-plane store, the path every peer rendezvouses through, within this; and, for a
    spare on gloo, one to every peer it will train with: the listener each member of the newest generation published
    for its gloo group, the peer named by rank, host and address when it cannot be reached (a refusal is a host that
    answered; not for a replacement started during a recovery, whose generation is not built yet, nor on NCCL)."""


@dataclass
class FaultConfig:
    """Which fault to inject, where and when (``recipes/fault/*.yaml``)."""

    kind: FaultKind = "none"
    """The fault; chaos only as the main fault (docs/faults.md)."""
    rank: int = 0
    """Victim logical rank (rank faults, also kill_all, wipe_shm, corrupt_snapshot)."""
    node: int = 0
    """Victim node (kill_node)."""
    step: int = -1
    """Inject at the start of this step; -1 = use after_s (slow_rank: from this step on)."""
    during: FaultMoment = "step"
    """step: at the start of `step`; recovery: when the victim enters its next recovery (kill_rank, hang_rank);
    replication: while the victim's ZeRO-1 shard copy after `step`'s update is in flight (kill_rank, DeadPool);
    after_reduce: the victim's link fails just after `step`'s reduction completed everywhere (transient);
    reduction: the victim's part of `step`'s reduction never leaves it and it waits like its peers, so the collective
    is stuck on every member until the controller cuts the generation off or the collective timeout ends it
    (transient);
    agreement: once `step`'s agreement (tp*pp > 1) completed on the victim, it fails there alone (transient) or the
    victim is killed before it commits (kill_rank, kill_node)."""
    hang: HangMode = "sigstop"
    """hang_rank: sigstop = the controller stops the whole process (no heartbeats either); stall = the victim's
    training thread blocks inside its step while its heartbeat thread goes on beating (a deadlock in user code, a
    kernel that never returns: what the per-phase hang timeouts find); stall needs during=step."""
    after_s: float = -1.0
    """Or inject after this many seconds of the victim's training; -1 = use step."""
    delay_s: float = 0.0
    """slow_rank: sleep before every step; slow_link: delay before every collective."""
    duration_s: float = -1.0
    """partition (also one drawn by chaos): how long the rank's connections stay cut; -1 = for good."""
    extra: list[dict[str, Any]] = field(default_factory=list)
    """Further faults, each with the keys above."""
    kinds: list[ChaosKind] = field(default_factory=lambda: ["transient", "kill_rank", "hang_rank", "kill_node",
                                                            "bitflip"])
    """chaos: the kinds drawn from."""
    mtbf_s: float = 20.0
    """chaos: mean of the exponential gap after each fault settles, seconds."""
    max_faults: int = 10
    """chaos: at most this many faults."""
    until_s: float = 600.0
    """chaos: no fault later than this many seconds after training began."""


@dataclass
class PolicyConfig:
    """For each fault class, the recovery actions to try, in order (``runner/config/policy.py``).

    A row left null follows the seeds, restricted to the techniques in ``ft``: transient [retry,
    restart_all]; process_crash and hang [restart_rank, takeover, restart_all] (swap_spare first with
    ft.deadpool.crash_action=swap); node_loss_spare_free [swap_spare, takeover, restart_all];
    node_loss_no_spare [takeover, restart_all]; replica_lost [restart_all]; silent_corruption
    [recompute]; straggler [report]. A row set by the user is taken as written.
    """

    transient: Optional[list[str]] = None
    """Every process alive, a collective failed."""
    process_crash: Optional[list[str]] = None
    """A rank's process died, its node is up."""
    hang: Optional[list[str]] = None
    """A rank stopped beating or stalled (the controller kills it)."""
    node_loss_spare_free: Optional[list[str]] = None
    """A node went silent, enough ready spares for its ranks."""
    node_loss_no_spare: Optional[list[str]] = None
    """A node went silent, not enough ready spares."""
    replica_lost: Optional[list[str]] = None
    """No live rank holds the model/optimizer state any more."""
    silent_corruption: Optional[list[str]] = None
    """The reduced gradient is implausible (bit flip); the only action is recompute, switched by trainer.sdc_factor."""
    straggler: Optional[list[str]] = None
    """A rank, host or link keeps the job waiting (``straggler`` group); report = the event and a console line."""
    reject_unhandled: bool = True
    """Refuse (exit 2) a mix that cannot handle a fault in fault, fault.extra or fault.kinds; false = inject it
    anyway and watch the run fail."""


@dataclass
class LoggerConfig:
    """Where metrics go besides the run directory's own files; the controller logs (runner/control/run_logger.py)."""

    kind: LoggerKind = "wandb"
    """The experiment logger (select with logger=wandb, logger=csv, logger=none)."""
    project: str = "resilient-runner"
    """W&B project (wandb only)."""
    mode: WandbMode = "offline"
    """W&B mode (wandb only); offline needs no network, `wandb sync` uploads later."""
    group: Optional[str] = None
    """W&B group (wandb only); null = the sweep directory in a multirun, else the run directory."""


@dataclass
class LauncherConfig:
    """How processes start, and how long every wait may last."""

    kind: LauncherKind = "auto"
    """auto = simulate the cluster locally unless torchrun or SLURM is detected (then run as one rank of it)."""
    mode: LauncherMode = "auto"
    """Under torchrun/SLURM, what one launched process is: per_rank = one rank (the launcher owns restarts);
    per_host = a host's node agent (node 0 also runs the controller); auto = per_rank. Must be auto under
    launcher=local."""
    start_timeout_s: Positive = 120.0
    """A worker's first heartbeat must come within this; also the initial rendezvous."""
    collective_timeout_s: Positive = 30.0
    """gloo/NCCL timeout of one collective."""
    rendezvous_timeout_s: Positive = 15.0
    """Forming the process group of a new generation."""
    recovery_timeout_s: Positive = 60.0
    """A worker waiting for the next generation; a victim waiting for the controller to carry out its fault."""
    run_timeout_s: Positive = 3600.0
    """The whole run; then it fails."""
    threads_per_rank: NonNegativeInt = 0
    """Torch intra-op threads per worker; 0 = cores // ranks (at least 1)."""
    secret_file: Optional[str] = None
    """File holding the job's secret that signs commands to node agents; unset: env RESILIENT_RUNNER_SECRET, else
    launcher=local generates one per job."""
    control_host: Optional[str] = None
    """launcher.mode=per_host: the address of node 0 the control-plane store listens on (the port comes from the
    OS), one the other hosts reach; unset: node 0's address on its route to MASTER_ADDR."""
    join: Optional[str] = None
    """HOST:PORT of a running launcher.mode=per_host job's control-plane store: this process, started later and
    outside the launcher, joins that job as a spare host (same overrides as the job's hosts, plus this key)."""


@dataclass
class TrainerConfig:
    """Optimisation settings shared by every rank."""

    max_steps: PositiveInt = 50
    """Optimizer steps; with max_epochs, the run ends at whichever of the two comes first (as in Lightning), so
    raise max_steps to train every epoch."""
    max_epochs: Optional[PositiveInt] = None
    """Passes over a finite training set (your DataModule's or module's map-style DataLoader): an epoch is
    len(dataset) // global_batch_size steps (the incomplete last step dropped, drop_last) and its order the sampler's
    (docs/quickstart.md, the data contract); null = epochs without end, max_steps ends the run. Not for the built-in
    GPT data, which has no end."""
    global_batch_size: PositiveInt = 8
    """Samples per step over all DP ranks; micro-batch = global_batch_size / dp."""
    lr: Positive = 3e-3
    """Peak learning rate (AdamW; built-in GPT only)."""
    min_lr: NonNegative = 3e-4
    """Cosine decay floor (built-in GPT only)."""
    warmup_steps: NonNegativeInt = 5
    """Linear warm-up steps (built-in GPT only)."""
    weight_decay: NonNegative = 0.1
    """AdamW weight decay on parameters with >= 2 dims (built-in GPT only)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas (built-in GPT only)."""
    grad_clip: NonNegative = 1.0
    """Global gradient-norm clip (Lightning's gradient_clip_val); 0 = off."""
    precision: PrecisionName = "32-true"
    """Lightning precision string."""
    master_weights: bool = False
    """With precision bf16-true and parallel.zero=1: the optimizer steps fp32 master weights and fp32 Adam moments
    of the rank's ZeRO-1 shard, beside bf16 parameters and gradients (Megatron's distributed optimizer)."""
    bucket_mb: Positive = 25.0
    """Gradient all-reduce bucket size (MiB); each bucket's all-reduce overlaps the rest of the backward."""
    sdc_factor: NonNegative = 100.0
    """Silent-corruption guard: recompute a step whose reduced gradient norm is non-finite or above sdc_factor x
    the median of recent accepted steps; 0 = off."""
    sdc_window: PositiveInt = 20
    """Accepted steps that median is taken over."""
    replica_check_every_n_steps: NonNegativeInt = 10
    """Replica check: every N committed steps, each data-parallel replica's parameter fingerprint rides in the step's
    gradient all-reduce (no collective of its own); replicas that disagree are restored from the majority and the
    step recomputed, or the run fails with replica_diverged when none can be trusted; 0 = off (divergence then
    shows only in the final checksums). docs/recovery.md."""
    log_every_n_steps: PositiveInt = 1
    """Experiment-logger cadence (metrics.jsonl gets every committed step regardless)."""
    progress_bar: bool = True
    """Progress bar on the console (logical rank 0): committed step, loss and tokens/s."""
    val_check_interval: StepsOrFraction = 0
    """Validate every N committed steps (an int), or every that fraction of an epoch (a float in (0, 1], with a
    finite training set of your own DataModule or module: epoch = len(dataset) // global_batch_size steps, counted
    within each epoch as Lightning does), sharded over the DP ranks; the final weights are validated once more after
    the last step; 0 = never. val/loss and what validation_step logs go to metrics.jsonl and the logger."""
    limit_val_batches: NonNegativeInt = 0
    """Validation batches per validation over all DP ranks; 0 = the whole val_dataloader() of your module or
    DataModule (the built-in data's held-out split has no end: set it)."""
    accumulate_grad_batches: PositiveInt = 1
    """Micro-batches per optimizer step on each rank (global_batch_size stays the samples per step)."""
    micro_batches: NonNegativeInt = 0
    """Pipeline micro-batches per step with parallel.pp > 1 (the 1F1B schedule's); the replica's batch
    (global_batch_size / dp) must divide into them; 0 = parallel.pp."""


@dataclass
class GPTConfig:
    """Shape of the built-in GPT (``runner.model.GPT``); the recipes in ``recipes/`` set it."""

    vocab_size: PositiveInt = 256
    """Vocabulary size (byte-level by default)."""
    seq_len: PositiveInt = 64
    """Context length; also the tokens per sample in the accounting."""
    n_layer: PositiveInt = 2
    """Transformer blocks."""
    n_head: PositiveInt = 2
    """Attention heads; must divide d_model."""
    d_model: PositiveInt = 64
    """Model width."""
    ffn_mult: PositiveInt = 4
    """FFN hidden width = ffn_mult x d_model."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout probability, seeded per (step, logical rank) when > 0."""
    bias: bool = True
    """Biases in Linear and LayerNorm."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}: "
                "pick a head count that divides the model width."
            )


@dataclass
class ModelConfig(GPTConfig):
    """The built-in GPT's shape, or a user's LightningModule through ``_target_`` (the shape then feeds the plan)."""

    _target_: Optional[str] = None
    """Import path of your LightningModule; null = the built-in GPT."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for _target_ (add them with +model.kwargs.NAME=...)."""


@dataclass
class DataConfig:
    """Step-indexed data source, or a user's LightningDataModule through ``_target_``."""

    _target_: Optional[str] = None
    """Import path of your LightningDataModule; null = the module's own train_dataloader() or the built-in data."""
    kind: DataKind = "synthetic"
    """Built-in GPT data: synthetic (a seeded sparse Markov chain, learnable) or memmap (data.path)."""
    path: Optional[str] = None
    """memmap only: a nanoGPT-style uint16 token .bin file (ids < model.vocab_size)."""
    val_path: Optional[str] = None
    """memmap with validation: the held-out token .bin file (nanoGPT's val.bin) that validation reads."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for _target_ (add them with +data.kwargs.NAME=...)."""


@dataclass
class CheckpointConfig:
    """The run's Lightning checkpoint, ``<run dir>/checkpoints/last.ckpt``, written at the end of every run."""

    every_n_steps: NonNegativeInt = 0
    """Also write it every n committed steps; 0 = only at the end (and when a SIGINT/SIGTERM stops the run)."""


@dataclass
class RunnerConfig:
    """Run-level switches."""

    smoke: bool = False
    """Shrink the recipe (model, and the layout above smoke_max_ranks) to train on CPU."""
    smoke_max_ranks: PositiveInt = 4
    """Smoke-mode layout cap."""
    device: Device = "auto"
    """auto uses a GPU per rank (logical_rank % device_count) when there are GPUs."""
    deterministic: bool = False
    """Deterministic kernels in every worker (``torch.use_deterministic_algorithms``): on GPUs the kernels that sum
    with atomics (attention's backward, some cuBLAS paths) give different bits from run to run, so a recovered run's
    parameters can match the fault-free run's bit for bit only with this on. CPU kernels are deterministic anyway."""
    peak_flops_per_rank: Positive = 1.0e12
    """Hardware peak FLOP/s of one rank, for MFU; the recipes set the GPU's bf16 peak."""
    cpu_max_params: PositiveInt = 400_000_000
    """Bigger models only print their plan on a host without enough GPUs."""
    gpu_memory_gib: Positive = 80.0
    """Memory of one GPU; a layout whose plan needs more per rank is refused, naming the smallest change that fits."""
    console_events: bool = True
    """One console line per recovery (and per failed run), from the controller's events."""
    resume: Optional[str] = None
    """A run dir or a .ckpt file: continue that run's checkpoint (checkpoints/last.ckpt) in this new run dir up to
    trainer.max_steps; auto = continue the run this run dir already holds, in place (from its newest checkpoint,
    else from scratch; its earlier outputs move to previous/<n>/): the default under torchrun and SLURM, so that a
    requeued or relaunched job goes on with the same command line; null = start from scratch (elsewhere)."""
    test_after_fit: bool = False
    """After the last step, run the module's test_step over the test_dataloader() of your DataModule (or module) with
    the final weights, its batches split over the DP ranks; what it logs (self.log, aggregated as Lightning's test
    loop does) goes to summary.json's ``test`` and the logger under the names it logs."""
    optimized_metric: Optional[str] = "train/loss"
    """The logged metric whose final value the job returns to Hydra (for a sweeper such as Optuna to optimise):
    train/loss, train/samples_per_s, train/tokens_per_s (token batches), train/step_time_s, or val/loss (with
    validation); null = return nothing."""


@dataclass
class RootConfig:
    """The whole config; ``ft`` is open because it is a list-valued group (each option checked against its
    technique's options schema)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout."""
    ft: dict[str, Any] = field(default_factory=dict)
    """The fault-tolerance techniques, in order: one key per option of group ft (each technique's ``config.py``)."""
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    """Detection."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """The fault to inject."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Straggler detection."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """The health check of spares and replacements."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Fault class -> ordered recovery actions."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment logger."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Process start and timeouts."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimisation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The run's Lightning checkpoint."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Lightning callbacks by name, each ``{_target_: package.module.Class, KEY: VALUE...}`` (group callbacks:
    default = the model summary, none = no callback); add one with +callbacks.NAME._target_=... (docs/configuration.md).
    """
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Run-level switches."""
    recipe_name: str = "none"
    """Set by the recipe; none means no recipe was chosen."""
    seed: int = 1234
    """Initial weights, data and per-step RNG; the same seed gives the same param_checksum."""


def register_schema() -> None:
    """Store the schema as ``base_config`` (``conf/config.yaml`` lists it first in its defaults), and each
    fault-tolerance schema as ``schema/ft/NAME`` (each ``conf/ft/NAME.yaml`` lists its own first)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    for name, schema in options_schemas().items():
        cs.store(group="schema/ft", name=name, node={name: schema})
