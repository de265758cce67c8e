"""The control plane at scale: the real controller and store against N simulated hosts that speak its protocol.

    python bench/control_scale.py [--hosts 16,128,1024,2048] [--ranks-per-host 8] [--generators 2]
                                  [--route store|agent|store,agent] [--step-s 0.1] [--emit-calibration FILE]

For each N, node 0's side is the code a job runs, untouched: a process composes the config (``launcher.mode=per_host``,
``ft=[flashrecovery,deadpool]``, N training hosts of ``--ranks-per-host`` ranks and one spare host), hosts the store and
runs ``runner.control.controller.Controller`` with every agent remote. ``--generators`` processes stand in for the N + 1
hosts, without training: each host registers its agent, beats ``agent/<n>/hb`` every ``heartbeat.agent_beat_s`` (and
reads its fence), and serves its signed command queue (spawn: a simulated worker, acked with a made-up pid; signal;
shutdown) on a thread of its own, as a node agent does; every simulated worker does what a worker's heartbeat thread
does each ``heartbeat.interval_s`` (set ``hb/<wid>``, get ``gen``, check ``stop``: three operations; its fence it reads
only in a new generation), its step advancing; a new replacement or spare writes ``ready/<wid>``; and each rank adopts
every generation it is a member of (reads ``gen/<g>``, writes ``pg/<g>/arrived/<rank>``). With ``--route agent``
(``heartbeat.route=agent``) the workers beat to their agent, not the store: each agent writes its ranks' record
(``agent/<n>/ranks``) when a rank's step moved or it went quiet (two intervals without a beat), beats ``<time> <record
version>`` every ``agent_beat_s``, reads its fence every quarter of ``controller_lost_after_s``, and reads each notice
the controller posts it (a fence, then each generation). A simulated step lasts ``--step-s``. Faults, one after the
other, each once the job is steady:

- crash: a worker's exit is reported by its agent (``agent/<n>/exit/<k>``), as after a SIGKILL;
- silent host: a host's agent and workers stop writing anything (a host cut off or powered down);
- hang: one worker stops beating (SIGSTOP), the controller kills it through its agent.

Printed per N: the controller process's CPU per second at steady state (the store lives in that process and is
counted with it) and its store server thread's share, the store operations per second (the generators count theirs; the
controller's are counted at the source, ``runner.plumbing.store_counts``), the generators' own CPU (they share the
machine's cores with the controller), and per fault detect -> decided -> generation published -> adopted by
every simulated rank, with the store operations of the recovery that the protocol's model predicts from N
(``recovery_ops``) beside those counted. What is simplified, and so cheaper here than in a real job: survivors
report no failed collective, and each generator waits for a generation's arrivals once, where every real
member waits for all of them (``Comm._arrive``) and then runs gloo's rendezvous (3 operations per member);
both are in the model. Nothing here is timed in a test: ``tests/test_control_scale.py`` checks the op counts
against the model at small N.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Optional

from tree_cpu import process_cpu_s, threads_cpu_s

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STORE_THREAD = "pt_tcpstore_uv"  # the TCPStore server's thread in the controller's process (libuv backend)
STEP_S = 0.1  # a simulated step: the step a simulated worker's heartbeat reports advances this often
STEADY_S = 4.0  # how long steady state is measured (--steady-s)
FAULT_TIMEOUT_S = 60.0
SATURATED = 0.9  # generators reaching less of the prescribed heartbeat rate than this cannot stand in for hosts
# a recovery's own store traffic; heartbeats are steady state
RECOVERY_CLASSES = ("gen", "pg", "agent", "ready", "fenced")
# Operations whose number follows from the protocol; a wait or check in a polling loop follows the clock instead
WRITES_AND_READS = frozenset({"set", "get", "add", "compare_set", "delete_key"})


def overrides(hosts: int, ranks_per_host: int, misses: int, route: str) -> list[str]:
    world = hosts * ranks_per_host
    return [f"heartbeat.misses={misses}", f"heartbeat.route={route}", "+recipe=gpt_tiny", "launcher.mode=per_host",
            f"parallel.nodes={hosts}",
            f"parallel.procs_per_node={ranks_per_host}", f"parallel.spares={ranks_per_host}",
            "ft=[flashrecovery,deadpool]", f"trainer.global_batch_size={world}", "trainer.max_steps=1000000",
            "logger=none", "launcher.start_timeout_s=600"]


# -- node 0: the real controller ----------------------------------------------------------------------------
def serve_controller(hosts: int, ranks_per_host: int, misses: int, route: str, run_dir: Path) -> None:
    """Compose and validate the job's config, host the store, write its port, run the controller."""
    from hydra import compose, initialize_config_dir

    from runner.config import register_all
    from runner.config.registry import CONF_DIR
    from runner.config.validate import validate
    from runner.control.controller import Controller
    from runner.plumbing import protocol

    register_all([])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides(hosts, ranks_per_host, misses, route))
    validate(cfg, for_training=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = protocol.host_store("127.0.0.1", cfg.launcher.start_timeout_s)
    (run_dir / "port.tmp").write_text(str(store.port))
    (run_dir / "port.tmp").replace(run_dir / "port")  # whole or absent: the bench reads it as soon as it exists
    Controller(cfg, run_dir, store=store, address=("127.0.0.1", store.port), agents_started_here=[]).run()


# -- the simulated hosts ------------------------------------------------------------------------------------
class Ops:
    """This generator's store operations by key class (counted here, not through a wrapper: cheaper): ``ops``
    the writes and reads the protocol prescribes, ``polls`` the waits and checks of polling loops."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def add(self, key_class: str, n: int = 1, poll: bool = False) -> None:
        with self.lock:
            self.counts[f"{'poll' if poll else 'op'}:{key_class}"] += n


class SimWorker:
    def __init__(self, wid: int, node: int, role: str) -> None:
        self.wid, self.node, self.role = wid, node, role
        self.seq, self.alive, self.beating = 0, True, True
        self.fence_read_at: Optional[int] = None  # the generation it last read its fence in
        self.stopped_at = 0.0  # when it stopped beating (monotonic): its agent marks it quiet two intervals later


class SimHost:
    """One host: its agent's registration, beat and command queue; its workers live in the generator."""

    def __init__(self, gen: Generator, node: int) -> None:
        self.gen, self.node = gen, node
        self.silent = False
        self.exits = 0
        self.version = 0  # route=agent: its ranks' record's version, and what the record last held
        self.rows_held: tuple = ()
        self.notices_read = 0

    def serve(self) -> None:
        from torch.distributed import DistError

        from runner.agents.auth import verify
        from runner.agents.node_agent import await_key
        from runner.plumbing import protocol

        store = protocol.connect("127.0.0.1", self.gen.port, 60)
        ops, key = self.gen.ops, protocol.agent_key
        store.set(key(self.node), json.dumps({"node": self.node, "pid": os.getpid(), "host": f"sim{self.node}"}))
        store.set(key(self.node, "hb"), str(time.time()))
        ops.add("agent")
        ops.add("agent_hb")
        seq = 0
        try:
            while not self.gen.stop.is_set():
                # as the agent waits for its next command: one wait that does not expire. A wait that expires costs
                # the store's server a walk over every key anyone awaits (torch's cancel of a wait): waits sliced
                # at 0.5 s here spent a third of a core at 2,048 hosts that no real agent spends
                ops.add("agent", poll=True)
                await_key(store, key(self.node, "cmd", seq + 1))
                seq += 1
                body = verify(self.gen.secret, store.get(key(self.node, "cmd", seq)))
                ops.add("agent")
                if self.silent or body is None:
                    continue  # a silent host carries nothing out
                if body["op"] == "spawn":
                    spec = body["spec"]
                    self.gen.add_worker(SimWorker(spec["wid"], self.node, spec["role"]))
                    store.set(key(self.node, "ack", seq), str(100000 + spec["wid"]))
                    if spec["role"] != "initial":
                        store.set(f"ready/{spec['wid']}", "1")  # warm: a fork server's child is ready at once
                        ops.add("ready")
                elif body["op"] == "signal":
                    worker = self.gen.workers[body["wid"]]
                    store.set(key(self.node, "ack", seq), "1")
                    if body["sig"] == signal.SIGKILL and worker.alive:
                        self.report_exit(store, worker, -signal.SIGKILL)
                elif body["op"] == "shutdown":
                    store.set(key(self.node, "ack", seq), "1")
                    ops.add("agent")
                    return
                ops.add("agent")  # the acknowledgement
        except DistError:
            return  # the store went with the controller

    def report_exit(self, store, worker: SimWorker, code: int) -> None:
        from runner.plumbing import protocol

        worker.alive = worker.beating = False
        k = store.add(protocol.agent_key(self.node, "exits"), 1)
        protocol.set_json(store, protocol.agent_key(self.node, "exit", k), {"wid": worker.wid, "code": code,
                                                                            "t": time.time()})
        self.gen.ops.add("agent", 2)


class Generator:
    """Hosts ``index``, ``index + count``, ... of the job: their agents, workers and generation adoption."""

    def __init__(self, port: int, nodes: list[int], out: Path, interval_s: float, secret: bytes, route: str,
                 step_s: float) -> None:
        self.port, self.out, self.interval_s, self.secret = port, out, interval_s, secret
        self.route, self.step_s = route, step_s
        self.ops = Ops()
        self.stop = threading.Event()
        self.hosts = {n: SimHost(self, n) for n in nodes}
        self.workers: dict[int, SimWorker] = {}
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def add_worker(self, w: SimWorker) -> None:
        with self.lock:
            self.workers[w.wid] = w

    def run(self) -> None:
        from runner.plumbing import protocol

        threads = [threading.Thread(target=h.serve, daemon=True) for h in self.hosts.values()]
        loops = (self.beat_agents, self.adopt) if self.route == "agent" else (self.beat_agents, self.beat_workers,
                                                                                 self.adopt)
        threads += [threading.Thread(target=loop, daemon=True) for loop in loops]
        for t in threads:
            t.start()
        control = protocol.connect("127.0.0.1", self.port, 60)
        while not self.stop.is_set():  # the bench's orders, through files: cheap, and no store traffic counted
            self.dump()
            for path in sorted(self.out.glob("order-*.json")):
                try:
                    order = json.loads(path.read_text())
                except FileNotFoundError:
                    continue  # the generator whose victim it names carried it out and removed it meanwhile
                if order.get("wid") in self.workers or order.get("node") in self.hosts:  # the victim is here
                    self.carry_out(order, control)
                    path.unlink()
            if (self.out / "stop").exists():
                self.stop.set()
            time.sleep(0.05)
        self.dump()

    def carry_out(self, order: dict, store) -> None:
        with open(self.out / "faults.jsonl", "a") as f:  # the fault's time: when it is carried out
            f.write(json.dumps({**order, "t": time.time()}) + "\n")
        kind = order["kind"]
        if kind == "crash":
            worker = self.workers[order["wid"]]
            self.hosts[worker.node].report_exit(store, worker, -signal.SIGKILL)
        elif kind == "silent":
            host = self.hosts[order["node"]]
            host.silent = True
            for w in list(self.workers.values()):
                if w.node == host.node:
                    w.beating = False
        elif kind == "hang":
            worker = self.workers[order["wid"]]
            worker.beating, worker.stopped_at = False, time.monotonic()

    def beat_agents(self) -> None:
        """Every agent every ``agent_beat_s``, as an agent's own heartbeat thread writes it: its beat and whether the
        controller fenced its host; with route=agent its ranks' record first when it changed, and the fence only every
        quarter of ``controller_lost_after_s``."""
        from runner.config.schema import HeartbeatConfig
        from runner.plumbing import protocol

        store = protocol.connect("127.0.0.1", self.port, 60)
        hb = HeartbeatConfig(interval_s=self.interval_s)
        every = 1 if self.route == "store" else max(1, int(hb.controller_lost_after_s / 4 / hb.agent_beat_s))
        beats = 0
        while not self.stop.is_set():
            t_next = time.monotonic() + hb.agent_beat_s
            now, beats = time.time(), beats + 1
            ranks: dict[int, list[SimWorker]] = {}
            for w in list(self.workers.values()):
                ranks.setdefault(w.node, []).append(w)
            for host in self.hosts.values():
                if host.silent:
                    continue
                if self.route == "store":
                    store.set(protocol.agent_key(host.node, "hb"), str(now))
                else:
                    self.write_record(store, host, ranks.get(host.node, []), now)
                    store.set(protocol.agent_key(host.node, "hb"), f"{now!r} {host.version}")
                self.ops.add("agent_hb")
                if beats % every == 0:
                    store.check([protocol.node_fence_key(host.node)])
                    self.ops.add("fenced", poll=True)
            self.stop.wait(max(0.0, t_next - time.monotonic()))

    def write_record(self, store, host: SimHost, workers: list[SimWorker], wall: float) -> None:
        """route=agent: the host's record of its live ranks (``runner.agents.beat_relay``), when a step moved or a rank
        went quiet."""
        from runner.plumbing import protocol

        now, step = time.monotonic(), int((time.monotonic() - self.t0) / self.step_s)
        quiet = {w.wid: not w.beating and now - w.stopped_at > 2 * self.interval_s for w in workers if w.alive}
        held = (step, tuple(sorted(quiet.items())))
        if held == host.rows_held:
            return
        host.rows_held, host.version = held, host.version + 1
        rows = {str(wid): {"step": step, "phase": "compute", "gen": -1, "in_flight": 0, "t": wall, "quiet": q}
                for wid, q in quiet.items()}
        store.set(protocol.agent_key(host.node, "ranks"), json.dumps({"v": host.version, "rows": rows},
                                                                     separators=(",", ":")))
        self.ops.add("agent_ranks")

    def beat_workers(self) -> None:
        """Every worker every interval: what its heartbeat thread does (set ``hb/<wid>``, get ``gen``, check ``stop``;
        the worker's fence once per new generation). One thread does every worker of this generator in turn: when a
        round takes longer than the interval the beats fall behind, which ``Run.steady`` reports against the rate
        the protocol prescribes."""
        from runner.plumbing import protocol

        store = protocol.connect("127.0.0.1", self.port, 60)
        while not self.stop.is_set():
            t_next = time.monotonic() + self.interval_s
            step = int((time.monotonic() - self.t0) / self.step_s)
            for w in list(self.workers.values()):
                if not w.beating:
                    continue
                w.seq += 1
                payload = {"seq": w.seq, "step": step, "phase": "compute", "rss": 1 << 30, "t": time.time()}
                store.set(f"hb/{w.wid}", json.dumps(payload))
                gen = int(store.get("gen"))
                store.check([protocol.STOP])
                self.ops.add("hb", 2)
                self.ops.add("stop", poll=True)
                if w.fence_read_at != gen:
                    store.check([protocol.worker_fence_key(w.wid)])
                    w.fence_read_at = gen
                    self.ops.add("fenced", poll=True)
            self.stop.wait(max(0.0, t_next - time.monotonic()))

    def adopt(self) -> None:
        """Each published generation: its members here read it and arrive at its rendezvous."""
        from torch.distributed import DistStoreError

        from runner.plumbing import protocol

        store = protocol.connect("127.0.0.1", self.port, 60)
        seen = -1
        while not self.stop.is_set():
            try:  # the bench's own watch, standing in for each member's wait: not counted
                store.wait([f"gen/{seen + 1}"], timedelta(seconds=0.2))
            except DistStoreError:
                continue
            seen += 1
            mine = [(rank, wid) for rank, wid in enumerate(protocol.Layout.from_json(store.get(f"gen/{seen}")).members)
                    if wid in self.workers and self.workers[wid].alive]
            for rank, _ in mine:  # each member: the newest generation, its layout, its arrival
                store.get("gen")
                store.get(f"gen/{seen}")
                store.set(f"pg/{seen}/arrived/{rank}", "1")
            self.ops.add("gen", 2 * len(mine))
            self.ops.add("pg", len(mine))
            if self.route == "agent":
                self.read_notices(store, seen)
            with open(self.out / "adopted.jsonl", "a") as f:
                f.write(json.dumps({"gen": seen, "t": time.time(), "ranks": len(mine)}) + "\n")

    def read_notices(self, store, gen: int) -> None:
        """route=agent: every host heard, its notices up to generation ``gen``'s (a fence of one of its workers
        comes before it), as its agent's notice watcher reads them (``NodeAgent._watch_notices``)."""
        from runner.plumbing import protocol

        for host in self.hosts.values():
            while not host.silent:
                key = protocol.agent_key(host.node, "notice", host.notices_read + 1)
                store.wait([key], timedelta(seconds=FAULT_TIMEOUT_S))
                notice = json.loads(store.get(key))
                host.notices_read += 1
                self.ops.add("agent")
                self.ops.add("agent", poll=True)
                if notice.get("gen") == gen:
                    break

    def dump(self) -> None:
        tmp = self.out / f"ops-{os.getpid()}.tmp"
        tmp.write_text(json.dumps(dict(self.ops.counts)))
        tmp.replace(self.out / f"ops-{os.getpid()}.json")


def serve_hosts(port: int, nodes: list[int], out: Path, interval_s: float, secret_file: Path, route: str,
                step_s: float) -> None:
    Generator(port, nodes, out, interval_s, secret_file.read_bytes(), route, step_s).run()


# -- the bench's side -------------------------------------------------------------------------------------
def recovery_ops(world: int, ranks_per_host: int, fault: str, route: str = "store",
                 hosts_lost: int = 0) -> dict[str, int]:
    """A recovery's store writes and reads by key class (polls left out: their number follows the clock), from
    the protocol, for a job of ``world`` ranks, ``hosts_lost`` hosts lost before it:

    - ``gen``: a crash or a hang publishes two generations (survivors-only, then complete), a silent host whose
      ranks a warm spare host takes one; the controller sets ``gen/<g>`` and ``gen`` (2), each member reads both
      (2 per member);
    - ``pg``: each member's arrival at the generation's rendezvous (1 per member). A real member then waits for
      every arrival and runs gloo's rendezvous (3 operations): ``pg_waits`` and ``gloo`` say how many, which the
      generators do not issue (one watch per generator stands in for the waits);
    - ``agent``: an exit report (the agent's counter and record, the controller's read: 3); a command (the
      controller's counter and record, the agent's read and acknowledgement, the controller's read of it: 5): a
      crash is an exit and a replacement's spawn, a hang also the kill before them and, before the kill, the
      stack-dump signal to every live rank (``runner.control.diagnosis``: N commands, sent together); a silent
      host's exit list is ended by the controller (its counter read, the end record, its watcher's read: 3);
    - ``ready``: the replacement's ready key (the controller looks for it in a polling check);
    - ``fenced``: one record per worker written off, and a silent host's own (``protocol.node_fence_key``);
    - with ``route=agent``, ``agent`` also holds the controller's notices (``AgentFleet.post_notice``): each
      generation to every agent not lost (posted and read: 2 each), each worker written off to its agent (2, only
      posted when its host is silent), the silent host's fence (posted only).
    """
    members = [world] if fault == "silent" else [world - 1, world]
    commands = {"crash": 1, "hang": 2 + world, "silent": 0}[fault]
    exits = 1  # a crash's or hang's exit report, or the end of a silent host's list
    written_off = ranks_per_host if fault == "silent" else 1
    agents_heard = world // ranks_per_host + 1 - hosts_lost - (fault == "silent")  # the spare host's agent too
    notices = 0 if route == "store" else (2 * agents_heard * len(members)
                                          + (written_off + 1 if fault == "silent" else 2 * written_off))
    return {"gen": sum(2 + 2 * m for m in members), "pg": sum(members), "agent": 3 * exits + 5 * commands + notices,
            "ready": 1 if commands else 0, "fenced": written_off + (fault == "silent"), "pg_waits": sum(members),
            "gloo": 3 * sum(members)}


def complete_lines(path: Path) -> list[dict]:
    """The JSON lines of a file other processes append to, without a last line still being written."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]


class Run:
    """One N: the controller process, the generators, the faults, the figures."""

    def __init__(self, hosts: int, ranks_per_host: int, generators: int, steady_s: float, misses: int, route: str,
                 step_s: float) -> None:
        self.hosts, self.rph, self.world = hosts, ranks_per_host, hosts * ranks_per_host
        self.generators, self.steady_s, self.misses = generators, steady_s, misses
        self.route, self.step_s = route, step_s
        self.hosts_lost = 0  # by the faults so far: their agents get no notices
        self.dir = Path(tempfile.mkdtemp(prefix="rr-scale-"))
        self.run_dir, self.out = self.dir / "run", self.dir / "sim"
        self.out.mkdir()
        self.counts = self.dir / "counts"
        self.counts.mkdir()
        self.gens: list[subprocess.Popen] = []
        self.controller: Optional[subprocess.Popen] = None
        self.logs: dict[int, Path] = {}  # pid -> its stderr: the directory is gone after close()

    def start(self) -> None:
        from runner.agents import auth

        secret = auth.new_secret()
        secret_file = self.dir / "secret"
        secret_file.write_text(secret)
        env = {**os.environ, auth.SECRET_ENV: secret, "RUNNER_STORE_COUNTS": str(self.counts)}
        me = str(Path(__file__).resolve())
        argv = [sys.executable, me, "--serve-controller", str(self.hosts), str(self.rph), str(self.misses),
                self.route, str(self.run_dir)]
        self.controller = self.spawn(argv, env, "controller")
        port_file = self.run_dir / "port"
        self.wait_for("the store's port", lambda: port_file.exists())
        port = port_file.read_text()
        nodes = list(range(self.hosts + 1))  # + the spare host
        env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, "RUNNER_STORE_COUNTS")}
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # a wait's slice running out is no news here
        n_gen = min(len(nodes), max(1, self.generators))
        for i in range(n_gen):
            self.gens.append(self.spawn([sys.executable, me, "--serve-hosts", port, ",".join(map(str, nodes[i::n_gen])),
                                         str(self.out), str(secret_file), self.route, str(self.step_s)], env,
                                        f"generator{i}"))
        self.wait_for("generation 0 adopted by every rank", lambda: self.adopted(0) >= self.world, timeout_s=600)

    def spawn(self, argv: list[str], env: dict, name: str) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        with open(log, "w") as stderr:
            proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr)
        self.logs[proc.pid] = log
        return proc

    def wait_for(self, what: str, cond, timeout_s: float = FAULT_TIMEOUT_S) -> float:
        deadline = time.monotonic() + timeout_s
        while not cond():
            for p in [self.controller, *self.gens]:
                if p is not None and p.poll() is not None:  # its log goes with the bench's directory: quote it
                    log = self.logs[p.pid].read_text()[-2000:]
                    raise RuntimeError(f"{what}: a bench process exited ({p.args[2]}), its log ends:\n{log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:.0f}s\n{self.state()}")
            time.sleep(0.01)
        return time.time()

    def state(self) -> str:
        """What a wait that timed out needs to be understood, in its message: the directory goes with the bench. The
        faults carried out and the orders no generator took, the run's newest events, each process's log tail."""
        carried = complete_lines(self.out / "faults.jsonl")
        pending = [path.name for path in self.out.glob("order-*.json")]
        newest = "\n".join(json.dumps(e)[:300] for e in complete_lines(self.run_dir / "events.jsonl")[-15:])
        logs = "\n".join(f"-- {log.name}: {log.read_text()[-600:]}" for log in self.logs.values() if log.exists())
        return f"faults carried out: {carried}\norders not taken: {pending}\nnewest events:\n{newest}\n{logs}"

    def adoptions(self) -> list[dict]:
        path = self.out / "adopted.jsonl"
        return complete_lines(path)

    def adopted(self, gen: int) -> int:
        return sum(a["ranks"] for a in self.adoptions() if a["gen"] == gen)

    def events(self, kind: str) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [e for e in complete_lines(path) if e["kind"] == kind]

    def ops(self) -> Counter:
        """Every store operation so far, ``op:<key class>`` or ``poll:<key class>``: the generators' counts and
        the controller process's records (``runner.plumbing.store_counts``)."""
        total: Counter = Counter()
        for f in self.out.glob("ops-*.json"):
            total.update(json.loads(f.read_text()))
        for _, what, key_class, _ in self.controller_records():
            if what not in ("connect", "sockets"):
                total[f"{'op' if what in WRITES_AND_READS else 'poll'}:{key_class}"] += 1
        return total

    def controller_records(self):
        """The controller process's store records (``runner.plumbing.store_counts``), each ``(wall time, what, key
        class, thread)``; a line still being written is read next time."""
        for f in self.counts.glob("*.tsv"):
            for line in f.read_text().split("\n")[:-1]:
                t, what, key_class, _, thread = line.split("\t")
                yield float(t), what, key_class, thread

    def controller_read(self, thread: str, since: float) -> bool:
        """Whether the controller process's thread ``thread`` read a key (a ``get``) after ``since`` (wall time)."""
        return any(name == thread and what == "get" and t > since for t, what, _, name in self.controller_records())

    def cpu(self, procs: list[subprocess.Popen]) -> float:
        total = 0.0
        for p in procs:
            try:
                total += process_cpu_s(p.pid)
            except (FileNotFoundError, ProcessLookupError):
                pass  # exited
        return total

    def steady(self) -> dict:
        """Controller and generators' CPU per second and store operations per second, nothing happening."""
        assert self.controller is not None
        c0, g0, ops0, t0 = self.cpu([self.controller]), self.cpu(self.gens), self.ops(), time.monotonic()
        s0 = threads_cpu_s(self.controller.pid, STORE_THREAD)
        time.sleep(self.steady_s)
        c1, g1, ops1, t1 = self.cpu([self.controller]), self.cpu(self.gens), self.ops(), time.monotonic()
        s1 = threads_cpu_s(self.controller.pid, STORE_THREAD)
        span, spent = t1 - t0, ops1 - ops0
        from runner.config.schema import HeartbeatConfig

        hb = HeartbeatConfig()
        if self.route == "store":
            # a worker's 3 operations per beat (the spare host's warm workers beat too); an agent's 2 per beat
            prescribed = 3 * (self.world + self.rph) / hb.interval_s + 2 * (self.hosts + 1) / hb.agent_beat_s
            achieved = (spent["op:hb"] + spent["poll:stop"] + spent["op:agent_hb"] + spent["poll:fenced"]) / span
        else:  # an agent's beat (its records, when a step moved, come on top)
            prescribed = (self.hosts + 1) / hb.agent_beat_s
            achieved = spent["op:agent_hb"] / span
        return {"controller_cpu": (c1 - c0) / span, "store_thread_cpu": (s1 - s0) / span,
                "generators_cpu": (g1 - g0) / span,
                "store_ops_per_s": sum(spent.values()) / span, "records_per_s": spent["op:agent_ranks"] / span,
                "beat_ops_per_s": achieved,
                "beat_ops_prescribed_per_s": prescribed}

    def fault(self, kind: str) -> dict:
        """One fault, carried out once the job is steady; its timeline and its store operations."""
        decided_before = len(self.events("recovery_decided"))
        members = self.last_members()
        ops0 = self.ops()
        if kind == "silent":
            order = {"kind": "silent", "node": self.hosts - 1}
        else:
            order = {"kind": kind, "wid": members[len(members) // 2]}
        carried = self.out / "faults.jsonl"
        faults_before = len(complete_lines(carried))
        tmp = self.out / f"order-{time.monotonic_ns()}.tmp"
        tmp.write_text(json.dumps(order))
        tmp.replace(tmp.with_suffix(".json"))  # whole or absent: the generators read it as soon as it exists
        self.wait_for(f"{kind}: decided", lambda: len(self.events("recovery_decided")) > decided_before)
        t_fault = complete_lines(carried)[faults_before]["t"]
        decided = self.events("recovery_decided")[-1]
        detected = [e for e in self.events("fault_detected") if e.get("recovery") == decided["recovery"]][0]
        complete = lambda: [e for e in self.events("generation")  # noqa: E731
                            if e.get("recovery") == decided["recovery"] and not e.get("pending")]
        self.wait_for(f"{kind}: complete generation", lambda: bool(complete()))
        gen = complete()[0]
        # by every member, and every generator done with it (with route=agent: each of its hosts read the notice)
        self.wait_for(f"{kind}: adopted", lambda: self.adopted(gen["gen"]) >= len(gen["members"]) and
                      sum(a["gen"] == gen["gen"] for a in self.adoptions()) == len(self.gens))
        t_adopted = max(a["t"] for a in self.adoptions() if a["gen"] == gen["gen"])
        if kind == "silent":  # the lost host's exit list ends (the controller writes that): its watcher's last read
            self.wait_for(f"{kind}: the lost host's exit list read to its end",
                          lambda: self.controller_read(f"exits-{order['node']}", since=t_fault))
        self.settle()
        spent = self.ops() - ops0
        model = recovery_ops(self.world, self.rph, kind, self.route, self.hosts_lost)
        self.hosts_lost += kind == "silent"
        return {"fault": kind, "symptom": detected.get("symptom"), "action": decided["action"],
                "detect_s": detected["t"] - t_fault,
                "decide_s": decided["t"] - detected["t"], "publish_s": gen["t"] - decided["t"],
                "adopt_s": t_adopted - gen["t"], "ops": {k: spent.get(f"op:{k}", 0) for k in RECOVERY_CLASSES},
                "model": model}

    def settle(self) -> None:
        """Until every generator dumped its counts after the newest adoption (they dump every 50 ms)."""
        t = time.time()
        self.wait_for("the generators' counts", lambda: len(list(self.out.glob("ops-*.json"))) == len(self.gens)
                      and all(f.stat().st_mtime > t for f in self.out.glob("ops-*.json")))

    def last_members(self) -> list[int]:
        return self.events("generation")[-1]["members"]

    def close(self) -> None:
        (self.out / "stop").write_text("")
        for p in [self.controller, *self.gens]:
            if p is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def measure(hosts: int, ranks_per_host: int, generators: int, faults: list[str], steady_s: float, misses: int,
            saturation: float, route: str = "store", step_s: float = STEP_S) -> dict:
    run = Run(hosts, ranks_per_host, generators, steady_s, misses, route, step_s)
    try:
        t0 = time.monotonic()
        run.start()
        result = {"hosts": hosts, "ranks": run.world, "route": route, "startup_s": time.monotonic() - t0,
                  **run.steady()}
        result["saturated"] = result["beat_ops_per_s"] < saturation * result["beat_ops_prescribed_per_s"]
        # a load this machine cannot generate: the controller would judge the generators' own lateness
        result["faults"] = [] if result["saturated"] else [run.fault(kind) for kind in faults]
        return result
    finally:
        run.close()


def calibration(results: list[dict], ranks_per_host: int) -> dict:
    """The simulator's calibration (``runner/sim/calibration.py``) from the largest size whose faults were timed:
    the runner's own detection and decision, which do not grow with N in the model above (an exit is one
    record, a silent host one beat's age, the decision one round). FlashRecovery's phases from the crash,
    DeadPool's from the silent host. Group rebuild and communicator creation stay the simulator's published
    figures: here the generators stand in for gloo and NCCL, so nothing of them is measured."""
    timed = [r for r in results if r["faults"]]
    if not timed:
        raise SystemExit("no size was timed (every one saturated): no calibration to write")
    r = timed[-1]
    fault = {f["fault"]: f for f in r["faults"]}
    phases = {}
    if "crash" in fault:
        phases["flashrecovery"] = {"detect_s": fault["crash"]["detect_s"], "decide_s": fault["crash"]["decide_s"]}
    if "silent" in fault:
        phases["deadpool"] = {"detect_s": fault["silent"]["detect_s"], "decide_s": fault["silent"]["decide_s"]}
    return {"measured": {"host": socket.gethostname(),
                         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         "by": f"bench/control_scale.py, control plane at {r['hosts']} hosts x {ranks_per_host} "
                               f"ranks ({r['ranks']} ranks)"},
            "phases": phases}


def report(r: dict, ranks_per_host: int) -> str:
    """One N's figures, as printed."""
    records = f", {r['records_per_s']:.0f} host records written/s" if r["route"] == "agent" else ""
    lines = [f"N={r['hosts']} hosts x {ranks_per_host} = {r['ranks']} ranks, heartbeat.route={r['route']}: start-up "
             f"{r['startup_s']:.1f}s; steady: "
             f"controller+store {r['controller_cpu']:.2f} core (the store's server thread "
             f"{r['store_thread_cpu']:.2f}), {r['store_ops_per_s']:.0f} store ops/s (heartbeats "
             f"{r['beat_ops_per_s']:.0f}/s of the {r['beat_ops_prescribed_per_s']:.0f}/s the protocol prescribes"
             f"{records}), generators {r['generators_cpu']:.2f} core"]
    if r["saturated"]:
        per_op = r["controller_cpu"] / r["store_ops_per_s"]
        lines.append(
            f"  saturated: the generators reach {r['beat_ops_per_s'] / r['beat_ops_prescribed_per_s']:.0%} of the "
            f"heartbeat traffic {r['ranks']} ranks prescribe, so no fault is timed (the controller would judge the "
            f"generators' lateness). At the measured {per_op * 1e6:.0f} us of controller+store CPU per operation, "
            f"{r['beat_ops_prescribed_per_s']:.0f} heartbeat operations/s alone would take "
            f"{r['beat_ops_prescribed_per_s'] * per_op:.1f} cores on host 0")
    for f in r["faults"]:
        lines.append(f"  {f['fault']:<7} -> {f['symptom']:<11} -> {f['action']:<12} detect {f['detect_s']:.3f}s, "
                     f"decide {f['decide_s']:.3f}s, publish {f['publish_s']:.3f}s, adopted by all {f['adopt_s']:.3f}s; "
                     f"ops {f['ops']} (model {f['model']})")
    return "\n".join(lines)


def route_ratio(store: dict, agent: dict) -> str:
    """The agent route's steady cost against the store route's at one N, measured in the same invocation (the
    machine's load drifts between invocations)."""
    def ratio(key: str) -> str:
        return f"{agent[key] / store[key]:.2f}x" if store[key] > 0 else "n/a"

    return (f"N={store['hosts']}: route=agent / route=store, same run: controller+store "
            f"{agent['controller_cpu']:.2f} / {store['controller_cpu']:.2f} core = {ratio('controller_cpu')}; "
            f"store ops/s {agent['store_ops_per_s']:.0f} / {store['store_ops_per_s']:.0f} = "
            f"{ratio('store_ops_per_s')}; generators {agent['generators_cpu']:.2f} / "
            f"{store['generators_cpu']:.2f} core")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-controller":
        serve_controller(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[6]))
        return
    from runner.config.schema import HeartbeatConfig

    if len(sys.argv) > 1 and sys.argv[1] == "--serve-hosts":
        serve_hosts(int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")], Path(sys.argv[4]),
                    HeartbeatConfig().interval_s, Path(sys.argv[5]), sys.argv[6], float(sys.argv[7]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="16,128,1024,2048", help="comma-separated numbers of training hosts")
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--generators", type=int, default=2, help="processes simulating the hosts")
    parser.add_argument("--faults", default="crash,silent,hang")
    parser.add_argument("--route", default="store",
                        help="heartbeat.route (store: workers beat to the store; agent: to their host's agent), or "
                             "store,agent: each N under both, one after the other, with the ratio printed")
    parser.add_argument("--step-s", type=float, default=STEP_S, help="how long a simulated training step lasts")
    parser.add_argument("--steady-s", type=float, default=STEADY_S, help="how long steady state is measured")
    parser.add_argument("--heartbeat-misses", type=int, default=HeartbeatConfig().misses,
                        help="the job's heartbeat.misses (more: the generators' own lateness is never a fault)")
    parser.add_argument("--saturation", type=float, default=SATURATED,
                        help="time no fault when the generators reach less of the prescribed heartbeat rate")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--emit-calibration", type=Path, metavar="FILE",
                        help="write the simulator's calibration file (python -m runner.sim calibration=FILE)")
    args = parser.parse_args()
    routes = args.route.split(",")
    if not set(routes) <= {"store", "agent"} or len(set(routes)) != len(routes):
        parser.error(f"--route {args.route}: give store, agent or store,agent")
    results = []
    for n in [int(x) for x in args.hosts.split(",")]:
        by_route = {}
        for route in routes:
            r = measure(n, args.ranks_per_host, args.generators, args.faults.split(","), args.steady_s,
                        args.heartbeat_misses, args.saturation, route, args.step_s)
            results.append(r)
            by_route[route] = r
            print(report(r, args.ranks_per_host), flush=True)
        if len(by_route) == 2:
            print(route_ratio(by_route["store"], by_route["agent"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.emit_calibration:
        args.emit_calibration.write_text(json.dumps(calibration(results, args.ranks_per_host), indent=1))


if __name__ == "__main__":
    main()
