"""summary.json: the run's contract with users, tools and later issues (docs/outputs.md).

Built at the end from the run's record (``RunRecord``: how it ended, its recoveries, the workers'
done records), events.jsonl and metrics.jsonl, so a recovery's phases come from timestamps recorded
where they happened. Under torchrun/SLURM the record also lists the job's earlier attempts
(``runner/launch/attempt_log.py``): each failed one is a recovery by the launcher's restart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from runner.control.records import Attempt, Recovery, RunRecord, last_step
from runner.planning.model_cost import mfu
from runner.planning.module_facts import ModuleFacts, module_facts
from runner.plumbing.durable import write_text_atomic
from runner.plumbing.events import committed_steps, read_jsonl
from runner.report.loggers import run_name


def write_summary(cfg, run_dir: Path, record: RunRecord) -> dict:
    run_dir = Path(run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    records = read_jsonl(run_dir / "metrics.jsonl")
    metrics = committed_steps(records)
    done = record.done
    checksums = sorted({d["checksum"] for d in done.values()})
    status, error = record.status, record.error  # judged once, before run_end (RunRecord.judge_end)
    wall = time.time() - (record.attempts[0].t_start if record.attempts else record.t_start)
    recoveries = _launcher_restarts(record.attempts, metrics)
    recoveries += [recovery_entry(r, events, metrics) for r in record.recoveries if r.action]
    committed = _last_per_step(metrics)
    steps_in_metrics = len({m["step"] for m in metrics})
    # a resumed run accounts from its checkpoint's step, a stopped one (a signal, or a callback's trainer.should_stop)
    # up to the step its members agreed to stop at
    first = next((e["at_step"] for e in events if e["kind"] == "resumed"), 0)
    agreed_stop = status == "stopped" or any(e["kind"] == "stop_agreed" for e in events)
    last = max((d["global_step"] for d in done.values()), default=0) if agreed_stop else \
        last_step(done, cfg.trainer.max_steps)
    accounting = _accounting(committed, cfg, record.dp, range(first, last), module_facts(cfg).tokens_per_sample)
    train_s = _train_seconds(metrics)
    facts = module_facts(cfg)
    samples_per_s = accounting["samples_committed"] / train_s if train_s > 0 else 0.0
    tokens_per_s = samples_per_s * facts.tokens_per_sample if facts.tokens_per_sample else None
    global_step = max((d["global_step"] for d in done.values()), default=steps_in_metrics)
    summary = {
        "status": status,
        **({"error": error} if status == "failed" else {}),
        "recipe": cfg.recipe_name,
        "model": facts.name,
        "run_name": run_name(cfg),
        "ft": list(record.ft),
        "fault": cfg.fault.kind,
        "world_size": record.dp,
        "nodes": cfg.parallel.nodes,
        "global_step": global_step,
        "initial_loss": metrics[0]["loss"] if metrics else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "steps_per_s": steps_in_metrics / train_s if train_s > 0 else 0.0,
        "mfu": _mfu(cfg, facts, samples_per_s, record.dp * int(cfg.parallel.tp) * int(cfg.parallel.pp)),  # every rank
        "wall_s": wall,
        "train_s": train_s,
        "param_checksum": checksums[0] if len(checksums) == 1 else None,
        "recoveries": recoveries,
        **({"attempts": _attempt_entries(record.attempts, metrics, status, error, global_step)}
           if record.attempts else {}),
        "takeovers": [{"wid": wid, **d["takeover"]} for wid, d in done.items() if "takeover" in d],
        **_replication(done),
        "sdc_recomputed_steps": [e["step"] for e in events if e["kind"] == "sdc_detected"],
        "stragglers": _stragglers(events, committed, recoveries),
        "replica_divergences": [{k: e[k] for k in ("step", "ranks", "action") if k in e}
                                for e in events if e["kind"] == "replica_diverged"],
        "steps_redone": len(metrics) - len(committed),
        "phase_timeouts": record.phase_timeouts,
        **accounting,
        **_after_fit(records),
    }
    summary["effective_training_time_ratio"] = _ettr(train_s, recoveries)
    # whole or absent: a run's end is awaited by watching for this file (tests, sweeps, a user's tools)
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _after_fit(records: list[dict]) -> dict:
    """The evaluations after fit (``runner.callbacks.evaluation``): ``val``, the final weights' validation values, and
    ``test``, ``runner.test_after_fit``'s, each under the names logged (the test's: what test_step logs)."""
    last = next((m for m in reversed(records) if m.get("evaluation") == "after_fit"), None)
    if last is None:
        return {}
    values = {k: v for k, v in last.items() if k not in ("step", "t", "gen", "evaluation")}
    val = {k: v for k, v in values.items() if k in last.get("val_metrics", ())}
    out = {"val": val} if val else {}
    test = {k: v for k, v in values.items() if k not in val and k != "val_metrics"}
    return {**out, **({"test": test} if test else {})}


def throughput(s: dict) -> tuple[float, str]:
    """A summary's throughput and its unit: tokens/s where a sample is tokens, else samples/s."""
    if s.get("tokens_per_s") is not None:
        return s["tokens_per_s"], "tokens/s"
    return s.get("samples_per_s") or 0.0, "samples/s"


