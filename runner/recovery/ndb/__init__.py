"""NDB (Neighbour-Do-Both, from MeCeFO): a DP neighbour computes a failed rank's micro-batch too.

When a data-parallel rank fails and no spare exists, a neighbour (``Topology.ndb_assignment``) runs its own
micro-batch exactly and the failed rank's with three cheap approximations, each switchable
(``NDBConfig``, mirrored by ``conf/ft/ndb.yaml``): attention skip-connection, FFN recomputation and
low-rank FFN weight gradients. API:

* ``extra_microbatch_loss(model, idx, targets, cfg, step, svd_cache) -> loss``: ``loss.backward()``
  accumulates the extra micro-batch's approximate gradients into ``.grad``, on top of the own
  micro-batch's. ``TakeoverForward(model, cfg)(idx, targets, step)`` keeps the SVD cache for you.
* ``attention_param_names(model) -> set[str]`` and
  ``contributor_counts(model, microbatches, takeovers, cfg) -> dict[str, int]``: after a SUM
  all-reduce, divide each gradient by its count (attention params exclude skipped micro-batches).
* ``lowrank_linear`` / ``LowRankWgradLinear``, ``SVDCache``, ``lowrank_rank``: approximation (c).

Inside the runner: ``runtime.NDBRuntime`` runs a taken-over micro-batch, ``neighbour.NeighbourTakeover``
is the training step's hook, ``worker.NDBWorker`` gives the worker its hooks.
"""

from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.lowrank import LowRankWgradLinear, SVDCache, lowrank_linear, lowrank_rank
from runner.recovery.ndb.params import attention_param_names, contributor_counts
from runner.recovery.ndb.takeover import TakeoverForward, extra_microbatch_loss

__all__ = [
    "LowRankWgradLinear",
    "NDBConfig",
    "SVDCache",
    "TakeoverForward",
    "attention_param_names",
    "contributor_counts",
    "extra_microbatch_loss",
    "lowrank_linear",
    "lowrank_rank",
]
