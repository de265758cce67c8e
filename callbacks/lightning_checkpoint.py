"""The run's Lightning checkpoint: when to write ``<run dir>/checkpoints/last.ckpt``, and what goes in it.

Due at the run's last step, every ``checkpoint.every_n_steps`` committed steps, and at the committed
step where the members agreed to stop (``StepCommit.stop_agreed``, after a SIGINT/SIGTERM to the
controller), after which the fit ends. One replica writes it: the member at process-group rank 0 of
the current generation (logical rank 0 unless a neighbour covers it), from a CPU copy, in a
background thread (``runner.checkpoint.writer``).

The file is what ``trainer.save_checkpoint`` writes (state_dict, optimizer_states, lr_schedulers,
loops, epoch, global_step, hyper_parameters) plus the corruption guard's history and our extras
under ``RUNNER_KEY`` (the data position, which is the committed step, and the seed: data and RNG
are functions of (seed, step, logical rank), so these two restore both). Under ZeRO-1 every member
first brings its parameters up to date and the optimizer shards are gathered, so the file holds the
whole optimizer state, as one unsharded optimizer would (``runner.checkpoint.zero_state``). With
tensor or pipeline parallelism the ranks of the writing replica gather their slices of the parameters and of
their optimizer state over its TP and PP groups (``runner.checkpoint.tp_state``), so the file holds the full
model as at tp = pp = 1 (under ZeRO-1 too: the DP group gathers the shards first, then the TP group the
slices). A fault during either gather is recovered from like any other and the checkpoint of that step is
skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Checkpoint

from runner.checkpoint import RUNNER_KEY, last_checkpoint
from runner.checkpoint.tp_state import gather_replica_state, optimizer_params
from runner.checkpoint.writer import CheckpointWriter, cpu_copy
from runner.checkpoint.zero_state import gather_full_state
from runner.plumbing.events import EventLog
from runner.training.comm import CollectiveFailure, Comm
from runner.training.status import checkpoint_phase
from runner.training.strategy import ResilientStrategy

log = logging.getLogger(__name__)


class LightningCheckpoint(Checkpoint):
    """A ``Checkpoint``, so that Lightning runs it after every other callback but the configured ModelCheckpoints
    before it: the file holds every callback's state of its step (``trainer.should_stop`` at the agreed stop is let
    through by ``runner.training.agreed_stop``)."""

    def __init__(self, run_dir: str | Path, every_n_steps: int, seed: int, events: EventLog) -> None:
        self.path = last_checkpoint(run_dir)
        self.every_n_steps, self.seed, self.events = every_n_steps, seed, events
        self._writer: Optional[CheckpointWriter] = None
        self._saved_step = -1
        self._stopping = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Every checkpoint the run dumps (last.ckpt, a ModelCheckpoint's, a snapshot, a hand-over) leaves out the
        step loaders' states: they are empty (a loader's position is the committed step), and plain Lightning, resuming
        the file with a DataLoader of its own, refuses a loader state it has no loader for."""
        fit = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if fit.get("combined_loader") and not any(fit["combined_loader"]):
            del fit["combined_loader"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ResilientStrategy)  # the writer and the gather are the runner's
        step = trainer.global_step
        stop = strategy.commit.stop_agreed
        every = self.every_n_steps > 0 and step % self.every_n_steps == 0
        if (stop or every or step >= trainer.max_steps) and step != self._saved_step:
            with checkpoint_phase(trainer):
                self._save(trainer, strategy, step)
        if stop and not self._stopping:
            self._stopping = True
            trainer.should_stop = True
            if strategy.comm.rank == 0:
                self.events.emit("stop_agreed")

    def on_train_end(self, trainer, pl_module) -> None:
        if self._writer is not None:  # the last write is on disk before the worker reports done
            self._writer.close()
            self._writer = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._writer is not None:  # the fit failed: let a write in flight finish, and say if it did not
            try:
                self._writer.close()
            except Exception as err:
                log.warning("checkpoint: the write in flight failed: %s", err)
            self._writer = None

    def _save(self, trainer, strategy: ResilientStrategy, step: int) -> None:
        full_optimizer, full_tp = None, None
        zero = strategy.update.zero
        try:
            if zero is not None:
                strategy.commit.sync_params()  # the other owners' parameters of this step's update
                full_optimizer = gather_full_state(zero, zero.rank, strategy.comm)
            if strategy.comm.replica_size > 1 and _in_writing_replica(strategy.comm):
                states = ([(full_optimizer, zero.unsharded)] if zero is not None and full_optimizer is not None
                          else [(opt.state_dict(), optimizer_params(opt)) for opt in trainer.optimizers])
                full_tp = gather_replica_state(trainer.lightning_module, states, strategy.comm)
        except CollectiveFailure as err:
            strategy.commit.recover_from(err)
            if strategy.comm.rank == 0:
                self.events.emit("checkpoint_skipped", at_step=step, reason=f"a fault during the gather: {err}")
            return
        self._saved_step = step
        if strategy.comm.rank != 0:
            return
        ckpt = strategy.state.dump_state()
        if full_optimizer is not None:
            ckpt["optimizer_states"] = [full_optimizer]
        if full_tp is not None:
            ckpt["state_dict"], ckpt["optimizer_states"] = full_tp
        ckpt[RUNNER_KEY] = {"data_step": step, "seed": self.seed, "dp": strategy.dp_size, "optimizer": "unsharded"}
        if self._writer is None:
            self._writer = CheckpointWriter(self.path, self._written)
        self._writer.submit(step, cpu_copy(ckpt))

    def _written(self, step: int, path: Path, seconds: float) -> None:
        self.events.emit("checkpoint_saved", at_step=step, path=str(path), seconds=seconds)


def _in_writing_replica(comm: Comm) -> bool:
    """Whether this rank holds a slice of the replica that writes (the one of process-group rank 0): only
    that replica's ranks gather, over its own groups, so the other replicas run no collective for it."""
    return comm.coords_of(comm.joined.logical[0])[0] == comm.dp_rank
