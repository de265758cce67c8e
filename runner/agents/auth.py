"""The per-job secret and the MAC that every command to a node agent carries.

The control-plane store has no authentication: whoever reaches its port can write keys. A node agent acts
on what it reads there (start a worker, signal one), so each command is signed with HMAC-SHA256 under a
secret the store never holds, and an agent refuses what does not verify. The secret reaches an agent
through its environment (``RESILIENT_RUNNER_SECRET``) or a file only the job's user can read
(``launcher.secret_file``); the local launcher generates one per job and hands it to its agents in their
environment, never on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Optional

SECRET_ENV = "RESILIENT_RUNNER_SECRET"


def job_secret(secret_file: Optional[str], pop_env: bool = False) -> Optional[bytes]:
    """The job's secret from ``RESILIENT_RUNNER_SECRET``, else from ``secret_file``; None if neither is set.
    ``pop_env``: remove it from this process's environment, so that no child inherits it."""
    from runner.config import ConfigError  # here: an agent process does not load the config machinery

    value = os.environ.pop(SECRET_ENV, None) if pop_env else os.environ.get(SECRET_ENV)
    if value is None and secret_file:
        try:
            value = Path(secret_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"launcher.secret_file={secret_file} cannot be read: {e}") from e
    if value is not None and not value:
        raise ConfigError(f"the job's secret ({SECRET_ENV} or launcher.secret_file) is empty")
    return value.encode() if value is not None else None


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: bytes, body: dict) -> str:
    """``body`` as the signed JSON message an agent verifies."""
    payload = json.dumps(body, sort_keys=True)
    return json.dumps({"body": payload, "mac": _mac(secret, payload)})


def verify(secret: bytes, raw: bytes | str) -> Optional[dict]:
    """The body of a signed message, or None when its MAC is missing or wrong (or it is no such message)."""
    try:
        message = json.loads(raw)
        payload, mac = message["body"], message["mac"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(payload, str) and isinstance(mac, str) and hmac.compare_digest(mac, _mac(secret, payload))):
        return None
    body = json.loads(payload)
    return body if isinstance(body, dict) else None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mac(secret: bytes, payload: str) -> str:
    return hmac.new(secret, payload.encode(), hashlib.sha256).hexdigest()
