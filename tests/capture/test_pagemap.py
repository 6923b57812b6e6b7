"""`written_pages`: which address ranges of a private file mapping hold pages the process
wrote, page by page, where smaps can only say it of the whole mapping; and `page_written`
on the pagemap entries it reads."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

from offload.capture.pagemap import page_written, written_pages
from offload.capture.smaps import written_ranges

PRESENT, SWAPPED, FILE = 1 << 63, 1 << 62, 1 << 61


def test_an_entry_is_written_when_present_and_anonymous_or_swapped() -> None:
    assert [page_written(e) for e in (0, PRESENT | FILE, PRESENT, PRESENT | 1234, SWAPPED, FILE)] == \
        [False, False, True, True, True, False]


def test_only_the_ranges_over_the_written_page_are_written(tmp_path: Path) -> None:
    page = mmap.PAGESIZE
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * (8 * page // 256))
    with path.open("rb") as handle:
        region = mmap.mmap(handle.fileno(), 8 * page, access=mmap.ACCESS_COPY)
    view = memoryview(region)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    ranges = [(base, base + page), (base + page, base + 3 * page), (base + 3 * page + 10, base + 4 * page),
              (base + 5 * page, base + 5 * page)]
    _ = view[0], view[2 * page]  # reads map the file's pages: not written
    assert written_pages(ranges) == (False, False, False, False)
    view[page + 7] = 1  # copies the second page
    assert written_pages(ranges) == (False, True, False, False)
    assert written_ranges(ranges[:3]) == (True, True, True)  # smaps sees the whole mapping written
    view.release()
