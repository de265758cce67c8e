"""One rank of a torchrun or SLURM job (``launcher.mode=per_rank``): the worker, plus the controller as a
thread of rank 0.

The launcher owns the processes here, so the controller cannot restart one in place: it still
detects, classifies and handles what needs no new process (a transient error is retried in a
rebuilt group), and otherwise ends the attempt with the reason so that the launcher restarts every
rank (``torchrun --max-restarts``). The control plane lives in the namespace of the attempt that all
ranks agree on (``runner/launch/attempt.py``) in the job's store: torchrun's agent store, or under SLURM a
TCPStore that rank 0 hosts at MASTER_ADDR:MASTER_PORT. A restart resumes from the newest flash
checkpoint every rank holds (``ft=[flash_ckpt]``), else from step 0. Rank 0 records each attempt's
start and end in the run directory (``runner/launch/attempt_log.py``) for the final summary. Each rank
reports its pid (``pid/<rank>`` in the namespace) so that rank 0 can signal the ranks of its own host.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig
from torch.distributed import PrefixStore, TCPStore

from runner.config import ConfigError
from runner.config.validate import all_faults, ft_names, world_size
from runner.control.controller import Controller
from runner.launch.attempt import AttemptHost, JobKeys, join_attempt
from runner.launch.attempt_log import AttemptLog, read_attempts
from runner.launch.termination import PromptTermination
from runner.plumbing import protocol
from runner.plumbing.events import EventLog
from runner.recovery.registry import saved_states, with_
from runner.training.worker import WorkerSpec, run_reporting

LEAVE_WAIT_S = 5.0  # rank 0 keeps the store it hosts up this long for the others to leave: they do at once


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
    restarted: bool  # the launcher says this process is a restart (on this host at least)
    earlier_attempts: int  # attempts the job's store cannot remember: SLURM's requeues each bring a fresh one


def rank_env(kind: str) -> RankEnv:
    e = os.environ
    if kind == "torchrun":
        return RankEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e["LOCAL_RANK"]), int(e.get("GROUP_RANK", 0)),
                       e["MASTER_ADDR"], int(e["MASTER_PORT"]), e.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                       e.get("TORCHELASTIC_RUN_ID", "job"), int(e.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0, 0)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in e]
    if missing:
        raise ConfigError(f"Under SLURM set {' and '.join(missing)} (e.g. the first node's hostname and a free port) "
                          "in the batch script: rank 0 hosts the job's store there.")
    requeues = int(e.get("SLURM_RESTART_COUNT", 0))
    return RankEnv(int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0)),
                   int(e.get("SLURM_NODEID", 0)), e["MASTER_ADDR"], int(e["MASTER_PORT"]), False,
                   e.get("SLURM_JOB_ID", "job"), requeues > 0, requeues)


class ExternalFleet:
    """Processes the launcher started: nothing to spawn; only the ranks on rank 0's own host can be
    signalled, through the pids they report. The configuration refuses a fault that would need another
    (``runner/launch/launcher.py``); a hung rank elsewhere ends the attempt through the decision."""

    can_spawn = False

    def __init__(self, store, node: int) -> None:
        self.store, self.node = store, node

    def spawn(self, target, args: tuple, wid: int, node: int) -> None:
        """Rank ``wid`` was started by the launcher; it runs this job's worker itself."""

    def signal(self, wid: int, node: int, sig: int) -> None:
        key = f"pid/{wid}"
        if not self.store.check([key]):
            return  # not started yet: nothing to signal
        where = protocol.get_json(self.store, key)
        if where["node"] == self.node:
            try:
                os.kill(where["pid"], sig)
            except ProcessLookupError:
                pass  # already gone

    def notify(self, targets: list[tuple[int, int]], sig: int) -> None:
        """``signal`` each of ``targets`` (wid, node): only those on this host can be reached."""
        for wid, node in targets:
            self.signal(wid, node, sig)

    def post_notice(self, notice: dict, nodes: Optional[list[int]] = None) -> None:
        """No agents here to notify (``heartbeat.route=agent`` is refused under per_rank): workers read the store."""

    def lose_node(self, node: int) -> list[int]:
        raise ConfigError("kill_node cannot be simulated under torchrun/SLURM; use the local launcher.")

    def node_beats(self) -> dict[int, float]:
        return {}  # no node agents of ours: workers' heartbeats are the evidence

    def fence(self, node: int, reason: str, gen: int) -> None:
        """No agents here: the launcher owns the hosts' processes (a lost node ends the attempt)."""

    def shutdown(self, status: str) -> None:
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

    def connect(master: bool = False) -> TCPStore:
        return TCPStore(env.addr, env.port, is_master=master, timeout=timeout, wait_for_workers=False)

    base = connect(master=env.rank == 0 and not env.agent_store)
    host: Optional[AttemptHost] = None
    if env.rank == 0:
        host = AttemptHost(connect(), env.job_id, str(run_dir), env.earlier_attempts)
        attempt, job_dir = host.attempt, host.run_dir
    else:
        attempt, job_dir = join_attempt(base, env.job_id, cfg.launcher.start_timeout_s)
    keys = JobKeys(env.job_id)
    namespace = keys.namespace(attempt)
    store = PrefixStore(namespace, base)
    run_dir = Path(job_dir)  # every rank, and every attempt, writes into the first attempt's rank 0 directory
    run_dir.mkdir(parents=True, exist_ok=True)
    store.set(f"pid/{env.rank}", json.dumps({"pid": os.getpid(), "node": env.node}))
    events = EventLog(run_dir / "events.jsonl", rank=lambda: env.rank, step=lambda: -1)
    events.emit("attempt_joined", attempt=attempt, namespace=namespace, node=env.node, pid=os.getpid(),
                launcher_restarted=env.restarted)
    events.close()
    restarted = attempt > 1 or env.restarted
    snapshots = with_(ft_names(cfg), "restarts_from_snapshots")
    role = resume_role(cfg, store, env, run_dir) if restarted and snapshots else "initial"
    if env.rank != 0:
        PromptTermination().install()
        code = _train(cfg, env, run_dir, namespace, role, store)
        if code:
            raise SystemExit(code)
        return None
    carry_fault_claims(cfg, base, keys, attempt)  # before the controller starts: no rank trains before it
    return _run_rank0(cfg, env, run_dir, namespace, role, store, attempt, host)


