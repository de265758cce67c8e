"""One process per host under torchrun or SLURM (``launcher.mode=per_host``): that process is the host's node agent.

Every host runs the same command, one process each (``torchrun --nproc_per_node=1``, ``srun
--ntasks-per-node=1``); its node index is the launcher's node rank (torchrun's ``GROUP_RANK``, SLURM's
``SLURM_NODEID``). Node 0 hosts the control-plane store on ``launcher.control_host`` (a port from the OS),
publishes that address in the launcher's own store and runs the controller, which starts node 0's agent
as a process of its own (never in the controller's multithreaded process) and awaits the other hosts'
agents. Every other host reads the address, composes the agent config from its own command line into
a file of its own, and becomes the agent: it refuses to start when that config's digest differs from the
one the controller signed. The launcher's store is torchrun's (reached through MASTER_ADDR/MASTER_PORT),
or under SLURM one that node 0 hosts at MASTER_ADDR:MASTER_PORT; the address lives under the job's id
(the rendezvous run id), never under the restart count, which differs between hosts.

A host started later, outside the launcher, joins the running job as a spare host through the controller's
address (``launcher.join=HOST:PORT``, ``join_running_job``): torchrun would restart every worker if a node
entered its rendezvous. It asks the controller for a node index (``runner.agents.joins``), then becomes that
node's agent like any other host.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig
from torch.distributed import DistError, TCPStore

from runner.agents import auth, joins, spawned
from runner.config import ConfigError
from runner.config.validate import ft_names
from runner.launch.host import claim_run_dir, external_launcher
from runner.launch.termination import PromptTermination
from runner.planning.topology import Topology
from runner.plumbing import protocol
from runner.plumbing.events import EventLog


@dataclass
class HostEnv:
    """What the launcher tells the process it started on one host."""

    node: int
    hosts: int
    addr: str  # the launcher's store
    port: int
    launcher_store: bool  # the launcher hosts that store (torchrun); else node 0 does (SLURM)
    job_id: str


def host_env(kind: str) -> HostEnv:
    e = os.environ
    if kind == "torchrun":
        if int(e.get("LOCAL_WORLD_SIZE", "1")) != 1:
            raise ConfigError(f"launcher.mode=per_host runs one process per host, but torchrun started "
                              f"{e['LOCAL_WORLD_SIZE']} on this one: use torchrun --nproc_per_node=1.")
        return HostEnv(int(e.get("GROUP_RANK", 0)), int(e["WORLD_SIZE"]), e["MASTER_ADDR"], int(e["MASTER_PORT"]),
                       e.get("TORCHELASTIC_USE_AGENT_STORE") == "True", e.get("TORCHELASTIC_RUN_ID", "job"))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in e]
    if missing:
        raise ConfigError(f"Under SLURM with launcher.mode=per_host set {' and '.join(missing)} in the batch script "
                          "(the first node's hostname and a free port): node 0 publishes the control-plane "
                          "store's address there.")
    hosts = int(e.get("SLURM_NNODES", e["SLURM_NTASKS"]))
    if int(e["SLURM_NTASKS"]) != hosts:
        raise ConfigError(f"launcher.mode=per_host runs one process per host, but SLURM started {e['SLURM_NTASKS']} "
                          f"tasks on {hosts} nodes: use srun --ntasks-per-node=1.")
    return HostEnv(int(e.get("SLURM_NODEID", 0)), hosts, e["MASTER_ADDR"], int(e["MASTER_PORT"]), False,
                   e.get("SLURM_JOB_ID", "job"))


_ROUNDS_PROBED = 64  # torchrun's rendezvous rounds looked for (one per restart of the job, and failed attempts)
_TERMINAL_STATE = "torchelastic/agent/terminal_state"  # the exit barrier's keys (torchelastic's agent, api.py)
REFUSED = "refused: "  # node 0 would not start: what it publishes instead of the control address


def control_key(job_id: str) -> str:
    """Where node 0 publishes ``HOST:PORT`` of the control-plane store, in the launcher's store."""
    return f"resilient-runner/{job_id}/per_host/control"


