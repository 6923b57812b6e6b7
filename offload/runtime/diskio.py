"""Reading byte ranges of files into host buffers, on worker threads (the disk tier's reads).

A request (file, offset, length, destination) is cut into chunks at multiples of
``chunk_bytes`` of the file, read on a small thread pool (``os.preadv`` releases the GIL).
`ReadMode.DIRECT` reads use ``O_DIRECT`` (aligned spans, through aligned staging buffers
unless the destination is aligned like the file); where the filesystem refuses it, or with
``direct=False``, `ReadMode.BUFFERED` reads go without readahead (``POSIX_FADV_RANDOM``) and
are followed by ``POSIX_FADV_DONTNEED``, so the page cache does not grow. Short reads and
``OSError`` are `ExecutionError` naming the file and offset; nothing about a failure is
remembered. docs/disk.md has the why and the numbers.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TypeAlias, final

import attrs
import torch

from offload.errors import ExecutionError
from offload.logs import logger

__all__ = ["BLOCK_BYTES", "CHUNK_BYTES", "THREADS", "Destination", "DiskReadStats", "DiskReader", "FileOps",
           "ReadHandle", "ReadMode", "Source"]

log = logger("offload.disk")

#: The alignment of ``O_DIRECT`` reads, in bytes: a multiple of every logical block size in use.
BLOCK_BYTES = 4096
#: The largest piece of a request that one thread reads, in bytes; also each thread's staging.
CHUNK_BYTES = 16 << 20
#: Worker threads by default: enough to keep a disk's queue busy, few enough to leave the cores.
THREADS = 4

#: A file: a path (opened here, closed by `DiskReader.close`) or an open fd (never closed here);
#: and where its bytes go: a contiguous CPU ``uint8`` tensor or a writable, contiguous memoryview.
Source: TypeAlias = str | os.PathLike[str] | int
Destination: TypeAlias = torch.Tensor | memoryview


class ReadMode(enum.Enum):
    """How a file is read: with ``O_DIRECT``, or buffered with its pages dropped after."""

    DIRECT = "direct"
    BUFFERED = "buffered"


@attrs.frozen(kw_only=True)
class FileOps:
    """The system calls a `DiskReader` makes (`os.open`, `os.preadv`, `os.posix_fadvise`),
    injected so that tests can fail them."""

    open: Callable[[str, int], int] = os.open
    preadv: Callable[[int, list[memoryview], int], int] = os.preadv
    fadvise: Callable[[int, int, int, int], None] = os.posix_fadvise


@attrs.frozen(kw_only=True)
class DiskReadStats:
    """What a `DiskReader` has read so far.

    Attributes:
        bytes_read: bytes delivered into destinations by the chunks that succeeded.
        read_seconds: wall seconds during which at least one request was outstanding.
        requests: requests finished, the failed ones included; failed: those that raised.
        direct_chunks: chunks read with ``O_DIRECT``; staged_bytes: the bytes of those that went
            through a staging buffer (and a copy) rather than straight in.
        buffered_chunks: chunks read buffered.
        direct_files, buffered_files: files open in each `ReadMode`.
    """

    bytes_read: int
    read_seconds: float
    requests: int
    failed: int
    direct_chunks: int
    staged_bytes: int
    buffered_chunks: int
    direct_files: int
    buffered_files: int

    @property
    def gbps(self) -> float:
        """`bytes_read` per `read_seconds`, in GB/s (1e9 bytes); 0.0 before any read."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


@attrs.define(kw_only=True, eq=False)
class _File:
    """An open file: the fd its chunks read now, its mode, and the fds a fallback retired."""

    name: str
    fd: int
    mode: ReadMode
    owned: bool
    proven: bool = False  # a direct read has worked: a later EINVAL is an error, not "unsupported"
    retired: list[int] = attrs.field(factory=list)


