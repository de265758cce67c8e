"""NDB approximations on a tiny GPT: which gradients each one changes, and by how much."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from runner.config import register_all
from runner.config.registry import CONF_DIR
from runner.model import GPT, GPTConfig
from runner.recovery.ndb.config import NDBConfig
from runner.recovery.ndb.lowrank import SVDCache, lowrank_linear, lowrank_rank
from runner.recovery.ndb.params import attention_param_names, contributor_counts
from runner.recovery.ndb.takeover import extra_microbatch_loss

ALL_OFF = NDBConfig(skip_attention=False, recompute_ffn=False, lowrank_ffn=False, warmup_steps=0)
CONF = Path(__file__).resolve().parents[1] / "conf" / "ft" / "ndb.yaml"


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiny_gpt(dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=dropout)
    return GPT(cfg).train()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (4, 16), generator=g)
    return idx, torch.randint(0, 64, (4, 16), generator=g)


def grads(model: GPT, loss_fn) -> dict[str, torch.Tensor | None]:
    """Gradients of one fresh backward, run from a fixed RNG state so dropout masks match."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss_fn().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def extra_grads(model: GPT, cfg: NDBConfig, step: int = 0) -> dict[str, torch.Tensor | None]:
    idx, tgt = batch()
    cache = SVDCache(cfg.svd_every)
    return grads(model, lambda: extra_microbatch_loss(model, idx, tgt, cfg, step, cache))


def plain_grads(model: GPT) -> dict[str, torch.Tensor | None]:
    idx, tgt = batch()
    return grads(model, lambda: model.loss(idx, tgt))


def assert_all_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- low-rank weight gradient (approximation c) -------------------------------------------------


def decaying_layer(inn: int = 32, out: int = 128, n: int = 256):
    """W with singular values 0.7**i and inputs that live mostly in W's top right-singular space."""
    torch.manual_seed(0)
    dt = torch.float64
    u, _ = torch.linalg.qr(torch.randn(out, inn, dtype=dt))
    v, _ = torch.linalg.qr(torch.randn(inn, inn, dtype=dt))
    s = 0.7 ** torch.arange(inn, dtype=dt)
    x = (torch.randn(n, inn, dtype=dt) * s) @ v.T + 0.01 * torch.randn(n, inn, dtype=dt)
    return (u * s) @ v.T, x, torch.randn(n, out, dtype=dt)


def lowrank_grads(w, x, gy, rank):
    w = w.clone().requires_grad_()
    b = torch.zeros(w.shape[0], dtype=w.dtype, requires_grad=True)
    x = x.clone().requires_grad_()
    v = SVDCache(svd_every=1).basis("w", w, rank, step=0)
    lowrank_linear(x, w, b, v).backward(gy)
    return w.grad, x.grad, b.grad


def test_lowrank_full_rank_equals_exact_wgrad():
    w, x, gy = decaying_layer()
    gw, gx, gb = lowrank_grads(w, x, gy, rank=w.shape[1])
    torch.testing.assert_close(gw, gy.T @ x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gy @ w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, gy.sum(0), rtol=1e-12, atol=1e-12)


def test_lowrank_error_falls_with_rank_and_dgrad_stays_exact():
    w, x, gy = decaying_layer()
    exact = gy.T @ x
    errors = []
    for rank in (1, 2, 4, 7, 16):
        gw, gx, gb = lowrank_grads(w, x, gy, rank)
        errors.append(((gw - exact).norm() / exact.norm()).item())
        torch.testing.assert_close(gx, gy @ w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gb, gy.sum(0), rtol=1e-12, atol=1e-12)
    assert errors == sorted(errors, reverse=True) and len(set(errors)) == len(errors)
    # rank 7 = ceil(0.2 * 32), the default ratio: ~9% relative error on this spectrum.
    assert errors[0] == pytest.approx(0.707, abs=0.01)
    assert errors[3] == pytest.approx(0.092, abs=0.01)


def test_rank_rule():
    cfg = NDBConfig()
    assert lowrank_rank(128, 32, cfg, step=0) == 7  # ceil(0.2 * 32)
    assert lowrank_rank(32, 128, cfg, step=0) == 7  # down-projection: min(out, in) = 32
    dyn = NDBConfig(dynamic_rank=True, base_rank=3)
    assert [lowrank_rank(128, 32, dyn, s) for s in (0, 3999, 5000, 99_000)] == [3, 3, 5, 32]


