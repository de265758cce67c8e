"""The attempt of a torchrun/SLURM job that all of its ranks agree on, and the namespace it gives them.

torchrun restarts a job's ranks after a failure (``--max-restarts``), but its restart count
(``TORCHELASTIC_RESTART_COUNT``) rises only on the host whose worker failed: the other hosts restart
for a membership change and keep theirs, so it cannot name an attempt. Here rank 0 takes a new
attempt id from a counter in the job's store (which outlives a restart: torchrun's agent store), and
every other rank asks rank 0 for it: it draws a ticket from a second counter and waits until rank 0
answers that ticket. A ticket is drawn after the previous attempt's processes are gone (torchrun
stops every worker before the next rendezvous), so only the current rank 0 can answer it; no rank
can read a stale attempt id. Under SLURM rank 0 hosts the store, so a requeued job starts with a
fresh one: its attempt ids then count on from ``SLURM_RESTART_COUNT``. The job's run directory is
fixed by the first attempt's rank 0, so that a restart (whose Hydra picks a new timestamped
directory) continues in the same one (under SLURM: pass the same ``hydra.run.dir`` to a requeue).
"""

from __future__ import annotations

import threading
from datetime import timedelta

from torch.distributed import Store

_ANSWER_POLL_S = 0.01  # rank 0 answers the tickets drawn since its last look this often


class JobKeys:
    """The job-level keys of the store (outside any attempt's namespace)."""

    def __init__(self, job_id: str) -> None:
        self.prefix = f"resilient-runner/{job_id}/"

    def namespace(self, attempt: int) -> str:
        return f"{self.prefix}{attempt}/"

    @property
    def attempts(self) -> str:
        return self.prefix + "attempts"

    @property
    def tickets(self) -> str:
        return self.prefix + "tickets"

    @property
    def run_dir(self) -> str:
        return self.prefix + "run_dir"

    def answer(self, ticket: int) -> str:
        return f"{self.prefix}answer/{ticket}"


class AttemptHost:
    """Rank 0's side: a new attempt id, the job's run directory, and answers to the other ranks' tickets
    for as long as the attempt runs (``close`` ends them). ``store``: a connection of its own, since a
    thread answers on it while the rank uses its other connections."""

    def __init__(self, store: Store, job_id: str, run_dir: str, earlier: int = 0) -> None:
        self.keys = JobKeys(job_id)
        self.store = store
        self.attempt = earlier + store.add(self.keys.attempts, 1)
        self.run_dir = store.compare_set(self.keys.run_dir, "", run_dir).decode()
        self._closed = threading.Event()
        self._answered = 0
        self._thread = threading.Thread(target=self._answer, name="attempt-answers", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        while True:
            drawn = self.store.add(self.keys.tickets, 0)
            for ticket in range(self._answered + 1, drawn + 1):
                self.store.set(self.keys.answer(ticket), str(self.attempt))
            self._answered = drawn
            if self._closed.wait(_ANSWER_POLL_S):
                return

    def close(self) -> None:
        self._closed.set()
        self._thread.join()


def join_attempt(store: Store, job_id: str, timeout_s: float) -> tuple[int, str]:
    """Another rank's side: (attempt id, run directory) from the current rank 0."""
    keys = JobKeys(job_id)
    ticket = store.add(keys.tickets, 1)
    store.wait([keys.answer(ticket)], timedelta(seconds=timeout_s))
    return int(store.get(keys.answer(ticket)).decode()), store.get(keys.run_dir).decode()