def _stragglers(events: list[dict], committed: list[dict], recoveries: list[dict]) -> list[dict]:
    """One entry per ``straggler_detected``: what was found and done, the step its hand-over took effect at (the
    first step committed by the new generation), and the run's pace in steps/s before the slowness began, while
    it lasted, and after the hand-over (from the first commit after it, so the regroup itself, which the recovery's
    RTO accounts for, is not in it): the same run's before and after compare the hand-over's result."""
    out = []
    for e in (e for e in events if e["kind"] == "straggler_detected"):
        rec = next((r for r in recoveries if r["fault"] == "straggler" and r["t_detect"] >= e["t"]), None)
        start = rec["t_first_commit"] if rec is not None else None
        slow_end = rec["t_detect"] if rec is not None else float("inf")
        out.append({
            "kind": e["straggler"], "rank": e["rank"], "host": e["host"], "ranks": e["ranks"], "factor": e["factor"],
            "first_step": e["first_step"], "at_step": e["at_step"], "action": e["action"],
            "recovery": rec["id"] if rec is not None else None,
            "handover_step": next((m["step"] for m in committed if start is not None and m["t"] >= start), None),
            "steps_per_s": {
                "before": _pace([m for m in committed if m["step"] < e["first_step"]]),
                "slow": _pace([m for m in committed if m["step"] >= e["first_step"] and m["t"] <= slow_end]),
                "after": _pace([m for m in committed if start is not None and m["t"] >= start]),
            },
        })
    return out


def _pace(metrics: list[dict]) -> Optional[float]:
    """Steps per second over these commits (one per step, in order): None for fewer than three."""
    if len(metrics) < 3 or metrics[-1]["t"] <= metrics[0]["t"]:
        return None
    return (len(metrics) - 1) / (metrics[-1]["t"] - metrics[0]["t"])


def _last_per_step(metrics: list[dict]) -> list[dict]:
    """Each step's last commit: a restart from a snapshot redoes the steps after it, and the commits
    it abandoned are not part of the final model."""
    last = {m["step"]: m for m in metrics}
    return [last[step] for step in sorted(last)]


def _accounting(metrics: list[dict], cfg, dp: int, steps: range, tokens_per_sample: Optional[int]) -> dict:
    """Sample accounting from the per-step counts that rode along each committed reduction; ``steps``: the run's;
    tokens only where a sample is tokens (the GPT, or a module stating ``tokens_per_sample``)."""
    micro = cfg.trainer.global_batch_size // dp
    seen: dict[tuple[int, int], int] = {}
    misplaced = 0
    for m in metrics:
        misplaced += m.get("misplaced", 0)
        for rank, count in enumerate(m["counts"]):
            seen[(m["step"], rank)] = seen.get((m["step"], rank), 0) + count
    expected = {(s, r) for s in steps for r in range(dp)}
    present = {k for k, c in seen.items() if c > 0}
    duplicated = sum(c - 1 for c in seen.values() if c > 1)
    return {
        "samples_committed": sum(seen.values()) * micro,
        "samples_lost": len(expected - present) * micro,
        "samples_duplicated": duplicated * micro,
        "samples_misplaced": misplaced * micro,
        "tokens_committed": sum(seen.values()) * micro * tokens_per_sample if tokens_per_sample else None,
    }


