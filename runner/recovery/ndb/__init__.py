"""NDB (Neighbour-Do-Both, from MeCeFO): a DP neighbour computes a failed rank's micro-batch too.

When a data-parallel rank fails and no spare exists, a neighbour (``Topology.covering_assignment``) runs its own
micro-batch exactly and the failed rank's with three cheap approximations, each switchable
(``config.NDBConfig``, mirrored by ``conf/ft/ndb.yaml``): attention skip-connection, FFN recomputation and
low-rank FFN weight gradients. API, by module (this package imports nothing, so the config check that reads
``config`` and the controller's ``action`` stay free of torch):

* ``takeover``: ``extra_microbatch_loss(model, idx, targets, cfg, step, svd_cache) -> loss``:
  ``loss.backward()`` accumulates the extra micro-batch's approximate gradients into ``.grad``, on top of
  the own micro-batch's. ``TakeoverForward(model, cfg)(idx, targets, step)`` keeps the SVD cache for you.
* ``params``: ``attention_param_names(model) -> set[str]`` and
  ``contributor_counts(model, microbatches, takeovers, cfg) -> dict[str, int]``: after a SUM
  all-reduce, divide each gradient by its count (attention params exclude skipped micro-batches).
* ``lowrank``: ``lowrank_linear`` / ``LowRankWgradLinear``, ``SVDCache``, ``lowrank_rank``: approximation (c).

Inside the runner: ``runtime.NDBRuntime`` runs a taken-over micro-batch, ``neighbour.NeighbourTakeover``
is the training step's hook, ``worker.NDBWorker`` gives the worker its hooks.
"""
