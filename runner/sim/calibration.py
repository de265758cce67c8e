"""Optional calibration from our own bench results (a JSON file).

Format (every section optional); `python bench/recovery.py --emit-calibration FILE`
writes one from this host's measurements:

    {"measured": {"host": "gpu-07", "date": "2026-12-01T09:00:00+00:00", "by": "bench/recovery.py"},
     "costs":  {"process_start_s": 7.5, "heartbeat_s": 1.0},
     "phases": {"flashrecovery": {"detect_s": 3.2, "rebuild_s": 2.4}}}

`costs` replaces component costs (names as in `costs.*`), so the N-dependence
of every recovery built on them is kept. `phases` replaces one technique's
(a name in the technique registry, or `restart`) modelled phase with a measured
constant at every N; use it for phases that are flat in N or were measured at
the target scale. Unknown names are errors, so a typo cannot silently leave a
paper default in place.
"""
import json
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path

from runner.recovery.registry import TECHNIQUES
from runner.sim.costs import PHASES
from runner.sim.errors import ConfigError
from runner.sim.pricing import RESTART

PhaseOverrides = Mapping[str, Mapping[str, float]]


def _check_keys(section: object, allowed, where: str) -> dict:
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a JSON object")
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid: {sorted(allowed)}")
    return section


def _numbers(section: object, allowed, where: str) -> dict[str, float]:
    section = _check_keys(section, allowed, where)
    bad = [k for k, v in section.items() if not isinstance(v, (int, float)) or v < 0]
    if bad:
        raise ConfigError(f"{where}: {bad} must be non-negative numbers")
    return {k: float(v) for k, v in section.items()}


def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"calibration file {path}: {exc}") from exc
    return _check_keys(data, ("measured", "costs", "phases"), f"calibration file {path}")


def label(path: str) -> str:
    """Where and when the file's numbers were measured, as its `measured` section says."""
    measured = _check_keys(_read(path).get("measured", {}), ("host", "date", "by"), "calibration.measured")
    parts = [str(measured[k]) for k in ("host", "date", "by") if k in measured]
    return ", ".join(parts) or f"calibration file {Path(path).name} (no host or date in it)"


def apply(cfg, path: str) -> PhaseOverrides:
    """Put the file's costs into `cfg.costs`, mark them and the phase overrides measured in `cfg.sources`
    (with the file's host, date and what measured them, so sim.json says where each number comes from), and
    return its phase overrides."""
    cfg.costs, overrides = load(path, cfg.costs)
    where = label(path)
    for key in _read(path).get("costs", {}):
        cfg.sources[f"costs.{key}"] = f"measured: {where}"
    for technique, phases in overrides.items():
        for phase in phases:
            cfg.sources[f"phases.{technique}.{phase}_s"] = f"measured: {where}"
    return overrides


def load(path: str, costs) -> tuple[object, PhaseOverrides]:
    """Return (costs with overrides applied, per-technique phase overrides)."""
    data = _read(path)
    measured = _numbers(data.get("costs", {}), [f.name for f in fields(costs)], "calibration.costs")
    typed = {k: type(getattr(costs, k))(v) for k, v in measured.items()}
    techniques = _check_keys(data.get("phases", {}), (*TECHNIQUES, RESTART), "calibration.phases")
    phase_keys = [f"{p}_s" for p in PHASES]
    overrides = {
        name: {
            key[: -len("_s")]: value
            for key, value in _numbers(per, phase_keys, f"calibration.phases.{name}").items()
        }
        for name, per in techniques.items()
    }
    return replace(costs, **typed), overrides
