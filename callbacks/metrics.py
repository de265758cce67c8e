"""Per-step metrics from the committed reduction: loss, step time, samples/s (tokens/s for token batches) and sample
accounting.

The all-reduce already carries, for every committed step, one count per logical rank whose
micro-batch went in and the summed loss, so the metrics rank logs the global view without an
extra collective. The metrics rank is the member of the generation with the lowest logical rank that did
not join it: logical rank 0 normally, another rank while NDB's neighbours cover rank 0 or in a generation
that rank 0's replacement joined (it does not hold the steps before). A step can be committed without its record:
the writer died between committing and writing, or it was a laggard that adopted the step from a
peer. So every member keeps its last record, and at its first commit in a new generation writes
that record if the file lacks it (under a file lock: once), so the accounting sees every step.
A step that carried a validation (``runner.training.validation``) has its values in its record: ``val/loss``,
the mean over every DP rank's validation batches, and what the module logged in ``validation_step`` under its own
names (``runner.training.eval_logs``), listed in ``val_metrics``; the logger gets them at that step. The
evaluations after fit (the final weights' validation, ``runner.test_after_fit``'s test) are one record more, at the
step after the last (``evaluation``: ``after_fit``), which the summary reports.

A record also holds, under their own names, what the module logged at that step and the learning rate of
each param group (``train/lr``, or ``train/lr-pg<i>`` with several, as Lightning's LearningRateMonitor
numbers them). Logged values come from Lightning's own logger connector: ``StepValues`` is the Trainer's
logger, so Lightning applies ``on_step``/``on_epoch``, ``reduce_fx``, ``sync_dist`` (inside the step's
reduction, ``runner.training.commit``), ``prog_bar`` and ``logger=False`` as it does for any logger, and
hands over each step's values after the step committed, and the epoch-end values at the epoch's last step
(listed in ``epoch_metrics``). So a record is written once its step's values are in (as soon as Lightning
handed them over; otherwise at the next step's start; the last step's at the end of training, after the epoch's
values), and a step redone after a recovery is logged once, with the committed values.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from runner.plumbing.events import METRICS_FIELDS, EventLog, JsonLines
from runner.plumbing.protocol import Layout
from runner.training.comm import Comm
from runner.training.commit import LOSS_SUM, MISPLACED
from runner.training.eval_logs import Evaluated


class CommitMetrics(Callback):
    def __init__(self, metrics: JsonLines, events: EventLog, comm: Comm, tokens_per_sample: Optional[int],
                 micro_batch: int, tp: int = 1) -> None:
        """``tp``: ranks per model replica; the accounting has one count per replica. ``tokens_per_sample``: None
        for a module whose batches are not tokens (it states no ``tokens_per_sample``): its records' ``tokens_per_s``
        is null, ``samples_per_s`` is always given."""
        self.metrics, self.events, self.comm, self.tp = metrics, events, comm, tp
        self.tokens_per_sample, self.micro_batch = tokens_per_sample, micro_batch
        self._t_step = time.perf_counter()
        self._last_gen: int | None = None
        self._unwritten: dict | None = None  # this member's last record, while another member writes
        self._pending: dict | None = None  # this writer's last record, until its step is over
        self._epoch_ended = False  # what Lightning logs now is the epoch's
        self._trainer: Any = None
        self.last: dict | None = None  # the newest committed step's record (the progress bar shows it)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._flush()
        self._epoch_ended = False
        self._t_step = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._epoch_ended = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush()

    def add_logged(self, step: int, values: dict[str, float]) -> None:
        """What Lightning's logger connector hands the logger at ``step``: into that step's record."""
        record = self.last
        if record is None or record["step"] != step:  # a step this member adopted without committing it
            return
        _refuse_runner_fields(set(values))
        record.update(values)
        if self._epoch_ended:
            record["epoch_metrics"] = sorted({*record.get("epoch_metrics", ()), *values})
        elif self._trainer is not None and step + 1 < self._trainer.max_steps:
            self._flush()  # the step's values are in: written now, not at the next step's start (a fault there)

    def _flush(self) -> None:
        if self._pending is not None:
            self.metrics.write(self._pending)
            self._pending = None

    def on_commit(self, step: int, extras, reduce_s: float, validated: Optional[Evaluated] = None) -> None:
        gen, layout = self.comm.gen, self.comm.layout
        assert layout is not None  # a step is committed only inside a generation this worker joined
        dp = layout.dp // self.tp  # one count per model replica (the TP ranks of a replica read one batch)
        counts = [int(c) for c in extras[:dp].tolist()]
        contributors = max(1, sum(counts))
        loss = float(extras[LOSS_SUM]) / contributors
        step_time = time.perf_counter() - self._t_step
        samples_per_s = sum(counts) * self.micro_batch / step_time if step_time > 0 else 0.0
        tokens_per_s = samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None
        record: dict[str, Any] = {
            "step": step, "t": time.time(), "loss": loss, "step_time_s": step_time, "reduce_s": reduce_s,
            "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s, "counts": counts,
            "misplaced": int(extras[MISPLACED]), "gen": gen}
        if validated is not None and validated.logged():
            _refuse_runner_fields(set(validated.logged()) - {"val/loss"})
            record.update(validated.logged())
            record["val_metrics"] = sorted(validated.logged())
        record.update(learning_rates(self._trainer.optimizers if self._trainer is not None else []))
        self.last = record
        if gen != self._last_gen and self._unwritten is not None and self._unwritten["step"] == step - 1:
            self._write_if_missing(self._unwritten)
        writer = metrics_writer(layout)
        if writer != self.comm.wid:
            self._last_gen, self._unwritten = gen, record
            return
        self._unwritten = None
        if self._last_gen is not None and gen != self._last_gen:
            self.events.emit("step_committed_after_recovery", gen=gen, committed_step=step)
        self._last_gen = gen
        self._pending = record

    def add_after_fit(self, step: int, values: dict[str, float], validation: list[str]) -> None:
        """The evaluations after fit (their logged values; ``validation``: the validation's names among them): a record
        of their own, at ``step`` (the number of committed updates they measured), after the last step's, by the
        member that writes the records."""
        layout = self.comm.layout
        if not values or layout is None or metrics_writer(layout) != self.comm.wid:
            return
        self._flush()
        record = {"step": step, "t": time.time(), "gen": self.comm.gen, "evaluation": "after_fit", **values}
        self.metrics.write({**record, "val_metrics": sorted(validation)} if validation else record)

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


def _refuse_runner_fields(names: set[str]) -> None:
    taken = sorted(names & METRICS_FIELDS)
    if taken:
        raise ValueError(f"The module logs {taken}, a name the runner gives a field of metrics.jsonl "
                         f"({sorted(METRICS_FIELDS)}): log it under another name (e.g. train/{taken[0]}).")


def metrics_writer(layout: Layout) -> int:
    """The member that writes the records: the one with the lowest logical rank that is not joining the generation
    (logical rank 0, whose own values are what Lightning gives a logger, unless it is a replacement that joined
    this generation). Every member decides alike from the layout alone."""
    ready = [i for i, wid in enumerate(layout.members) if wid not in layout.joiners] or [0]
    return layout.members[min(ready, key=lambda i: (layout.logical[i], i))]


def learning_rates(optimizers: list) -> dict[str, float]:
    """The learning rate each param group applies in this step's update: ``train/lr``, or ``train/lr-pg<i>``
    (numbered from 1 over every optimizer's groups) with several."""
    rates = [float(group["lr"]) for opt in optimizers for group in opt.param_groups]
    if len(rates) == 1:
        return {"train/lr": rates[0]}
    return {f"train/lr-pg{i}": lr for i, lr in enumerate(rates, 1)}


class StepValues(Logger):
    """The Trainer's logger: Lightning's logger connector hands it what the module logs, and it gives that to
    ``CommitMetrics`` for the committed step's record (which the controller's run logger reads)."""

    def __init__(self, metrics: CommitMetrics) -> None:
        super().__init__()
        self.commit_metrics = metrics

    @property
    def name(self) -> str:
        return "runner"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        # Lightning adds the epoch to every step's values; a record is a step's (epochs are counted elsewhere)
        values = {k: float(v) for k, v in metrics.items() if k != "epoch"}
        if step is not None and values:
            self.commit_metrics.add_logged(step, values)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The controller logs the resolved config (module arguments included) as the run's config."""
