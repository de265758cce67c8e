"""Config composition and validation: every recipe composes; bad input fails before any worker starts."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from runner.config import ConfigError, register_all
from runner.config.registry import CONF_DIR, FAULTS_DIR, RECIPES_DIR, fault_names, recipe_names
from runner.config.schema import FaultConfig, RootConfig
from runner.config.validate import validate
from runner.recovery.registry import options_schemas
from tests.conftest import ROOT, run_cli

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
        (["parallel.order=tp-dp"], "must name tp, pp and dp once each"),
        (["parallel.nodes=2", "parallel.procs_per_node=3", "parallel.tp=2", "trainer.global_batch_size=6"],
         "a tensor-parallel group would span two nodes"),
        (["parallel.spares=-1"], "negative"),
        (["parallel.nodes=4", "parallel.procs_per_node=4"], "global_batch_size"),
        (["fault=kill_rank", "fault.rank=9"], "fault.rank=9"),
        (["fault=kill_node", "fault.node=5"], "fault.node=5"),
        (["fault=kill_rank", "fault.step=500"], "never fire"),
        (["heartbeat.stall_timeout_s=0.01"], "stall_timeout_s"),
        (["trainer.sdc_window=0"], "sdc_window"),
        (["trainer.replica_check_every_n_steps=-1"], "replica_check_every_n_steps=-1"),
        (["fault=param_bitflip", "parallel.zero=1"], "param_bitflip"),
        (["fault=param_bitflip", "fault.rank=0", "parallel.procs_per_node=1"], "at least 2 replicas"),
        (["fault=partition", "fault.duration_s=-5"], "duration_s"),
        (["ft=flashrecovery", "ft.flashrecovery.max_restarts=-1"], "max_restarts"),
        (["ft=deadpool", "parallel.spares=1", "ft.deadpool.crash_action=teleport"], "crash_action"),
        (["ft=deadpool", "parallel.spares=0"], "parallel.spares=0"),  # unset, it is one spare node
        (["ft=ndb", "ft.ndb.rank_ratio=3"], "rank_ratio"),
        (["+ft.flashrecovery.bogus=1", "ft=flashrecovery"], "ft.flashrecovery"),
        (["parallel.zero=2"], "parallel.zero=2"),
        (["parallel.zero=1", "ft=flashrecovery"], "add deadpool to ft"),
        (["parallel.zero=1", "ft=deadpool", "parallel.spares=1"], "parallel.nodes >= 2"),
        (["parallel.zero=1", "parallel.nodes=2", "parallel.procs_per_node=1", "ft=[ndb]"], "add deadpool to ft"),
        (["parallel.zero=1", "ft=[flashrecovery,flash_ckpt]"], "only DeadPool's replicas"),
        (["fault=kill_rank", "fault.during=replication"], "during=replication"),
        (["parallel.zero=1", "parallel.nodes=2", "ft=deadpool", "fault=kill_rank", "fault.step=3",
          "fault.during=replication"], "add ft.deadpool.replication=copy"),
        (["parallel.zero=1", "parallel.nodes=2", "ft=deadpool", "ft.deadpool.replication=mirror"], "replication"),
        (["parallel.zero=1", "parallel.nodes=2", "ft=deadpool", "ft.deadpool.verify_every_n_steps=0"],
         "verify_every_n_steps=0 must be >= 1"),
        (["parallel.nodes=2", "ft=deadpool", "ft.deadpool.replication=copy"], "parallel.zero=0 shards nothing"),
        (["parallel.zero=1", "parallel.nodes=2", "ft=deadpool", "ft.deadpool.replication=copy",
          "ft.deadpool.verify_every_n_steps=10"], "verifies replicas kept by replay"),
        (["fault=kill_rank", "fault.during=after_reduce"], "during=after_reduce"),
        (["checkpoint.every_n_steps=-1"], "checkpoint.every_n_steps=-1"),
        (["runner.gpu_memory_gib=0"], "runner.gpu_memory_gib=0"),
        (["launcher.secret_file=/nonexistent/secret"], "launcher.secret_file=/nonexistent/secret"),
    ],
)
def test_impossible_or_unsupported_configs_fail_with_what_to_change(overrides, expected):
    cfg = _compose("+recipe=gpt_tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)  # one paragraph


@pytest.mark.parametrize("overrides", [
    ["parallel.zero=1"],  # no fault tolerance
    ["parallel.zero=1", "parallel.nodes=2", "parallel.spares=1", "ft=[flashrecovery,deadpool]"],
    ["parallel.zero=1", "ft=[flash_ckpt]"],
    # NDB takes a failed rank over, and the holder of its shard's replica updates the shard in its place
    ["parallel.zero=1", "parallel.nodes=2", "parallel.procs_per_node=1", "ft=[ndb,deadpool]"],
    ["parallel.zero=1", "parallel.nodes=2", "parallel.procs_per_node=1", "ft=[ndb,deadpool]",
     "trainer.precision=bf16-true", "trainer.master_weights=true"],
])
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


def _cli_with_imports(*overrides: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -m runner`` and every module it imported (``-X importtime`` names them on stderr)."""
    args = [sys.executable, "-X", "importtime", "-m", "runner", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert len(imported) > 100  # the timing lines were read
    return proc, imported


@pytest.mark.parametrize("overrides, code", [
    (("+recipe=gpt_tiny", "+foo=1"), 2),  # a wrong key: compose and validate
    (("+recipe=gpt_tiny", "parallel.tp=3"), 2),  # an impossible layout
    (("+recipe=gpt_tiny", "trainer.lr=-1"), 2),  # out of the schema's range
], ids=["bad_key", "impossible_layout", "out_of_range"])
def test_refused_config_never_imports_torch(overrides, code, run_dir):
    """Composing and validating a config stay free of torch, Lightning and wandb (importing them took more than
    half of a refusal's time)."""
    proc, imported = _cli_with_imports(*overrides, run_dir=run_dir)
    assert proc.returncode == code, proc.stderr[-3000:]
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "lightning", "wandb"))
    assert not heavy, heavy[:10]