def test_svd_cache_refreshes_every_svd_every_steps():
    cache = SVDCache(svd_every=5)
    w = torch.randn(16, 8)
    v0 = cache.basis("fc", w, rank=2, step=10)
    assert cache.basis("fc", w * 3, rank=2, step=14) is v0  # stale weight ignored inside tau
    v1 = cache.basis("fc", w * 3, rank=2, step=15)
    assert v1 is not v0 and v1.shape == (8, 2)
    assert cache.basis("fc", w, rank=3, step=15).shape == (8, 3)  # rank change forces an SVD


# ---- approximations on the GPT ------------------------------------------------------------------


def test_everything_off_matches_plain_backward_exactly():
    model = tiny_gpt()
    reference = plain_grads(model)
    assert_all_equal(extra_grads(model, ALL_OFF), reference)
    assert_all_equal(extra_grads(model, NDBConfig(exact_reference=True, warmup_steps=0)), reference)


def test_forward_value_is_exact_with_all_approximations():
    model = tiny_gpt()
    idx, tgt = batch()
    torch.manual_seed(7)
    plain = model.loss(idx, tgt)
    torch.manual_seed(7)
    approx = extra_microbatch_loss(model, idx, tgt, NDBConfig(warmup_steps=0), 0, SVDCache(50))
    assert torch.equal(plain, approx)


def test_skip_attention_adds_nothing_to_attention_grads():
    model = tiny_gpt()
    idx, tgt = batch()
    own_idx, own_tgt = batch(seed=2)
    cfg = NDBConfig(warmup_steps=0)  # all approximations on
    attention = attention_param_names(model)
    assert len(attention) == 2 * (2 + 4)  # per block: ln1 weight/bias, qkv and proj weight/bias

    model.zero_grad(set_to_none=True)
    model.loss(own_idx, own_tgt).backward()
    own = {n: p.grad.clone() for n, p in model.named_parameters()}
    extra_microbatch_loss(model, idx, tgt, cfg, 0, SVDCache(50)).backward()
    for name, p in model.named_parameters():
        if name in attention:
            assert torch.equal(p.grad, own[name]), name
        else:
            assert (p.grad - own[name]).abs().max() > 1e-6, name

    alone = extra_grads(model, cfg)
    assert {n for n, g in alone.items() if g is None} == attention


def test_ffn_recomputation_gives_identical_grads_with_dropout():
    model = tiny_gpt(dropout=0.1)
    for lowrank in (False, True):  # whole FFN branch / only ln2 -> fc -> gelu is recomputed
        base = dataclasses.replace(ALL_OFF, lowrank_ffn=lowrank)
        recompute = dataclasses.replace(base, recompute_ffn=True)
        assert_all_equal(extra_grads(model, recompute), extra_grads(model, base))
    # dropout really draws from the RNG, so equality above needs the preserved RNG state
    idx, tgt = batch()
    torch.manual_seed(1)
    first = model.loss(idx, tgt)
    assert not torch.equal(first, model.loss(idx, tgt))


def test_lowrank_changes_only_ffn_weight_grads_and_waits_for_warmup():
    model = tiny_gpt()
    cfg = dataclasses.replace(ALL_OFF, lowrank_ffn=True, warmup_steps=1000)
    exact = extra_grads(model, ALL_OFF)
    assert_all_equal(extra_grads(model, cfg, step=999), exact)

    approx = extra_grads(model, cfg, step=1000)
    ffn_weights = {n for n in exact if n.endswith(("ffn.fc.weight", "ffn.out.weight"))}
    assert len(ffn_weights) == 4
    for name in exact:
        if name in ffn_weights:
            rel = ((approx[name] - exact[name]).norm() / exact[name].norm()).item()
            # random init has a flat spectrum: rank 7 of 32 keeps ~sqrt(7/32) of G_W, error ~0.88
            assert 0.85 < rel < 1.0, (name, rel)
        else:  # exact G_X upstream, so every other gradient is bitwise unchanged
            assert torch.equal(approx[name], exact[name]), name


# ---- aggregation, neighbour choice, conf ---------------------------------------------------------


