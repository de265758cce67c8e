"""attempts.jsonl: when each attempt of a torchrun/SLURM job started and how it ended.

Every attempt writes into the job's one run directory; rank 0 appends a line when its attempt
starts and one when it ends (completed, failed with the controller's reason, or terminated by the
launcher), so that the final summary accounts for the attempts before it. An attempt whose rank 0
was lost has no end line: the summary then infers its end from the next attempt's start.
"""

from __future__ import annotations

import time
from pathlib import Path

from runner.control.records import Attempt
from runner.plumbing.events import JsonLines, read_jsonl

FILE = "attempts.jsonl"


class AttemptLog:
    """Rank 0's writer of its attempt's lines."""

    def __init__(self, run_dir: Path, attempt: int) -> None:
        self.lines = JsonLines(Path(run_dir) / FILE)
        self.attempt = attempt
        self.ended = False

    def start(self) -> None:
        self.lines.write({"attempt": self.attempt, "t_start": time.time()})

    def end(self, status: str, error: str, step: int) -> None:
        """Once per attempt (the first end wins: a SIGTERM during the normal end changes nothing)."""
        if self.ended:
            return
        self.ended = True
        self.lines.write({"attempt": self.attempt, "t_end": time.time(), "status": status, "error": error,
                          "step": step})


def read_attempts(run_dir: Path) -> list[Attempt]:
    """The job's attempts, oldest first, each with what its lines say."""
    attempts: dict[int, Attempt] = {}
    for line in read_jsonl(Path(run_dir) / FILE):
        a = line["attempt"]
        if "t_start" in line:
            attempts[a] = Attempt(a, line["t_start"])
        elif a in attempts:
            rec = attempts[a]
            rec.t_end, rec.status, rec.error, rec.step = line["t_end"], line["status"], line["error"], line["step"]
    return [attempts[a] for a in sorted(attempts)]
