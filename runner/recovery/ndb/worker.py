"""NDB's worker side: the neighbour's take-over of failed ranks' micro-batches inside its step, and the
step times and memory it reports."""

from __future__ import annotations

from lightning.pytorch import LightningModule

from runner.model import GPT
from runner.parallel.generation_group import GenerationGroup
from runner.parallel.pipeline import GPTStage, OneFOneB
from runner.recovery.common.hooks import WorkerContext, WorkerHooks
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.neighbour import NeighbourTakeover
from runner.recovery.ndb.runtime import NDBRuntime


class NDBWorker:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def hooks(self, module: LightningModule) -> WorkerHooks:
        cfg = self.ctx.cfg
        model = module.model
        assert isinstance(model, (GPT, GPTStage))  # our GPT (or its stage), not a wrapper: the approximations' model
        comm = self.ctx.comm

        def schedule() -> OneFOneB:
            """pp > 1: a taken-over batch runs through this stage's own schedule (built once the groups exist)."""
            assert isinstance(model, GPTStage)
            return OneFOneB(model, GenerationGroup(comm, "pp", comm.pp_rank, comm.pp),
                            cfg.trainer.micro_batches or comm.pp)

        runtime = NDBRuntime(model, NDBConfig(**cfg.ft.ndb), cfg.seed, data_rank=lambda rank: comm.coords_of(rank)[0],
                             pipeline=schedule if isinstance(model, GPTStage) else None)

        def final_record() -> dict:
            return {"takeover": runtime.stats()} if runtime.step_times[True] else {}

        return WorkerHooks(takeover=NeighbourTakeover(runtime, self.ctx.status, self.ctx.comm.device),
                           final_record=final_record)
