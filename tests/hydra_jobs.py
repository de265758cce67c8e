"""A Hydra callback that records what a launcher learns of each job (Hydra's ``JobReturn``, the object the basic,
joblib and submitit launchers all report from): its status and its return value, or its error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class RecordJobReturn(Callback):
    """Writes ``job_return.json`` into each job's output directory."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        failed = job_return.status == JobStatus.FAILED
        value = job_return._return_value  # the property re-raises a failed job's error
        record = {"status": job_return.status.name,
                  "value": f"{type(value).__name__}: {value}" if failed else value}
        (Path(config.hydra.runtime.output_dir) / "job_return.json").write_text(json.dumps(record))
