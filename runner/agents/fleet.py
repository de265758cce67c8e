"""The controller's side of the node agents: the fleet it starts, signals and watches workers through.

Under ``launcher=local`` it starts one agent process per (simulated) host, each running what
``python -m runner.agents`` runs on a host, and reaches them only through the job's store: commands
go into each agent's queue, signed with the job's secret (``runner.agents.auth``); exits come back the
moment an agent sees them and become the controller's ``("exit", wid, code, t)`` queue items; an
agent's heartbeat key tells the controller it is alive. The config the agents run is a file in the run
dir written before they start; the store carries only its signed digest. Losing a node is SIGKILLing
its agent: its workers and persister die with it (``runner.agents.spawned``).

The agents are forked from one zygote (``runner.agents.fork_server``): a fresh interpreter, started once,
that imports the agent's and the workers' modules, so that N simulated hosts pay those imports once, not
2N times (each agent's own host fork server is then a plain fork of the agent). The zygote dies with
the controller; the agents' arguments and the job's secret reach them over its socket, never on a
command line.

Under ``launcher.mode=per_host`` (``runner.launch.per_host``) the fleet starts only node 0's agent and awaits the
others: each host's launcher started its agent, which writes its own copy of the config file and
registers. Such a remote agent has no process handle here: only its heartbeat says it lives. A host
started later joins the same way once the controller granted it a node index (``runner.agents.joins``):
``adopt`` adds it.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from queue import Queue
from typing import Optional

import psutil
from omegaconf import DictConfig, OmegaConf
from torch.distributed import DistError, DistStoreError

from runner.agents import auth, node_agent
from runner.agents.fork_server import ForkedProcess, ForkServer
from runner.agents.node_agent import await_key
from runner.config import ConfigError
from runner.config.schema import HeartbeatConfig
from runner.config.validate import all_faults
from runner.control.records import exit_code
from runner.plumbing import protocol
from runner.recovery.actions import NodePersist

ACK_SLICE = timedelta(seconds=1)  # how long an ack is awaited before looking whether the agent still lives
ACK_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 60.0  # an agent's workers' grace, then its persister's last breakpoint writes
EXIT_REPORT_TIMEOUT_S = 5.0  # a SIGKILLed worker's exit reaches the queue in milliseconds
ZYGOTE_PRELOAD = ["runner.agents.node_agent"]  # before the workers' modules


class AgentProcess:
    """An agent forked by the zygote, with the part of ``subprocess.Popen``'s interface the fleet uses."""

    def __init__(self, proc: ForkedProcess) -> None:
        self._proc, self.pid = proc, proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def poll(self) -> Optional[int]:
        return self._proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"node agent {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        self._proc.kill()


class AgentHandle:
    """One agent process as the controller sees it: its workers, the exits it reported, its heartbeat."""

    def __init__(self, node: int, proc: Optional[AgentProcess], silence_s: float) -> None:
        self.node, self.proc = node, proc  # proc: None for an agent another host's launcher started
        self.silence_s = silence_s  # a remote agent silent this long is taken as gone
        self.silent = False  # a remote agent's beat, when last read, was older than silence_s
        self.workers: dict[int, int] = {}  # wid -> pid, as the agent acknowledged the spawn
        self.reported: set[int] = set()  # wids whose exit is in the controller's queue (or, once lost, gone)
        self.lost = False
        self.registered = True  # False: a late host granted this index never registered (it holds no node)
        self.hb_value: Optional[bytes] = None
        self.beats = 0  # beats read so far (each a new value)
        self.record_version = 0  # heartbeat.route=agent: the version of its ranks' record its newest beat names
        # heartbeat.route=agent: the numbers of the notices posted to it (``AgentFleet.post_notice``); ``next`` is one
        # call, so a stop's notice, posted from the signal handler, cannot take a number the interrupted code took
        self.notice_seq = itertools.count(1)
        self.last_beat = time.monotonic()
        self.lock = threading.Lock()
        self.watcher: Optional[threading.Thread] = None
        self.watching = threading.Event()  # its exit watcher's connection is up (``AgentFleet._start_watchers``)

    def exit_reported(self, wid: int) -> bool:
        """The worker is gone and the controller has its exit in the queue (a lost node reports none)."""
        with self.lock:
            return wid not in self.workers or wid in self.reported or not self.alive()

    def alive(self) -> bool:
        if self.lost:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        return not self.silent  # as of the controller's last look at the heartbeats


