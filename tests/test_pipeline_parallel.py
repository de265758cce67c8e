"""Pipeline parallelism on real processes and real gloo groups: two stages of a GPT under the 1F1B schedule
compute the unsharded model's loss, gradients and optimizer steps, also with each stage tensor-parallel."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import GlooGroups, rel_error, run_ranks

from runner.model import GPT, GPTConfig
from runner.parallel.pipeline import GPTStage, OneFOneB
from runner.parallel.tensor import gather_full, shard_gpt_for_tp
from runner.planning.topology import Topology

PP = 2
STEPS = 3
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
MICRO_BATCHES = (1, 4)  # no steady phase at all, and warm-up, steady phase and drain


def _train_stage_and_reference(rank: int, groups: GlooGroups) -> dict:
    group = groups("pp", list(range(PP)))
    report: dict = {}
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(CFG.vocab_size, (8, CFG.seq_len), generator=gen)  # one batch: the loss must fall
    targets = torch.randint(CFG.vocab_size, (8, CFG.seq_len), generator=gen)
    for m in MICRO_BATCHES:
        torch.manual_seed(0)
        reference = GPT(CFG)
        stage = GPTStage(copy.deepcopy(reference), rank, PP)
        schedule = OneFOneB(stage, group, micro_batches=m)
        full = dict(reference.named_parameters())
        opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        opt_pp = torch.optim.AdamW(stage.parameters(), lr=1e-2)
        losses, grads, sends = [], [], group.sends
        for step in range(STEPS + 1):  # the last forward checks the loss after the third step
            loss_ref = reference.loss(idx, targets)
            loss = schedule.step(idx, targets)
            losses.append((loss_ref.item(), None if loss is None else loss.item()))
            if step == STEPS:
                break
            loss_ref.backward()
            grads.append(max(rel_error(p.grad, full[stage.full_name(n)].grad) for n, p in stage.named_parameters()))
            for opt in (opt_ref, opt_pp):
                opt.step()
                opt.zero_grad(set_to_none=True)
        end = max((p.detach() - full[stage.full_name(n)].detach()).abs().max().item()
                  for n, p in stage.named_parameters())
        report[m] = {"loss": losses, "grad": grads, "end": end, "sends": group.sends - sends,
                     "blocks": [stage.full_name(n).split(".")[1] for n, _ in stage.named_parameters()
                                if n.startswith("blocks.")][:1]}
    return report


def test_pp2_1f1b_matches_the_unsharded_model():
    reports = run_ranks(_train_stage_and_reference, PP)
    for rank, report in reports.items():
        for m in MICRO_BATCHES:
            r = report[m]
            assert r["blocks"] == [str(rank)]  # stage s holds block s of two
            # the same parameters give the same gradients; after Adam steps the parameters differ by rounding
            # noise that Adam amplifies (see test_tensor_parallel), and the gradients by a little more
            assert r["grad"][0] < 1e-5 and max(r["grad"]) < 1e-4, r["grad"]
            assert r["end"] < 1e-4
            # each micro-batch's activation forward or gradient backward, and the tied gradient, every step
            assert r["sends"] == (STEPS + 1) * (m + 1)
    for m in MICRO_BATCHES:
        last = reports[PP - 1][m]["loss"]
        for loss_ref, loss in last:
            assert loss == pytest.approx(loss_ref, rel=1e-5)
        assert last[-1][1] < last[0][1]  # the steps trained
        assert all(loss is None for _, loss in reports[0][m]["loss"])  # only the last stage has a loss


def _train_tp_pp_and_reference(rank: int, groups: GlooGroups) -> dict:
    topo = Topology(nodes=2, procs_per_node=2, tp=2, pp=PP)  # one replica: a TP pair on each node, one stage each
    dp, pp, tp = topo.coords(rank)
    tp_group = groups(f"tp{dp}.{pp}", topo.tp_group(rank))
    pp_group = groups(f"pp{dp}.{tp}", topo.pp_group(rank))
    torch.manual_seed(0)
    reference = GPT(CFG)
    stage = GPTStage(shard_gpt_for_tp(copy.deepcopy(reference), tp_group), pp, PP)
    schedule = OneFOneB(stage, pp_group, micro_batches=2)
    full = dict(reference.named_parameters())
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(CFG.vocab_size, (4, CFG.seq_len), generator=gen)
    targets = torch.randint(CFG.vocab_size, (4, CFG.seq_len), generator=gen)
    loss_ref = reference.loss(idx, targets)
    loss = schedule.step(idx, targets)
    loss_ref.backward()
    grads = gather_full(stage, tp_group, grads=True)
    return {"stage": pp, "loss": (loss_ref.item(), None if loss is None else loss.item()),
            "grad": max(rel_error(g, full[stage.full_name(n)].grad) for n, g in grads.items())}


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks_matches_the_unsharded_model():
    reports = run_ranks(_train_tp_pp_and_reference, 4)
    assert [r["stage"] for _, r in sorted(reports.items())] == [0, 0, 1, 1]  # TP innermost, then PP
    for report in reports.values():
        assert report["grad"] < 1e-5
        loss_ref, loss = report["loss"]
        assert loss is None if report["stage"] == 0 else loss == pytest.approx(loss_ref, rel=1e-5)


def _validate_stage_and_reference(rank: int, groups: GlooGroups) -> dict:
    group = groups("pp", list(range(PP)))
    torch.manual_seed(0)
    reference = GPT(CFG)
    stage = GPTStage(copy.deepcopy(reference), rank, PP)
    schedule = OneFOneB(stage, group, micro_batches=2)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(CFG.vocab_size, (rows, CFG.seq_len), generator=gen),
                torch.randint(CFG.vocab_size, (rows, CFG.seq_len), generator=gen)) for rows in (4, 4, 3, 4, 2)]
    with torch.no_grad():
        expected = [reference.loss(idx, targets).item() for idx, targets in batches]
    losses = schedule.forward_only(batches)
    return {"losses": [loss.item() for loss in losses], "expected": expected, "sends": group.sends,
            "grads": [n for n, p in stage.named_parameters() if p.grad is not None]}


@pytest.mark.slow
def test_forward_only_gives_each_batch_the_unsharded_models_loss_exactly():
    """Five validation batches, more than the stages keep in flight and of two sizes: each goes through the
    pipeline whole, so the last stage's loss is the unsharded model's bit for bit; the first stage returns zeros
    (a sum over the pipeline is the last stage's), sends one activation per batch, and no gradient appears."""
    reports = run_ranks(_validate_stage_and_reference, PP)
    first, last = reports[0], reports[PP - 1]
    assert last["losses"] == last["expected"]
    assert first["losses"] == [0.0] * len(first["expected"])
    assert (first["sends"], last["sends"]) == (len(first["expected"]), 0)
    assert first["grads"] == last["grads"] == []


def test_a_stage_needs_whole_blocks_and_its_own_slot_in_the_group():
    with pytest.raises(ValueError, match="divide model.n_layer"):
        GPTStage(GPT(CFG), 0, 3)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))  # one real rank
    with pytest.raises(ValueError, match="stage 1 of 2 runs on rank 0 of a group of 1"):
        OneFOneB(GPTStage(GPT(CFG), 1, 2), group, micro_batches=2)
    with pytest.raises(ValueError, match="at least one"):
        OneFOneB(GPTStage(GPT(CFG), 0, 1), group, micro_batches=0)
