"""The progress log of a long move (bytes and GB/s on the ``offload.load`` logger)."""

from __future__ import annotations

import time
from typing import final

import torch

from offload.logs import logger
from offload.pure.units import format_bytes

log = logger("offload.load")

def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes of `tensor`'s elements (not of its whole storage)."""
    return tensor.numel() * tensor.element_size()


@final
class Progress:
    """Logs how far a long move has got (bytes, GB/s) on the ``offload.load`` logger, at
    most once every `every` seconds, and once at the end (`total_bytes` 0: not known)."""

    def __init__(self, what: str, total_bytes: int, *, every: float = 2.0) -> None:
        self._what = what
        self._total = total_bytes
        self._done = 0
        self._kept = 0
        self._every = every
        self._start = self._last = time.monotonic()

    def advance(self, nbytes: int, *, moved: bool = True) -> None:
        """`nbytes` more are done: copied or allocated, or (``moved=False``) used where
        they are, which takes no time and is reported apart."""
        if not moved:
            self._kept += nbytes
            return
        self._done += nbytes
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            if self._total:
                log.info("%s: %s of %s (%.2f GB/s)", self._what, format_bytes(self._done), format_bytes(self._total),
                         self._rate(now))
            else:  # the total is not known beforehand (weights read one at a time)
                log.info("%s: %s so far (%.2f GB/s)", self._what, format_bytes(self._done), self._rate(now))

    def finish(self) -> None:
        """Log the total."""
        now = time.monotonic()
        kept = f"; {format_bytes(self._kept)} used in place" if self._kept else ""
        if self._done:
            log.info("%s: %s in %.2f s (%.2f GB/s)%s", self._what, format_bytes(self._done), now - self._start,
                     self._rate(now), kept)
        elif self._kept:
            log.info("%s: nothing to copy%s", self._what, kept)

    def _rate(self, now: float) -> float:
        return self._done / max(now - self._start, 1e-9) / 1e9
