"""FlashRecovery's options (``ft.flashrecovery.*``, ``conf/ft/flashrecovery.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FlashRecoveryConfig:
    """FlashRecovery: restart only the failed rank, with its state from a healthy DP replica (RPO 0)."""

    max_restarts: int = 10
    """Restarts of failed ranks over the whole run; one more and the run fails."""
    retry_transient: bool = True
    """A collective error with every process alive is retried in a rebuilt group; nobody restarts."""
    standby: bool = False
    """One warm replacement per host, started ahead and parked until a crashed rank of its host needs it (one more
    worker process's memory per host); needs runner.device=cpu."""
