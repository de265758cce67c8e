"""State packed for a peer (runner.training.packed): what comes back is what was sent, and nothing else is run."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch

from runner.training.packed import from_bytes, to_bytes


def test_tensors_and_containers_come_back_exactly() -> None:
    shared = torch.randn(3, 5)
    state = {
        "state_dict": OrderedDict(w=shared, b=torch.arange(4, dtype=torch.int64)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0), "exp_avg": shared.t()}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}]}],
        "half": torch.ones(3, dtype=torch.bfloat16), "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4), "also_empty": torch.empty(0), "grads": [None, torch.zeros(2, 2)],
        "dtype": torch.float16, "shape": torch.Size([2, 3]), "tags": {"a", "b"}, "step": 12, "name": "x",
    }

    def same(a, b) -> None:
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    padded = torch.cat([to_bytes(state), torch.zeros(13, dtype=torch.uint8)])  # a receiver's padding is ignored
    got = from_bytes(padded)
    same(state, from_bytes(torch.cat([torch.zeros(3, dtype=torch.uint8), padded])[3:]))  # bytes at any address
    same(state, got)
    assert got["state_dict"]["w"] is not got["optimizer_states"][0]["state"][0]["exp_avg"]
    assert got["state_dict"]["w"].untyped_storage().nbytes() == 15 * 4  # its own storage, not the received bytes
    again = from_bytes(to_bytes({"a": shared, "b": shared}))
    assert again["a"] is again["b"]  # one object sent once, as torch.load gives it back


@dataclass
class Registered:
    value: int


def test_anything_but_plain_containers_is_refused_unless_registered_as_safe() -> None:
    with pytest.raises(pickle.UnpicklingError, match="only tensors, plain containers"):
        from_bytes(to_bytes({"f": test_tensors_and_containers_come_back_exactly}))
    with pytest.raises(pickle.UnpicklingError, match="Registered"):
        from_bytes(to_bytes(Registered(3)))
    with torch.serialization.safe_globals([Registered]):  # as torch.load(weights_only=True) would accept it
        assert from_bytes(to_bytes(Registered(3))) == Registered(3)
