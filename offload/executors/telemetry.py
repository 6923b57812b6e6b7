"""The opt-in periodic stats line both executors log (`log_stats_every`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import final

from offload.errors import ExecutionError
from offload.logs import logger
from offload.pure.stats import OffloadStats, render_stats_line

__all__ = ["StepLog"]

log = logger("offload.stats")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


@final
class StepLog:
    """Logs one line of stats (logger ``offload.stats``, INFO) every N forward steps or
    every S seconds, whichever comes first; off until `configure` turns it on. Asked once
    per step, it costs one attribute test while off."""

    def __init__(self) -> None:
        self.active = False
        self._steps: int | None = None
        self._seconds: float | None = None
        self._last_step = 0
        self._last_time = 0.0

    def configure(self, steps: int | None, seconds: float | None) -> None:
        """Log every `steps` steps and/or every `seconds` seconds; both None turns it off.

        Raises:
            ExecutionError: `steps` is not a positive int, or `seconds` not a positive finite number.
        """
        if steps is not None and not _positive_int(steps):
            raise ExecutionError(f"log_stats_every(steps=...) needs a positive int, got {steps!r}",
                                 name="steps", value=steps)
        if seconds is not None and not _positive_number(seconds):
            raise ExecutionError(f"log_stats_every(seconds=...) needs a positive finite number, got {seconds!r}",
                                 name="seconds", value=seconds)
        self._steps, self._seconds = steps, None if seconds is None else float(seconds)
        self.active = steps is not None or seconds is not None
        self._last_time = time.monotonic()

    def step(self, steps: int, stats: Callable[[], OffloadStats]) -> None:
        """Called at each forward step (`steps` seen so far): log when one is due."""
        now = time.monotonic()
        due_steps = self._steps is not None and steps - self._last_step >= self._steps
        due_time = self._seconds is not None and now - self._last_time >= self._seconds
        if due_steps or due_time:
            self._last_step, self._last_time = steps, now
            log.info("%s", render_stats_line(stats()))
