"""The one exception type the CLI turns into a readable message and exit 2.

Anything else escaping the simulator is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
    """A config value, technique name or calibration file the user must fix."""
