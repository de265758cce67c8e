"""Typed schema of the simulator config, registered in Hydra's ConfigStore.

The schema rejects unknown keys and wrongly typed values before any simulation
runs. Defaults live only in `conf/config.yaml` (fields here are MISSING), so
there is one place to read and change them. `check_ranges` adds the value
ranges types cannot express; technique names are checked in `sweep.check_mix`
so that error can list the valid names. The `decision` block holds a block per
registered technique with options the decision reads (DECISION_OPTIONS), typed
as that technique's own options dataclass.
"""
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runner.config.schema import choices
from runner.recovery.registry import TECHNIQUES
from runner.recovery.technique import Technique
from runner.sim.costs import CommInit, Detector
from runner.sim.errors import ConfigError
from runner.sim.failures import FaultClass

SOURCE_KINDS = ("published", "fitted", "measured", "derived", "guess")


@dataclass
class ClusterConf:
    gpus: Any = MISSING  # int, or a list of ints for a sweep table
    gpus_per_node: int = MISSING
    model_parallel_nodes: int = MISSING  # nodes holding one model replica (TP x PP)
    spares_nodes: int = MISSING  # DeadPool hot spares
    repair_hours: float = MISSING  # time until a lost node is back in service


@dataclass
class ModelConf:
    params_b: float = MISSING
    bytes_per_param: float = MISSING  # bf16 weights + fp32 master + two Adam moments


@dataclass
class JobConf:
    days: float = MISSING
    checkpoint_interval_min: Optional[float] = MISSING  # null: Young/Daly optimum at each N
    snapshot_interval_min: float = MISSING  # flash_ckpt in-memory snapshots
    step_s: float = MISSING


@dataclass
class CauseConf:
    count: float = MISSING
    fault: FaultClass = MISSING


@dataclass
class FailuresConf:
    reference_interruptions: float = MISSING
    reference_days: float = MISSING
    reference_gpus: int = MISSING
    rate_scale: float = MISSING
    mix: dict[str, CauseConf] = MISSING


@dataclass
class CostsConf:
    # detect
    detector: Detector = MISSING  # what notices a fault on the whole-job restart path
    heartbeat_s: float = MISSING
    heartbeat_misses: int = MISSING
    exit_detect_s: float = MISSING
    collective_timeout_s: float = MISSING
    sdc_detect_s: float = MISSING
    decide_s: float = MISSING
    # replace
    reschedule_s: float = MISSING  # whole-job requeue at 1,024 GPUs ...
    requeue_per_doubling_s: float = MISSING  # ... plus this per doubling of N
    process_start_s: float = MISSING
    node_start_s: float = MISSING
    # rebuild
    comm_init: CommInit = MISSING
    rebuild_base_s: float = MISSING
    rebuild_per_doubling_s: float = MISSING
    # restore / save
    storage_gbps: float = MISSING
    node_storage_gbps: float = MISSING
    p2p_gbps: float = MISSING
    host_mem_gbps: float = MISSING
    snapshot_block_s: float = MISSING
    # degraded running
    takeover_throughput_loss: float = MISSING  # the job's throughput lost while neighbours compute failed ranks


@dataclass
class StragglersConf:
    """Slow hosts (fail-slow): they fail nothing, the synchronous job runs at the slowest one's pace."""

    enabled: bool = MISSING  # false: no stragglers (the failure-only results)
    per_node_day: float = MISSING  # arrivals per node and day (a Poisson process of its own)
    slowdown: float = MISSING  # the job's step time x this while a straggling host is in it (>= 1)
    window_steps: int = MISSING  # the runner's straggler.window_steps: slow steps before it is found


# The options of a technique (its `ft.<name>` block) that the decision function and the restart budgets read.
DECISION_OPTIONS = ("max_restarts", "retry_transient", "crash_action")


def _technique_decision_conf(technique: Technique) -> Optional[type]:
    """The schema of `decision.<name>`: the technique's options in DECISION_OPTIONS, typed as in its options
    dataclass (so a value is checked as the runner checks it); None if it has none of them."""
    hints = get_type_hints(technique.options)
    chosen = [(f.name, hints[f.name], field(default=MISSING))
              for f in fields(technique.options) if f.name in DECISION_OPTIONS]
    name = technique.options.__name__.removesuffix("Config") + "DecisionConf"
    return make_dataclass(name, chosen, namespace={"__module__": __name__}) if chosen else None


# technique name -> the schema of its `decision.<name>` block, in registry order
TECHNIQUE_DECISIONS: dict[str, type] = {
    name: conf for name, technique in TECHNIQUES.items() if (conf := _technique_decision_conf(technique))}


def decision_choices(name: str) -> dict[str, tuple]:
    """The options of `decision.<name>` whose technique allows a closed set of values, with that set."""
    hints = get_type_hints(TECHNIQUES[name].options, include_extras=True)
    return {f.name: allowed for f in fields(TECHNIQUE_DECISIONS[name])
            if (allowed := choices(hints[f.name])) is not None}


