"""The node agent: one process per host that runs the host's workers for the controller, over TCP only.

It connects to the job's store, checks that the config file it was given is the one the controller
signed (it refuses to start otherwise: the config names classes to import), registers, and beats a
heartbeat. Then it carries out the controller's commands (start a worker from its host's fork server;
signal one; shut down), each verified against the job's secret
(``runner.agents.auth``): a command with a bad or missing MAC is logged (``command_refused``) and not
carried out. Every worker exit is reported the moment it happens. It owns its host's flash-checkpoint
persister. It dies with its launcher, and its fork server and every process that forks die with it
(``runner.agents.spawned``), so killing an agent is a real host loss. When the controller's store goes
away, or does not answer for ``HeartbeatConfig.controller_lost_after_s`` (its host went silent: the store
calls block, ``runner.plumbing.contact``), it kills its workers and exits non-zero (``EXIT_CONTROLLER_LOST``). Once the
controller declared its host lost it stays lost: the agent reads the signed fence (``protocol.node_fence_key``)
with its next beat when it is heard again, kills its workers and exits non-zero (``EXIT_FENCED``); the host may
come back only as a new host joining the job (``runner.agents.joins``). Its exit code says how the job ended:
the shutdown command carries the host's code (``runner.control.records.exit_code``).

The agent imports the worker's modules itself (the preload list of its config file) and, before its
threads start, forks the host's fork server from itself (``runner.agents.fork_server``): a worker
or a replacement starts in a fork, without a second interpreter's imports.

``python -m runner.agents --store HOST:PORT --node N --run-dir DIR [--gpus 0,1] [--secret-file F]``; the
secret comes from ``RESILIENT_RUNNER_SECRET`` (removed from the environment at once) or ``--secret-file``.
Under ``launcher=local`` the controller's zygote forks ``main`` with the same arguments and the secret.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NoReturn, Optional

from torch.distributed import DistError, DistStoreError

from runner.agents import auth, spawned
from runner.agents.beat_relay import BeatRelay
from runner.agents.fork_server import ForkedProcess, ForkServer
from runner.config.schema import HeartbeatConfig
from runner.plumbing import protocol
from runner.plumbing.beat_socket import BEAT_SOCKET_ENV
from runner.plumbing.contact import ControllerContact
from runner.plumbing.events import EventLog
from runner.recovery.actions import NodePersist, NodeService

CONNECT_TIMEOUT_S = 60.0
REFUSAL_READ_TIMEOUT_S = 30.0
WAIT_SLICE = timedelta(hours=1)  # a blocking wait for the next command or exit, renewed while nothing comes
EXIT_REFUSED = 2  # the agent would not start (its config, the job's secret)
EXIT_CONTROLLER_LOST = 3  # the controller's store went away or stopped answering
EXIT_FENCED = 4  # the controller declared this host lost
EXIT_TERMINATED = 128 + signal.SIGTERM  # its launcher's SIGTERM (``terminated``): what a shell reports for one
HALT_GRACE_S = 2.0  # a halting agent's workers, killed, are awaited this long each
TORCHRUN_GRACE_S = 3.0  # a torchrun told to end (SIGTERM) is SIGKILLed after this


class WorkerWatch:
    """The host's worker processes, and a thread that reports each one's exit the moment it happens. The thread
    sleeps until an exit, a new worker or ``stop`` wakes it (no periodic wake-up: an idle host's agent, a spare
    host's, spends no CPU between its beats)."""

    def __init__(self, report: Callable[[int, Optional[int]], None]) -> None:
        self.report = report
        self.procs: dict[int, BaseProcess | ForkedProcess] = {}  # wid -> its started worker process
        self.reported: set[int] = set()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, name="worker-watch", daemon=True)
        self._thread.start()

    def add(self, wid: int, proc: BaseProcess | ForkedProcess) -> None:
        with self._lock:
            self.procs[wid] = proc
        os.write(self._wake_w, b"x")

    def pids(self) -> dict[int, int]:
        with self._lock:
            return {wid: _pid(p) for wid, p in self.procs.items() if p.exitcode is None}

    def signal(self, wid: int, sig: int) -> None:
        with self._lock:
            proc = self.procs.get(wid)
        if proc is not None and proc.exitcode is None:
            try:
                os.kill(_pid(proc), sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Report the exits still pending, then stop watching."""
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _watch(self) -> None:
        while True:
            # every worker whose exit is not reported yet, also one another thread already reaped (reading
            # ``exitcode`` reaps, as pids() does): its sentinel stays readable, so its exit is reported now
            with self._lock:
                live = {p.sentinel: wid for wid, p in self.procs.items() if wid not in self.reported}
            stopping = self._stop
            ready = wait(list(live) + [self._wake_r], timeout=0 if stopping else WAIT_SLICE.total_seconds())
            for r in ready:
                if r == self._wake_r:
                    os.read(self._wake_r, 64)
                    continue
                assert isinstance(r, int)  # wait() hands back the descriptors it was given
                wid = live[r]
                with self._lock:
                    proc = self.procs[wid]
                proc.join(timeout=1)
                self.report(wid, proc.exitcode)
                with self._lock:
                    self.reported.add(wid)
            if stopping:
                return


def _pid(proc: BaseProcess | ForkedProcess) -> int:
    """A process is added once started, so it has a pid."""
    assert proc.pid is not None
    return proc.pid


class NodeAgent:
    """Node ``node``'s agent: verifies its config, registers, then serves the controller's commands."""

    def __init__(self, node: int, address: tuple[str, int], secret: bytes, run_dir: Path,
                 gpus: Optional[list[int]], config_file: Optional[Path] = None, torchrun: Optional[int] = None) -> None:
        self.node, self.address, self.secret, self.run_dir = node, address, secret, run_dir
        self.torchrun = torchrun  # the pid of the torchrun that started this host's process, if one did
        self.gpus = gpus
        self.config_file = config_file or run_dir / protocol.AGENT_CONFIG_FILE  # per_host: this host's own copy
        self.events = EventLog(run_dir / "events.jsonl", rank=lambda: f"agent-{node}", step=lambda: -1)
        self.store = protocol.connect(*address, CONNECT_TIMEOUT_S)
        self.cfg_dict: dict = {}
        self.persister: Optional[NodeService] = None
        self.fork_server: Optional[ForkServer] = None
        self.exits = 0
        self._stop_beat = threading.Event()
        self._halting = threading.Lock()  # one halt (the watchdog's, the fence's or a lost store's); never released
        self._fence_refused = False
        self.relay: Optional[BeatRelay] = None  # heartbeat.route=agent: this host's workers beat to it
        self._notice = 0  # route=agent: the controller's notice the watcher waits for (``_watch_notices``)

    def _await_refusal_read(self) -> None:
        """Stay until the controller has read the refusal (it acknowledges, or ends and its store closes):
        under torchrun this host's launcher may hold the rendezvous store, and leaving at once can take the
        controller's host down before it reports why the job failed. Bounded: REFUSAL_READ_TIMEOUT_S."""
        try:
            self.store.wait([protocol.agent_key(self.node, "refusal_read")], timedelta(seconds=REFUSAL_READ_TIMEOUT_S))
        except DistError:  # the controller ended (its store closed), or the wait ran out
            pass

    def run(self) -> int:
        refusal = self._load_config()
        if refusal is not None:
            self.events.emit("agent_refused", node=self.node, reason=refusal)
            self.store.set(protocol.agent_key(self.node, "refused"), refusal)
            print(f"node agent {self.node}: {refusal}", file=sys.stderr)
            self._await_refusal_read()
            return EXIT_REFUSED
        self.store.set(protocol.agent_key(self.node, "hb"), repr(time.time()))  # exists before anyone reads it
        protocol.set_json(self.store, protocol.agent_key(self.node),
                          {"node": self.node, "pid": os.getpid(), "host": socket.gethostname()})
        self.reports = protocol.connect(*self.address, CONNECT_TIMEOUT_S)
        self.watch = WorkerWatch(self._report_exit)
        self.contact = ControllerContact(self.lost_after_s, self._controller_silent, name="controller-contact")
        if self.heartbeat.route == "agent":  # after the fork server forked: its processes hold no copy of the socket
            self.relay = BeatRelay(self.node, self.interval_s)
            self.relay.start()
            notices = threading.Thread(target=self._watch_notices, args=(self.relay,), name="notices", daemon=True)
            notices.start()
        beat = threading.Thread(target=self._beat, name="agent-heartbeat", daemon=True)
        beat.start()
        self.contact.start()
        try:
            return self._serve()
        except DistError as e:  # the controller's store is gone: nobody is left to tell what to do
            self._halt(EXIT_CONTROLLER_LOST, "controller_lost", f"lost the controller ({str(e).splitlines()[0]})")
        finally:  # never left inside a store call at exit (a daemon thread in C++ then aborts the process)
            self.contact.stop()
            self._stop_beat.set()
            beat.join(timeout=self.interval_s)
            if self.relay is not None:
                self._end_notices(notices)
                self.relay.close()

    def _load_config(self) -> Optional[str]:
        """Read the config file, check it against the controller's signed digest, import the worker's
        modules, fork the host's fork server and start the node's persister from it. Returns why the agent
        refuses to start, or None."""
        raw = self.config_file.read_bytes()
        signed = auth.verify(self.secret, self.store.get(protocol.AGENT_CONFIG))
        if signed is None:
            return "the controller's config digest does not carry a valid MAC for this job's secret"
        if signed.get("sha256") != auth.digest(raw):
            return (f"{self.config_file.name} differs from the config the controller signed (every host must run "
                    "the same command, with the same hydra.run.dir)")
        agent_cfg = json.loads(raw)
        self.cfg_dict = agent_cfg["config"]
        self.heartbeat = HeartbeatConfig.of(self.cfg_dict["heartbeat"])
        self.interval_s, self.lost_after_s = self.heartbeat.interval_s, self.heartbeat.controller_lost_after_s
        for module in agent_cfg["preload"]:
            importlib.import_module(module)
        persist = agent_cfg["persist"]
        spec = None if persist is None else NodePersist(**{**persist, "out_dir": Path(persist["out_dir"]),
                                                           "events_path": Path(persist["events_path"])})
        if spec is not None:  # the service's module too, before the fork server forks
            module, start = spec.start.split(":")
            start_service = getattr(importlib.import_module(module), start)
        self.fork_server = ForkServer.fork()  # from the main thread, which lives as long as the agent
        if spec is not None:
            self.persister = start_service(self.fork_server, spec, self.node)
        return None

    def _serve(self) -> int:
        seq = 0
        while True:
            seq += 1
            key = protocol.agent_key(self.node, "cmd", seq)
            await_key(self.store, key)
            body = auth.verify(self.secret, self.store.get(key))
            why = None if body is not None else "bad or missing MAC"
            if body is not None and (body.get("node"), body.get("seq")) != (self.node, seq):
                why = f"signed for node {body.get('node')}'s command {body.get('seq')}, not this one (a replay)"
            if body is not None and why is None and body.get("op") not in ("spawn", "signal", "shutdown"):
                why = f"unknown command {body.get('op')!r}"
            if why is not None or body is None:
                self.events.emit("command_refused", node=self.node, seq=seq, reason=why)
                continue
            if body["op"] == "shutdown":
                self._shutdown(body["completed"])
                self.store.set(protocol.agent_key(self.node, "ack", seq), "0")  # its workers' exits are reported
                return int(body["exit_code"])  # the job's end, as this host's launcher is to see it
            ack = self._spawn(body["spec"]) if body["op"] == "spawn" else self._signal(body["wid"], body["sig"])
            self.store.set(protocol.agent_key(self.node, "ack", seq), str(ack))

    def _spawn(self, spec_fields: dict) -> int:
        env = {"LOCAL_RANK": str(spec_fields["local_rank"])}
        if self.relay is not None:
            env[BEAT_SOCKET_ENV] = self.relay.name
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpus[spec_fields["local_rank"] % len(self.gpus)])
        assert self.fork_server is not None  # started before the first command is read
        proc = self.fork_server.start(spawned.run_worker, (spec_fields, self.cfg_dict, env))
        self.watch.add(spec_fields["wid"], proc)
        return _pid(proc)

    def _signal(self, wid: int, sig: int) -> int:
        self.watch.signal(wid, sig)
        return sig

    def _report_exit(self, wid: int, code: Optional[int]) -> None:
        if self.relay is not None:
            self.relay.forget(wid)
        self.exits += 1
        try:
            protocol.set_json(self.reports, protocol.agent_key(self.node, "exit", self.exits),
                              {"wid": wid, "code": code, "t": time.time()})
            self.reports.add(protocol.agent_key(self.node, "exits"), 1)
        except DistError:
            pass  # the controller is gone: nobody to report to

    def _beat(self) -> None:
        """Beat every ``agent_beat_s``, and read whether the controller fenced this host: one round trip, which also
        tells the contact's watchdog that the controller answers. With ``heartbeat.route=agent`` the host's
        record goes first when it changed and the beat carries its version; the fence, a new generation and a stop
        come as notices (``_watch_notices``), so the round trip is made only every quarter of the contact's bound."""
        beats = protocol.connect(*self.address, CONNECT_TIMEOUT_S)
        key, fence = protocol.agent_key(self.node, "hb"), protocol.node_fence_key(self.node)
        records = protocol.agent_key(self.node, "ranks")
        every = 1 if self.relay is None else max(1, int(self.lost_after_s / 4 / self.heartbeat.agent_beat_s))
        try:
            for n in itertools.count():
                if self._stop_beat.wait(self.heartbeat.agent_beat_s):
                    return
                now = repr(time.time())  # when: a beat seen late still proves life only until then
                if self.relay is None:
                    beats.set(key, now)
                else:
                    record = self.relay.record()
                    if record is not None:  # written before the beat that names its version
                        beats.set(records, record)
                    beats.set(key, f"{now} {self.relay.version}")
                if n % every == 0:
                    self.contact.asking()
                    if beats.check([fence]):
                        self._read_fence(beats.get(fence))
                    self.contact.answered()
        except DistError:
            return  # the controller is gone; the command loop notices too

    def _watch_notices(self, relay: BeatRelay) -> None:
        """route=agent: the controller's notices to this host (``AgentFleet.post_notice``: a new generation, a stop, a
        worker or this host written off), one blocking wait each, nothing polled; what the workers' heartbeats answer
        with (``runner.agents.beat_relay``). The agent's own ``end`` notice ends it (``_end_notices``)."""
        store = protocol.connect(*self.address, CONNECT_TIMEOUT_S)
        try:
            relay.gen = int(store.get("gen")) if store.check(["gen"]) else -1  # published before its first notice
            relay.stop_requested = store.check([protocol.STOP])
            while True:
                self._notice += 1
                key = protocol.agent_key(self.node, "notice", self._notice)
                await_key(store, key)
                notice = json.loads(store.get(key))
                if notice.get("end"):
                    return
                if "fence" in notice:  # a fence comes before the generation that replaces its worker
                    relay.fences[int(notice["fence"]["wid"])] = notice["fence"]
                relay.gen = max(relay.gen, notice.get("gen", -1))
                relay.stop_requested = relay.stop_requested or notice.get("stop", False)
                if notice.get("host_fenced"):
                    self._read_fence(store.get(protocol.node_fence_key(self.node)))
        except DistError:
            return  # the controller is gone; the command loop notices too

    def _end_notices(self, watcher: threading.Thread) -> None:
        """Wake the notice watcher with an ``end`` notice of the agent's own and wait for it: a thread still waiting in
        a store call when the process ends is woken by the store's close and aborts the process."""
        for _ in range(3):  # a notice of the controller's may take the key first: then the next one
            try:
                self.store.set(protocol.agent_key(self.node, "notice", self._notice), json.dumps({"end": True}))
            except DistError:
                pass  # the store is gone: so is the watcher's wait
            watcher.join(timeout=1.0)
            if not watcher.is_alive():
                return

    def _read_fence(self, raw: bytes) -> None:
        """The controller declared this host lost: halt. A fence without the job's MAC is logged once and ignored
        (the store has no authentication; only the controller may stop a host)."""
        record = auth.verify(self.secret, raw)
        if record is not None and record.get("node") == self.node:
            self._halt(EXIT_FENCED, "agent_fenced", f"fenced by the controller: {record.get('reason')}",
                       gen=record.get("gen"))
        elif not self._fence_refused:
            self._fence_refused = True
            self.events.emit("command_refused", node=self.node, seq=None, reason="a fence without a valid MAC")

    def terminated(self) -> NoReturn:
        """Its launcher sent SIGTERM (``runner.launch.termination``): halt, the breakpoint persists finished."""
        self._halt(EXIT_TERMINATED, "agent_terminated", "terminated by its launcher (SIGTERM)")

    def _controller_silent(self, silent_s: float) -> None:
        self._halt(EXIT_CONTROLLER_LOST, "controller_lost",
                   f"the controller did not answer for {silent_s:.1f}s (bound {self.lost_after_s:g}s)")

    def _halt(self, code: int, kind: str, reason: str, **details) -> NoReturn:
        """Stop this host's part of the job and end the process with ``code``, from whichever thread saw why (the
        others may be blocked in store calls to a silent controller): every worker killed at once; the persister
        finishes the breakpoint persists their exits started (a relaunch resumes from them) unless the host was
        fenced (its state is no longer the job's)."""
        self._halting.acquire()  # a second caller waits here until the first one's os._exit
        self.events.emit(kind, node=self.node, reason=reason, exit_code=code, **details)
        print(f"node agent {self.node}: {reason}; stopping its workers", file=sys.stderr, flush=True)
        self._shutdown(completed=False, persist=code != EXIT_FENCED)
        if code == EXIT_CONTROLLER_LOST and self.torchrun is not None:
            self._end_torchrun(self.torchrun)
        os._exit(code)

    @staticmethod
    def _end_torchrun(pid: int) -> None:
        """The torchrun that started this host's process would outlive the job: its own store calls to the
        rendezvous store, on node 0's host too, block as ours did when that host went silent, so it never sees this
        process exit. SIGTERM, then SIGKILL after ``TORCHRUN_GRACE_S`` (its handler runs only between those calls);
        this process dies with it (parent-death signal), or by the SIGTERM torchrun sends its workers."""
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + TORCHRUN_GRACE_S
        while os.getppid() == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() == pid:
            os.kill(pid, signal.SIGKILL)

    def _shutdown(self, completed: bool, persist: bool = True) -> None:
        """Every worker ends (killed at once unless the run completed); the persister finishes what its
        trainers' exits started (unless ``persist`` is off: it is killed); every exit is reported."""
        grace = time.monotonic() + (5.0 if completed else HALT_GRACE_S)
        if not completed:
            for wid in self.watch.pids():
                self.watch.signal(wid, signal.SIGKILL)
        for wid in list(self.watch.pids()):
            proc = self.watch.procs[wid]
            proc.join(timeout=max(0.0, grace - time.monotonic()))
            if proc.exitcode is None:
                self.watch.signal(wid, signal.SIGCONT)
                self.watch.signal(wid, signal.SIGKILL)
                proc.join(timeout=5)
        if self.persister is not None:
            if persist:
                self.persister.stop()
            else:
                self.persister.kill()
        self.watch.stop()
        if self.fork_server is not None:
            self.fork_server.close()


