"""The one error type for bad input (its message is one paragraph that says what to change), and the import of a
``_target_`` that a refusal quotes."""

from __future__ import annotations

from typing import Any, Optional


class ConfigError(ValueError):
    """Raised before any process starts when the config cannot run as asked."""


def imported(target: str) -> tuple[Any, Optional[str]]:
    """The object a ``_target_`` names, or None and why it cannot be imported: the first line of the import's own
    error (Hydra wraps it), for a refusal to quote."""
    from hydra.utils import get_object  # here: the error type stays free of imports

    try:
        return get_object(target), None
    except Exception as err:  # noqa: BLE001 - any import-time failure of the user's code is the answer
        cause = err.__cause__ or err
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return None, reason.rstrip(".")
