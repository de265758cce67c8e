"""A Lightning Trainer whose ``should_stop`` is agreed by every member at a committed step.

In Lightning a callback (EarlyStopping, a user's) or the module stops the fit by setting ``trainer.should_stop``, and
EarlyStopping makes the ranks agree with ``strategy.reduce_boolean_decision``, a collective of its own between steps.
Here no collective runs outside a step's reduction (one that a rank's death interrupts could not be completed by any
recovery), so a rank's ``should_stop = True`` is a request (``ResilientStrategy.request_stop``): the stop flag of the
next step's reduction carries it, and once that step is committed every member, a replacement's too, stops there,
with checkpoints/last.ckpt written (``callbacks/lightning_checkpoint.py`` sets ``should_stop`` at the agreed step,
which this class lets through). A stop decided after step N's commit ends the run after step N + 1, in a fault-free
and a recovered run alike; a decision taken at the last step is the end anyway.
"""

from __future__ import annotations

import lightning.pytorch as pl

from runner.training.strategy import ResilientStrategy


class AgreedStopTrainer(pl.Trainer):
    _stopping = False

    @property
    def should_stop(self) -> bool:
        return self._stopping

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        if not value:
            self._stopping = False
            return
        strategy = self.strategy
        if isinstance(strategy, ResilientStrategy) and not strategy.commit.stop_agreed:
            strategy.request_stop()
            return
        self._stopping = True
