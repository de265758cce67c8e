"""Which (GPU count, mix) points to simulate, checked up front, and running them.

Kept apart from Hydra so tests and notebooks can call `simulate` on a plain
`SimConf` object.
"""
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runner.recovery.registry import TECHNIQUES
from runner.sim import decisions, schema
from runner.sim.costs import CostModel
from runner.sim.decisions import RunnerPolicy
from runner.sim.engine import JobPlan, RunResult, make_plan, run_point
from runner.sim.errors import ConfigError
from runner.sim.failures import FailureModel
from runner.sim.pricing import Pricing

Mix = tuple[str, ...]


@dataclass
class Point:
    gpus: int
    mix: Mix
    plan: JobPlan
    runs: list[RunResult]


@dataclass
class Sweep:
    sizes: list[int]
    mixes: list[Mix]
    model: CostModel
    failures: FailureModel
    overrides: Mapping[str, Mapping[str, float]]
    points: dict[tuple[int, Mix], Point] = field(default_factory=dict)


def sizes_of(cfg) -> list[int]:
    raw = cfg.cluster.gpus
    values = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    per_node, mp = cfg.cluster.gpus_per_node, cfg.cluster.model_parallel_nodes
    for g in values:
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
            raise ConfigError(f"cluster.gpus: {g!r} is not a positive integer")
        check_layout(g, per_node, mp)
    return sorted(set(values))


def check_layout(gpus: int, per_node: int, mp_nodes: int) -> None:
    if gpus % per_node or (gpus // per_node) % mp_nodes:
        raise ConfigError(
            f"cluster.gpus={gpus} must fill whole model replicas: a multiple of "
            f"gpus_per_node ({per_node}) x model_parallel_nodes ({mp_nodes})"
        )


def check_mix(names: Sequence[str]) -> None:
    """Reject names the technique registry does not know, or repeated ones, with a message a user can act on."""
    unknown = [n for n in names if n not in TECHNIQUES]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if unknown or repeated:
        problem = f"unknown technique name(s) {unknown}" if unknown else f"repeated name(s) {repeated}"
        raise ConfigError(
            f"ft: {problem} in {list(names)}. An ft mix is a list of recovery techniques, as the "
            f"runner's ft; for each fault the runner's policy table picks the action. "
            f"Valid names: {', '.join(TECHNIQUES)}. Use 'ft=[]' for the "
            f"restart-all-from-disk baseline, e.g. 'ft=[{','.join(TECHNIQUES)}]'."
        )


def mixes_of(cfg) -> list[Mix]:
    """`ft` given: the baseline plus that mix; `ft` null: every mix in `mixes`."""
    chosen = [[], list(cfg.ft)] if cfg.ft is not None else [list(m) for m in cfg.mixes]
    unique: list[Mix] = []
    for names in chosen:
        check_mix(names)
        decisions.check(cfg.decision, names, cfg.cluster.spares_nodes * cfg.cluster.gpus_per_node,
                        cfg.cluster.gpus_per_node)
        if tuple(names) not in unique:
            unique.append(tuple(names))
    return unique


def policy_for(cfg, gpus: int, mix: Sequence[str]) -> RunnerPolicy:
    """The runner's decisions for this mix on a job of `gpus` GPUs."""
    nodes = gpus // cfg.cluster.gpus_per_node
    return RunnerPolicy(cfg.decision, mix, cfg.cluster.gpus_per_node, nodes,
                        nodes // cfg.cluster.model_parallel_nodes, cfg.cluster.spares_nodes * cfg.cluster.gpus_per_node)


def simulate(cfg, overrides: Mapping[str, Mapping[str, float]]) -> Sweep:
    schema.check_ranges(cfg)
    model = CostModel(cfg.costs, cfg.model, cfg.cluster)
    failures = FailureModel(cfg.failures)
    sweep = Sweep(sizes_of(cfg), mixes_of(cfg), model, failures, overrides)
    for gpus in sweep.sizes:
        pricing = Pricing(model, overrides, gpus)
        for mix in sweep.mixes:
            plan = make_plan(cfg, model, failures, gpus, mix)
            runs = run_point(plan, policy_for(cfg, gpus, mix), pricing, failures, cfg.seed, cfg.runs)
            sweep.points[(gpus, mix)] = Point(gpus, mix, plan, runs)
    return sweep


def mix_label(mix: Sequence[str]) -> str:
    return ",".join(mix) if mix else "restart (ft=[])"