def run_host(cfg: DictConfig, run_dir: Path, kind: str, continuing: bool = False) -> Optional[dict]:
    """Node 0: the controller's summary. Any other host: None once its agent ended well (else SystemExit).
    ``continuing``: the run continues the one its run dir holds (``runner.resume=auto``)."""
    _require_secret(cfg)
    env = host_env(kind)
    topo = Topology.from_cfg(cfg)
    if env.hosts != topo.total_nodes:
        raise ConfigError(f"{kind} started {env.hosts} hosts but the config asks for {topo.total_nodes} "
                          f"(parallel.nodes={topo.nodes} and {topo.spare_nodes} spare host(s) for "
                          f"parallel.spares={topo.spares}): make them equal (torchrun --nnodes={topo.total_nodes}).")
    launcher = _launcher_store(env, cfg.launcher.start_timeout_s)
    if env.node == 0:
        return _run_controller(cfg, run_dir, env, launcher, continuing)
    address = launcher.get(control_key(env.job_id)).decode()  # waits up to launcher.start_timeout_s
    if address.startswith(REFUSED):
        raise ConfigError(f"node 0 refused to start: {address[len(REFUSED):]}")
    spawned.die_with_parent()
    secret = auth.job_secret(cfg.launcher.secret_file, pop_env=True)  # no worker inherits it
    assert secret is not None  # checked above
    config = _agent_config(cfg, run_dir)
    _joined(run_dir, env.node, address, "agent")
    code = _run_agent(run_dir, env.node, address, secret, config, torchrun=os.getppid() if kind == "torchrun" else None)
    if code:
        raise SystemExit(code)
    return None


