"""The disk rate as the tier's reader reaches it (offload.runtime.diskrate) on real files
under tmp_path: `read_like_the_tier` reads every layer's runs exactly, laid out congruent
with the file (straight in, nothing staged), at most `depth` layers in flight; and
`measure_disk_rate` times a scratch file it removes, also when a read fails. Failing and
recording system calls are injected through `FileOps`. No timing assertions."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest

from offload.errors import ExecutionError
from offload.runtime.diskio import BLOCK_BYTES, DiskReader, FileOps
from offload.runtime.diskrate import layer_bytes, measure_disk_rate, read_like_the_tier, staging_buffers


def write_file(path: Path, size: int) -> bytes:
    data = random.Random(0).randbytes(size)
    path.write_bytes(data)
    return data


def test_every_layer_is_read_exactly_and_congruent_with_its_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    data = write_file(path, 40 * BLOCK_BYTES + 77)
    name = str(path)
    # Layers of one or two runs, at offsets off and on block boundaries; the last ends the file.
    layers = [[(name, 100, 3 * BLOCK_BYTES)], [(name, 4 * BLOCK_BYTES, BLOCK_BYTES), (name, 9 * BLOCK_BYTES + 5, 700)],
              [(name, 20 * BLOCK_BYTES, 20 * BLOCK_BYTES + 77)]]
    buffers = staging_buffers(layer_bytes(layers), len(layers))  # one buffer per layer: all kept to check
    with DiskReader(threads=3, chunk_bytes=2 * BLOCK_BYTES) as reader:
        assert read_like_the_tier(reader, layers, depth=len(layers), buffers=buffers) == sum(
            n for runs in layers for _, _, n in runs)
        staged = reader.stats().staged_bytes
    for runs, buffer in zip(layers, buffers, strict=True):
        assert buffer.data_ptr() % BLOCK_BYTES == 0
        at = 0
        for _, offset, length in runs:
            at += (offset - at) % BLOCK_BYTES  # congruent with the file
            assert bytes(buffer[at:at + length].tolist()) == data[offset:offset + length]
            at += length
    # Only the partial blocks at the runs' ends went through staging, as the tier's reads do.
    assert staged < 4 * BLOCK_BYTES


@pytest.mark.parametrize("depth", [1, 2])
def test_at_most_depth_layers_are_in_flight(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "model.bin"
    write_file(path, 8 * BLOCK_BYTES)
    layers = [[(str(path), k * BLOCK_BYTES, BLOCK_BYTES)] for k in range(8)]
    lock, events = threading.Lock(), []

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        with lock:
            events.append(("start", offset // BLOCK_BYTES))
        n = os.preadv(fd, buffers, offset)
        with lock:
            events.append(("end", offset // BLOCK_BYTES))
        return n

    with DiskReader(threads=4, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=preadv)) as reader:
        read_like_the_tier(reader, layers, depth=depth)
    in_flight: set[int] = set()
    most = 0
    for kind, layer in events:
        (in_flight.add if kind == "start" else in_flight.discard)(layer)
        most = max(most, len(in_flight))
    assert most <= depth
    assert sorted(layer for kind, layer in events if kind == "end") == list(range(8))
    if depth == 1:  # strictly one after another, in order
        assert events == [(kind, k) for k in range(8) for kind in ("start", "end")]


def test_bad_depths_and_too_few_buffers_are_refused(tmp_path: Path) -> None:
    with DiskReader() as reader:
        with pytest.raises(ValueError, match="depth"):
            read_like_the_tier(reader, [], depth=0)
        with pytest.raises(ValueError, match="2 buffers"):
            read_like_the_tier(reader, [], depth=2, buffers=staging_buffers(BLOCK_BYTES, 1))


def test_the_rate_is_measured_and_the_scratch_file_removed(tmp_path: Path) -> None:
    rate = measure_disk_rate(tmp_path, nbytes=1 << 20, request_bytes=256 << 10, repeat=2, threads=2,
                             chunk_bytes=64 << 10)
    assert len(rate.runs) == 2 and all(r > 0 for r in rate.runs)
    assert min(rate.runs) <= rate.gbps <= max(rate.runs)
    assert (rate.nbytes, rate.request_bytes, rate.threads, rate.chunk_bytes, rate.depth) == (
        1 << 20, 256 << 10, 2, 64 << 10, 2)
    assert rate.mode in ("direct", "buffered")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_read_is_an_error_and_removes_the_scratch_file(tmp_path: Path) -> None:
    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(ExecutionError, match="Input/output error"):
        measure_disk_rate(tmp_path, nbytes=1 << 20, request_bytes=256 << 10, repeat=1,
                          reader=lambda: DiskReader(ops=FileOps(preadv=preadv)))
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_is_not_there_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        measure_disk_rate(tmp_path / "missing", nbytes=1 << 20)
    with pytest.raises(ValueError, match="at least 1"):
        measure_disk_rate(tmp_path, nbytes=0)
