"""What one control-plane store operation costs here, and what each heartbeat protocol would cost host 0 at N hosts.

    python bench/store_costs.py [--hosts 16,128,1024,2048] [--ranks-per-host 8] [--seconds 3] [--clients 2]
                                [--json FILE]

``bench/control_scale.py`` runs the real controller against simulated hosts, but its generators cannot produce the
heartbeat traffic of more than about 1,000 ranks on two cores. This bench measures the unit costs instead, on the
real store (``protocol.host_store``, hosted by a process of its own whose CPU is read from /proc):

- a set: TCPStore answers no set, so a client's sets are pipelined (``store_us``, the store's CPU per set, of a
  host record of today's payloads: the largest value any protocol below writes);
- a round trip: a ``get`` or ``check`` waits for its answer (``store_us`` again), the kind every poll is;
- the controller's heartbeat read at each N, done here for real: one ``multi_get`` of every key of a kind (the
  store's and the reader's CPU) and the JSON decode of each value, for every worker's ``hb/<wid>`` and for the host
  records the protocols below would read instead.

From those it projects host 0's CPU per second (the store and the controller's heartbeat poll, one per
``heartbeat.interval_s``) for two protocols at each N, against the 0.25-core target:

- ``per_worker`` (the runner's protocol): each worker sets ``hb/<wid>`` and reads ``gen`` and ``stop`` every
  interval (1 set, 2 round trips); each agent sets its beat and checks its fence every ``heartbeat.agent_beat_s``; the
  controller reads and decodes every worker's payload every interval;
- ``per_host`` (workers beat to their agent on their own host): each agent sets one record per interval with its
  ranks' payloads; it learns a new generation, a stop or its fence from blocking waits (answered when the key is
  written, no steady polling), and proves the controller alive with one round trip per quarter of
  ``controller_lost_after_s``; the controller reads and decodes every host's record every interval (each one
  changes: the payloads carry a sequence number and a clock);
- ``per_host_changes``: as ``per_host``, but the agent judges its own ranks' silence (they are on its host), so its
  record holds compact rows (``row``) that change only when a rank's step or phase does (``--step-s``), and its
  beat (a time and the record's version) is a key of its own: the controller reads every beat each interval and
  reads and decodes only the records whose version moved.

The hosts' own CPU is not host 0's and is left out. A figure of the clients' rate is printed too: a round trip's
store cost falls as the load rises (the server batches what is queued), so the unit costs are those of the rate
reached. Nothing here is timed in a test: ``tests/test_store_costs.py`` checks the accounting at a small N.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

from tree_cpu import process_cpu_s

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.config.schema import HeartbeatConfig  # noqa: E402  (the project's root is on the path only now)
from runner.training.status import TIMINGS_KEPT  # noqa: E402

TARGET_CORES = 0.25  # the budget for controller + store at 2,048 hosts x 8 ranks


def payload(step: int) -> dict:
    """A worker's heartbeat as ``callbacks.heartbeat`` writes it, with a full timing window."""
    return {"seq": step, "step": step, "phase": "compute", "rss": 1 << 30, "t": time.time(), "gen": 3,
            "in_flight": 1, "timing": [[step - i, 0.25, 0.01, 0.002] for i in range(TIMINGS_KEPT)]}


def row(step: int) -> list:
    """The same worker as a host record's row: what changed since the agent's last record (step, phase, generation,
    collectives in flight, the newest step's timing), no sequence number, clock or repeated timing window."""
    return [step, "compute", 3, 1, [step - 1, 0.25, 0.01, 0.002]]


def serve(port_queue, done) -> None:
    """Host the store and nothing else, so that this process's CPU is the store's."""
    from runner.plumbing import protocol

    store = protocol.host_store("127.0.0.1", 60)
    port_queue.put(store.port)
    done.wait()


def hammer(port: int, index: int, kind: str, seconds: float, value: bytes, counts) -> None:
    """Sets (``kind`` "set") or round trips ("get") for ``seconds``; a last round trip, so every set was served
    before the count is reported."""
    from runner.plumbing import protocol

    store = protocol.connect("127.0.0.1", port, 60)
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        for k in range(256):
            if kind == "set":
                store.set(f"bench/{index}/{k}", value)
            else:
                store.get("gen")
        n += 256
    store.get("gen")
    counts.put(n)


