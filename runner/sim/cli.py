"""Hydra entry point: compose the config, run the sweep, print and save results.

Config problems that types cannot catch (technique names, GPU counts, the
calibration file) end the run with one readable paragraph and exit status 2.
"""
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from runner.sim import calibration, plots, report, schema
from runner.sim.errors import ConfigError
from runner.sim.sweep import simulate

schema.register()
# An absolute path: the package-relative form would need conf/ to be a module.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def mark_command_line_costs(cfg, overrides: list[str]) -> None:
    """A cost set on the command line no longer has its profile's source."""
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if key.startswith("costs."):
            cfg.sources[key] = f"guess: set on the command line ({key}={value})"


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg: Any = OmegaConf.to_object(dcfg)  # a SimConf (the schema)
    mark_command_line_costs(cfg, list(HydraConfig.get().overrides.task))
    try:
        overrides: calibration.PhaseOverrides = {}
        if cfg.calibration:
            overrides = calibration.apply(cfg, to_absolute_path(cfg.calibration))
        sweep = simulate(cfg, overrides)
        summary = report.summarize(sweep, cfg)
    except ConfigError as exc:
        print(f"runner.sim: error: {exc}", file=sys.stderr)
        sys.exit(2)
    out = Path(HydraConfig.get().runtime.output_dir) / "sim.json"
    payload = {
        "measured": calibration.label(to_absolute_path(cfg.calibration)) if cfg.calibration else None,
        "config": OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True),
        "costs_used": asdict(cfg.costs),
        "phase_overrides": overrides,
        **summary,
    }
    out.write_text(json.dumps(payload, indent=1))
    print(report.format_text(summary, cfg))
    print(f"\nwrote {out}")
    if cfg.plots:
        for png in plots.write(summary, out.parent):
            print(f"wrote {png}")
