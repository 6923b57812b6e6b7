"""The disk reader (offload.runtime.diskio) on real files under tmp_path: exact bytes at
every alignment, chunked and concurrent reads, the buffered fallback, and errors that name
the file and the offset and leave the reader working. Failing system calls are injected
through `FileOps`, never patched."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from offload.errors import ExecutionError
from offload.runtime.diskio import BLOCK_BYTES, DiskReader, FileOps, ReadMode

SIZE = 3 * BLOCK_BYTES + 123  # a file whose end is not block-aligned


def write_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


def read_bytes(reader: DiskReader, source: str | Path | int, offset: int, length: int) -> bytes:
    """Read through a memoryview destination; the bytes it holds afterwards."""
    dest = bytearray(length)
    assert reader.submit(source, offset, length, memoryview(dest)).wait() == length
    return bytes(dest)


def read_tensor(reader: DiskReader, source: str | Path, offset: int, length: int) -> bytes:
    """Read through a uint8 tensor destination; the bytes it holds afterwards."""
    dest = torch.zeros(length, dtype=torch.uint8)
    assert reader.submit(source, offset, length, dest).wait() == length
    return bytes(dest.tolist())


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def sample(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "sample.bin"
    return path, write_file(path, SIZE)


@pytest.fixture
def reader() -> Iterator[DiskReader]:
    with DiskReader(threads=3, chunk_bytes=2 * BLOCK_BYTES) as made:
        yield made


RANGES = [  # (offset, length)
    (0, 1), (0, SIZE), (1, BLOCK_BYTES - 1), (BLOCK_BYTES - 1, 2), (BLOCK_BYTES, BLOCK_BYTES),
    (100, 9000), (SIZE - 10, 10), (2 * BLOCK_BYTES + 5, SIZE - 2 * BLOCK_BYTES - 5), (0, 2 * BLOCK_BYTES + 1),
]


@pytest.mark.parametrize(("offset", "length"), RANGES)
def test_every_range_arrives_exactly_through_o_direct(reader: DiskReader, sample: tuple[Path, bytes], offset: int,
                                                      length: int) -> None:
    path, data = sample
    assert read_bytes(reader, path, offset, length) == data[offset:offset + length]
    assert read_tensor(reader, str(path), offset, length) == data[offset:offset + length]
    assert reader.mode_of(path) is ReadMode.DIRECT
    stats = reader.stats()
    assert stats.bytes_read == 2 * length and stats.requests == 2 and stats.failed == 0
    assert stats.direct_files == 1 and stats.buffered_files == 0 and stats.buffered_chunks == 0


def test_a_zero_length_read_reads_and_opens_nothing(reader: DiskReader, tmp_path: Path) -> None:
    missing = tmp_path / "missing.bin"
    handle = reader.submit(missing, 5, 0, memoryview(bytearray()))
    assert handle.done() and handle.wait() == 0
    assert reader.submit(missing, 0, 0, torch.empty(0, dtype=torch.uint8)).wait() == 0
    assert reader.mode_of(missing) is None
    assert reader.stats().requests == 2 and reader.stats().bytes_read == 0


def test_many_concurrent_requests_over_several_files(tmp_path: Path) -> None:
    files = {tmp_path / f"f{i}.bin": write_file(tmp_path / f"f{i}.bin", 40_000 + 777 * i, seed=i) for i in range(3)}
    rng = random.Random(7)
    requests = []
    for _ in range(300):
        path = rng.choice(list(files))
        offset = rng.randrange(len(files[path]))
        length = rng.randrange(len(files[path]) - offset + 1)
        requests.append((path, offset, length, bytearray(length)))
    with DiskReader(threads=4, chunk_bytes=BLOCK_BYTES) as reader:
        handles = [reader.submit(p, o, n, memoryview(d)) for p, o, n, d in requests]
        assert [h.wait() for h in handles] == [n for _, _, n, _ in requests]
        for path, offset, length, dest in requests:
            assert bytes(dest) == files[path][offset:offset + length]
        stats = reader.stats()
    assert stats.requests == 300 and stats.failed == 0 and stats.direct_files == 3
    assert stats.bytes_read == sum(n for _, _, n, _ in requests)
    assert stats.read_seconds > 0 and stats.gbps > 0


def test_a_large_request_is_cut_at_chunk_multiples_of_the_file(tmp_path: Path) -> None:
    chunk = 16 * BLOCK_BYTES
    path = tmp_path / "large.bin"
    data = write_file(path, 20 * chunk + 5)
    offset, length = 777, 18 * chunk
    with DiskReader(threads=4, chunk_bytes=chunk) as reader:
        assert read_tensor(reader, path, offset, length) == data[offset:offset + length]
        stats = reader.stats()
    # [777, chunk), then 17 whole chunks, then [18 * chunk, 18 * chunk + 777): 19 chunks.
    assert stats.direct_chunks == 19 and stats.bytes_read == length and stats.requests == 1


def test_a_destination_aligned_like_the_file_is_read_straight_into(tmp_path: Path) -> None:
    chunk = 16 * BLOCK_BYTES
    path = tmp_path / "large.bin"
    data = write_file(path, 8 * chunk + 1000)
    area = mmap.mmap(-1, 9 * chunk)  # page-aligned
    view = memoryview(area)
    with DiskReader(threads=2, chunk_bytes=chunk) as reader:
        # Aligned offset, length and address: every byte goes straight into the destination.
        kept = reader.submit(path, chunk, 4 * chunk, view[:4 * chunk])
        assert kept.wait() == 4 * chunk
        assert bytes(view[:4 * chunk]) == data[chunk:5 * chunk]
        assert (reader.stats().direct_chunks, reader.stats().staged_bytes) == (4, 0)
        # 100 bytes into a block, at an address 100 bytes into a page, 50 bytes short of a block
        # at the end: only the partial blocks at the two ends are staged.
        offset, length = chunk + 100, 3 * chunk - 150
        assert reader.submit(path, offset, length, view[100:100 + length]).wait() == length
        assert bytes(view[100:100 + length]) == data[offset:offset + length]
        assert (reader.stats().direct_chunks, reader.stats().staged_bytes) == (4 + 3, (BLOCK_BYTES - 100)
                                                                                + (BLOCK_BYTES - 50))
        # Up to the end of the file, which is not block-aligned: the last 1000 bytes are staged.
        offset, length = 7 * chunk, chunk + 1000
        assert reader.submit(path, offset, length, view[:length]).wait() == length
        assert bytes(view[:length]) == data[offset:]
        assert reader.stats().staged_bytes == 2 * BLOCK_BYTES - 150 + 1000
        # The same range at an address unlike the file's: every byte is staged.
        assert reader.submit(path, offset, length, view[1:1 + length]).wait() == length
        assert bytes(view[1:1 + length]) == data[offset:]
        assert reader.stats().staged_bytes == 2 * BLOCK_BYTES - 150 + 1000 + length
    view.release()
    area.close()  # the finished handle holds no view of the map
    assert area.closed and kept.done()


class Barrier2:
    """A preadv that makes its first two calls meet: proof that two chunks are read at once."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.calls = 0
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def __call__(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        with self.lock:
            self.calls += 1
            first_two = self.calls <= 2
            self.threads.add(threading.get_ident())
        if first_two:
            self.barrier.wait()
        return os.preadv(fd, buffers, offset)


def test_the_chunks_of_one_request_are_read_by_several_threads_at_once(tmp_path: Path) -> None:
    path = tmp_path / "two.bin"
    data = write_file(path, 4 * BLOCK_BYTES)
    preadv = Barrier2()
    with DiskReader(threads=2, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=preadv)) as reader:
        assert read_bytes(reader, path, 0, 4 * BLOCK_BYTES) == data
    assert len(preadv.threads) == 2 and threading.get_ident() not in preadv.threads