@pytest.mark.parametrize("overrides, expected, misleading", [
    (["trainer.lr=-1"], "trainer.lr=-1 must be > 0.", None),
    (["trainer.global_batch_size=-8"], "trainer.global_batch_size=-8 must be >= 1.", "data-parallel ranks"),
    (["trainer.max_steps=-5"], "trainer.max_steps=-5 must be >= 1.", "fault.step"),
    (["trainer.precision=16-mixd"], "trainer.precision='16-mixd' is not one of 32-true, bf16-mixed, 16-mixed", None),
    (["model._target_=torch.nn.Linear"], "model._target_=torch.nn.Linear is a class deriving from Module, not a "
     "lightning.pytorch.LightningModule", None),
    (["+ckpt_path=last.ckpt"], "ckpt_path is not a config key: use runner.resume", "checkpoint"),
    (["model._target_=tests.regressors.ValidatedRegressor", "+model.kwargs.hidden=3"],
     "model._target_=tests.regressors.ValidatedRegressor cannot be built with model.kwargs={'hidden': 3}: TypeError",
     None),
], ids=["lr", "batch", "max_steps", "precision", "not_a_module", "ckpt_path", "module_kwargs"])
def test_bad_input_exits_2_before_any_worker_starts(overrides, expected, misleading, run_dir):
    """Each bad input is refused in the launching process: exit 2, one paragraph that says what to change, and no
    worker: the process never imported the launcher that starts the controller, agents and workers, and no runner
    file (the workers' events.jsonl with their pids, the agents' config) was written."""
    proc, imported = _cli_with_imports("+recipe=gpt_tiny", *overrides, run_dir=run_dir)
    assert proc.returncode == 2, proc.stderr[-3000:]
    refusals = [line for line in (proc.stdout + proc.stderr).splitlines() if "Invalid configuration" in line]
    assert len(refusals) == 1 and expected in refusals[0], refusals
    assert misleading is None or misleading not in refusals[0], refusals[0]
    assert not {"runner.launch.launcher", "runner.training.worker", "runner.control.controller"} & imported
    assert not [p.name for p in run_dir.glob("*") if p.name not in (".hydra", "cli.log")]


