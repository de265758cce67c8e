"""Start the job: on one host, a controller with simulated nodes; under torchrun/SLURM, one rank or one host.

``launcher.mode`` says what a process the external launcher started is: ``per_rank`` (one rank; what
``auto`` means) or ``per_host`` (a host's node agent, node 0's also the controller: ``runner.launch.per_host``).
Under ``per_rank`` the controller runs in rank 0 and can signal only the ranks of its own host; under
``per_host`` it reaches every host's workers but no host's memory or agent: faults it could not carry
out are refused here, before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from runner.checkpoint.resume import module_arguments, newest_checkpoint, resume_checkpoint
from runner.config import ConfigError
from runner.config.validate import all_faults
from runner.control.controller import Controller
from runner.launch.host import claim_run_dir, external_launcher
from runner.recovery.registry import standby_options

CONTROLLER_CARRIED = ("kill_rank", "hang_rank")  # rank faults the controller carries out by signalling the victim
NO_PER_RANK = ("kill_node", "kill_all", "wipe_shm", "corrupt_snapshot", "chaos")  # need a process on every host
NO_PER_HOST = ("kill_node", "wipe_shm", "corrupt_snapshot", "chaos")  # lose a host, or act on another host's memory


def launch(cfg: DictConfig, run_dir: Path) -> dict | None:
    """Returns the summary, or None on a rank of an external job other than rank 0."""
    kind = cfg.launcher.kind if cfg.launcher.kind != "auto" else (external_launcher() or "local")
    if not cfg.launcher.join:  # a joining host's config is the running job's, checked by its node 0
        check_mode(cfg, kind)
    continuing = _continues_in_place(cfg, kind, Path(run_dir))
    if cfg.runner.resume:  # the workers get the checked file's absolute path
        cfg.runner.resume = str(resume_checkpoint(cfg.runner.resume, Path(run_dir), cfg.trainer.max_steps,
                                                  module_arguments(cfg), in_place=continuing))
    if cfg.launcher.join:  # a host started later, outside the launcher: a spare host of a running per_host job
        from runner.launch.per_host import join_running_job

        join_running_job(cfg, Path(run_dir))
        return None
    if kind != "local" and cfg.launcher.mode == "per_host":
        from runner.launch.per_host import run_host

        return run_host(cfg, Path(run_dir), kind, continuing)
    if kind != "local":
        from runner.launch.external import run_rank

        return run_rank(cfg, Path(run_dir), kind)
    claim_run_dir(Path(run_dir), continuing)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Controller(cfg, run_dir).run()


def _continues_in_place(cfg: DictConfig, kind: str, run_dir: Path) -> bool:
    """``runner.resume=auto`` (the default under torchrun and SLURM): this run continues the one its run dir holds,
    from the newest checkpoint there (``newest_checkpoint``: last.ckpt, or a newer verified flash checkpoint), or
    from scratch when there is none. Every host of a per_host job resolves it alike (the agents' configs must agree
    with the controller's), and only the controller's host moves the earlier outputs aside (``claim_run_dir``).
    Under per_rank a torchrun/SLURM restart continues the job through its attempts (``runner.launch.attempt``), so
    there auto asks for nothing more. Sets ``runner.resume`` to the file to continue from (or null)."""
    resume = cfg.runner.resume
    if resume is None and cfg.launcher.join is None and (kind != "local" or "SLURM_JOB_ID" in os.environ):
        resume = "auto"
    if resume != "auto":
        return False
    if kind != "local" and cfg.launcher.mode != "per_host":
        cfg.runner.resume = None
        return False
    newest = newest_checkpoint(run_dir)
    cfg.runner.resume = str(newest) if newest.is_file() else None
    print(f"[runner] runner.resume=auto: continuing from {newest}" if newest.is_file() else
          f"[runner] runner.resume=auto: no checkpoint in {run_dir}, starting from step 0", flush=True)
    return True


def check_mode(cfg: DictConfig, kind: str) -> None:
    """``launcher.mode`` fits the launcher, and under ``per_rank`` every configured fault can be carried out."""
    mode = cfg.launcher.mode
    if cfg.launcher.get("control_host") and (kind == "local" or mode != "per_host"):
        raise ConfigError(f"launcher.control_host={cfg.launcher.control_host} is where node 0 of a "
                          "launcher.mode=per_host job listens for the other hosts' agents; this run "
                          f"({kind}, launcher.mode={mode}) has no such agents: drop launcher.control_host, or "
                          "start the job under torchrun/SLURM with launcher.mode=per_host.")
    if kind == "local":
        if mode != "auto":
            raise ConfigError(f"launcher.mode={mode} applies under torchrun or SLURM; with launcher=local (one host, "
                              "simulated nodes) leave launcher.mode=auto.")
        return
    if mode == "per_host":
        for f in all_faults(cfg):
            if f.kind in NO_PER_HOST:
                raise ConfigError(f"fault={f.kind} cannot be carried out under {kind} with launcher.mode=per_host: "
                                  "the controller reaches the other hosts' workers through their agents, not their "
                                  "memory or the agents themselves; kill the host's processes from outside, or "
                                  "simulate it with the local launcher.")
        return
    if cfg.heartbeat.route == "agent":
        raise ConfigError(f"heartbeat.route=agent sends each worker's heartbeat to its host's node agent, and "
                          f"launcher.mode=per_rank starts none (under {kind} the launcher owns the processes): set "
                          "heartbeat.route=store, or launcher.mode=per_host.")
    if cfg.launcher.secret_file:
        raise ConfigError(f"launcher.secret_file={cfg.launcher.secret_file} signs the commands to node agents, and "
                          "launcher.mode=per_rank starts none (the launcher owns the processes): drop "
                          "launcher.secret_file.")
    for option in standby_options(list(cfg.get("ft") or {}), cfg.get("ft") or {}):
        raise ConfigError(f"{option}=true keeps a warm replacement on each host's node agent, and "
                          f"launcher.mode=per_rank starts none (under {kind} the launcher restarts ranks itself): set "
                          f"{option}=false, or launcher.mode=per_host.")
    ppn = cfg.parallel.procs_per_node
    for f in all_faults(cfg):
        if f.kind in NO_PER_RANK:
            raise ConfigError(f"fault={f.kind} cannot be carried out under {kind} with launcher.mode=per_rank: the "
                              "controller (a thread of rank 0) can signal only the ranks of its own host; use the "
                              "local launcher to simulate it.")
        if f.kind in CONTROLLER_CARRIED and not 0 < f.rank < ppn:
            raise ConfigError(f"fault={f.kind} fault.rank={f.rank} cannot be carried out under {kind} with "
                              f"launcher.mode=per_rank: the controller runs in rank 0 and can signal only the other "
                              f"ranks of its own host (ranks 1..{ppn - 1} with parallel.procs_per_node={ppn}).")
