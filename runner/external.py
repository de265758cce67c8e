"""One rank of a torchrun or SLURM job: the same worker, plus the controller as a thread of rank 0.

The launcher owns the processes here, so the controller cannot restart one in place: it still
detects, classifies and handles what needs no new process (a transient error is retried in a
rebuilt group), and otherwise ends the job with the reason so that the launcher restarts it
(``torchrun --max-restarts``). The control plane lives in a namespace of the job's store: torchrun's
agent store, or under SLURM a TCPStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from omegaconf import DictConfig
from torch.distributed import PrefixStore, TCPStore

from runner.config import ConfigError
from runner.config.validate import world_size
from runner.control.controller import Controller
from runner.worker import WorkerSpec, run_reporting


@dataclass
class RankEnv:
    rank: int
    world: int
    local_rank: int
    node: int
    addr: str
    port: int
    agent_store: bool  # the launcher already hosts the store
    job_id: str
    attempt: int


def rank_env(kind: str) -> RankEnv:
    e = os.environ
    if kind == "torchrun":
        return RankEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e["LOCAL_RANK"]), int(e.get("GROUP_RANK", 0)),
                       e["MASTER_ADDR"], int(e["MASTER_PORT"]), e.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                       e.get("TORCHELASTIC_RUN_ID", "job"), int(e.get("TORCHELASTIC_RESTART_COUNT", 0)))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in e]
    if missing:
        raise ConfigError(f"Under SLURM set {' and '.join(missing)} (e.g. the first node's hostname and a free port) "
                          "in the batch script: rank 0 hosts the job's store there.")
    return RankEnv(int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0)),
                   int(e.get("SLURM_NODEID", 0)), e["MASTER_ADDR"], int(e["MASTER_PORT"]), False,
                   e.get("SLURM_JOB_ID", "job"), int(e.get("SLURM_RESTART_COUNT", 0)))


class ExternalFleet:
    """Processes the launcher started: nothing to spawn or signal from here."""

    can_spawn = False

    def spawn(self, target, args: tuple, wid: int, node: int) -> None:
        """Rank ``wid`` was started by the launcher; it runs this job's worker itself."""

    def signal(self, wid: int, node: int, sig: int) -> None:
        """Another host's process cannot be signalled; a hung rank ends the job via the decision."""

    def lose_node(self, node: int) -> list[int]:
        raise ConfigError("kill_node cannot be simulated under torchrun/SLURM; use the local launcher.")

    def node_beats(self) -> dict[int, float]:
        return {}  # no node agents of ours: workers' heartbeats are the evidence

    def shutdown(self, completed: bool) -> None:
        """The launcher reaps its processes."""


def run_rank(cfg: DictConfig, run_dir: Path, kind: str) -> dict | None:
    env = rank_env(kind)
    if env.world != world_size(cfg):
        raise ConfigError(
            f"{kind} started {env.world} processes but the config asks for parallel.nodes x parallel.procs_per_node "
            f"= {world_size(cfg)}; make them equal (e.g. torchrun --nnodes={cfg.parallel.nodes} "
            f"--nproc_per_node={cfg.parallel.procs_per_node})."
        )
    timeout = timedelta(seconds=cfg.launcher.start_timeout_s)
    base = TCPStore(env.addr, env.port, is_master=env.rank == 0 and not env.agent_store, timeout=timeout,
                    wait_for_workers=False)
    namespace = f"resilient-runner/{env.job_id}/{env.attempt}/"
    store = PrefixStore(namespace, base)
    if env.rank == 0:
        store.set("run_dir", str(run_dir))
    run_dir = Path(store.get("run_dir").decode())  # every rank writes into rank 0's output directory
    run_dir.mkdir(parents=True, exist_ok=True)
    controller = thread = None
    result: dict = {}
    if env.rank == 0:
        controller = Controller(cfg, run_dir, fleet=ExternalFleet(), store=store, address=(env.addr, env.port),
                                namespace=namespace)
        thread = threading.Thread(target=lambda: result.update(controller.run()), name="controller", daemon=True)
        thread.start()
    spec = WorkerSpec(str(run_dir), env.rank, env.node, env.local_rank, env.rank, "initial", 0, env.addr, env.port,
                      namespace)
    code = run_reporting(spec, cfg)
    if store.add("left", 1) == env.world:
        store.set("all_left", "1")
    if thread is None:
        if code:
            raise SystemExit(code)
        return None
    thread.join(timeout=cfg.launcher.run_timeout_s)
    try:  # rank 0 hosts (or holds) the store: keep it up until every rank is done with it
        store.wait(["all_left"], timedelta(seconds=cfg.launcher.recovery_timeout_s))
    except Exception:
        pass  # a rank that died never leaves; the summary already says what happened
    return result
