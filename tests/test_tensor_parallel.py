"""Tensor parallelism on two real processes and a real gloo group: the TP=2 shard of a GPT computes the
unsharded model's loss, gradients and optimizer steps, with one all-reduce per branch in each direction."""

from __future__ import annotations

import copy
import multiprocessing
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from runner.model import GPT, GPTConfig
from runner.parallel.tensor import ShardLayout, gather_full, shard_gpt_for_tp

TP = 2
STEPS = 3
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
TIMEOUT_S = 60.0


class CountingGroup:
    """The real gloo group, counting the all-reduces and sends launched on it."""

    def __init__(self, pg) -> None:
        self.pg, self.allreduces, self.sends = pg, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.pg, name)

    def allreduce(self, tensors):
        self.allreduces += 1
        return self.pg.allreduce(tensors)

    def send(self, tensors, peer: int, tag: int):
        self.sends += 1
        return self.pg.send(tensors, peer, tag)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class GlooGroups:
    """Real gloo groups over the test's store: ``groups(name, members)`` on every member rank builds one."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank = store, rank

    def __call__(self, name: str, members: list[int]) -> CountingGroup:
        prefix = dist.PrefixStore(f"{name}/", self.store)
        return CountingGroup(dist.ProcessGroupGloo(prefix, members.index(self.rank), len(members),
                                                   timedelta(seconds=TIMEOUT_S)))


def _rank_main(body, rank: int, size: int, port: int, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=TIMEOUT_S))
        results.put((rank, body(rank, GlooGroups(store, rank))))
    except Exception:  # the parent reports the child's traceback instead of waiting for its timeout
        results.put((rank, traceback.format_exc()))


def run_ranks(body, size: int) -> dict:
    """``body(rank, groups)`` on ``size`` spawned processes sharing a store on a port from the OS, where
    ``groups`` builds their gloo groups; each rank's report by rank, after checking that every rank returned
    one and exited cleanly."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(body, rank, size, port, results)) for rank in range(size)]
    for p in procs:
        p.start()
    reports = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, report in sorted(reports.items()):
        assert isinstance(report, dict), f"rank {rank} failed:\n{report}"
    assert all(p.exitcode == 0 for p in procs)
    return reports


def _train_tp_and_reference(rank: int, groups: GlooGroups) -> dict:
    group = groups("tp", list(range(TP)))
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = shard_gpt_for_tp(copy.deepcopy(reference), group)
    start = gather_full(model, group)
    report: dict = {"start": max(rel_error(start[n], p.detach()) for n, p in reference.named_parameters()),
                    "qkv_shape": list(model.blocks[0].attn.qkv.weight.shape), "loss": [], "grad": []}
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt_tp = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(CFG.vocab_size, (4, CFG.seq_len), generator=gen)  # one batch: the loss must fall
    targets = torch.randint(CFG.vocab_size, (4, CFG.seq_len), generator=gen)
    for step in range(STEPS + 1):  # the last forward checks the loss after the third step
        loss_ref, before = reference.loss(idx, targets), group.allreduces
        loss = model.loss(idx, targets)
        forward = group.allreduces - before
        report["loss"].append((loss_ref.item(), loss.item()))
        if step == STEPS:
            break
        loss_ref.backward()
        loss.backward()
        report.setdefault("allreduces", (forward, group.allreduces - before - forward))
        grads = gather_full(model, group, grads=True)
        report["grad"].append(max(rel_error(grads[n], p.grad) for n, p in reference.named_parameters()))
        for opt in (opt_ref, opt_tp):
            opt.step()
            opt.zero_grad(set_to_none=True)
    end = gather_full(model, group)
    report["end"] = max((end[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return report


def test_tp2_matches_the_unsharded_model():
    reports = run_ranks(_train_tp_and_reference, TP)
    for report in reports.values():
        assert report["qkv_shape"] == [3 * CFG.d_model // TP, CFG.d_model]  # each rank holds half the heads
        assert report["start"] == 0.0  # the shards are slices of the full weights, nothing else
        assert report["allreduces"] == (2 * CFG.n_layer, 2 * CFG.n_layer)  # attention and FFN, each direction
        for loss_ref, loss in report["loss"]:
            assert loss == pytest.approx(loss_ref, rel=1e-5)
        # Adam turns the rounding noise of a gradient that is zero in exact arithmetic (the key bias: softmax
        # ignores a shift shared by a row) into steps of its own: from the second step on the parameters, and
        # so the gradients, differ by more than rounding; parameters are compared absolutely.
        assert report["grad"][0] < 1e-5 and max(report["grad"]) < 1e-4, report["grad"]
        assert report["end"] < 1e-4
        assert report["loss"][-1][0] < report["loss"][0][0]  # the steps trained
    assert reports[0]["loss"] == reports[1]["loss"]  # the TP ranks agree bit for bit


@pytest.mark.parametrize("shape, layout", [((6, 4), ShardLayout(0, parts=3)), ((4, 6), ShardLayout(1)),
                                           ((12,), ShardLayout(0, parts=3))])
def test_a_shard_layout_cuts_and_reassembles_a_tensor(shape, layout):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    shards = [layout.shard(full, r, 2) for r in range(2)]
    assert torch.equal(layout.unshard(shards), full)
    if layout.parts == 3 and len(shape) == 1:  # q, k and v each contribute their first half to rank 0
        assert shards[0].tolist() == [0, 1, 4, 5, 8, 9]


def _single_rank_group():
    """A real gloo group of one process (an in-memory store): its collectives are identities."""
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=TIMEOUT_S))


def test_tp1_is_the_unsharded_model():
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = shard_gpt_for_tp(copy.deepcopy(reference), _single_rank_group())
    idx = torch.randint(CFG.vocab_size, (2, CFG.seq_len))
    assert torch.equal(model.loss(idx, idx), reference.loss(idx, idx))
    with pytest.raises(ValueError, match="sharded already"):
        shard_gpt_for_tp(model, _single_rank_group())


class _TwoRanks:
    """The shape of a two-rank group, for refusals that happen before any collective."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("change, match", [({"n_head": 1}, "multiples of 2"), ({"dropout": 0.1}, "model.dropout=0")])
def test_a_model_tp_cannot_split_exactly_is_refused(change, match):
    cfg = GPTConfig(**{**CFG.__dict__, **change})
    with pytest.raises(ValueError, match=match):
        shard_gpt_for_tp(GPT(cfg), _TwoRanks())