@pytest.mark.slow  # run time: the message is checked in-process above, the CLI's exit 2 by the unimportable-target runs
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


# Every option of every config group, every recipe and every fault: each composes and validates.
GROUP_OPTIONS = [(d.name, f.stem) for d in sorted(CONF_DIR.iterdir()) if d.is_dir() for f in sorted(d.glob("*.yaml"))]
NEEDS = {("ft", "deadpool"): ["parallel.spares=1"], ("fault", "kill_node"): ["parallel.nodes=2"]}  # to train


@pytest.mark.parametrize("group, option", GROUP_OPTIONS + [("fault", f) for f in fault_names()])
def test_every_config_group_option_composes_and_validates_for_training(group, option):
    cfg = _compose("+recipe=gpt_tiny", f"{group}={option}", *NEEDS.get((group, option), []))
    validate(cfg)


def test_every_group_option_is_covered():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert groups == {"callbacks", "ft", "heartbeat", "launcher", "logger", "parallel", "policy", "straggler",
                      "trainer"}
    assert {f"{o}" for g, o in GROUP_OPTIONS if g == "ft"} == set(options_schemas())


def _schema_of_yaml(path: Path) -> tuple[type, dict]:
    """The schema a YAML file's keys belong to, and those keys (a recipe's are global)."""
    text = OmegaConf.to_container(OmegaConf.load(path)) or {}
    text.pop("defaults", None)
    if path.parent == RECIPES_DIR:
        return RootConfig, text
    if path.parent == FAULTS_DIR:
        return FaultConfig, text
    if path.parent.name == "ft":
        return options_schemas()[path.stem], text.get(path.stem) or {}
    return typing.get_type_hints(RootConfig)[path.parent.name], text


def _repeated_defaults(schema: type, values: dict, where: str = "") -> list[str]:
    if not dataclasses.is_dataclass(schema):  # an open group (callbacks): its entries have no defaults
        return []
    out = []
    for f in dataclasses.fields(schema):
        if f.name not in values:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            out += _repeated_defaults(type(default), values[f.name] or {}, f"{where}{f.name}.")
        elif values[f.name] == default:
            out.append(f"{where}{f.name}")
    return out


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*/*.yaml")) + sorted(RECIPES_DIR.glob("**/*.yaml")),
                         ids=lambda p: str(p.relative_to(CONF_DIR.parent)))
def test_yaml_holds_only_what_differs_from_the_schema(path):
    schema, values = _schema_of_yaml(path)
    assert not _repeated_defaults(schema, values), f"{path.name} repeats the schema's defaults"


def _schemas() -> dict[str, type]:
    """Every config section and its dataclass: the root's groups and each fault-tolerance option."""
    out = {"top level": RootConfig}
    groups = typing.get_type_hints(RootConfig).items()
    out.update({name: hint for name, hint in groups if dataclasses.is_dataclass(hint)})
    out.update({f"ft.{name}": schema for name, schema in options_schemas().items()})
    return out


def _attribute_docstrings(cls: type) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                names.add(stmt.target.id)
    return names


