"""Component costs, in seconds, as functions of the job size.

Every recovery strategy is assembled from these parts (see strategies.py), so a
change of one measured component moves every strategy that uses it. Nothing
here knows a published end-to-end number; the simulator has to reproduce those
from the parts.
"""
import math
from dataclasses import dataclass, fields

from runner.sim.failures import FaultClass

PHASES = ("detect", "decide", "replace", "rebuild", "restore")


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
        self.repair_s = cluster.repair_hours * 3600.0
        mp_gpus = cluster.model_parallel_nodes * cluster.gpus_per_node
        # Each GPU holds 1/mp of the weights and optimizer state (no ZeRO over DP,
        # so every data-parallel replica reads its own copy from storage).
        self.state_gb_per_gpu = model.params_b * model.bytes_per_param / mp_gpus

    # detect ---------------------------------------------------------------
    def active_detect(self, fault: FaultClass) -> float:
        """Heartbeats with the step counter in the payload: a missed beat or a
        stalled step is seen after `misses` beats; the fault lands mid-interval."""
        if fault is FaultClass.silent_corruption:
            return self.c.sdc_detect_s
        return self.c.heartbeat_s * (self.c.heartbeat_misses - 0.5)

    def passive_detect(self, fault: FaultClass) -> float:
        """Without a monitor only a process exit is seen quickly; the survivors
        of a lost node, a hang or a link fault block until the collective timeout."""
        if fault is FaultClass.process_crash:
            return self.c.exit_detect_s
        if fault is FaultClass.silent_corruption:
            return self.c.sdc_detect_s
        return self.c.collective_timeout_s

    # replace --------------------------------------------------------------
    def start_nodes(self, nodes: int) -> float:
        """Containers start in parallel but pull the image from one shared registry."""
        return self.c.process_start_s + nodes * self.c.image_gb / self.c.registry_gbps

    def reschedule_job(self, gpus: int) -> float:
        return self.c.reschedule_s + self.start_nodes(gpus // self.gpus_per_node)

    # rebuild --------------------------------------------------------------
    def full_rendezvous(self, gpus: int) -> float:
        """One TCPStore serves N registrations plus a naive rank-table exchange in
        which every rank reads every other rank's entry (N^2 reads); NCCL's
        bootstrap then walks a ring over all ranks (O(N))."""
        store = (gpus + gpus * gpus) / self.c.store_ops_per_s
        return store + self.c.nccl_base_s + self.c.nccl_per_rank_s * gpus

    def incremental_rendezvous(self, gpus: int) -> float:
        """Sharded store (O(N/K)), rank table from a shared file (O(1)), and only
        the links touching the replaced ranks re-bootstrapped (O(log N))."""
        store = gpus / (self.c.store_shards * self.c.store_ops_per_s)
        return store + self.c.nccl_base_s + self.c.nccl_per_doubling_s * math.log2(gpus)

    # restore / save ----------------------------------------------------------
    def storage_io(self, gpus: int) -> float:
        """Every GPU reads (or writes) its shard; the slower of the shared file
        system and one node's storage link sets the time."""
        shared = gpus * self.state_gb_per_gpu / self.c.storage_gbps
        per_node = self.gpus_per_node * self.state_gb_per_gpu / self.c.node_storage_gbps
        return max(shared, per_node)

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
