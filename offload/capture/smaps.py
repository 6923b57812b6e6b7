"""How much memory a process's mapping of a shared segment takes: Rss and Pss from
``/proc/<pid>/smaps``. Pss (proportional set size) divides each shared page among the
processes that map it, so the Pss of one segment summed over its processes is the
memory it really takes, once, however many map it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs

__all__ = ["SMAPS_PATH", "SegmentMemory", "parse_smaps", "parse_written", "segment_memory", "written_ranges"]

#: smaps of a process (``self`` or a pid).
SMAPS_PATH = "/proc/{pid}/smaps"


@attrs.frozen(kw_only=True)
class SegmentMemory:
    """One process's mappings of one segment.

    Attributes:
        mappings: how many mappings of it the process has.
        size_bytes: their virtual size, in bytes.
        rss_bytes: bytes of it resident in the process's page tables.
        pss_bytes: its proportional share of those, in bytes.
    """

    mappings: int
    size_bytes: int
    rss_bytes: int
    pss_bytes: int


def parse_smaps(text: str, name: str) -> SegmentMemory:
    """Add up the smaps entries whose path contains `name` (a segment's name)."""
    mappings = size = rss = pss = 0
    inside = False
    for line in text.splitlines():
        first, _, rest = line.partition(" ")
        if "-" in first and not first.endswith(":"):  # a mapping's header: "start-end perms offset dev inode path"
            inside = name in rest
            mappings += inside
            continue
        if not inside:
            continue
        key, _, value = line.partition(":")
        amount = value.split()
        if not amount or not amount[0].isdigit():
            continue
        kib = int(amount[0]) * 1024
        if key == "Size":
            size += kib
        elif key == "Rss":
            rss += kib
        elif key == "Pss":
            pss += kib
    return SegmentMemory(mappings=mappings, size_bytes=size, rss_bytes=rss, pss_bytes=pss)


def segment_memory(name: str, pid: int | str = "self") -> SegmentMemory:
    """`parse_smaps` of process `pid`'s smaps for segment `name`.

    Raises:
        OSError: the process or its smaps cannot be read.
    """
    with open(SMAPS_PATH.format(pid=pid), encoding="utf-8", errors="replace") as f:
        return parse_smaps(f.read(), name)


def parse_written(text: str, ranges: Sequence[tuple[int, int]]) -> tuple[bool, ...]:
    """For each ``[start, end)`` address range of `ranges`: whether a mapping of `text` (a
    process's smaps) that overlaps it holds pages copied on write, i.e. written by the
    process (its ``Anonymous`` is not 0: in a private file mapping, those are the pages
    that no longer are the file's)."""
    written: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in text.splitlines():
        first, _, _ = line.partition(" ")
        if "-" in first and not first.endswith(":"):
            low, _, high = first.partition("-")
            try:
                current = (int(low, 16), int(high, 16))
            except ValueError:
                current = None
            continue
        if current is not None and line.startswith("Anonymous:"):
            amount = line.split()
            if len(amount) > 1 and amount[1].isdigit() and int(amount[1]) > 0:
                written.append(current)
    written.sort()
    starts = [start for start, _ in written]
    found = []
    for start, end in ranges:
        # The written mappings are disjoint: the last one that starts before the range ends
        # overlaps it if any does.
        at = bisect.bisect_left(starts, end)
        found.append(bool(at) and written[at - 1][1] > start)
    return tuple(found)


def written_ranges(ranges: Sequence[tuple[int, int]], pid: int | str = "self") -> tuple[bool, ...]:
    """`parse_written` of process `pid`'s smaps.

    Raises:
        OSError: the process or its smaps cannot be read.
    """
    with open(SMAPS_PATH.format(pid=pid), encoding="utf-8", errors="replace") as f:
        return parse_written(f.read(), ranges)