def test_a_pipeline_stages_takeover_forward_is_the_models_cut_into_stages():
    """Two stages of the same GPT, chained, give the taken-over loss of the whole model and its gradients
    (the stage forward the 1F1B schedule runs in place of the stage's own), with every approximation on."""
    from runner.parallel.pipeline import GPTStage
    from runner.recovery.ndb.takeover import extra_microbatch_stage

    model, cfg = tiny_gpt(dropout=0.0), NDBConfig(warmup_steps=0)
    want = extra_grads(model, cfg)
    first, last = GPTStage(model, 0, 2), GPTStage(model, 1, 2)
    last.head.weight = model.tok_emb.weight  # one process: the tied copy is the embedding itself
    idx, tgt = batch()
    caches = SVDCache(cfg.svd_every), SVDCache(cfg.svd_every)  # one per stage (process), as blocks count from 0

    def loss() -> torch.Tensor:
        hidden = extra_microbatch_stage(first, idx, cfg, 0, caches[0])
        logits = extra_microbatch_stage(last, hidden, cfg, 0, caches[1])
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))

    got = grads(model, loss)
    assert got.keys() == want.keys()
    for name, grad in got.items():  # attention's are None: skipped
        assert (grad is None and want[name] is None) or torch.equal(grad, want[name]), name


def test_contributor_counts_drop_skipped_microbatches_for_attention_only():
    model = tiny_gpt()
    counts = contributor_counts(model, microbatches=4, takeovers=1, cfg=NDBConfig())
    assert counts["blocks.0.attn.qkv.weight"] == 3
    assert counts["blocks.1.ln1.bias"] == 3
    assert counts["blocks.1.ffn.out.weight"] == 4
    assert counts["tok_emb.weight"] == 4
    no_skip = contributor_counts(model, 4, 1, NDBConfig(skip_attention=False))
    assert set(no_skip.values()) == {4}
    with pytest.raises(ValueError, match="own"):
        contributor_counts(model, microbatches=2, takeovers=2, cfg=NDBConfig())


def test_yaml_mirrors_config_dataclass():
    """conf/ft/ndb.yaml takes NDBConfig as its schema and sets only keys it declares, so ft=ndb composes to it."""
    option = yaml.safe_load(CONF.read_text())
    assert option["defaults"][0] == "/schema/ft/ndb@_here_"
    knobs = option.get("ndb") or {}
    assert set(knobs) <= {f.name for f in dataclasses.fields(NDBConfig)}
    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=["+recipe=gpt_tiny", "ft=ndb"]).ft.ndb
    assert list(composed) == [f.name for f in dataclasses.fields(NDBConfig)]
    assert NDBConfig(**composed) == NDBConfig(**knobs)
    with pytest.raises(ValueError, match="rank_ratio"):
        NDBConfig(rank_ratio=0.0)


def _takeover_at_tp2(rank: int, groups) -> dict:
    """On each of two TP ranks: the extra micro-batch's gradients through the TP-sharded GPT (gathered) against
    the unsharded one's with every approximation but low-rank, then with all of them (their FFN weights' against
    the exact ones, and the rank of each slice's own gradient)."""
    from runner.parallel.tensor import gather_full, shard_gpt_for_tp

    group = groups("tp", [0, 1])
    reference = tiny_gpt(dropout=0.0)
    model = shard_gpt_for_tp(copy.deepcopy(reference), group)
    ffn = [n for n in dict(reference.named_parameters()) if ".ffn." in n and n.endswith("weight")]
    cheap, every = NDBConfig(lowrank_ffn=False), NDBConfig(warmup_steps=0)
    exact = extra_grads(reference, cheap)
    extra_grads(model, cheap)
    got = gather_full(model, group, grads=True)
    report: dict = {"cheap": [rel_error(got[n], w) for n, w in exact.items() if w is not None]}
    want = extra_grads(reference, every)
    extra_grads(model, every)
    got = gather_full(model, group, grads=True)
    report["all"] = [rel_error(got[n], w) for n, w in want.items() if w is not None and n not in ffn]
    report["all_ffn"] = [rel_error(got[n], exact[n]) for n in ffn]
    local = dict(model.named_parameters())
    report["slice_ranks"] = [(int(torch.linalg.matrix_rank(local[n].grad)), lowrank_rank(*local[n].shape, every, 0))
                             for n in ffn]
    return report


@pytest.mark.slow
def test_the_takeover_at_tp2_matches_the_unsharded_one_but_for_each_slices_lowrank_basis():
    from tests.test_tensor_parallel import run_ranks

    for report in run_ranks(_takeover_at_tp2, 2).values():
        assert report["cheap"] and max(report["cheap"]) < 1e-5  # no low-rank: the unsharded takeover's gradients
        assert max(report["all"]) < 1e-5  # low-rank changes the FFN weights' gradients only: ...
        assert all(0 < err < 1 for err in report["all_ffn"])  # ... each slice's exact one, projected ...
        assert all(got <= rank for got, rank in report["slice_ranks"])  # ... on its own rank-r basis