def await_key(store, key: str) -> None:
    """Block until ``key`` exists, however long that takes (DistError once the store is gone)."""
    while True:
        try:
            store.wait([key], WAIT_SLICE)
            return
        except DistStoreError:
            continue  # nothing for a while: keep waiting


def _gpus(arg: Optional[str]) -> Optional[list[int]]:
    """The physical GPUs this host's workers may use: ``--gpus`` indexes the visible ones (all by default)."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [int(d) for d in visible.split(",")] if visible else list(range(count))
    chosen = [int(i) for i in arg.split(",")] if arg else list(range(count))
    return [physical[i] for i in chosen]


def main(argv: Optional[list[str]] = None, secret: Optional[bytes] = None) -> None:
    """The agent's command line; ``secret`` is given by a caller that forked this process (the zygote)."""
    parser = argparse.ArgumentParser(prog="python -m runner.agents", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="HOST:PORT of the job's control-plane store")
    parser.add_argument("--node", type=int, required=True, help="this host's node index")
    parser.add_argument("--run-dir", type=Path, required=True,
                        help=f"holds {protocol.AGENT_CONFIG_FILE} and events.jsonl")
    parser.add_argument("--gpus", help="indices of the visible GPUs this host's workers use (default: all)")
    parser.add_argument("--secret-file", help=f"file holding the job's secret when {auth.SECRET_ENV} is not set")
    args = parser.parse_args(argv)
    spawned.die_with_parent()  # a host's agent goes with its launcher
    secret = secret if secret is not None else auth.job_secret(args.secret_file, pop_env=True)
    if secret is None:
        sys.exit(f"node agent {args.node}: no job secret: set {auth.SECRET_ENV} or pass --secret-file")
    host, port = args.store.rsplit(":", 1)
    agent = NodeAgent(args.node, (host, int(port)), secret, args.run_dir, _gpus(args.gpus))
    sys.exit(agent.run())