class AgentFleet:
    """One node agent process per node, reached through the store; the controller's fleet under
    ``launcher=local`` (every agent started here) and ``launcher.mode=per_host`` (node 0's started here,
    the others awaited: ``started_here``)."""

    can_spawn = True

    def __init__(self, cfg: DictConfig, run_dir: Path, store, address: tuple[str, int], events: Queue,
                 preload: list[str], persist: Optional[NodePersist], nodes: int,
                 started_here: Optional[list[int]] = None) -> None:
        if not sys.platform.startswith("linux") and any(f.kind == "kill_node" for f in all_faults(cfg)):
            raise ConfigError("fault kill_node needs Linux under launcher=local: a lost node's workers die with "
                              "its agent through the parent-death signal (prctl), which this OS lacks.")
        self.store, self.address, self.events = store, address, events
        secret = auth.job_secret(cfg.launcher.secret_file)
        secret_text = secret.decode() if secret is not None else auth.new_secret()
        self.secret = secret_text.encode()
        self._publish_config(cfg, Path(run_dir), preload, persist)
        here = set(range(nodes) if started_here is None else started_here)
        gpus = _gpu_shares(nodes, cfg.parallel.procs_per_node) if started_here is None else []
        self.silence_s = silence_s = HeartbeatConfig.of(cfg.heartbeat).silence_s
        self.start_timeout_s = cfg.launcher.start_timeout_s
        self.notices = cfg.heartbeat.route == "agent"  # the agents wait for the controller's notices
        self.zygote = ForkServer.exec_preloaded(ZYGOTE_PRELOAD + preload)
        self.agents: list[AgentHandle] = []
        try:
            for n in range(nodes):
                proc = None  # an agent another host's launcher started
                if n in here:
                    argv = ["--store", f"{address[0]}:{address[1]}", "--node", str(n), "--run-dir", str(run_dir)] \
                        + (["--gpus", gpus[n]] if gpus else [])
                    proc = AgentProcess(self.zygote.start(node_agent.main, (argv, self.secret)))
                self.agents.append(AgentHandle(n, proc, silence_s))
            self._await_registration(cfg.launcher.start_timeout_s)
            self._start_watchers(self.agents)
        except BaseException:
            for a in self.agents:
                if a.proc is not None:
                    a.proc.kill()
                    a.proc.wait()
            self.zygote.close()
            raise

    def adopt(self, node: int, registered: bool = True) -> None:
        """A host that joined the running job registered its agent as node ``node``, the next index (a remote
        agent, seen by its heartbeat). ``registered=False``: it never did; the index stays taken, by nobody."""
        assert node == len(self.agents), f"node {node} joins a fleet of {len(self.agents)} nodes"
        agent = AgentHandle(node, None, self.silence_s)
        self.agents.append(agent)
        if not registered:
            agent.registered, agent.lost = False, True
            return
        self._start_watchers([agent])

    def spawn(self, target, args: tuple, wid: int, node: int) -> None:
        """Node ``node``'s agent starts worker ``wid`` from its fork server. Only the spec travels: the agent
        runs ``runner.training.worker.main`` (``target``) with the config of its own file."""
        if (target.__module__, target.__name__) != ("runner.training.worker", "main"):
            raise ValueError(f"node agents start runner.training.worker.main only, "
                             f"not {target.__module__}.{target.__name__}")
        agent = self.agents[node]
        ack = self._command(agent, {"op": "spawn", "spec": asdict(args[0])})
        if ack is not None:
            with agent.lock:
                agent.workers[wid] = int(ack)

    def signal(self, wid: int, node: int, sig: int) -> None:
        """Signal worker ``wid``; returns once its agent did and, for SIGKILL, once the worker's exit is in
        the controller's queue: kills carried out together (one step's faults, a hang kill beside a crash)
        are then decided together, however late the agents' reports travel (a lost node's workers are
        gone already)."""
        agent = self.agents[node]
        self._command(agent, {"op": "signal", "wid": wid, "sig": int(sig)})
        deadline = time.monotonic() + EXIT_REPORT_TIMEOUT_S
        while sig == signal.SIGKILL and agent.alive() and not agent.exit_reported(wid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def notify(self, targets: list[tuple[int, int]], sig: int) -> None:
        """Send ``sig`` to every (wid, node) of ``targets`` (a signal that ends nobody: the stack dump), every command
        queued before any acknowledgement is awaited: one round trip for the job, not one per rank in turn."""
        sent = [(agent, self._send(agent, {"op": "signal", "wid": wid, "sig": int(sig)}))
                for wid, node in targets if (agent := self.agents[node]).alive()]
        for agent, seq in sent:
            self._await_ack(agent, seq, ACK_TIMEOUT_S)

    def post_notice(self, notice: dict, nodes: Optional[list[int]] = None) -> None:
        """``heartbeat.route=agent``: a notice to the agent of each of ``nodes`` (default: every agent not lost), which
        waits for its next one (``NodeAgent._watch_notices``): a new generation, a stop, a worker or its host written
        off. One set per agent, nothing polled; under ``route=store`` the workers read these from the store
        themselves, and nothing is posted."""
        if not self.notices:
            return
        body = json.dumps(notice)
        for agent in self.agents if nodes is None else [self.agents[n] for n in nodes]:
            if not agent.registered or (nodes is None and agent.lost):
                continue
            self.store.set(protocol.agent_key(agent.node, "notice", next(agent.notice_seq)), body)

    def lose_node(self, node: int) -> list[int]:
        """Simulate the host going down: its agent SIGKILLed, its workers and persister dying with it.
        Returns the workers it took (once they are gone)."""
        agent = self.agents[node]
        if agent.proc is None:
            raise ConfigError(f"node {node}'s agent runs on another host: kill_node cannot be simulated there "
                              "(launcher.mode=per_host refuses it at start-up)")
        with agent.lock:
            victims = [wid for wid in agent.workers if wid not in agent.reported]
            agent.lost = True
        try:
            host = [p.pid for p in psutil.Process(agent.proc.pid).children(recursive=True)]  # fork server and below
        except psutil.NoSuchProcess:
            host = []  # the agent was gone already, and its processes with it
        agent.proc.kill()
        agent.proc.wait()
        deadline = time.monotonic() + 5
        while any(_running(pid) for pid in host) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._end_exits(agent)
        return victims

    def node_beats(self) -> dict[int, float]:
        """When each agent last beat (monotonic), by the time the beat carries: a beat read late (the agent's
        last one, read after its host died) proves life only until it was written."""
        agents = [a for a in self.agents if a.registered]
        values = self.store.multi_get([protocol.agent_key(a.node, "hb") for a in agents])
        now, wall = time.monotonic(), time.time()
        for agent, value in zip(agents, values):
            if value != agent.hb_value:  # "<wall time>", or under heartbeat.route=agent "<wall time> <record version>"
                beat_wall, _, version = value.partition(b" ")
                agent.hb_value, agent.last_beat = value, now - max(0.0, wall - float(beat_wall))
                agent.beats += 1
                agent.record_version = int(version) if version else agent.record_version
            agent.silent = now - agent.last_beat > agent.silence_s
        return {a.node: a.last_beat for a in agents}

    def fence(self, node: int, reason: str, gen: int) -> None:
        """The controller declared node ``node`` lost: it stays lost (``alive`` is False from now on, however its
        beat comes back), nothing is sent to it any more, and its agent, once heard again, reads the signed fence
        and halts (``runner.agents.node_agent``). A host comes back only by joining anew (``runner.agents.joins``)."""
        agent = self.agents[node]
        with agent.lock:
            if agent.lost:
                return  # lost already (its agent killed here, or fenced before)
            agent.lost = True
        self.store.set(protocol.node_fence_key(node),
                       auth.sign(self.secret, {"node": node, "reason": reason, "gen": gen}))
        self.post_notice({"host_fenced": True}, [node])  # read at once when its link is back
        self._end_exits(agent)

    def shutdown(self, status: str) -> None:
        """Every agent ends its workers (killed at once unless the run completed) and exits with the code of the
        run's ``status`` (``records.exit_code``); a remote agent is awaited until it acknowledged (it then has
        reported its workers' exits)."""
        body = {"op": "shutdown", "completed": status in ("completed", "stopped"), "exit_code": exit_code(status)}
        sent = {agent.node: self._send(agent, body) for agent in self.agents if agent.alive()}
        for agent in self.agents:
            if agent.proc is None:
                if agent.node in sent:
                    self._await_ack(agent, sent[agent.node], SHUTDOWN_TIMEOUT_S)
            else:
                try:
                    agent.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)  # its workers' grace, then its persister's writes
                except subprocess.TimeoutExpired:
                    agent.proc.kill()
                    agent.proc.wait()
            if not agent.lost:
                self._end_exits(agent)
            if agent.watcher is not None:
                agent.watcher.join(timeout=5)
        self.zygote.close()

    # -- the store side ---------------------------------------------------------------------------
    def _publish_config(self, cfg: DictConfig, run_dir: Path, preload: list[str],
                        persist: Optional[NodePersist]) -> None:
        """Write what the agents run to the run dir, and its signed digest to the store."""
        raw = agent_config(cfg, preload, persist)
        (run_dir / protocol.AGENT_CONFIG_FILE).write_bytes(raw)
        self.config_digest = auth.digest(raw)  # what a host joining later must compose too
        self.store.set(protocol.AGENT_CONFIG, auth.sign(self.secret, {"sha256": self.config_digest}))

    def _command(self, agent: AgentHandle, body: dict, ack: bool = True) -> Optional[bytes]:
        """Queue a signed command for ``agent``; with ``ack``, wait until it was carried out and return the
        agent's answer (None when the agent is gone)."""
        if not agent.alive():
            return None
        seq = self._send(agent, body)
        return self._await_ack(agent, seq, ACK_TIMEOUT_S) if ack else None

    def _send(self, agent: AgentHandle, body: dict) -> int:
        """Queue a signed command for ``agent``; returns its place in the queue."""
        seq = self.store.add(protocol.agent_key(agent.node, "cmds"), 1)
        self.store.set(protocol.agent_key(agent.node, "cmd", seq),
                       auth.sign(self.secret, {**body, "node": agent.node, "seq": seq}))
        return seq

    def _await_ack(self, agent: AgentHandle, seq: int, timeout_s: float) -> Optional[bytes]:
        """The agent's answer to command ``seq``, or None when it is gone or did not answer in time."""
        key = protocol.agent_key(agent.node, "ack", seq)
        deadline = time.monotonic() + timeout_s
        while agent.alive() and time.monotonic() < deadline:
            try:
                self.store.wait([key], ACK_SLICE)
                return self.store.get(key)
            except DistStoreError:
                if agent.proc is None:
                    self.node_beats()  # a remote agent's life shows only in its beat
                continue
        return None

    def _await_registration(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(self.agents)
        while waiting:
            for agent in list(waiting):
                refused = protocol.agent_key(agent.node, "refused")
                if self.store.check([protocol.agent_key(agent.node)]):
                    waiting.remove(agent)
                    agent.last_beat = time.monotonic()
                elif self.store.check([refused]):
                    why = protocol.read_refusal(self.store, agent.node)
                    raise RuntimeError(f"the node agent of host {agent.node} refused to start: {why}")
                elif agent.proc is not None and agent.proc.poll() is not None:
                    raise RuntimeError(f"node agent {agent.node} exited with code {agent.proc.returncode} before "
                                       f"registering: see its output")
            if waiting and time.monotonic() > deadline:
                remote = [a.node for a in waiting if a.proc is None]
                hint = (f" (hosts {remote}: start the same command on every host, one process per host)"
                        if remote else "")
                raise RuntimeError(f"node agents {[a.node for a in waiting]} did not register within "
                                   f"launcher.start_timeout_s={timeout_s}{hint}")
            time.sleep(0.01)

    def _start_watchers(self, agents: list[AgentHandle]) -> None:
        """Start each agent's exit watcher and return once every one is connected. An exit reported before its
        watcher's connection is up reaches the controller only when it is: a connection can take seconds (torch's
        store server looks up each new peer's name, on its one event-loop thread, where reverse DNS is slow), and
        meanwhile the heartbeat rules would take the exited worker for a hung one."""
        for a in agents:
            a.watcher = threading.Thread(target=self._watch_exits, args=(a,), name=f"exits-{a.node}", daemon=True)
            a.watcher.start()
        deadline = time.monotonic() + self.start_timeout_s
        for a in agents:
            if not a.watching.wait(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"the controller's watcher of node {a.node}'s exits did not connect to the store "
                                   f"within launcher.start_timeout_s={self.start_timeout_s}s: see the error above it "
                                   f"in this output, or raise the timeout where connections are slow")

    def _watch_exits(self, agent: AgentHandle) -> None:
        """Turn the agent's exit records into the controller's queue items, at once, until the list ends."""
        store = protocol.connect(*self.address, timeout_s=self.start_timeout_s)
        agent.watching.set()
        seen = 0
        try:
            while True:
                key = protocol.agent_key(agent.node, "exit", seen + 1)
                await_key(store, key)
                seen += 1
                record = protocol.get_json(store, key)
                if record.get("end"):
                    return
                with agent.lock:
                    if not agent.lost:
                        self.events.put(("exit", record["wid"], record["code"], record["t"]))
                    agent.reported.add(record["wid"])
        except DistError:
            return  # the store is gone with the controller

    def _end_exits(self, agent: AgentHandle) -> None:
        """The agent is gone: end its exit list after the last record it wrote."""
        last = self.store.add(protocol.agent_key(agent.node, "exits"), 0)
        protocol.set_json(self.store, protocol.agent_key(agent.node, "exit", last + 1), {"end": True})


def agent_config(cfg: DictConfig, preload: list[str], persist: Optional[NodePersist]) -> bytes:
    """The config file an agent runs: the job's config, its fork server's preloads, its node's persister.
    Every host composes it from its own command line; the controller signs its digest."""
    agent_cfg = {"config": OmegaConf.to_container(cfg, resolve=True), "preload": preload,
                 "persist": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(persist).items()}
                 if persist is not None else None}
    return json.dumps(agent_cfg).encode()


def _running(pid: int) -> bool:
    """The process exists and is no zombie (a dead process whose parent died is reaped by init, or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _gpu_shares(nodes: int, procs_per_node: int) -> list[str]:
    """Each simulated host's GPUs (indices of the visible ones), as logical ranks took them before: node n's
    local rank i uses GPU (n * procs_per_node + i) mod count. None without GPUs."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return []
    return [",".join(str((n * procs_per_node + i) % count) for i in range(procs_per_node)) for n in range(nodes)]