@dataclass
class DecisionCommonConf:
    """The `decision` keys of every mix; DecisionConf adds the techniques' blocks and the policy rows."""

    launcher: str = MISSING  # local | auto: the runner restarts processes; torchrun | slurm: the launcher does
    sdc_guard: bool = MISSING  # trainer.sdc_factor > 0


DecisionConf = make_dataclass(
    "DecisionConf",
    [*((name, conf, field(default_factory=conf)) for name, conf in TECHNIQUE_DECISIONS.items()),
     ("policy", dict[str, Optional[list[str]]], field(default_factory=dict))],
    bases=(DecisionCommonConf,),
    namespace={"__module__": __name__,
               "__doc__": "What the runner's decision function reads (its conf/ft/* budgets and conf/policy rows)."},
)


@dataclass
class SimConf:
    profile_name: str = MISSING  # which cluster the cost constants describe (conf/profile/)
    profile_about: str = MISSING
    cluster: ClusterConf = field(default_factory=ClusterConf)
    model: ModelConf = field(default_factory=ModelConf)
    job: JobConf = field(default_factory=JobConf)
    failures: FailuresConf = field(default_factory=FailuresConf)
    costs: CostsConf = field(default_factory=CostsConf)
    stragglers: StragglersConf = field(default_factory=StragglersConf)
    sources: dict[str, str] = MISSING  # "costs.x": "published|fitted|measured|derived|guess: where from"
    decision: DecisionCommonConf = field(default_factory=DecisionConf)  # a DecisionConf
    ft: Optional[list[str]] = MISSING  # one mix to compare against the baseline
    mixes: list[list[str]] = MISSING  # used when ft is null
    seed: int = MISSING
    runs: int = MISSING
    calibration: Optional[str] = MISSING
    plots: bool = MISSING  # PNGs beside sim.json


def register() -> None:
    """Make the schema available as the `sim_schema` default of config.yaml."""
    ConfigStore.instance().store(name="sim_schema", node=SimConf)


def check_ranges(cfg) -> None:
    """Values that would make the simulation meaningless or never end."""
    positive = {
        "runs": cfg.runs,
        "job.days": cfg.job.days,
        "job.step_s": cfg.job.step_s,
        "job.snapshot_interval_min": cfg.job.snapshot_interval_min,
        "cluster.gpus_per_node": cfg.cluster.gpus_per_node,
        "cluster.model_parallel_nodes": cfg.cluster.model_parallel_nodes,
        "model.params_b": cfg.model.params_b,
        "model.bytes_per_param": cfg.model.bytes_per_param,
        "failures.rate_scale": cfg.failures.rate_scale,
        "failures.reference_interruptions": cfg.failures.reference_interruptions,
        "failures.reference_days": cfg.failures.reference_days,
        "failures.reference_gpus": cfg.failures.reference_gpus,
    }
    if cfg.job.checkpoint_interval_min is not None:  # None means Young/Daly
        positive["job.checkpoint_interval_min"] = cfg.job.checkpoint_interval_min
    for f in fields(cfg.costs):  # rates divide, so they must be > 0; durations >= 0
        if f.name in ("detector", "comm_init"):
            continue
        if f.name.endswith("_gbps") or f.name == "heartbeat_misses":
            positive[f"costs.{f.name}"] = getattr(cfg.costs, f.name)
        elif getattr(cfg.costs, f.name) < 0:
            raise ConfigError(f"costs.{f.name} must be >= 0")
    bad = [k for k, v in positive.items() if v <= 0]
    if bad:
        raise ConfigError(f"{', '.join(bad)} must be > 0")
    if cfg.stragglers.per_node_day < 0 or cfg.stragglers.slowdown < 1 or cfg.stragglers.window_steps < 1:
        raise ConfigError("stragglers.per_node_day must be >= 0 (0: none), stragglers.slowdown >= 1 (the job's "
                          "step time x this while a straggler is in it) and stragglers.window_steps >= 1")
    if cfg.cluster.spares_nodes < 0 or not 0 <= cfg.costs.takeover_throughput_loss < 1:
        raise ConfigError(
            "cluster.spares_nodes must be >= 0 and costs.takeover_throughput_loss in [0, 1)"
        )
    check_sources(cfg)


def source_kind(text: str) -> str:
    return text.split(":", 1)[0].strip()


def check_sources(cfg) -> None:
    """Every cost constant says where it comes from, with one of SOURCE_KINDS."""
    keys = [f"costs.{f.name}" for f in fields(cfg.costs)] + ["stragglers.per_node_day", "stragglers.slowdown"]
    missing = [k for k in keys if k not in cfg.sources]
    bad = [k for k, v in cfg.sources.items() if source_kind(v) not in SOURCE_KINDS]
    if missing or bad:
        raise ConfigError(
            f"sources: {'no entry for ' + ', '.join(missing) if missing else ''}"
            f"{'; ' if missing and bad else ''}{'unknown kind in ' + ', '.join(bad) if bad else ''}. "
            f"Each entry reads '<kind>: <where from>' with kind one of {', '.join(SOURCE_KINDS)}."
        )