def _launcher_store(env: HostEnv, timeout_s: float) -> TCPStore:
    """The launcher's store (torchrun's, or under SLURM the one node 0 hosts)."""
    return TCPStore(env.addr, env.port, is_master=env.node == 0 and not env.launcher_store,
                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def report_refusal(cfg: DictConfig, reason: str) -> None:
    """A host of a ``launcher.mode=per_host`` job refused to start (its config, its layout, its secret): say why where
    the other hosts look, so that the job fails now naming it instead of waiting out ``launcher.start_timeout_s``.
    Node 0 publishes the reason instead of the control-plane address (every other host reads it and exits 2; it
    stays until they did, at most ``REFUSAL_READ_TIMEOUT_S``); another host writes it where the controller awaits its
    agent (``agent/<node>/refused``), and stays until the controller read it (node 0's run then fails at once with
    the reason in summary.json). Nothing outside torchrun and SLURM. The caller checked the mode (not a joining
    host: nobody awaits that one)."""
    from runner.agents.node_agent import REFUSAL_READ_TIMEOUT_S

    kind = external_launcher() if cfg.launcher.kind == "auto" else cfg.launcher.kind
    if kind not in ("torchrun", "slurm"):
        return
    try:
        env = host_env(kind)
        launcher = _launcher_store(env, cfg.launcher.start_timeout_s)
        read = control_key(env.job_id) + "/refusal_read"
        if env.node == 0:
            launcher.set(control_key(env.job_id), REFUSED + reason)
            deadline = time.monotonic() + REFUSAL_READ_TIMEOUT_S
            while launcher.add(read, 0) < env.hosts - 1 and time.monotonic() < deadline:
                time.sleep(0.05)  # under SLURM the store is this process's: the others read it before it goes
            return
        address = launcher.get(control_key(env.job_id)).decode()  # waits up to launcher.start_timeout_s
        if address.startswith(REFUSED):  # node 0 refused too: nobody awaits this host
            launcher.add(read, 1)
            return
        host, port = address.rsplit(":", 1)
        store = protocol.connect(host, int(port), REFUSAL_READ_TIMEOUT_S)
        store.set(protocol.agent_key(env.node, "refused"), reason)
        store.wait([protocol.agent_key(env.node, "refusal_read")], timedelta(seconds=REFUSAL_READ_TIMEOUT_S))
    except (DistError, ConfigError, KeyError, ValueError):
        pass  # no launcher store to reach, or nobody read it in time: this host's exit code still tells


def join_running_job(cfg: DictConfig, run_dir: Path) -> None:
    """A host started later joins the job whose control-plane store is at ``launcher.join`` as a spare host: it
    asks the controller for a node index, then runs that node's agent in this process until the job ends
    (SystemExit with the agent's code, or 2 with the reason when the controller refuses it)."""
    _require_secret(cfg)
    address = cfg.launcher.join
    cfg.launcher.join = None  # the rest is the job's config, as every other host composed it
    spawned.die_with_parent()
    secret = auth.job_secret(cfg.launcher.secret_file, pop_env=True)
    assert secret is not None  # checked above
    config = _agent_config(cfg, run_dir)
    host, port = address.rsplit(":", 1)
    try:
        store = protocol.connect(host, int(port), cfg.launcher.start_timeout_s)
        node = joins.request_node(store, secret, auth.digest(config), cfg.launcher.start_timeout_s)
    except (joins.JoinRefused, DistError) as e:
        reason = str(e).splitlines()[0]
        events = EventLog(run_dir / "events.jsonl", rank=lambda: "joining-host", step=lambda: -1)
        events.emit("agent_refused", node=None, control_store=address, reason=reason)
        events.close()
        print(f"[runner] the job at launcher.join={address} refused this host: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e
    print(f"[runner] joined the job at {address} as node {node}, a spare host", flush=True)
    code = _run_agent(run_dir, node, address, secret, config)
    if code:
        raise SystemExit(code)


def _require_secret(cfg: DictConfig) -> None:
    if auth.job_secret(cfg.launcher.secret_file) is None:
        raise ConfigError(f"launcher.mode=per_host signs the controller's commands with the job's secret, which every "
                          f"host must hold: set {auth.SECRET_ENV} on every host, or launcher.secret_file to a file "
                          "the job distributes (python -c 'import secrets; print(secrets.token_hex(32))').")


def _run_controller(cfg: DictConfig, run_dir: Path, env: HostEnv, launcher: TCPStore, continuing: bool) -> dict:
    from runner.control.controller import Controller

    claim_run_dir(run_dir, continuing)
    run_dir.mkdir(parents=True, exist_ok=True)
    host = cfg.launcher.control_host or own_address_towards(env.addr, env.port)
    store = protocol.host_store(host, cfg.launcher.start_timeout_s)
    _joined(run_dir, 0, f"{host}:{store.port}", "controller")
    launcher.set(control_key(env.job_id), f"{host}:{store.port}")
    print(f"[runner] control plane at {host}:{store.port} (a host started later joins with the same command "
          f"plus launcher.join={host}:{store.port})", flush=True)
    summary = Controller(cfg, run_dir, store=store, address=(host, store.port), agents_started_here=[0]).run()
    if env.launcher_store:  # torchrun
        lost = [n for n in range(env.hosts) if store.check([protocol.node_fence_key(n)])]
        arrive_for_lost_hosts(launcher, env.job_id, env.hosts, len(lost))
    return summary


def arrive_for_lost_hosts(launcher: TCPStore, run_id: str, hosts: int, lost: int) -> None:
    """torchrun's agents end in an exit barrier that waits for every agent of the rendezvous (300 s, a setting its
    command line does not expose), and the agent of a host the job lost never arrives: the surviving hosts would
    stay five minutes after the job ended. Node 0 arrives in the lost hosts' place, in the barrier's own keys
    (torchelastic's ``agent/terminal_state/num_members`` and ``last_member`` under the rendezvous' prefix, in its
    store: ``_exit_barrier``), so each survivor's torchrun ends once its own process did. A lost host heard again
    later arrives too and finds the barrier passed."""
    if not lost:
        return
    barrier = _exit_barrier(launcher, run_id)
    if barrier is None:
        return
    store, prefix = barrier
    if store.add(f"{prefix}/num_members", lost) == hosts:
        store.set(f"{prefix}/last_member", "<val_ignored>")


def _exit_barrier(launcher: TCPStore, run_id: str) -> Optional[tuple[TCPStore, str]]:
    """The store and key prefix of torchrun's exit barrier, read from the arguments of the torchrun that started
    this process with torchrun's own parser: the static rendezvous' store is the one its workers are given
    (``MASTER_ADDR``), prefixed by the run id; the c10d rendezvous' is at ``--rdzv-endpoint``, prefixed by the
    run id and the newest rendezvous round (each round's store holds ``MASTER_ADDR``). None for another launcher."""
    from torch.distributed.run import get_args_parser

    try:
        argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    start = next((i + 1 for i, a in enumerate(argv) if a == "torch.distributed.run" or a.endswith("torchrun")), None)
    if start is None:
        return None
    try:
        args, _ = get_args_parser().parse_known_args(argv[start:])
    except SystemExit:  # argparse's way of refusing arguments it cannot read
        return None
    if args.rdzv_backend == "static":
        return launcher, f"{run_id}/{_TERMINAL_STATE}"
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    host, port = (args.rdzv_endpoint.rsplit(":", 1) if ":" in args.rdzv_endpoint else (args.rdzv_endpoint, "29400"))
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    rounds = [r for r in range(_ROUNDS_PROBED) if store.check([f"torch.rendezvous.{run_id}.{r}/MASTER_ADDR"])]
    return (store, f"torch.rendezvous.{run_id}.{max(rounds)}/{_TERMINAL_STATE}") if rounds else None


def _agent_config(cfg: DictConfig, run_dir: Path) -> bytes:
    """The agent config this host composes from its own command line (the controller signed its digest)."""
    from runner.agents.fleet import agent_config
    from runner.control.controller import agent_setup
    from runner.recovery.registry import build_actions

    run_dir.mkdir(parents=True, exist_ok=True)
    preload, persist = agent_setup(build_actions(ft_names(cfg), cfg, Topology.from_cfg(cfg), run_dir))
    return agent_config(cfg, preload, persist)


def _run_agent(run_dir: Path, node: int, address: str, secret: bytes, config: bytes,
               torchrun: Optional[int] = None) -> int:
    """This host's node agent, in this process (it dies with its launcher), with its own config file; ``torchrun``:
    the pid of the torchrun that started this process, which the agent ends when it lost the controller."""
    from runner.agents.node_agent import NodeAgent, _gpus

    config_file = run_dir / f"agent_config.node{node}.json"
    config_file.write_bytes(config)
    host, port = address.rsplit(":", 1)
    agent = NodeAgent(node, (host, int(port)), secret, run_dir, _gpus(None), config_file, torchrun)
    # the launcher's SIGTERM halts the host's part of the job as a lost controller does, breakpoint persists finished
    PromptTermination(agent.terminated, main_thread_acts=False).install()
    return agent.run()


def _joined(run_dir: Path, node: int, address: str, role: str) -> None:
    """``host_joined`` in this host's events.jsonl: which process of which host is which node."""
    events = EventLog(run_dir / "events.jsonl", rank=lambda: f"host-{node}", step=lambda: -1)
    events.emit("host_joined", node=node, pid=os.getpid(), host=socket.gethostname(), control_store=address, role=role)
    events.close()


def own_address_towards(addr: str, port: int) -> str:
    """This host's address on its route to ``addr`` (a UDP connect sends nothing): one the hosts that reach
    the launcher's store reach too."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(addr), port))
        return s.getsockname()[0]
