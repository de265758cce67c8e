"""The simulator reproduces published clusters (issue 16's acceptance): each profile against its anchors."""
from pathlib import Path

import pytest

from runner.sim import anchors
from runner.sim.costs import CostModel
from tests.test_sim import load_cfg

DOCS = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"
PROFILES = ("llama3", "bytedance", "flashrecovery_paper")


def model_of(cfg):
    return CostModel(cfg.costs, cfg.model, cfg.cluster)


def test_llama3_restart_all_baseline_at_16k_over_54_days():
    cfg = load_cfg()  # profile=llama3 is the default
    assert cfg.profile_name == "llama3"
    ettr, _ = anchors.baseline_ettr(cfg, 16384, 54)
    assert 0.88 <= ettr <= 0.95


def test_bytedance_requeue_within_25_percent_of_byterobust_table_7():
    model = model_of(load_cfg("profile=bytedance"))
    for gpus, published in anchors.BYTEROBUST_REQUEUE_S.items():
        modelled = anchors.requeue_phases(model, gpus).restart
        assert abs(modelled / published - 1) <= 0.25, (gpus, modelled, published)


def test_bytedance_at_megascale_scale_above_90_percent_and_catches_up_in_15_minutes():
    cfg = load_cfg("profile=bytedance")
    ettr, events = anchors.baseline_ettr(anchors.megascale_setting(cfg), anchors.MEGASCALE_GPUS, 54)
    assert ettr > 0.90
    catch_up = [e.phases.restart + e.lost_work_s for e in events if e.technique == "restart"]
    assert sum(catch_up) / len(catch_up) <= anchors.MEGASCALE_CATCH_UP_S
    assert model_of(cfg).comm_init(anchors.MEGASCALE_GPUS) < 30


def test_flashrecovery_paper_restart_table_within_25_percent():
    model = model_of(load_cfg("profile=flashrecovery_paper"))
    for gpus, published in anchors.FLASHRECOVERY_RESTART_ALL_S.items():
        assert abs(anchors.requeue_phases(model, gpus).restart / published - 1) <= 0.25, gpus
    for gpus, at_least in anchors.FLASHRECOVERY_RESTART_ALL_AT_LEAST_S.items():
        assert anchors.requeue_phases(model, gpus).restart > at_least
    for gpus, published in anchors.FLASHRECOVERY_S.items():
        assert abs(anchors.rank_restart_phases(model, gpus).restart / published - 1) <= 0.25, gpus


@pytest.mark.parametrize("profile", PROFILES)
def test_every_anchor_of_every_profile_is_in_band_and_in_the_docs(profile):
    cfg = load_cfg(f"profile={profile}", "runs=4")
    docs = DOCS.read_text()
    assert "| anchor | published | simulated |" in docs
    for anchor in anchors.anchors(cfg):
        assert anchor.ok, anchor
        assert anchor.name in docs, anchor.name


@pytest.mark.parametrize("profile", PROFILES)
def test_every_constant_has_a_source_and_the_docs_say_which_kind(profile):
    cfg = load_cfg(f"profile={profile}")
    docs = DOCS.read_text()
    for key, source in cfg.sources.items():
        kind = source.split(":", 1)[0]
        assert kind in ("published", "fitted", "measured", "derived", "guess"), (key, source)
        assert f"`{key}`" in docs, key