def _train_seconds(metrics: list[dict]) -> float:
    if len(metrics) < 2:
        return sum(m["step_time_s"] for m in metrics)
    return metrics[-1]["t"] - metrics[0]["t"] + metrics[0]["step_time_s"]


def _mfu(cfg, facts: ModuleFacts, samples_per_s: float, ranks: int) -> Optional[float]:
    """Model FLOPs utilisation; None when the model's FLOPs are unknown (a user module without flops_per_sample)."""
    if facts.flops_per_sample is None:
        return None
    return mfu(facts.flops_per_sample, samples_per_s, cfg.runner.peak_flops_per_rank * ranks)


def _replication(done: dict) -> dict:
    """DeadPool with ZeRO-1: shard bytes sent to neighbours per step once replicas are seeded (all ranks; 0 when the
    holders replay the updates), everything the replication sent over the run (seeds, copies, digests) and the host
    memory the replication holds on the busiest rank (send buffer, replica slots or the replayed replica, records)."""
    reps = [d["replication"] for d in done.values() if "replication" in d]
    if not reps:
        return {}
    return {"replication_bytes_per_step": sum(r["bytes_per_step"] for r in reps),
            "replication_bytes_sent": sum(r.get("bytes_sent", 0) for r in reps),
            "replication_buffer_bytes_max": max(r["buffer_bytes"] for r in reps)}


def _ettr(train_s: float, recoveries: list[dict]) -> float:
    """Effective training time ratio: the share of the training span not spent recovering."""
    if train_s <= 0:
        return 0.0
    lost = sum(r["rto_s"] or 0.0 for r in recoveries)
    return max(0.0, (train_s - lost) / train_s)


def _attempt_entries(attempts: list[Attempt], metrics: list[dict], status: str, error: str,
                     step: int) -> list[dict]:
    """Every attempt of the job, the last one (this one) ending now as the summary says."""
    entries = [{"attempt": a.attempt, "t_start": a.t_start, "t_end": a.t_end, "status": a.status or "unrecorded",
                "error": a.error, "step": _step_reached(a, nxt.t_start, metrics)}
               for a, nxt in zip(attempts, attempts[1:])]
    entries.append({"attempt": attempts[-1].attempt, "t_start": attempts[-1].t_start, "t_end": time.time(),
                    "status": status, "error": error if status == "failed" else "", "step": step})
    return entries


def _step_reached(attempt: Attempt, next_start: float, metrics: list[dict]) -> int:
    """The step after the newest one an attempt committed (its commits are those before the next attempt
    started), so that its restart's RPO counts exactly the commits the next attempt redoes (``steps_redone``).
    Its end record's step, the newest step a heartbeat reported, is only the fallback (it committed nothing):
    heartbeats lag a loaded host's steps, and a rank can report a step whose commit never happened."""
    committed = [m["step"] for m in metrics if attempt.t_start <= m["t"] < next_start]
    return max(committed) + 1 if committed else attempt.step


def _launcher_restarts(attempts: list[Attempt], metrics: list[dict]) -> list[dict]:
    """A recovery per failed attempt: the launcher restarted every rank. Its fault is the attempt's end;
    the work lost runs from the step it reached back to the step the next attempt resumed from (0 without
    a flash checkpoint); its RTO runs to the next attempt's first commit."""
    entries: list[dict] = []
    for prev, nxt in zip(attempts, attempts[1:]):
        t_end = prev.t_end if prev.t_end is not None else nxt.t_start
        step = _step_reached(prev, nxt.t_start, metrics)
        after = [m for m in metrics if m["t"] >= nxt.t_start]
        t_commit = after[0]["t"] if after else None
        entries.append({
            "id": prev.attempt,
            "fault": "attempt_failed",
            "victims": [],
            "step": step,
            "action": "launcher_restart",
            "reason": prev.error or "the attempt ended without a record of why (its rank 0 was lost)",
            "decide_reason": "launcher",  # the launcher, not the controller, decided to restart every rank
            "rpo_steps": max(0, step - after[0]["step"]) if after and step >= 0 else None,
            "resumed_step": after[0]["step"] if after else None,  # 0: from scratch (no common flash checkpoint)
            "rto_s": (t_commit - t_end) if t_commit else None,
            "detect_s": None, "decide_s": None, "replace_s": None, "rebuild_s": None, "restore_s": None,
            "survivors_ready_s": None,
            "t_fault": t_end,
            "t_detect": None, "t_decide": None, "t_replacement_ready": nxt.t_start, "t_group_formed": None,
            "t_first_commit": t_commit,
        })
    return entries


