"""The one error tree of `offload`.

::

    OffloadError                         root: catch this to catch everything we raise
    ├── ConfigError      (ValueError)    an OffloadConfig that cannot be honoured
    ├── EnvError         (ValueError)    a bad or contradictory environment variable
    ├── PlanError        (ValueError)    inconsistent specs, plans or schedules
    ├── CheckpointError  (ValueError)    a missing, unreadable or corrupt checkpoint file
    └── ExecutionError   (RuntimeError)  a device or host-memory operation failed

Every error carries the offending ``name`` (a field, variable, parameter or path) and
``value`` where there is one, so that callers can react without parsing the message.
This module imports nothing outside the standard library, so the pure core can use it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EnvError",
    "ExecutionError",
    "OffloadError",
    "PlanError",
]


class OffloadError(Exception):
    """Root of every error `offload` raises on purpose.

    Args:
        message: the whole human-readable explanation; it names the bad value.
        name: the field, variable, parameter or path at fault, when there is one.
        value: the offending value, when there is one.
    """

    def __init__(self, message: str, *, name: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.name = name
        self.value = value


class ConfigError(OffloadError, ValueError):
    """An `OffloadConfig` field, or a combination of fields, that cannot be honoured."""


class EnvError(OffloadError, ValueError):
    """An environment variable holds a value we do not accept, or two spellings disagree."""


class PlanError(OffloadError, ValueError):
    """Specs, plans or schedules that are inconsistent with each other or with themselves."""


class CheckpointError(OffloadError, ValueError):
    """A checkpoint directory or file is missing, unreadable or corrupt."""


class ExecutionError(OffloadError, RuntimeError):
    """An effect failed while running a plan (device, stream, host memory); wraps the cause."""
