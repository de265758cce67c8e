"""Per-step metrics from the committed reduction: loss, step time, tokens/s and sample accounting.

The all-reduce already carries, for every committed step, one count per logical rank whose
micro-batch went in and the summed loss, so the metrics rank logs the global view without an
extra collective. The metrics rank is the first member of the generation that is not joining it:
logical rank 0 normally, another rank while NDB's neighbours cover rank 0 or rank 0's replacement
is still joining (it does not hold the steps before). A step can be committed without its record:
the writer died between committing and writing, or it was a laggard that adopted the step from a
peer. So every member keeps its last record, and at its first commit in a new generation writes
that record if the file lacks it (under a file lock: once), so the accounting sees every step.
A step that carried a validation (``runner.training.validation``) has ``val/loss`` in its record,
the mean over every DP rank's validation batches, and the logger gets it at that step.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from lightning.pytorch.callbacks import Callback

from runner.plumbing.events import EventLog, JsonLines
from runner.training.comm import Comm
from runner.training.commit import LOSS_SUM, MISPLACED, VAL_BATCHES, VAL_LOSS_SUM


class CommitMetrics(Callback):
    def __init__(self, metrics: JsonLines, events: EventLog, comm: Comm, tokens_per_sample: int,
                 micro_batch: int, tp: int = 1) -> None:
        """``tp``: ranks per model replica; the accounting has one count per replica."""
        self.metrics, self.events, self.comm, self.tp = metrics, events, comm, tp
        self.tokens_per_sample, self.micro_batch = tokens_per_sample, micro_batch
        self._t_step = time.perf_counter()
        self._last_gen: int | None = None
        self._unwritten: dict | None = None  # this member's last record, while another member writes
        self.last: dict | None = None  # the newest committed step's record (the progress bar shows it)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t_step = time.perf_counter()

    def on_commit(self, step: int, extras, reduce_s: float) -> None:
        gen, layout = self.comm.gen, self.comm.layout
        assert layout is not None  # a step is committed only inside a generation this worker joined
        dp = layout.dp // self.tp  # one count per model replica (the TP ranks of a replica read one batch)
        counts = [int(c) for c in extras[:dp].tolist()]
        contributors = max(1, sum(counts))
        loss = float(extras[LOSS_SUM]) / contributors
        step_time = time.perf_counter() - self._t_step
        tokens = sum(counts) * self.micro_batch * self.tokens_per_sample
        record = {"step": step, "t": time.time(), "loss": loss, "step_time_s": step_time, "reduce_s": reduce_s,
                  "tokens_per_s": tokens / step_time if step_time > 0 else 0.0, "counts": counts,
                  "misplaced": int(extras[MISPLACED]), "gen": gen}
        val_batches = int(extras[VAL_BATCHES])
        if val_batches:
            record["val/loss"] = float(extras[VAL_LOSS_SUM]) / val_batches
        self.last = record
        if gen != self._last_gen and self._unwritten is not None and self._unwritten["step"] == step - 1:
            self._write_if_missing(self._unwritten)
        writer = next((wid for wid in layout.members if wid not in layout.joiners), layout.members[0])
        if writer != self.comm.wid:
            self._last_gen, self._unwritten = gen, record
            return
        self._unwritten = None
        if self._last_gen is not None and gen != self._last_gen:
            self.events.emit("step_committed_after_recovery", gen=gen, committed_step=step)
        self._last_gen = gen
        self.metrics.write(record)

    def _write_if_missing(self, record: dict, tail_bytes: int = 1 << 16) -> None:
        """Append ``record`` unless metrics.jsonl's tail has its step; the lock makes one holder do it."""
        fcntl.flock(self.metrics.fd, fcntl.LOCK_EX)
        try:
            with open(self.metrics.path, "rb") as f:
                start = max(0, os.fstat(f.fileno()).st_size - tail_bytes)
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines()[1 if start else 0:]  # a first may be cut
            if not any(json.loads(line).get("step") == record["step"] for line in lines if line.strip()):
                self.metrics.write(record)
        finally:
            fcntl.flock(self.metrics.fd, fcntl.LOCK_UN)
