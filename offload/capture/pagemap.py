"""Which pages of a process's private file mappings it wrote, page by page, from
``/proc/<pid>/pagemap`` (one 64-bit entry per virtual page; Documentation/admin-guide/mm/pagemap.rst).

`offload.capture.smaps.written_ranges` answers per mapping (a mapping's ``Anonymous``);
a disk tier maps a checkpoint file whole, many tensors in one mapping, so a write into
one tensor's pages must be told from the others by its pages. In a private file mapping
a page the process wrote is a private copy: an anonymous page (present, and not a file
page), or one swapped out (file pages are never swapped). The flag bits are readable by
the process itself without privileges (Linux 4.2 on; only the frame numbers are hidden).
"""

from __future__ import annotations

import array
import mmap
from collections.abc import Sequence

__all__ = ["PAGEMAP_PATH", "page_written", "written_pages"]

#: pagemap of a process (``self`` or a pid).
PAGEMAP_PATH = "/proc/{pid}/pagemap"

_PRESENT = 1 << 63
_SWAPPED = 1 << 62
_FILE = 1 << 61  # a file page or shared anonymous memory


def page_written(entry: int) -> bool:
    """Whether a pagemap `entry` of a page of a private file mapping is a page the process
    wrote (copied on write): anonymous and present, or swapped out."""
    return bool(entry & _SWAPPED) or (bool(entry & _PRESENT) and not entry & _FILE)


def written_pages(ranges: Sequence[tuple[int, int]], pid: int | str = "self") -> tuple[bool, ...]:
    """For each ``[start, end)`` address range of `ranges` (in private file mappings of
    process `pid`): whether a page it touches was written by the process (`page_written`).
    An empty range is not.

    Raises:
        OSError: the process or its pagemap cannot be read.
    """
    page = mmap.PAGESIZE
    found: list[bool] = []
    with open(PAGEMAP_PATH.format(pid=pid), "rb", buffering=0) as f:
        for start, end in ranges:
            if end <= start:
                found.append(False)
                continue
            first, last = start // page, (end - 1) // page
            f.seek(first * 8)
            entries = array.array("Q")
            entries.frombytes(f.read((last - first + 1) * 8))
            found.append(any(page_written(entry) for entry in entries))
    return tuple(found)
