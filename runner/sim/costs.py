"""Component costs, in seconds, as functions of the job size, from published measurements.

Every recovery is assembled from these parts (see pricing.py), so a change
of one measured component moves every recovery that uses it. Each part is the
shape a published measurement shows (docs/simulator.md has the sources); the
constants come from the profile (conf/profile/*.yaml), which says for each one
whether it is published, fitted, measured or a guess.
"""
import enum
import math
from dataclasses import dataclass, fields

from runner.sim.failures import FaultClass

PHASES = ("detect", "decide", "replace", "rebuild", "restore")


class Detector(str, enum.Enum):
    """What notices a fault when the job is restarted as a whole (ft=[] or a failed run)."""

    heartbeat = "heartbeat"  # an agent's heartbeats stop or carry a stalled step counter
    timeout = "timeout"  # survivors block in a collective until its timeout; only exits are seen at once


class CommInit(str, enum.Enum):
    """MegaScale's three communicator initialisations (NSDI'24, measured on 2,048 GPUs)."""

    naive = "naive"  # TCPStore + a global barrier per group: O(N^2)
    store = "store"  # Redis-backed store, barriers kept: O(N^2)
    optimised = "optimised"  # barriers reordered away: O(N)


COMM_INIT_REF_GPUS = 2048
# seconds at 2,048 GPUs and the power of N it grows with: 1,047 s, 361 s, "under 5 s" (4.5 s keeps
# the "under 30 s above 10,000 GPUs" figure: 4.5 x 12,288 / 2,048 = 27 s)
COMM_INIT = {CommInit.naive: (1047.0, 2), CommInit.store: (361.0, 2), CommInit.optimised: (4.5, 1)}
REQUEUE_REF_GPUS = 1024  # requeue(N) = reschedule_s + requeue_per_doubling_s x log2(N / 1,024)


@dataclass(frozen=True)
class Phases:
    """Recovery time objective split into the five phases of a recovery."""

    detect: float = 0.0
    decide: float = 0.0
    replace: float = 0.0
    rebuild: float = 0.0
    restore: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def restart(self) -> float:
        """What a 'restart time' usually counts: everything after the decision."""
        return self.replace + self.rebuild + self.restore


class CostModel:
    """Turns `costs.*`, `model.*` and `cluster.*` into component durations."""

    def __init__(self, costs, model, cluster):
        self.c = costs
        self.gpus_per_node = cluster.gpus_per_node
        self.mp_nodes = cluster.model_parallel_nodes
        self.repair_s = cluster.repair_hours * 3600.0
        self.state_gb = model.params_b * model.bytes_per_param  # one copy of weights + optimizer state
        # Each GPU of a model replica holds 1/mp of it; the data-parallel replicas hold the same.
        self.state_gb_per_gpu = self.state_gb / (self.mp_nodes * self.gpus_per_node)

    # detect ---------------------------------------------------------------
    def heartbeat_detect(self, fault: FaultClass) -> float:
        """Heartbeats with the step counter in the payload: a missed beat or a
        stalled step is seen after `misses` beats; the fault lands mid-interval."""
        if fault is FaultClass.silent_corruption:
            return self.c.sdc_detect_s
        return self.c.heartbeat_s * (self.c.heartbeat_misses - 0.5)

    def timeout_detect(self, fault: FaultClass) -> float:
        """Without a monitor only a process exit is seen quickly; the survivors
        of a lost node, a hang or a link fault block until the collective timeout."""
        if fault is FaultClass.process_crash:
            return self.c.exit_detect_s
        if fault is FaultClass.silent_corruption:
            return self.c.sdc_detect_s
        return self.c.collective_timeout_s

    def requeue_detect(self, fault: FaultClass) -> float:
        """Detection on the whole-job restart path, by the profile's detector."""
        if Detector(self.c.detector) is Detector.heartbeat:
            return self.heartbeat_detect(fault)
        return self.timeout_detect(fault)

    # replace --------------------------------------------------------------
    def requeue(self, gpus: int) -> float:
        """Tear the job down, reschedule every pod and start it: ByteRobust's Table 7
        grows by a near-constant step per doubling of N (454 s at 2k to 768 s at 16k)."""
        doublings = math.log2(gpus / REQUEUE_REF_GPUS)
        return max(self.c.node_start_s, self.c.reschedule_s + self.c.requeue_per_doubling_s * doublings)

    # rebuild --------------------------------------------------------------
    def comm_init(self, gpus: int) -> float:
        """Communicator initialisation of every rank, scaled from MegaScale's 2,048-GPU figures."""
        at_ref, power = COMM_INIT[CommInit(self.c.comm_init)]
        return at_ref * (gpus / COMM_INIT_REF_GPUS) ** power

    def group_rebuild(self, gpus: int) -> float:
        """The runner's rebuild around replaced ranks (FlashRecovery's parallel store and
        static rank table): the store is sharded, so only a log2(N) bootstrap remains."""
        return self.c.rebuild_base_s + self.c.rebuild_per_doubling_s * math.log2(gpus)

    # restore / save ----------------------------------------------------------
    def storage_read(self, gpus: int) -> float:
        """Each data-parallel group reads one copy of the state, spread over all nodes,
        and broadcasts it: the shared file system or one node's link, then one NIC copy."""
        nodes = gpus // self.gpus_per_node
        read = max(self.state_gb / self.c.storage_gbps, self.state_gb / nodes / self.c.node_storage_gbps)
        return read + self.peer_copy()

    def storage_write(self, gpus: int) -> float:
        """A disk checkpoint writes one copy of the state (one data-parallel rank per shard)."""
        nodes = gpus // self.gpus_per_node
        return max(self.state_gb / self.c.storage_gbps, self.state_gb / nodes / self.c.node_storage_gbps)

    def peer_copy(self) -> float:
        """One GPU's shard copied from a healthy replica over its own NIC."""
        return self.state_gb_per_gpu / self.c.p2p_gbps

    def host_copy(self) -> float:
        """One GPU's shard copied back from a snapshot in host memory."""
        return self.state_gb_per_gpu / self.c.host_mem_gbps

    # checkpoint policy ---------------------------------------------------------
    @staticmethod
    def young_interval_s(save_cost_s: float, mtbf_s: float) -> float:
        """Young's optimum sqrt(2*C*MTBF) for a checkpoint costing C seconds."""
        return math.sqrt(2.0 * save_cost_s * mtbf_s)
