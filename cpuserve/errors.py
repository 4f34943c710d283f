"""User-facing errors: one clear line that names the file or tensor and what was expected.

The CLI prints these without a traceback (unless --debug); anything else is a bug and keeps its
traceback.
"""


class CpuserveError(Exception):
    """An error caused by the user's input (files, flags, requests), not by a bug."""


class CheckpointError(CpuserveError):
    """A model directory or file is missing, malformed or unsupported."""


class ConfigError(CpuserveError):
    """A config field is missing, invalid or names something unsupported."""