def unit_cost(ctx, port: int, server: int, kind: str, clients: int, seconds: float, value: bytes) -> dict:
    counts = ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(port, i, kind, seconds, value, counts)) for i in range(clients)]
    c0, t0 = process_cpu_s(server), time.monotonic()
    for p in procs:
        p.start()
    ops = sum(counts.get(timeout=seconds + 60) for _ in procs)
    c1, t1 = process_cpu_s(server), time.monotonic()
    for p in procs:
        p.join()
    return {"ops": ops, "ops_per_s": ops / (t1 - t0), "store_us": 1e6 * (c1 - c0) / ops}


def read_costs(store, server: int, hosts: int, rph: int, repeats: int) -> dict:
    """The controller's heartbeat reads at ``hosts`` (+ the spare host), each done for real against the store:
    ``per_worker`` every worker's payload; ``per_host`` one record per host of its ranks' payloads; ``beats`` every
    agent's beat, its time and its record's version; ``rows`` one record per host of compact rows (``row``)."""
    world = (hosts + 1) * rph
    workers = {wid: json.dumps(payload(100)) for wid in range(world)}
    records = {n: json.dumps({str(w): json.loads(workers[w]) for w in range(n * rph, (n + 1) * rph)})
               for n in range(hosts + 1)}
    rows = {n: json.dumps({str(w): row(100) for w in range(n * rph, (n + 1) * rph)}) for n in range(hosts + 1)}
    values = {**{f"hb/{w}": raw for w, raw in workers.items()}, **{f"hb/node/{n}": raw for n, raw in records.items()},
              **{f"hb/rows/{n}": raw for n, raw in rows.items()},
              **{f"hb/beat/{n}": json.dumps([time.time(), 1234]) for n in range(hosts + 1)}}
    for key, raw in values.items():
        store.set(key, raw)
    out: dict = {"payload_bytes": len(workers[0]), "record_bytes": len(records[0]), "row_record_bytes": len(rows[0])}
    for name, prefix in (("per_worker", "hb/"), ("per_host", "hb/node/"), ("beats", "hb/beat/"), ("rows", "hb/rows/")):
        keys = [f"{prefix}{i}" for i in range(world if name == "per_worker" else hosts + 1)]
        times = max(repeats, 100_000 // len(keys))  # the store's CPU is read in clock ticks
        s0, m0 = process_cpu_s(server), time.process_time()
        for _ in range(times):
            raws = store.multi_get(keys)
        s1, m1 = process_cpu_s(server), time.process_time()
        assert raws == [values[k].encode() for k in keys]  # the reads are what was written, all of it
        out[name] = {"keys": len(keys), "multi_get_store_s": (s1 - s0) / times, "multi_get_reader_s": (m1 - m0) / times,
                     "decode_s": per_call(lambda raws=raws: [json.loads(raw) for raw in raws], repeats)}
    return out


def per_call(call, times: int) -> float:
    """CPU seconds per call of ``call``."""
    t0 = time.process_time()
    for _ in range(times):
        call()
    return (time.process_time() - t0) / times


PROTOCOLS = ("per_worker", "per_host", "per_host_changes")
PHASE_CHANGES_PER_STEP = 2  # compute -> reduce -> the next step's compute: a rank's row changes twice a step


def project(hosts: int, rph: int, heartbeat: HeartbeatConfig, step_s: float, units: dict, reads: dict) -> dict:
    """Host 0's cores per second for each protocol at ``hosts`` training hosts (+ a spare host): the store's CPU for
    the sets and round trips the hosts send, and the controller's heartbeat read (one per interval); and each
    protocol's share of the ``per_worker`` baseline's, in the same run."""
    agents, world = hosts + 1, (hosts + 1) * rph
    interval_s = heartbeat.interval_s
    pw, ph = reads["per_worker"], reads["per_host"]
    alive_trips = agents * 4 / heartbeat.controller_lost_after_s  # an agent proves the controller alive 4x per bound
    changed = agents * PHASE_CHANGES_PER_STEP / step_s  # host records rewritten per second
    agent_beats = agents / heartbeat.agent_beat_s  # today each beat is a set and a check of the host's fence
    flows = {
        "per_worker": {"sets_per_s": world / interval_s + agent_beats,
                       "round_trips_per_s": 2 * world / interval_s + agent_beats,
                       "read_s": read_s(pw) + pw["decode_s"]},
        "per_host": {"sets_per_s": agents / interval_s, "round_trips_per_s": alive_trips,
                     "read_s": read_s(ph) + ph["decode_s"]},
        # every agent's beat read every interval, a version in it saying whose rows changed; only those read and
        # decoded
        "per_host_changes": {"sets_per_s": agents / interval_s + changed, "round_trips_per_s": alive_trips,
                             "read_s": read_s(reads["beats"]) + reads["beats"]["decode_s"]
                             + changed * interval_s / agents * (read_s(reads["rows"]) + reads["rows"]["decode_s"])},
    }
    out = {"hosts": hosts, "ranks": hosts * rph}
    for name, flow in flows.items():
        store = (flow["sets_per_s"] * units["set"]["store_us"] + flow["round_trips_per_s"]
                 * units["round_trip"]["store_us"]) * 1e-6
        read = flow["read_s"] / interval_s
        out[name] = {**flow, "store_ops_cores": store, "heartbeat_read_cores": read, "host0_cores": store + read}
    for name in PROTOCOLS:
        out[name]["host0_vs_per_worker"] = out[name]["host0_cores"] / out["per_worker"]["host0_cores"]
        out[name]["store_vs_per_worker"] = out[name]["store_ops_cores"] / out["per_worker"]["store_ops_cores"]
    return out


def read_s(read: dict) -> float:
    """Host 0's CPU for one ``multi_get`` of every key of a kind: the store's and the controller's."""
    return read["multi_get_store_s"] + read["multi_get_reader_s"]


def report(units: dict, projections: list[dict]) -> str:
    s, r = units["set"], units["round_trip"]
    lines = [f"store CPU per set {s['store_us']:.2f} us ({s['ops_per_s']:.0f}/s reached), per round trip "
             f"{r['store_us']:.1f} us ({r['ops_per_s']:.0f}/s reached); host 0's cores = store ops + heartbeat reads "
             "(x: host 0's CPU, and the store's, over per_worker's, same run)",
             f"{'hosts x ranks':>20}" + "".join(f"{name:>62}" for name in PROTOCOLS)]
    for p in projections:
        cells = [f"{p[n]['sets_per_s'] + p[n]['round_trips_per_s']:>8.0f} ops/s {p[n]['store_ops_cores']:>5.2f} + "
                 f"{p[n]['heartbeat_read_cores']:>5.2f} = {p[n]['host0_cores']:>5.2f} "
                 f"({p[n]['host0_vs_per_worker']:.3f}x, store {p[n]['store_vs_per_worker']:.3f}x)" for n in PROTOCOLS]
        meets = [n for n in PROTOCOLS if p[n]["host0_cores"] <= TARGET_CORES]
        size = f"{p['hosts']:>7} x {p['ranks'] // p['hosts']} ({p['ranks']:>6})"
        within = ", ".join(meets) or "none"
        lines.append(size + "".join(f"{c:>62}" for c in cells) + f"   <= {TARGET_CORES} core: {within}")
    return "\n".join(lines)


def main() -> None:
    from runner.plumbing import protocol

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="16,128,1024,2048", help="comma-separated numbers of training hosts")
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each unit cost is measured")
    parser.add_argument("--clients", type=int, default=2, help="processes issuing the operations")
    parser.add_argument("--repeats", type=int, default=10, help="controller reads timed at each N")
    parser.add_argument("--step-s", type=float, default=1.0, help="a training step (per_host_changes' record rate)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    heartbeat = HeartbeatConfig()
    ctx = mp.get_context("spawn")
    ports, done = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(ports, done), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        store = protocol.connect("127.0.0.1", port, 60)
        store.set("gen", "3")
        record = json.dumps({str(w): payload(100) for w in range(args.ranks_per_host)}).encode()
        units = {"set": unit_cost(ctx, port, server.pid, "set", args.clients, args.seconds, record),
                 "round_trip": unit_cost(ctx, port, server.pid, "get", args.clients, args.seconds, b"")}
        hosts = [int(x) for x in args.hosts.split(",")]
        reads = {n: read_costs(store, server.pid, n, args.ranks_per_host, args.repeats) for n in hosts}
        projections = [project(n, args.ranks_per_host, heartbeat, args.step_s, units, reads[n]) for n in hosts]
    finally:
        done.set()
        server.join(timeout=10)
    print(report(units, projections), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"units": units, "reads": reads, "projections": projections}, indent=1))


if __name__ == "__main__":
    main()
