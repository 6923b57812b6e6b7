"""`parse_written`: which address ranges overlap a mapping with pages copied on write, read
from smaps text; and `written_ranges` on this process's own private file mapping, before
and after a write."""

from __future__ import annotations

import mmap
from pathlib import Path

from offload.capture.smaps import parse_written, written_ranges

SMAPS = """\
7f0000000000-7f0000002000 rw-p 00000000 08:01 42 /models/a.safetensors
Size:                  8 kB
Anonymous:             4 kB
VmFlags: rd wr mr mw me ac
7f0000002000-7f0000004000 rw-p 00002000 08:01 42 /models/a.safetensors
Size:                  8 kB
Anonymous:             0 kB
7f0000010000-7f0000011000 r--p 00000000 08:01 43 /models/b.safetensors
Anonymous:             0 kB
"""


def test_a_range_is_written_when_a_mapping_it_overlaps_holds_copied_pages() -> None:
    base = 0x7F0000000000
    ranges = [(base + 0x100, base + 0x200), (base + 0x2100, base + 0x3000), (base + 0x1F00, base + 0x2100),
              (base + 0x10000, base + 0x10010), (base + 0x20000, base + 0x20010)]
    assert parse_written(SMAPS, ranges) == (True, False, True, False, False)


def test_this_processs_private_mapping_is_written_only_after_a_write(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with path.open("rb") as handle:
        region = mmap.mmap(handle.fileno(), 16384, access=mmap.ACCESS_COPY)
    view = memoryview(region)
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    span = [(address, address + 16384)]
    _ = view[100]  # a read maps the file's page: not a copy
    assert written_ranges(span) == (False,)
    view[5000] = 7  # a write copies the page
    assert written_ranges(span) == (True,)
    assert path.read_bytes()[5000] == (5000 % 256)  # the file is as it was
    view.release()
