"""``python -m runner``: compose the Hydra config, validate it, plan, launch, summarise.

Validation and planning happen here, in the launching process, before any worker starts; workers
receive the resolved config as a dict and never run Hydra (so a multirun is never re-run by a
child process).

What a launcher sees: a single run exits with the job's code. Each job of a ``-m`` sweep returns the final
value of ``runner.optimized_metric`` (what a sweeper optimises), and one that did not complete raises
``JobFailed``, so Hydra's launchers (basic, joblib, submitit) record it failed; Hydra runs every job of the
sweep first, then reports the failure and exits non-zero.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config import ConfigError, register_all
from runner.config.registry import CONF_DIR, user_config_dirs
from runner.config.validate import validate
from runner.control.records import EXIT_RUN_FAILED, EXIT_STOPPED, exit_code
from runner.launch.objective import final_metric
from runner.planning.module_facts import subject_name
from runner.planning.plan import apply_smoke, make_plan, memory_problem, needs_gpus, scaled
from runner.report.summary import throughput

EXIT_CONFIG = 2
EXIT_NEEDS_GPUS = 3
OUTCOMES = {EXIT_RUN_FAILED: "failed", EXIT_CONFIG: "was refused (bad config)",
            EXIT_NEEDS_GPUS: "did not train (it needs GPUs this host lacks)",
            EXIT_STOPPED: "was stopped (SIGINT/SIGTERM/SIGUSR2)"}

register_all(user_config_dirs(sys.argv[1:]))  # a user's recipes/ beside --config-dir or on hydra.searchpath


class JobFailed(RuntimeError):
    """A job of a ``-m`` sweep that did not complete (its exit code would not be 0)."""


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    code = run(cfg, run_dir)
    if code and HydraConfig.get().mode == RunMode.RUN:
        sys.exit(code)
    if code:
        raise JobFailed(f"the job in {run_dir} {OUTCOMES.get(code, 'failed')}: exit code {code}; its output says why")
    metric = cfg.runner.optimized_metric
    return final_metric(run_dir, metric) if metric else None


def run(cfg: DictConfig, run_dir: Path) -> int:
    """Run one job; returns the process exit code (0 completed, 1 failed, 2 bad config, 3 needs GPUs, 75 stopped
    by SIGINT/SIGTERM/SIGUSR2 after a checkpoint)."""
    try:
        validate(cfg, for_training=False)
        if cfg.runner.smoke:
            for change in apply_smoke(cfg):
                print(f"[runner] smoke: {change}", flush=True)
        plan = make_plan(cfg)
        print(plan.render(cfg), flush=True)
        too_big = memory_problem(cfg, plan)
        if too_big:
            raise ConfigError(too_big)
        if needs_gpus(cfg, plan):
            print(
                f"[runner] {subject_name(cfg)} has {scaled(plan.params)} parameters and needs {plan.world} GPUs "
                f"with {plan.bytes_per_rank / 2**30:.0f} GiB each; this host has {plan.gpus_available}. Launch it "
                "under torchrun or SLURM on a GPU cluster, or add runner.smoke=true to train the same recipe shrunk "
                "on CPU.",
                file=sys.stderr, flush=True,
            )
            return EXIT_NEEDS_GPUS
        cfg.parallel.spares = plan.spares  # a default spare node, in the config the workers get
        validate(cfg, for_training=True)
        from runner.launch.launcher import launch  # heavy imports only once the config is known to be good

        summary = launch(cfg, run_dir)
    except ConfigError as err:
        print(f"[runner] {err}", file=sys.stderr, flush=True)
        if cfg.launcher.mode == "per_host" and not cfg.launcher.join:  # the other hosts learn why, and end now
            from runner.launch.per_host import report_refusal  # (torch: only on a host of such a job)

            report_refusal(cfg, str(err))
        return EXIT_CONFIG
    if summary is None:  # a rank other than 0 of a torchrun/SLURM job: rank 0 reports
        return 0
    print(render_summary(summary, run_dir), flush=True)
    return exit_code(summary["status"])


def render_summary(s: dict, run_dir: Path) -> str:
    rate, unit = throughput(s)
    lines = [
        "=" * 72,
        f"run {s['status'].upper()}: {s['run_name']}  ({run_dir})",
    ]
    if s["status"] == "failed":
        lines.append(f"  error        {s.get('error')}")
    ettr = (f"ETTR {s['effective_training_time_ratio']:.3f}" if s["status"] != "failed"
            else "no ETTR: the run failed")
    lines += [
        f"  steps        {s['global_step']}  loss {_loss(s['initial_loss'])} -> {_loss(s['final_loss'])}",
        f"  throughput   {s['steps_per_s']:.2f} steps/s, {rate:.0f} {unit}, "
        + (f"MFU {100 * s['mfu']:.2f}%" if s.get("mfu") is not None else "MFU unknown (the module states no "
           "flops_per_sample)"),
        f"  wall         {s['wall_s']:.1f}s (training {s['train_s']:.1f}s, {ettr})",
        f"  samples      committed {s['samples_committed']}, lost {s['samples_lost']}, "
        f"duplicated {s['samples_duplicated']}",
        f"  checksum     {s['param_checksum'] or 'none (the run failed: no replica is vouched for)'}",
    ]
    for r in s["recoveries"]:
        lines.append(f"  recovery {r['id']}   {r['fault']} of {r['victims']} at step {r['step']} -> {r['action']}: "
                     + recovery_cost(r))
    for t in s.get("takeovers", []):
        lines.append(
            f"  takeover     worker {t['wid']} also computes ranks {t['extra_ranks']}: step "
            f"{_fmt(t['step_time_before_s'])} -> {_fmt(t['step_time_after_s'])}, peak RSS "
            f"{t['peak_rss_before_kib'] / 1024:.0f} -> {t['peak_rss_after_kib'] / 1024:.0f} MiB"
        )
    lines.append("=" * 72)
    return "\n".join(lines)


def recovery_cost(r: dict) -> str:
    """``RTO 0.349 s (fault to first full-world commit: detect 0.040 + decide 0.052 + ...), RPO 0 steps``, in the
    phases the console's recovery line uses; a recovery whose world never committed again says so instead."""
    phases = " + ".join(f"{p} {r[f'{p}_s']:.3f}" for p in ("detect", "decide", "replace", "rebuild", "restore")
                        if r.get(f"{p}_s") is not None)
    if r.get("rto_s") is None:
        return f"no RTO: the full world never committed again (reached: {phases or 'nothing'})"
    return f"RTO {r['rto_s']:.3f} s (fault to first full-world commit: {phases}), RPO {r['rpo_steps']} steps"


def _loss(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}s"


if __name__ == "__main__":
    main()
