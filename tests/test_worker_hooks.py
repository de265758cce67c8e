"""The registry of techniques' worker sides and how their hooks are merged."""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback

from runner.recovery.common.hooks import WorkerHooks
from runner.recovery.registry import TECHNIQUES
from runner.recovery.worker_registry import combine


class _Technique:
    def __init__(self, hooks: WorkerHooks) -> None:
        self._hooks = hooks

    def hooks(self, module) -> WorkerHooks:
        return self._hooks


def test_every_technique_has_a_worker_side():
    assert sorted(TECHNIQUES) == ["deadpool", "flash_ckpt", "flashrecovery", "ndb"]
    assert all(callable(getattr(t.worker_side(), "hooks", None)) for t in TECHNIQUES.values())


def test_hooks_of_several_techniques_are_merged_in_ft_order():
    first, second = Callback(), Callback()
    takeover = object()
    merged = combine([
        _Technique(WorkerHooks(callbacks=[first], final_record=lambda: {"a": 1})),
        _Technique(WorkerHooks()),
        _Technique(WorkerHooks(takeover=takeover, side_group=True, callbacks=[second],  # type: ignore[arg-type]
                               final_record=lambda: {"b": 2})),
    ], module=None)  # type: ignore[arg-type]
    assert merged.callbacks == [first, second]
    assert merged.takeover is takeover and merged.side_group
    assert merged.shard_replication is None and merged.restore_snapshot is None
    assert merged.final_record() == {"a": 1, "b": 2}


def test_a_hook_two_techniques_fill_is_refused():
    with pytest.raises(ValueError, match="'takeover'"):
        combine([_Technique(WorkerHooks(takeover=object())), _Technique(WorkerHooks(takeover=object()))],  # type: ignore[arg-type]
                module=None)  # type: ignore[arg-type]
