"""NDB's worker side: the neighbour's take-over of failed ranks' micro-batches inside its step, and the
step times and memory it reports."""

from __future__ import annotations

from lightning.pytorch import LightningModule

from runner.model import GPT
from runner.recovery.hooks import WorkerContext, WorkerHooks
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.neighbour import NeighbourTakeover
from runner.recovery.ndb.runtime import NDBRuntime


class NDBWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def hooks(self, module: LightningModule) -> WorkerHooks:
        cfg = self.ctx.cfg
        model = module.model
        assert isinstance(model, GPT)  # our GPT, not a wrapper: the approximations' model
        comm = self.ctx.comm
        runtime = NDBRuntime(model, NDBConfig(**cfg.ft.ndb), cfg.seed, data_rank=lambda rank: comm.coords_of(rank)[0])

        def final_record() -> dict:
            return {"takeover": runtime.stats()} if runtime.step_times[True] else {}

        return WorkerHooks(takeover=NeighbourTakeover(runtime, self.ctx.status, self.ctx.comm.device),
                           final_record=final_record)