def recovery_entry(rec: Recovery, events: list[dict], metrics: list[dict]) -> dict:
    """One ``recoveries[]`` entry: the phases from the record's times, the injected fault and the groups formed
    (``events``) and the steps committed before the fault and after the recovery (``metrics``). The run logger
    computes the same entry live, as soon as that step is committed."""
    # an injected fault belongs to this recovery unless an earlier recovery's detection already claimed it
    claimed = max((e["t"] for e in events if e["kind"] == "fault_detected" and e.get("recovery") != rec.id
                   and e["t"] < rec.t_detect), default=float("-inf"))
    injected = [e for e in events if e["kind"] == "fault_injected" and claimed < e.get("t", 0) <= rec.t_detect + 1e-3]
    t_fault = injected[-1].get("t_fault", injected[-1]["t"]) if injected else rec.t_detect
    if injected:
        fault_step = injected[-1].get("at_step", injected[-1]["step"])
    else:  # a fault from outside (a host lost, a process killed): the step in progress when it was detected
        fault_step = max((m["step"] for m in metrics if m["t"] <= t_fault), default=-1) + 1
    formed = [e for e in events if e["kind"] == "group_formed" and e.get("gen") == rec.full_gen]
    t_formed = min((e["t"] for e in formed), default=None)
    survivors = [e for e in events if e["kind"] == "group_formed" and e.get("gen") == rec.survivors_gen]
    after = [m for m in metrics if rec.full_gen is not None and m["gen"] >= rec.full_gen]
    t_commit = after[0]["t"] if after else None
    # each phase boundary no earlier than the one before: a time the controller observed late (a replacement's
    # readiness polled after its group had formed) ends its phase where the next one begins, so that the phases
    # add up to the RTO exactly
    last = t_commit if t_commit else float("inf")
    t_decide = min(max(rec.t_decide or rec.t_detect, rec.t_detect), last)
    t_ready = min(max(rec.t_ready or t_decide, t_decide), last)
    t_formed = min(max(t_formed or t_ready, t_ready), last)
    entry = {
        "id": rec.id,
        "fault": rec.fault,
        "victims": rec.victims,
        "step": fault_step,
        "action": rec.action,
        "reason": rec.reason,
        "decide_reason": rec.decide_reason,
        # steps of work to redo; 0 when the struck step was committed anyway (a fault after its reduction)
        "rpo_steps": max(0, fault_step - after[0]["step"]) if after and fault_step >= 0 else None,
        "rto_s": (t_commit - t_fault) if t_commit else None,
        "detect_s": rec.t_detect - t_fault,
        "decide_s": t_decide - rec.t_detect,
        "replace_s": t_ready - t_decide,
        "rebuild_s": t_formed - t_ready,
        "restore_s": (t_commit - t_formed) if t_commit else None,
        "survivors_ready_s": (min(e["t"] for e in survivors) - t_fault) if survivors else None,
        "t_fault": t_fault,
        "t_detect": rec.t_detect,
        "t_decide": t_decide,
        "t_replacement_ready": t_ready,
        "t_group_formed": t_formed,
        "t_first_commit": t_commit,
        "diagnosis": rec.diagnosis,  # a hang: where everyone was (runner.control.diagnosis)
        "verdict": rec.verdict,
        # a stall: the phase and the hang timeout in effect when it was found (runner.control.phase_timeouts)
        "stall": next(({k: s[k] for k in ("phase", "timeout_s", "calibrated")} for s in rec.symptoms
                       if s["kind"] in ("hang", "stuck") and "timeout_s" in s), None),
    }
    return entry
