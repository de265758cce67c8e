"""What the controller records: each worker process, each recovery, and the run as a whole.

``RunRecord`` is what the summary is built from (``runner/report/summary.py``): the controller fills it and
hands it over at the end, so the summary depends on no controller internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

EXIT_RUN_FAILED = 1
EXIT_STOPPED = 75  # SIGINT/SIGTERM/SIGUSR2: checkpointed and stopped (EX_TEMPFAIL: requeue and resume)


def exit_code(status: str) -> int:
    """The exit code of every host's process for a run that ended with ``status``: 0 completed, 75 stopped, 1 failed
    (node 0's launching process and every other host's agent say the same)."""
    return {"completed": 0, "stopped": EXIT_STOPPED}.get(status, EXIT_RUN_FAILED)


@dataclass
class Worker:
    """One worker process: where it runs, which logical rank it computes, and what its heartbeats said."""

    wid: int
    node: int
    local_rank: int
    logical: int
    role: str
    t_spawn: float
    ready: bool = False
    synced: bool = False  # holds the model/optimizer state (an initial worker, or a joiner seen training)
    done: bool = False
    finished_ranks: list[int] = field(default_factory=list)  # once done: the logical ranks it computed to the end
    dead: bool = False
    killed_for: str = ""  # set when the controller itself killed it (hang)
    hb_seq: int = -1
    hb_change: float = 0.0
    hb_beat: Optional[dict] = field(default=None, repr=False)  # the beat whose content was handled last
    hb_step: int = -1
    hb_step_change: float = 0.0
    hb_phase: str = ""
    hb_gen: int = -1  # the generation its newest heartbeat said it had joined
    first_step: int = -1  # the step of its first heartbeat while training (its guard's history starts there)


@dataclass
class Recovery:
    """What the controller knows of one recovery; worker events fill in the rest at the end."""

    id: int
    t_detect: float
    t_detect_mono: float
    symptoms: list = field(default_factory=list)
    fault: str = ""
    victims: list = field(default_factory=list)
    step: int = -1
    action: str = ""
    reason: str = ""
    decide_reason: str = ""  # the rule that closed the decision: conclusive_exit, window, proof_of_life, arrivals
    t_fault: Optional[float] = None
    t_decide: Optional[float] = None
    t_ready: Optional[float] = None
    survivors_gen: Optional[int] = None
    full_gen: Optional[int] = None
    diagnosis: Optional[str] = None  # a hang's diagnosis directory, relative to the run directory
    verdict: Optional[str] = None  # its one-line verdict: where everyone was


@dataclass
class Attempt:
    """One launch of a torchrun/SLURM job's ranks (``runner/launch/attempt_log.py``): the launcher restarts them
    after a failure, and the summary accounts for every attempt."""

    attempt: int
    t_start: float
    t_end: Optional[float] = None  # None: still running, or it ended without a record (rank 0 was lost)
    status: str = ""  # completed | failed | "" (no record of its end)
    error: str = ""
    step: int = -1  # the newest step a heartbeat of it reported (-1: unknown); the summary prefers its commits


@dataclass
class RunRecord:
    """The run as the summary sees it: how it ended, its recoveries and the workers' done records."""

    ft: list[str]
    dp: int
    t_start: float
    status: str = "running"  # running | completed | failed
    error: str = ""
    recoveries: list[Recovery] = field(default_factory=list)
    done: dict[int, dict] = field(default_factory=dict)  # wid -> its done record, for each rank's last worker
    attempts: list[Attempt] = field(default_factory=list)  # torchrun/SLURM: the job's earlier attempts, oldest first
    phase_timeouts: dict[str, dict] = field(default_factory=dict)  # each phase's hang timeout at the end

    def judge_end(self) -> None:
        """The run's final verdict, decided once, before anything reports it: a completed run whose replicas ended
        with different parameters failed."""
        checksums = {d["checksum"] for d in self.done.values()}
        if self.status == "completed" and len(checksums) != 1:
            self.status = "failed"
            self.error = f"replicas ended with different parameters: {len(checksums)} distinct checksums"


def last_step(done: dict[int, dict], max_steps: int) -> int:
    """The step the run ends at: ``trainer.max_steps``, or the earlier end of its ``trainer.max_epochs`` that the
    workers found once they knew the training set's length (the ``max_steps`` of their final records)."""
    return min((d.get("max_steps", max_steps) for d in done.values()), default=max_steps)