def test_submit_returns_before_the_read_and_wait_blocks_for_it(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    gate = threading.Event()

    def gated(fd: int, buffers: list[memoryview], offset: int) -> int:
        assert gate.wait(10)
        return os.preadv(fd, buffers, offset)

    with DiskReader(threads=1, ops=FileOps(preadv=gated)) as reader:
        dest = bytearray(100)
        handle = reader.submit(path, 50, 100, memoryview(dest))
        assert not handle.done() and dest == bytearray(100)
        with pytest.raises(TimeoutError, match="offset 50"):
            handle.wait(timeout=0.05)
        assert reader.stats().read_seconds > 0  # outstanding time counts while it runs
        gate.set()
        assert handle.wait(10) == 100 and handle.done()
        assert bytes(dest) == data[50:150]


class RecordingFadvise:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, fd: int, offset: int, length: int, advice: int) -> None:
        self.calls.append((offset, length, advice))
        os.posix_fadvise(fd, offset, length, advice)


def test_buffered_reads_when_asked_drop_the_pages_they_read(reader: DiskReader, sample: tuple[Path, bytes]) -> None:
    path, data = sample
    fadvise = RecordingFadvise()
    with DiskReader(threads=2, chunk_bytes=BLOCK_BYTES, direct=False, ops=FileOps(fadvise=fadvise)) as buffered:
        assert read_bytes(buffered, path, 100, SIZE - 100) == data[100:]
        assert buffered.mode_of(path) is ReadMode.BUFFERED
        stats = buffered.stats()
    assert stats.buffered_chunks == 4 and stats.direct_chunks == 0 and stats.buffered_files == 1
    page = mmap.PAGESIZE
    assert all(advice == os.POSIX_FADV_DONTNEED and off % page == 0 and n % page == 0
               for off, n, advice in fadvise.calls)
    covered = sorted((off, off + n) for off, n, _ in fadvise.calls)
    assert covered[0][0] == 0 and covered[-1][1] >= SIZE  # every page read was dropped