@pytest.mark.parametrize("section", list(_schemas()))
def test_every_schema_field_has_a_docstring_and_a_row_in_the_docs(section):
    schema = _schemas()[section]
    names = [f.name for f in dataclasses.fields(schema)]
    assert schema.__doc__ and not set(names) - _attribute_docstrings(schema)
    docs = (CONF_DIR.parent / "docs" / "configuration.md").read_text()
    if section == "top level":  # a group has a section of its own; the plain keys have rows in "Top level"
        assert not [n for n in _schemas() if n != section and "." not in n and f"\n## `{n}`" not in docs]
        names = [n for n in names if n not in _schemas() and n not in ("ft", "callbacks")]  # open groups
        assert "\n## `ft`" in docs and "\n## `callbacks`" in docs
    heading = "## Top level" if section == "top level" else f"## `{section.split('.')[0]}`"
    text = docs.split(heading, 1)[1].split("\n## ", 1)[0]
    assert not [n for n in names if f"| `{n}` |" not in text], f"docs/configuration.md {heading} lacks rows"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["+trainer.max_step=3"], "the closest valid key is trainer.max_steps"),
        (["+ckpt_path=last.ckpt"], "ckpt_path is not a config key"),
        (["ft=flashrecovery", "+ft.flashrecovery.max_restart=3"], "closest valid key is ft.flashrecovery.max_restarts"),
        (["fault=kill_rank", "+fault.extra=[{kind: kill_rank, rnk: 0, step: 3}]"], "fault.extra[0].rnk"),
        (["logger.kind=tensorboard"], "logger.kind='tensorboard' is not one of wandb, csv, none"),
        (["launcher.kind=k8s"], "launcher.kind='k8s'"),
        (["runner.device=tpu"], "runner.device='tpu'"),
        (["data.kind=parquet"], "data.kind='parquet'"),
        (["ft=ndb", "ft.ndb.neighbour=ring_far"], "ft.ndb.neighbour='ring_far'"),
        (["fault=kill_rank", "fault.during=later"], "fault.during='later'"),
        (["fault=kill_rank", "fault.node=1"], "fault.node=1 is ignored by kind=kill_rank"),
        (["fault=chaos", "fault.step=3"], "fault.step=3 is ignored by kind=chaos"),
        (["fault=slow_rank", "fault.duration_s=5"], "fault.duration_s=5.0 is ignored by kind=slow_rank"),
        (["fault=kill_rank", "fault.mtbf_s=3"], "fault.mtbf_s=3.0 is ignored"),
        (["data.path=/nonexistent.bin"], "data.path=/nonexistent.bin is ignored with data.kind=synthetic"),
        (["data.kind=memmap"], "data.path=None is not a file"),
        (["data.kind=memmap", "data.path=/nonexistent.bin"], "is not a file"),
        (["model._target_=lightning.pytorch.demos.boring_classes.BoringModel", "data.kind=memmap"],
         "data.kind=memmap is ignored: with model._target_ set"),
        (["+model.kwargs.hidden=3"], "model.kwargs are passed to model._target_, which is not set"),
        (["+data.kwargs.hidden=3"], "data.kwargs are passed to data._target_, which is not set"),
        (["logger=csv", "logger.mode=online"], "logger.mode=online is ignored with logger.kind=csv"),
        (["ft=[flashrecovery,deadpool]", "parallel.spares=1", "ft.deadpool.max_restarts=3"],
         "ft.deadpool.max_restarts=3 is ignored with flashrecovery in ft"),
        (["model._target_=no_such_pkg.Module"], "model._target_=no_such_pkg.Module cannot be imported"),
        (["data._target_=lightning.pytorch.demos.boring_classes.NoSuchData"], "data._target_="),
        (["data._target_=torch.nn.Linear"], "data._target_=torch.nn.Linear is a class deriving from Module, not a "
         "lightning.pytorch.LightningDataModule"),
        (["model._target_=lightning.pytorch.demos.boring_classes.BoringDataModule"],
         "not a lightning.pytorch.LightningModule"),
        (["model._target_=math.pi"], "model._target_=math.pi is a float, not a lightning.pytorch.LightningModule"),
        (["trainer.warmup_steps=-1"], "trainer.warmup_steps=-1 must be >= 0."),
        (["model.dropout=1.5"], "model.dropout=1.5 must be >= 0 and < 1."),
        (["launcher.run_timeout_s=0"], "launcher.run_timeout_s=0 must be > 0."),
        (["+trainer.gradient_clip_val=1"], "trainer.gradient_clip_val is not a config key: use trainer.grad_clip."),
        (["runner.optimized_metric=train/acc"], "runner.optimized_metric=train/acc is not a metric this run logs"),
        (["runner.optimized_metric=val/loss"], "use one of train/loss, train/samples_per_s, train/tokens_per_s, "
         "train/step_time_s, or val/loss with trainer.val_check_interval=N"),
    ],
)
def test_no_silent_keys_unknown_out_of_set_ignored_or_unimportable(overrides, expected):
    cfg = _compose("+recipe=gpt_tiny", *overrides)
    for for_training in (False, True):
        with pytest.raises(ConfigError) as err:
            validate(cfg, for_training=for_training)
        assert expected in str(err.value)
        assert "\n" not in str(err.value)


