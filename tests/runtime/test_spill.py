"""The spill file (`offload.runtime.spill`): unlinked once open, every tensor read back
through the disk reader bit for bit from a block boundary (strided views by their whole
span), a full disk refused with nothing left behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from offload.errors import ExecutionError
from offload.runtime.diskio import DiskReader
from offload.runtime.spill import ALIGN_BYTES, SpillFile


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


def test_a_full_disk_is_refused_naming_it_and_the_spill_file_is_gone(tmp_path: Path) -> None:
    calls: list[int] = []

    def full(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data, offset)

    spill = SpillFile(tmp_path, pwrite=full)
    spill.append(torch.ones(4))
    read_fd = spill.read_fd
    with pytest.raises(ExecutionError, match=r"writing 16 bytes to the spill file in .* at offset 4096 failed: "
                                             r"\[Errno 28\] No space left on device") as caught:
        spill.append(torch.ones(4))
    assert caught.value.value == "ENOSPC"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError) as closed:
        os.fstat(read_fd)
    assert closed.value.errno == errno.EBADF


def test_a_directory_that_cannot_hold_it_is_refused_by_name(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ExecutionError, match="cannot make a spill file in") as caught:
        SpillFile(missing)
    assert caught.value.name == "spill_dir" and caught.value.value == str(missing)
