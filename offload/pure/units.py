"""Byte units for people: GiB in tables, exact integers in data."""

from __future__ import annotations

import math
from collections.abc import Sequence

from offload.errors import ConfigError

__all__ = ["GIB", "KIB", "MAX_BYTES", "MIB", "format_bytes", "gib", "gib_to_bytes", "ranks_text"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
#: The largest byte count a size given in GiB may stand for: 2**60 bytes (2**30 GiB),
#: far beyond any machine, and small enough that every sum of sizes stays exact.
MAX_BYTES = 1 << 60


def gib_to_bytes(value: object, *, name: str = "gib", allow_zero: bool = True) -> int:
    """A size in GiB (2**30 bytes) as whole bytes, rounded to the nearest byte.

    Args:
        value: the size in GiB, an int or float (not a bool).
        name: what to call it in an error (a field, argument or flag).
        allow_zero: whether exactly 0 is a size that means something to the caller.

    Returns:
        ``round(value * 2**30)``: from 1 to `MAX_BYTES` bytes, or 0 for exactly 0 when
        `allow_zero`.

    Raises:
        ConfigError: `value` is not a finite number >= 0, is a positive number that rounds
            to 0 bytes, is 0 where 0 is not allowed, or stands for more than `MAX_BYTES`;
            the error names `name` and carries `value`.
    """
    smallest = (f"{'0 or ' if allow_zero else ''}a number of GiB from {1 / GIB:.3g} (1 byte) to "
                f"{MAX_BYTES // GIB} (2**60 bytes)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be {smallest}, got {value!r}", name=name, value=value)
    if value > MAX_BYTES / GIB:
        raise ConfigError(f"{name} must be {smallest}, got {value!r}, more than 2**60 bytes", name=name, value=value)
    nbytes = round(value * GIB)
    if nbytes == 0 and (value != 0 or not allow_zero):
        detail = "" if value == 0 else ", which rounds to 0 bytes"
        raise ConfigError(f"{name} must be {smallest}, got {value!r}{detail}", name=name, value=value)
    return nbytes


def gib(nbytes: int) -> float:
    """Bytes as GiB (2**30 bytes)."""
    return nbytes / GIB


def format_bytes(nbytes: int) -> str:
    """``"12.34 GiB"`` from 1 GiB, ``"5.6 MiB"`` from 1 MiB, ``"8.0 KiB"`` from 1 KiB, else ``"123 B"``."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    if abs(nbytes) >= MIB:
        return f"{nbytes / MIB:.1f} MiB"
    if abs(nbytes) >= KIB:
        return f"{nbytes / KIB:.1f} KiB"
    return f"{nbytes} B"


def ranks_text(ranks: Sequence[int]) -> str:
    """``0-3`` for a run, ``0, 2, 5`` otherwise."""
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(str(r) for r in ordered)
