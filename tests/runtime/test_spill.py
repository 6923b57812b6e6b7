"""The spill file (`offload.runtime.spill`): unlinked once open, every tensor read back
through the disk reader bit for bit from a block boundary (strided views by their whole
span), a full disk refused with what was written before kept; and `FileMap`: many views
of a file in one private mapping, no fd held, pages given back with their views."""

from __future__ import annotations

import errno
import gc
import mmap
import os
from pathlib import Path

import pytest
import torch

from offload.capture.pagemap import written_pages
from offload.errors import ExecutionError
from offload.runtime.diskio import DiskReader
from offload.runtime.spill import ALIGN_BYTES, SEGMENT_BYTES, FileMap, SpillFile


def _read(reader: DiskReader, fd: int, offset: int, length: int) -> bytes:
    dest = torch.empty(length, dtype=torch.uint8)
    assert reader.submit(fd, offset, length, dest).wait() == length
    return dest.numpy().tobytes()


def test_tensors_written_once_are_read_back_bit_for_bit_and_nothing_is_left_in_the_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weight = torch.randn(33, 17)
    tensors = [weight, torch.randn(5, dtype=torch.float64).to(torch.bfloat16), weight.t(),
               torch.arange(7, dtype=torch.int8), torch.empty(0)]
    with SpillFile(tmp_path) as spill, DiskReader(threads=2) as reader:
        assert list(tmp_path.iterdir()) == []  # unlinked once open
        extents = [spill.append(t) for t in tensors]
        spill.flush()
        assert all(offset % ALIGN_BYTES == 0 for offset, length in extents if length)
        assert [length for _, length in extents] == [33 * 17 * 4, 10, 33 * 17 * 4, 7, 0]
        for tensor, (offset, length) in zip(tensors, extents, strict=True):
            raw = _read(reader, spill.read_fd, offset, length) if length else b""
            want = tensor.contiguous() if tensor.is_contiguous() else tensor.t().contiguous()  # the span, as stored
            assert raw == want.view(-1).view(torch.uint8).numpy().tobytes()
        assert spill.nbytes == extents[-2][0] + 7


def test_a_full_disk_is_refused_naming_it_and_what_was_written_before_stays(tmp_path: Path) -> None:
    """A failed append keeps nothing of its tensor (the file is cut back) and leaves the
    file as it was: what was appended before reads back, mapped and through the reader,
    and appends work again once there is room (new weights for a running model must not
    lose the old ones)."""
    calls: list[int] = []
    full = [False]

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if full[0]:
            os.pwrite(fd, data[:3], offset)  # part of it, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data, offset)

    with SpillFile(tmp_path, pwrite=pwrite) as spill, DiskReader(threads=1) as reader:
        first = torch.arange(4, dtype=torch.float32)
        offset, length = spill.append(first)
        mapped = spill.map(offset, length)
        full[0] = True
        with pytest.raises(ExecutionError, match=r"writing 16 bytes to the spill file in .* at offset 4096 failed: "
                                                 r"\[Errno 28\] No space left on device") as caught:
            spill.append(torch.ones(4))
        assert caught.value.value == "ENOSPC" and caught.value.name == "spill_dir"
        assert list(tmp_path.iterdir()) == []
        assert spill.nbytes == 16 and os.fstat(spill.read_fd).st_size == 16  # the part written is gone
        assert torch.equal(mapped.view(torch.float32), first)
        assert _read(reader, spill.read_fd, offset, length) == first.numpy().tobytes()
        full[0] = False
        again = spill.append(torch.full((4,), 7.0))
        assert again == (4096, 16) and torch.equal(spill.map(*again).view(torch.float32), torch.full((4,), 7.0))
        read_fd = spill.read_fd
    with pytest.raises(OSError) as closed:
        os.fstat(read_fd)
    assert closed.value.errno == errno.EBADF
    assert torch.equal(mapped.view(torch.float32), first)  # a mapping outlives the fds


def _open_fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_views_of_a_file_share_one_mapping_hold_no_fd_and_keep_it_mapped(tmp_path: Path) -> None:
    """A thousand views of one file, asked for from its end backwards: one mapping, no fd
    held (the caller's fd may close); each view has a storage of its own; a write into one
    goes to a private copy (never the file) and is seen through no other view; the mapping
    lives until the last view goes."""
    path = tmp_path / "data.bin"
    data = bytes(range(256)) * 4096  # 1 MiB
    path.write_bytes(data)
    start = _open_fds()
    fd = os.open(path, os.O_RDONLY)
    files = FileMap(fd, str(path))
    offsets = list(range(len(data) - 1000, 0, -1000))
    views = [files.view(offset, 1000, covering=(0, len(data))) for offset in offsets]
    os.close(fd)
    assert _open_fds() == start and files.mappings == 1
    assert len({v.untyped_storage().data_ptr() for v in views}) == len(views)
    assert all(v.untyped_storage().nbytes() == 1000 for v in views)
    assert all(v.numpy().tobytes() == data[offset:offset + 1000] for offset, v in zip(offsets, views, strict=True))
    views[5][0] = 255 - data[offsets[5]]
    assert path.read_bytes() == data
    assert int(views[5][0]) == 255 - data[offsets[5]] and views[6].numpy().tobytes() == data[offsets[6]:][:1000]
    kept = views[-1]
    del views
    assert files.mappings == 1 and kept.numpy().tobytes() == data[offsets[-1]:offsets[-1] + 1000]
    del kept
    assert files.mappings == 0


def test_a_written_page_goes_back_to_the_file_when_its_last_view_goes(tmp_path: Path) -> None:
    """The pages wholly inside a dead view's bytes are given back (a write copied them: host
    memory nothing can read any more); the view beside it in the same mapping keeps its own."""
    page = mmap.PAGESIZE
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * (8 * page))
    fd = os.open(path, os.O_RDONLY)
    files = FileMap(fd, str(path))
    gone = files.view(0, 4 * page, covering=(0, 8 * page))
    stays = files.view(4 * page, 4 * page)
    os.close(fd)
    address = gone.data_ptr()
    gone.fill_(9)
    stays.fill_(5)
    assert written_pages([(address, address + 4 * page)]) == (True,)
    del gone
    assert written_pages([(address, address + 4 * page), (stays.data_ptr(), stays.data_ptr() + 4 * page)]) == \
        (False, True)
    assert bool((stays == 5).all())


def test_a_spill_file_is_mapped_in_segments_not_per_tensor(tmp_path: Path) -> None:
    with SpillFile(tmp_path) as spill:
        tensors = [torch.full((1000,), float(k)) for k in range(50)]
        copies = [spill.map(*spill.append(t)).view(torch.float32) for t in tensors]
        assert spill.mappings == 1
        big = spill.map(*spill.append(torch.zeros(SEGMENT_BYTES // 4 + 1)))  # past the first segment
        assert spill.mappings == 2 and big.numel() == SEGMENT_BYTES + 4
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors, strict=True))


def test_a_directory_that_cannot_hold_it_is_refused_by_name(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ExecutionError, match="cannot make a spill file in") as caught:
        SpillFile(missing)
    assert caught.value.name == "spill_dir" and caught.value.value == str(missing)
