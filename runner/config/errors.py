"""The one error type for bad input: its message is one paragraph that says what to change."""


class ConfigError(ValueError):
    """Raised before any process starts when the config cannot run as asked."""