@final
@attrs.define(kw_only=True, eq=False)
class ReadHandle:
    """One submitted request (`name`: the file, as errors name it; `offset`, `length`: in bytes)."""

    name: str
    offset: int
    length: int
    _view: memoryview  # the destination's bytes, for preadv
    _address: int  # where they start, for memmove (a ctypes call: it releases the GIL, runs on one core)
    _keep: torch.Tensor | None  # a tensor destination, alive as long as the handle (a view holds itself)
    _remaining: int
    _before: Callable[[], object] | None = None  # waited on the worker before each chunk
    _error: ExecutionError | None = None
    _done: threading.Event = attrs.field(factory=threading.Event)

    def done(self) -> bool:
        """True once every chunk has finished, well or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the request has finished; the bytes read (its length).

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
            ExecutionError: a chunk failed or the file ended early (the first failure).
            TimeoutError: `timeout` passed first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"reading {self.name} at offset {self.offset} did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        return self.length


@final
class DiskReader:
    """Fills host buffers from byte ranges of files, on worker threads; a context manager.

    Args:
        threads: worker threads (at least 1).
        chunk_bytes: the largest piece one thread reads, a multiple of `block_bytes`.
        block_bytes: the ``O_DIRECT`` alignment, a power of two of at least 512.
        direct: open paths with ``O_DIRECT`` where the filesystem takes it; False reads
            them buffered. An fd is read as it was opened.
        ops: the system calls (`FileOps`); tests inject failing ones.

    Raises:
        ValueError: a bad `threads`, `chunk_bytes` or `block_bytes`.
    """

    def __init__(self, *, threads: int = THREADS, chunk_bytes: int = CHUNK_BYTES, block_bytes: int = BLOCK_BYTES,
                 direct: bool = True, ops: FileOps | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if block_bytes < 512 or block_bytes & (block_bytes - 1):
            raise ValueError(f"block_bytes must be a power of two of at least 512, got {block_bytes}")
        if chunk_bytes < block_bytes or chunk_bytes % block_bytes:
            raise ValueError(f"chunk_bytes must be a positive multiple of {block_bytes}, got {chunk_bytes}")
        self._chunk, self._block, self._direct = chunk_bytes, block_bytes, direct
        self._ops = ops if ops is not None else FileOps()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-diskio")
        self._local = threading.local()  # each worker's staging buffer
        self._lock = threading.Lock()  # guards everything below
        self._files: dict[str | int, _File] = {}
        self._closed = False
        self._outstanding = 0  # requests submitted and not finished
        self._busy_since = self._seconds = 0.0  # when _outstanding last left 0; busy seconds before that
        self._counts = dict.fromkeys(("bytes", "requests", "failed", "direct", "staged", "buffered"), 0)

    def submit(self, source: Source, offset: int, length: int, dest: Destination, *,
               before: Callable[[], object] | None = None) -> ReadHandle:
        """Start reading `length` bytes of `source` from `offset` into `dest`.

        Args:
            source: a path, or an open fd (read as it was opened, ``O_DIRECT`` or not).
            offset: the file offset of the first byte, in bytes.
            length: bytes to read; 0 reads (and opens) nothing.
            dest: exactly `length` bytes to fill (`Destination`), not to be touched until
                `ReadHandle.wait`; read straight into where its address is `offset` modulo the block.
            before: called on the worker thread before each chunk is read, e.g. the
                ``synchronize`` of the event of the device copy still reading `dest`
                (so must be idempotent); what it raises fails the request.

        Returns:
            The request's handle.

        Raises:
            ValueError: a negative offset or length, a destination that is not `length`
                contiguous writable host bytes, or a closed reader.
        """
        name = str(source) if isinstance(source, int) else os.fspath(source)
        if offset < 0 or length < 0:
            raise ValueError(f"reading {name}: offset and length must be >= 0, got {offset} and {length}")
        view, address = _destination(dest, length)
        step = self._chunk  # cut at its multiples in the file: every chunk but the first and last is aligned
        starts = [offset, *range((offset // step + 1) * step, offset + length, step)] if length else []
        handle = ReadHandle(name=name, offset=offset, length=length, view=view, address=address,
                            keep=dest if isinstance(dest, torch.Tensor) else None, remaining=len(starts),
                            before=before)
        with self._lock:
            if self._closed:
                raise ValueError(f"reading {name}: the disk reader is closed")
            if not starts:
                self._counts["requests"] += 1
                handle._done.set()
                return handle
            if self._outstanding == 0:
                self._busy_since = time.perf_counter()
            self._outstanding += 1
            for start, end in zip(starts, [*starts[1:], offset + length], strict=True):
                self._pool.submit(self._run_chunk, handle, source, start, end)
        return handle

    def mode_of(self, source: Source) -> ReadMode | None:
        """How `source` is read; None until it has been opened (successfully)."""
        with self._lock:
            file = self._files.get(source if isinstance(source, int) else os.fspath(source))
            return None if file is None else file.mode

    def stats(self) -> DiskReadStats:
        """The counters so far."""
        with self._lock:
            c, modes = self._counts, [file.mode for file in self._files.values()]
            busy = time.perf_counter() - self._busy_since if self._outstanding else 0.0
            return DiskReadStats(
                bytes_read=c["bytes"], read_seconds=self._seconds + busy, requests=c["requests"], failed=c["failed"],
                direct_chunks=c["direct"], staged_bytes=c["staged"], buffered_chunks=c["buffered"],
                direct_files=modes.count(ReadMode.DIRECT), buffered_files=modes.count(ReadMode.BUFFERED))

    def close(self) -> None:
        """Finish the requests submitted, join the threads, close the fds opened here."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for file in files:
            for fd in [*file.retired, *[file.fd] * file.owned]:
                os.close(fd)

    def __enter__(self) -> DiskReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _run_chunk(self, handle: ReadHandle, source: Source, start: int, end: int) -> None:
        """Read one chunk and count it; never raises (an error goes to the handle)."""
        error: ExecutionError | None = None
        kind, staged = "", 0
        try:
            if handle._before is not None:
                handle._before()
            kind, staged = self._read_chunk(self._open(source, handle.name), handle, start, end)
        except ExecutionError as exc:
            error = exc
        except Exception as exc:  # an OSError, or anything else: a waiter must never hang on a lost chunk
            error = ExecutionError(f"reading {handle.name} at offset {handle.offset} ({handle.length} bytes) failed "
                                   f"at file offset {start}: {exc}", name=handle.name, value=handle.offset)
            error.__cause__ = exc
        with self._lock:
            if error is None:
                self._counts["bytes"] += end - start
                self._counts[kind] += 1
                self._counts["staged"] += staged
            elif handle._error is None:
                handle._error = error
            handle._remaining -= 1
            if handle._remaining:
                return
            self._counts["requests"] += 1
            self._counts["failed"] += handle._error is not None
            self._outstanding -= 1
            if self._outstanding == 0:
                self._seconds += time.perf_counter() - self._busy_since
        handle._view.release()  # so that the caller can close what it points into (an mmap)
        handle._done.set()

    def _open(self, source: Source, name: str) -> _File:
        """The open file of `source`, opened on first use (a failed open is not remembered)."""
        key = source if isinstance(source, int) else name
        with self._lock:
            if key not in self._files:
                if isinstance(source, int):
                    fd, direct = source, bool(fcntl.fcntl(source, fcntl.F_GETFL) & os.O_DIRECT)
                else:
                    fd, direct = -1, self._direct
                    try:
                        fd = self._ops.open(name, os.O_RDONLY | os.O_DIRECT) if direct else fd
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        direct = False
                        log.info("%s refuses O_DIRECT (%s); reading it buffered, dropping its pages after", name, exc)
                    fd = fd if direct else self._ops.open(name, os.O_RDONLY)
                mode = ReadMode.DIRECT if direct else ReadMode.BUFFERED
                if not direct:
                    _no_readahead(fd)
                self._files[key] = _File(name=name, fd=fd, mode=mode, owned=not isinstance(source, int))
            return self._files[key]

    def _fall_back(self, file: _File, fd: int) -> None:
        """`file` refused its first ``O_DIRECT`` read on `fd`: read it buffered from now on (`fd` stays
        open until `close`, other chunks may be reading it); a caller's fd, without its path, is refused."""
        with self._lock:
            if file.fd != fd:
                return  # another chunk fell back first
            if not file.owned:
                raise ExecutionError(f"{file.name} was opened with O_DIRECT, which its filesystem refuses: pass its "
                                     "path instead (the reader then reads it buffered)", name=file.name, value=fd)
            file.retired.append(fd)
            file.fd, file.mode = self._ops.open(file.name, os.O_RDONLY), ReadMode.BUFFERED
            _no_readahead(file.fd)
        log.info("%s refused an O_DIRECT read; reading it buffered, dropping its pages after", file.name)

    def _read_chunk(self, file: _File, handle: ReadHandle, start: int, end: int) -> tuple[str, int]:
        """Read file bytes [start, end) into the destination at ``start - handle.offset``: how
        ("direct" or "buffered"), and the bytes that went through staging. Raises
        `ExecutionError` when the file ends before `end`, ``OSError`` when a read fails."""
        fd, block = file.fd, self._block
        if file.mode is ReadMode.DIRECT:
            # A destination congruent with the file (address = offset, modulo the block) takes the
            # chunk's whole blocks straight in; only the rest is read into staging and copied.
            inner = (-(-start // block) * block, end // block * block)
            if (handle._address - handle.offset) % block or inner[0] >= inner[1]:
                inner = (end, end)
            try:
                if inner[0] < inner[1]:
                    lo, hi = inner[0] - handle.offset, inner[1] - handle.offset
                    got = self._fill(fd, handle._view[lo:hi], inner[0], direct=True)
                    _check(file, handle, inner[1], inner[0] + got)
                staged = [(a, b) for a, b in ((start, inner[0]), (inner[1], end)) if a < b]
                for a, b in staged:
                    first, last = a // block * block, -(-b // block) * block
                    view, address = self._staging()
                    _check(file, handle, b, first + self._fill(fd, view[:last - first], first, direct=True))
                    ctypes.memmove(handle._address + a - handle.offset, address + a - first, b - a)
                file.proven = True
                return "direct", sum(b - a for a, b in staged)
            except OSError as exc:
                if exc.errno != errno.EINVAL or file.proven:
                    raise
                self._fall_back(file, fd)
                fd = file.fd
        lo, hi = start - handle.offset, end - handle.offset
        reached = start + self._fill(fd, handle._view[lo:hi], start, direct=False)
        first, last = start // mmap.PAGESIZE * mmap.PAGESIZE, -(-reached // mmap.PAGESIZE) * mmap.PAGESIZE
        self._ops.fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)  # the pages read, whole
        _check(file, handle, end, reached)
        return "buffered", 0

    def _fill(self, fd: int, buffer: memoryview, position: int, *, direct: bool) -> int:
        """Read into `buffer` from file `position` until it is full or the file ends; the
        bytes read. A direct read that ends off a block boundary has met the end."""
        got = 0
        while got < len(buffer):
            n = self._ops.preadv(fd, [buffer[got:]], position + got)
            got += n
            if n == 0 or (direct and n % self._block):
                break
        return got

    def _staging(self) -> tuple[memoryview, int]:
        """This thread's staging buffer, `chunk_bytes` at an aligned address: a view and the address."""
        found: tuple[memoryview, int] | None = getattr(self._local, "staging", None)
        if found is None:
            raw = torch.empty(self._chunk + self._block, dtype=torch.uint8)  # its pages are touched on first use
            self._local.raw = raw
            address = raw.data_ptr() + (-raw.data_ptr() % self._block)
            found = self._local.staging = (_bytes_at(address, self._chunk), address)
        return found


def _no_readahead(fd: int) -> None:
    """Read `fd` without readahead (``POSIX_FADV_RANDOM``; best effort): a buffered read
    then brings only the pages asked for, which it drops after, where readahead would
    leave the pages past each run in the page cache (up to the device's ``read_ahead_kb``:
    8 MiB on this machine). A hint on how the fd is read, not a read: not in `FileOps`."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        pass


def _check(file: _File, handle: ReadHandle, end: int, reached: int) -> None:
    """Raise `ExecutionError` when a chunk of `handle` ending at `end` stopped at `reached`."""
    if reached < end:
        raise ExecutionError(f"short read of {file.name} at offset {handle.offset} ({handle.length} bytes): "
                             f"the file ends at byte {reached}, before byte {end}", name=file.name, value=handle.offset)


def _bytes_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` at `address`, memory something else keeps alive."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _destination(dest: Destination, length: int) -> tuple[memoryview, int]:
    """`dest` as a byte view, and the address of its first byte.

    Raises:
        ValueError: `dest` is not exactly `length` contiguous, writable host bytes.
    """
    if isinstance(dest, torch.Tensor):
        if dest.device.type != "cpu" or dest.dtype != torch.uint8 or not dest.is_contiguous() or dest.numel() != length:
            raise ValueError(f"the destination must be {length} contiguous CPU uint8 bytes, got a {dest.dtype} tensor "
                             f"of {dest.numel()} elements on {dest.device} (contiguous: {dest.is_contiguous()})")
        return (_bytes_at(dest.data_ptr(), length) if length else memoryview(bytearray())), dest.data_ptr()
    if dest.readonly or not dest.c_contiguous or dest.nbytes != length:
        raise ValueError(f"the destination must be {length} contiguous writable bytes, got a memoryview of "
                         f"{dest.nbytes} (readonly: {dest.readonly}, contiguous: {dest.c_contiguous})")
    view = dest.cast("B") if length else dest
    return view, (ctypes.addressof(ctypes.c_char.from_buffer(view)) if length else 0)