def test_unknown_key_added_with_plus_exits_2_naming_the_closest_key(run_dir):
    run = run_cli("+recipe=gpt_tiny", "+trainer.no_such_key=1", run_dir=run_dir, timeout=60)
    assert run.returncode == 2
    line = next(x for x in run.output.splitlines() if "Invalid configuration" in x)
    assert "trainer.no_such_key is not a config key: the closest valid key is trainer." in line
    assert "max_steps" in line  # the keys trainer takes
    assert not (run_dir / "events.jsonl").exists()


@pytest.mark.slow  # run time: the message is checked in-process above, the CLI's exit 2 by the unimportable-target runs
def test_a_key_the_chosen_data_ignores_exits_2(run_dir):
    run = run_cli("+recipe=gpt_tiny", "data.path=/nonexistent.bin", run_dir=run_dir, timeout=60)
    assert run.returncode == 2
    assert "data.path=/nonexistent.bin is ignored with data.kind=synthetic" in run.output
    assert not (run_dir / "events.jsonl").exists()


@pytest.mark.parametrize("group", ["model", "data"])
def test_a_target_that_cannot_be_imported_exits_2_before_any_worker(run_dir, group):
    run = run_cli("+recipe=gpt_tiny", f"{group}._target_=no_such_pkg.Thing", run_dir=run_dir, timeout=60)
    assert run.returncode == 2
    assert f"{group}._target_=no_such_pkg.Thing cannot be imported (No module named 'no_such_pkg')" in run.output
    assert not (run_dir / "events.jsonl").exists()


def test_a_flashrecovery_standby_is_refused_where_it_could_take_a_gpu_slot():
    cfg = _compose("+recipe=gpt_tiny", "ft=[flashrecovery]", "ft.flashrecovery.standby=true")
    with pytest.raises(ConfigError, match="ft.flashrecovery.standby=true with runner.device=auto"):
        validate(cfg)
    validate(_compose("+recipe=gpt_tiny", "ft=[flashrecovery]", "ft.flashrecovery.standby=true", "runner.device=cpu"))


def test_a_user_module_and_data_module_pass_the_target_check():
    validate(_compose("+recipe=gpt_tiny", "model._target_=lightning.pytorch.demos.boring_classes.BoringModel",
                      "data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule"))


@pytest.mark.parametrize("overrides", [[], ["fault=kill_rank", "fault.step=3"]], ids=["no_fault", "fault"])
def test_a_bad_max_steps_is_reported_alone(overrides):
    """No fault set, no sentence about a fault (the step of "none" is -1); a bad max_steps is the only problem."""
    with pytest.raises(ConfigError) as err:
        validate(_compose("+recipe=gpt_tiny", "trainer.max_steps=-5", *overrides))
    assert str(err.value) == "Invalid configuration: trainer.max_steps=-5 must be >= 1."


def test_every_process_derives_the_same_heartbeat_deadlines():
    """The controller reads the composed config, a node agent the JSON it is sent: both derive the deadlines
    from HeartbeatConfig's properties, so they agree only if the agent gets every heartbeat key."""
    import json

    from runner.agents.fleet import agent_config
    from runner.config.schema import HeartbeatConfig

    cfg = _compose("+recipe=gpt_tiny", "heartbeat=flashrecovery")
    ours = HeartbeatConfig.of(cfg.heartbeat)
    agents = HeartbeatConfig.of(json.loads(agent_config(cfg, [], None))["config"]["heartbeat"])
    assert agents == ours and ours.silence_s == 15.0 and ours.controller_lost_after_s == 60.0