def _run_rank0(cfg: DictConfig, env: RankEnv, run_dir: Path, namespace: str, role: str, store, attempt: int,
               host: Optional[AttemptHost]) -> dict:
    """Rank 0: the controller in a thread beside the worker, and the attempt's record."""
    log = AttemptLog(run_dir, attempt)
    log.start()
    controller = Controller(cfg, run_dir, fleet=ExternalFleet(store, env.node), store=store,
                            address=(env.addr, env.port), namespace=namespace)
    controller.record.attempts = read_attempts(run_dir)

    def step_reached() -> int:
        members = getattr(controller, "members", None)  # built once the controller started
        return max((w.hb_step for w in members.workers.values()), default=-1) if members else -1

    def on_term() -> None:  # the controller's reason when it ended the attempt before the launcher stopped it
        record = controller.record
        error = record.error if record.status == "failed" else "terminated by the launcher (SIGTERM)"
        log.end("failed", error, step_reached())

    PromptTermination(on_term).install()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(controller.run()), name="controller", daemon=True)
    thread.start()
    _train(cfg, env, run_dir, namespace, role, store)
    thread.join(timeout=cfg.launcher.run_timeout_s)
    if result:
        log.end(result["status"], result.get("error", ""), step_reached())
    else:
        log.end("failed", "the controller did not finish", step_reached())
    if host is not None:
        host.close()
    if not env.agent_store:  # rank 0 hosts the store: keep it up while the others leave (they do at once)
        try:
            store.wait(["all_left"], timedelta(seconds=LEAVE_WAIT_S))
        except Exception:
            pass  # a rank that died never leaves; the summary already says what happened
    return result


def _train(cfg: DictConfig, env: RankEnv, run_dir: Path, namespace: str, role: str, store) -> int:
    spec = WorkerSpec(str(run_dir), env.rank, env.node, env.local_rank, env.rank, role, 0, env.addr, env.port,
                      namespace)
    code = run_reporting(spec, cfg)
    try:
        if store.add("left", 1) == env.world:
            store.set("all_left", "1")
    except Exception:
        pass  # rank 0's store is gone: nobody is left to wait for this rank
    return code


def resume_role(cfg: DictConfig, store, env: RankEnv, run_dir: Path) -> str:
    """A restarted attempt of a mix that restarts ranks from snapshots (flash checkpoints): ``restore`` when some
    step's snapshot is held by every rank (in its host's memory, a partner's copy or on disk: the technique's
    ``SavedState``), else ``initial`` (from step 0). Every rank publishes the steps it holds and reads everyone's, so
    all of them choose alike."""
    held = sorted({s for state in saved_states(ft_names(cfg)) for s in state.held_steps(run_dir, env.rank)})
    table = protocol.steps_held_by_each_rank(store, "resume/held", env.rank, env.world, held,
                                             cfg.launcher.start_timeout_s)
    return "restore" if set.intersection(*table) else "initial"


def carry_fault_claims(cfg: DictConfig, base, keys: JobKeys, attempt: int) -> None:
    """A configured fault fires once per job: claims made in an earlier attempt's namespace are claims in
    this one too (the victims claim ``fault/claim/<i>`` in ``callbacks/fault_injection.py``)."""
    earlier = [PrefixStore(keys.namespace(a), base) for a in range(1, attempt)]
    this = PrefixStore(keys.namespace(attempt), base)
    for i in range(len(all_faults(cfg))):
        claim = f"fault/claim/{i}"
        if any(store.check([claim]) for store in earlier):
            this.add(claim, 1)