def test_a_filesystem_refusing_o_direct_at_open_is_read_buffered(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    opened: list[int] = []

    def refuse_direct(name: str, flags: int) -> int:
        opened.append(flags)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", name)
        return os.open(name, flags)

    with DiskReader(chunk_bytes=BLOCK_BYTES, ops=FileOps(open=refuse_direct)) as reader:
        assert read_bytes(reader, path, 1, SIZE - 2) == data[1:-1]
        assert reader.mode_of(path) is ReadMode.BUFFERED
        assert read_bytes(reader, path, 0, 10) == data[:10]
    assert opened == [os.O_RDONLY | os.O_DIRECT, os.O_RDONLY]  # one try, then buffered for good


def test_a_filesystem_refusing_the_first_o_direct_read_is_read_buffered(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    direct_fds: list[int] = []

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if is_direct(fd):
            direct_fds.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.preadv(fd, buffers, offset)

    with DiskReader(threads=2, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=refuse_direct)) as reader:
        assert read_tensor(reader, path, 3, SIZE - 3) == data[3:]
        assert reader.mode_of(path) is ReadMode.BUFFERED
        assert reader.stats().buffered_chunks == 4 and reader.stats().failed == 0
    assert direct_fds
    for fd in set(direct_fds):  # the retired O_DIRECT fd was closed with the reader
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF


def test_einval_after_a_direct_read_worked_is_an_error_not_a_fallback(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    calls = []

    def fail_second(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.preadv(fd, buffers, offset)

    with DiskReader(threads=1, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=fail_second)) as reader:
        assert read_bytes(reader, path, 0, 10) == data[:10]
        with pytest.raises(ExecutionError) as failed:
            read_bytes(reader, path, 4 * 1000, 10)
        assert failed.value.name == str(path) and failed.value.value == 4000
        assert reader.mode_of(path) is ReadMode.DIRECT
        assert read_bytes(reader, path, 4000, 10) == data[4000:4010]


@pytest.mark.parametrize("direct", [True, False])
def test_a_short_read_names_the_file_and_offset_and_the_next_read_works(sample: tuple[Path, bytes],
                                                                        direct: bool) -> None:
    path, data = sample
    with DiskReader(threads=2, chunk_bytes=BLOCK_BYTES, direct=direct) as reader:
        dest = torch.full((200,), 7, dtype=torch.uint8)
        with pytest.raises(ExecutionError) as short:
            reader.submit(path, SIZE - 50, 200, dest).wait()
        assert short.value.name == str(path) and short.value.value == SIZE - 50
        assert str(path) in str(short.value) and f"offset {SIZE - 50}" in str(short.value)
        assert f"ends at byte {SIZE}" in str(short.value)
        assert read_bytes(reader, path, SIZE - 50, 50) == data[-50:]
        stats = reader.stats()
    assert stats.failed == 1 and stats.requests == 2 and stats.bytes_read == 50


def test_a_missing_file_is_an_error_and_is_read_once_it_appears(reader: DiskReader, tmp_path: Path) -> None:
    path = tmp_path / "later.bin"
    with pytest.raises(ExecutionError) as missing:
        read_bytes(reader, path, 10, 100)
    assert missing.value.name == str(path) and missing.value.value == 10
    assert isinstance(missing.value.__cause__, FileNotFoundError)
    assert str(path) in str(missing.value) and "offset 10" in str(missing.value)
    assert reader.mode_of(path) is None
    data = write_file(path, 500)
    assert read_bytes(reader, path, 10, 100) == data[10:110]


def test_an_io_error_is_an_execution_error_and_the_next_read_works(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    failures = [OSError(errno.EIO, "Input/output error")]

    def flaky(fd: int, buffers: list[memoryview], offset: int) -> int:
        if failures:
            raise failures.pop()
        return os.preadv(fd, buffers, offset)

    with DiskReader(threads=2, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=flaky)) as reader:
        with pytest.raises(ExecutionError) as failed:
            read_bytes(reader, path, 4096, 100)
        assert failed.value.name == str(path) and failed.value.value == 4096
        assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == errno.EIO
        assert read_bytes(reader, path, 4096, 100) == data[4096:4196]
        assert reader.stats().failed == 1


def test_a_callers_fd_is_read_as_it_was_opened_and_left_open(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    plain = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with DiskReader(chunk_bytes=BLOCK_BYTES) as reader:
            assert read_bytes(reader, plain, 5, 5000) == data[5:5005]
            assert read_bytes(reader, direct, 5, 5000) == data[5:5005]
            assert reader.mode_of(plain) is ReadMode.BUFFERED and reader.mode_of(direct) is ReadMode.DIRECT
        assert os.pread(plain, 4, 0) == data[:4]  # still open
        assert os.fstat(direct).st_size == SIZE
    finally:
        os.close(plain)
        os.close(direct)


def test_a_callers_o_direct_fd_its_filesystem_refuses_is_an_error_naming_it(sample: tuple[Path, bytes]) -> None:
    """The reader cannot reopen an fd without its path (it reads no /proc): it says to pass
    the path, and the fd stays the caller's, open."""
    path, data = sample

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.preadv(fd, buffers, offset)

    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with DiskReader(threads=1, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=refuse_direct)) as reader:
            with pytest.raises(ExecutionError, match="was opened with O_DIRECT, which its filesystem refuses: pass "
                                                     "its path instead"):
                read_bytes(reader, direct, 0, 10)
            assert read_bytes(reader, path, 0, 10) == data[:10]  # by its path: read buffered
            assert reader.mode_of(path) is ReadMode.BUFFERED
        assert os.fstat(direct).st_size == SIZE
    finally:
        os.close(direct)


def test_destinations_that_are_not_exactly_the_bytes_are_refused(reader: DiskReader,
                                                                 sample: tuple[Path, bytes]) -> None:
    path, _ = sample
    bad: list[torch.Tensor | memoryview] = [
        torch.empty(9, dtype=torch.uint8), torch.empty(10, dtype=torch.float32),
        torch.empty(20, dtype=torch.uint8)[::2], memoryview(bytes(10)), memoryview(bytearray(11)),
    ]
    messages = []
    for dest in bad:
        with pytest.raises(ValueError) as refused:
            reader.submit(path, 0, 10, dest)
        messages.append(str(refused.value))
    assert all("10" in message for message in messages)
    with pytest.raises(ValueError, match="must be >= 0"):
        reader.submit(path, -1, 10, memoryview(bytearray(10)))
    assert reader.stats().requests == 0


def test_a_closed_reader_refuses_requests(sample: tuple[Path, bytes]) -> None:
    path, data = sample
    with DiskReader() as reader:
        assert read_bytes(reader, path, 0, 4) == data[:4]
    with pytest.raises(ValueError, match="closed"):
        reader.submit(path, 0, 4, memoryview(bytearray(4)))
    assert reader.mode_of(path) is None  # its files were closed and forgotten


@pytest.mark.parametrize(("threads", "chunk", "block"), [(0, BLOCK_BYTES, BLOCK_BYTES), (1, 1000, 512),
                                                         (1, BLOCK_BYTES, 1000), (1, 2048, BLOCK_BYTES)])
def test_bad_settings_are_refused(threads: int, chunk: int, block: int) -> None:
    with pytest.raises(ValueError) as refused:
        DiskReader(threads=threads, chunk_bytes=chunk, block_bytes=block)
    assert any(str(v) in str(refused.value) for v in (threads, chunk, block))


@pytest.fixture(scope="module")
def big_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("diskio") / "big.bin"
    return path, write_file(path, 10 * BLOCK_BYTES + 321, seed=3)


@settings(max_examples=60)
@given(st.data())
def test_any_range_arrives_exactly(big_sample: tuple[Path, bytes], data: st.DataObject) -> None:
    path, content = big_sample
    offset = data.draw(st.integers(0, len(content)))
    length = data.draw(st.integers(0, len(content) - offset))
    direct = data.draw(st.booleans())
    with DiskReader(threads=2, chunk_bytes=2 * BLOCK_BYTES, direct=direct) as reader:
        assert read_bytes(reader, path, offset, length) == content[offset:offset + length]


def test_before_runs_on_the_worker_before_any_byte_is_read_and_its_failure_fails_the_request(
        sample: tuple[Path, bytes]) -> None:
    """What a staging buffer's refill waits for: the device copy still reading it."""
    path, data = sample
    order: list[str] = []
    gate = threading.Event()

    def copy_done() -> None:  # a device copy's event, synchronised on the worker
        assert gate.wait(10)
        order.append(f"waited on {threading.current_thread().name != threading.main_thread().name}")

    def logged(fd: int, buffers: list[memoryview], offset: int) -> int:
        order.append("read")
        return os.preadv(fd, buffers, offset)

    with DiskReader(threads=1, chunk_bytes=BLOCK_BYTES, ops=FileOps(preadv=logged)) as reader:
        dest = torch.zeros(100, dtype=torch.uint8)
        handle = reader.submit(path, 7, 100, dest, before=copy_done)
        assert not handle.done() and order == []  # nothing is read while the copy runs
        gate.set()
        assert handle.wait(10) == 100 and bytes(dest.tolist()) == data[7:107]
        assert order[0] == "waited on True" and "read" in order[1:]

        def broken() -> None:
            raise RuntimeError("the copy failed")

        with pytest.raises(ExecutionError, match="the copy failed") as caught:
            reader.submit(path, 0, 10, torch.zeros(10, dtype=torch.uint8), before=broken).wait(10)
        assert caught.value.name == str(path)
        assert read_bytes(reader, path, 0, 10) == data[:10]
