"""The runner's own decision function applied to the simulator's faults.

The simulator does not choose a recovery itself: for every simulated fault it
calls `runner.control.decision.decide` with the policy table, the mix, the budgets left
and the spares left, as the controller would, so a simulated mix does what the
runner would do. Silent corruption is not classified by `decide`; its action is
the policy table's `silent_corruption` row (the gradient guard's recompute).
"""
from collections.abc import Sequence
from dataclasses import asdict

from omegaconf import OmegaConf

from runner.config import policy
from runner.control.decision import Decision, decide, decide_straggler
from runner.recovery.registry import restart_owner, with_
from runner.sim.errors import ConfigError
from runner.sim.failures import FaultClass
from runner.sim.schema import TECHNIQUE_DECISIONS, decision_choices

# The launchers under which the runner itself restarts processes (decide's can_restart).
OWN_PROCESSES = ("local", "auto")
LAUNCHERS = (*OWN_PROCESSES, "torchrun", "slurm")


def runner_cfg(decision_conf, nodes: int, mix: Sequence[str], spares: int = 0, gpus_per_node: int = 1):
    """The part of the runner's config that `decide` reads, from the simulator's `decision` block
    (``spares``: warm spare ranks): each technique's block is its `ft.<name>` options. The `ft=[]` baseline has no
    technique to carry out any action, so it takes no policy rows."""
    d = decision_conf
    return OmegaConf.create({
        "ft": {name: asdict(getattr(d, name)) for name in TECHNIQUE_DECISIONS},
        "parallel": {"nodes": nodes, "zero": 0, "spares": spares, "procs_per_node": gpus_per_node},
        "policy": dict(d.policy) if mix else {},
        "trainer": {"sdc_factor": 100.0 if d.sdc_guard else 0.0},
    })


def check(decision_conf, mix: Sequence[str], spares: int = 0, gpus_per_node: int = 1) -> None:
    """Values of the `decision` block the runner would refuse for this mix (the launcher, a technique's option
    outside its set, `decision.policy` rows), as one ConfigError."""
    if decision_conf.launcher not in LAUNCHERS:
        raise ConfigError(f"decision.launcher={decision_conf.launcher!r}: use one of {', '.join(LAUNCHERS)}")
    for name in TECHNIQUE_DECISIONS:
        for option, allowed in decision_choices(name).items():
            value = getattr(getattr(decision_conf, name), option)
            if value not in allowed:
                raise ConfigError(f"decision.{name}.{option}={value!r}: use {' or '.join(allowed)}")
    problems = policy.row_problems(runner_cfg(decision_conf, 2, mix, spares, gpus_per_node), list(mix))
    if problems:
        raise ConfigError(f"decision.policy with ft={list(mix)}: {' '.join(problems)}")


class RunnerPolicy:
    """One mix's decisions. A fault is described to `decide` the way the controller
    describes it: a crashed rank on node 1, or node 1 lost with its ranks; data-parallel
    survivors exist when the job has at least two model replicas."""

    def __init__(self, decision_conf, mix: Sequence[str], gpus_per_node: int, nodes: int, dp_degree: int,
                 spares: int = 0):
        self.ft = list(mix)
        self.cfg = runner_cfg(decision_conf, nodes, mix, spares, gpus_per_node)
        self.g, self.nodes = gpus_per_node, nodes
        self.has_replica = dp_degree >= 2
        self.can_restart = decision_conf.launcher in OWN_PROCESSES
        owner, snapshots = restart_owner(self.ft), with_(self.ft, "restarts_from_snapshots")
        self.max_restarts = self.cfg.ft[owner].max_restarts if owner else 0
        self.max_full_restarts = self.cfg.ft[snapshots[0]].max_restarts if snapshots else 0
        self.sdc_row = policy.table(self.cfg, self.ft)["silent_corruption"]
        self._memo: dict[tuple, Decision] = {}
        self._providers: dict[str, str] = {}

    def provider(self, action: str) -> str:
        """The technique in `ft` (first in ft order) that carries `action` out (or guard, or the controller)."""
        if action not in self._providers:
            found = policy.providers(action, self.cfg, self.ft)
            self._providers[action] = next((s for s in self.ft if s in found), found[0] if found else action)
        return self._providers[action]

    def decide(self, fault: FaultClass, *, restarts_left: int, spare_ranks: int, full_restarts_left: int,
               takeovers: bool, survivors: bool = True) -> Decision:
        key = (fault, restarts_left, spare_ranks, full_restarts_left, takeovers, survivors)
        if key not in self._memo:
            self._memo[key] = self._decide(*key)
        return self._memo[key]

    def _decide(self, fault, restarts_left, spare_ranks, full_restarts_left, takeovers, survivors) -> Decision:
        if fault is FaultClass.silent_corruption:
            action = self.sdc_row[0] if self.sdc_row else "fail"
            reason = ("the gradient guard recomputes the step" if self.sdc_row else
                      "the gradient guard is off: the corruption is found later and the job requeued")
            return Decision(fault.value, action, [], reason, "silent_corruption")
        node_ranks = list(range(self.g, 2 * self.g))  # node 1's logical ranks
        lost = fault is FaultClass.node_loss
        return decide(
            ft=self.ft, cfg=self.cfg, can_restart=self.can_restart,
            dead=[self.g] if fault in (FaultClass.process_crash, FaultClass.hang) else [],
            hung=fault is FaultClass.hang, lost_nodes=[1] if lost else [], lost_ranks=node_ranks if lost else [],
            survivors=[0] if survivors and self.has_replica else [], restarts_left=restarts_left,
            spares=spare_ranks, full_restarts_left=full_restarts_left,
            nodes_up=self.nodes - 1 if lost else self.nodes,
            no_snapshots=[2 * self.g] if takeovers else [],
        )

    def straggler(self, *, restarts_left: int, spare_ranks: int) -> str:
        """The action on a straggling host (node 1), as the controller decides it: the policy's straggler row."""
        key = ("straggler", restarts_left, spare_ranks)
        if key not in self._memo:
            self._memo[key] = decide_straggler(
                ft=self.ft, cfg=self.cfg, kind="host", rank=self.g, host_ranks=list(range(self.g, 2 * self.g)),
                can_restart=self.can_restart, restarts_left=restarts_left, spares=spare_ranks)
        return self._memo[key].action

    def table(self, spare_ranks: int) -> dict[str, Decision]:
        """The action for every policy fault class with full budgets, no takeover running."""
        def fresh(fault: FaultClass, spares: int = spare_ranks, survivors: bool = True) -> Decision:
            return self.decide(fault, restarts_left=self.max_restarts, spare_ranks=spares,
                               full_restarts_left=self.max_full_restarts, takeovers=False, survivors=survivors)

        return {
            "transient": fresh(FaultClass.transient),
            "process_crash": fresh(FaultClass.process_crash),
            "hang": fresh(FaultClass.hang),
            "node_loss_spare_free": fresh(FaultClass.node_loss, spares=max(spare_ranks, self.g)),
            "node_loss_no_spare": fresh(FaultClass.node_loss, spares=0),
            "replica_lost": fresh(FaultClass.process_crash, survivors=False),
            "silent_corruption": fresh(FaultClass.silent_corruption),
        }
