"""Byte units for people: GiB in tables, exact integers in data."""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB", "format_bytes", "gib"]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


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
