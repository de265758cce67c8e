"""Config composition and validation: every recipe composes; bad input fails before any worker starts."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from runner.config import ConfigError, register_all
from runner.config.registry import CONF_DIR, recipe_names
from runner.config.validate import validate
from tests.conftest import run_cli

register_all()


def _compose(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_composes_and_validates_for_planning(recipe):
    cfg = _compose(f"+recipe={recipe}")
    assert cfg.recipe_name == recipe
    validate(cfg, for_training=False)


def test_recipes_cover_the_seed_range():
    assert {"gpt_tiny", "gpt_small", "gpt1_2b", "gpt13b"} <= set(recipe_names())


def test_ft_is_a_list_group_single_or_several_in_order():
    assert list(_compose("+recipe=gpt_tiny").ft) == []
    assert list(_compose("+recipe=gpt_tiny", "ft=deadpool").ft) == ["deadpool"]
    cfg = _compose("+recipe=gpt_tiny", "ft=[flashrecovery,deadpool]")
    assert list(cfg.ft) == ["flashrecovery", "deadpool"]
    assert cfg.ft.flashrecovery.max_restarts == 10


def test_recipe_override_of_parallel_group_is_honoured():
    assert _compose("+recipe=gpt_small").parallel.nodes == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=3"], "tp*pp"),
        (["parallel.dp_group_size=3"], "dp_group_size"),
        (["parallel.spares=-1"], "negative"),
        (["parallel.nodes=4", "parallel.procs_per_node=4"], "global_batch_size"),
        (["fault=kill_rank", "fault.rank=9"], "fault.rank=9"),
        (["fault=kill_node", "fault.node=5"], "fault.node=5"),
        (["fault=kill_rank", "fault.step=500"], "never fire"),
        (["heartbeat.stall_timeout_s=0.01"], "stall_timeout_s"),
        (["trainer.sdc_window=0"], "sdc_window"),
        (["fault=partition", "fault.duration_s=-5"], "duration_s"),
        (["ft=flashrecovery", "ft.flashrecovery.max_restarts=-1"], "max_restarts"),
        (["ft=deadpool", "parallel.spares=1", "ft.deadpool.crash_action=teleport"], "crash_action"),
        (["ft=deadpool"], "parallel.spares=0"),
        (["ft=ndb", "ft.ndb.rank_ratio=3"], "rank_ratio"),
        (["+ft.flashrecovery.bogus=1", "ft=flashrecovery"], "ft.flashrecovery"),
        (["parallel.zero=2"], "parallel.zero=2"),
        (["parallel.zero=1", "ft=flashrecovery"], "add deadpool to ft"),
        (["parallel.zero=1", "ft=deadpool", "parallel.spares=1"], "parallel.nodes >= 2"),
        (["parallel.zero=1", "parallel.nodes=2", "parallel.procs_per_node=1", "ft=[deadpool,ndb]"], "ft=ndb yet"),
        (["parallel.zero=1", "ft=[flashrecovery,flash_ckpt]"], "only DeadPool's replicas"),
        (["fault=kill_rank", "fault.during=replication"], "during=replication"),
        (["fault=kill_rank", "fault.during=after_reduce"], "during=after_reduce"),
    ],
)
def test_impossible_or_unsupported_configs_fail_with_what_to_change(overrides, expected):
    cfg = _compose("+recipe=gpt_tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)  # one paragraph


@pytest.mark.parametrize("overrides", [["parallel.zero=1"],  # no fault tolerance
                                       ["parallel.zero=1", "parallel.nodes=2", "parallel.spares=1", "ft=[flashrecovery,deadpool]"],
                                       ["parallel.zero=1", "ft=[flash_ckpt]"]])
def test_zero1_trains_alone_or_with_deadpool(overrides):
    validate(_compose("+recipe=gpt_tiny", *overrides))


def test_no_recipe_is_an_error_listing_recipes():
    with pytest.raises(ConfigError, match="gpt_tiny"):
        validate(_compose())


def test_unknown_recipe_fails_listing_available_recipes(run_dir):
    run = run_cli("+recipe=gpt_nope", run_dir=run_dir, timeout=60)
    assert run.returncode != 0
    assert "gpt_tiny" in run.output and "gpt13b" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_unknown_key_fails_before_any_worker(run_dir):
    run = run_cli("+recipe=gpt_tiny", "parallel.nodez=2", run_dir=run_dir, timeout=60)
    assert run.returncode != 0
    assert "nodez" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_impossible_layout_exits_2_before_any_worker(run_dir):
    run = run_cli("+recipe=gpt_tiny", "parallel.tp=3", run_dir=run_dir, timeout=60)
    assert run.returncode == 2
    assert "tp*pp" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_schema_rejects_wrong_types():
    with pytest.raises(Exception, match="nodes"):
        _compose("+recipe=gpt_tiny", "parallel.nodes=abc")


def test_resolved_config_is_plain_data():
    cfg = _compose("+recipe=gpt_tiny", "ft=flashrecovery")
    assert isinstance(OmegaConf.to_container(cfg, resolve=True), dict)
