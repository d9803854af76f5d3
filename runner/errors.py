"""The one exception type for bad input: it names the key or path and says how to fix it."""


class ConfigError(ValueError):
    """Bad input the user can fix: an impossible combination, a missing dataset, a corrupt file.

    ``python -m runner`` prints ``error: <message>`` (no traceback) and exits with status 2, before any
    result file is written.
    """
