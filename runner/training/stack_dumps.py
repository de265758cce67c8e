"""A worker's Python stacks on demand: ``DUMP_SIGNAL`` makes the process write every thread's stack.

``faulthandler`` writes from its C-level signal handler, so a worker whose main thread waits inside a
collective (or any C call) still dumps at once. Each worker appends to a file of its own under the run
directory; the controller signals every live rank before it kills a hung one, and copies what each
appended into the recovery's diagnosis (``runner.control.diagnosis``).
"""

from __future__ import annotations

import faulthandler
import signal
from pathlib import Path
from typing import IO

DUMP_SIGNAL = signal.SIGUSR2
_open: list[IO[str]] = []  # faulthandler keeps only the descriptor: the file object must live as long as the process


def stack_file(run_dir: Path, wid: int) -> Path:
    return Path(run_dir) / "diagnosis" / "stacks" / f"w{wid}.txt"


def arm(run_dir: Path, wid: int) -> None:
    """Dump every thread's stack to this worker's stack file on ``DUMP_SIGNAL``."""
    path = stack_file(run_dir, wid)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    _open.append(f)
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
