"""A spill file: where the disk tier keeps weights that are not in a checkpoint as the model
holds them (converted at load, fused, quantised, or from a model that came from no
checkpoint), or new weights given to disk-tier layers, written once and read many times;
and `FileMap`, the private mappings through which the disk tier's host copies see a file.

The file is unlinked as soon as it is open, so nothing is left behind whatever happens to
the process (a crash, a kill): its blocks are freed when its last fd closes and its last
mapping goes. Two fds are kept: one to write through, one to read with ``O_DIRECT``
(`offload.runtime.diskio`) where the filesystem takes it. Each tensor starts on a block
boundary, so that a read into a buffer aligned like the file goes straight in.

One fd per file, few mappings: ``mmap.mmap(fd, ...)`` duplicates `fd` and keeps the
duplicate for the mapping's life (CPython's mmap module; ``trackfd=False`` only came in
Python 3.13), so a mapping per tensor held an fd per tensor, and a checkpoint stored one
tensor per expert would pass ``ulimit -n`` (and, mapping by mapping, ``vm.max_map_count``).
`FileMap` maps with ``mmap(2)`` itself (through ctypes), which keeps no fd (the mapping
holds the file), in few large mappings: a checkpoint file whole, a spill file in segments
that double (it grows as it is appended to, after planning too). Each tensor handed out
is a view with a storage of its own (its own data pointer and size: the executors tell
host copies apart by storage) over its bytes in one mapping, and keeps that mapping
alive; a mapping goes with the last of them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import final

import torch

from offload.errors import ExecutionError
from offload.logs import logger

__all__ = ["FileMap", "SpillFile", "read_exact"]

log = logger("offload.disk")

#: Where each tensor starts: a multiple of this many bytes (the ``O_DIRECT`` block).
ALIGN_BYTES = 4096

#: The smallest segment a spill file is mapped in, in bytes; each new segment is at least
#: as long as the file before it, so the segments double.
SEGMENT_BYTES = 256 << 20


def _span(tensor: torch.Tensor) -> memoryview:
    """The bytes `tensor`'s elements span in its storage (a strided view's whole span, as
    its host copy holds it), as a read-only byte view; a CPU tensor."""
    storage = tensor.untyped_storage()
    first = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return memoryview(b"")
    last = sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True))
    nbytes = (last + 1) * tensor.element_size()
    data = torch.empty(0, dtype=torch.uint8).set_(storage, first, (nbytes,), (1,))
    view: memoryview = data.numpy().data
    return view.cast("B")


def read_exact(fd: int, dest: torch.Tensor, offset: int) -> None:
    """Fill `dest` (a contiguous host tensor) with its bytes' worth of the file open as
    `fd`, from `offset`, read with ``pread`` (not through a mapping) without readahead,
    then ask the page cache to let go of them, whole pages (best effort: they were read
    once; the kernel keeps a page the range covers only in part, so the range is rounded
    out to pages).

    Raises:
        OSError: the read failed, or the file ended first (saying after how many bytes).
    """
    view: memoryview = dest.reshape(-1).view(torch.uint8).numpy().data
    view = view.cast("B")
    length, done = len(view), 0
    if not length:
        return
    _advise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is asked (it would stay cached)
    try:
        while done < length:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"end of file after {done} of {length} bytes")
            done += got
    finally:
        _advise(fd, 0, 0, os.POSIX_FADV_NORMAL)  # the fd may be mapped too: faults there read ahead as usual
        first = offset - offset % mmap.PAGESIZE
        _advise(fd, first, -(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE - first, os.POSIX_FADV_DONTNEED)


def _advise(fd: int, offset: int, length: int, advice: int) -> None:
    """``posix_fadvise``, best effort (advice only)."""
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except OSError:
        pass


class _Libc:
    """``mmap``, ``munmap`` and ``madvise`` of the C library, through ctypes (loaded on first use)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mmap = lib.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64)
        self.munmap = lib.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.madvise = lib.madvise
        self.madvise.restype = ctypes.c_int
        self.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@functools.cache
def _libc() -> _Libc:
    return _Libc()


#: What ``mmap(2)`` returns when it fails.
_MAP_FAILED = ctypes.c_void_p(-1).value


def _unmap(address: int, length: int) -> None:
    _libc().munmap(address, length)


@final
class _Region:
    """One private mapping of file bytes [`start`, `end`) (page-aligned `start`), made with
    ``mmap(2)``: no fd is kept. It is unmapped when it and every view into it are gone (each
    view's finalizer holds it)."""

    __slots__ = ("__weakref__", "_live", "address", "end", "start")

    def __init__(self, fd: int, start: int, end: int) -> None:
        address = _libc().mmap(None, end - start, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
        if address is None or address == _MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self.address, self.start, self.end = int(address), start, end
        self._live: dict[tuple[int, int], int] = {}  # (file offset, length) -> views of it alive
        # Not at exit: the process's end unmaps everything, and a tensor still alive then
        # must not point at memory unmapped before it.
        weakref.finalize(self, _unmap, self.address, end - start).atexit = False

    def view(self, offset: int, length: int) -> torch.Tensor:
        """File bytes [`offset`, `offset + length`) (inside this mapping) as a ``uint8``
        tensor with a storage of its own, which keeps the mapping."""
        address = self.address + offset - self.start
        pages = (ctypes.c_ubyte * length).from_address(address)
        key = (offset, length)
        self._live[key] = self._live.get(key, 0) + 1
        weakref.finalize(pages, self._gone, key, address, length).atexit = False  # holds the mapping till then
        return torch.frombuffer(pages, dtype=torch.uint8)

    def _gone(self, key: tuple[int, int], address: int, length: int) -> None:
        """A view died. When it was the last of its bytes, the pages wholly inside them go
        back (``MADV_DONTNEED``): a page it wrote (copied on write) is host memory that
        nothing can read any more; the next access would read the file again. Views are of
        one tensor's bytes each, and tensors do not overlap in their file (safetensors
        refuses it; a spill file appends), so no other view sees those pages."""
        left = self._live.get(key, 1) - 1
        if left:
            self._live[key] = left
            return
        self._live.pop(key, None)
        first = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (address + length) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            _libc().madvise(first, last - first, mmap.MADV_DONTNEED)  # best effort: it only gives memory back


@final
class FileMap:
    """Private mappings of one file open as `fd` (see the module docstring): the caller
    keeps `fd` open while it makes views, and may close it after (the mappings hold the
    file).

    A view reads the file (through the page cache) and takes no host memory until read; a
    write goes to a private copy of the page and never to the file. The file stays mapped
    as long as any view lives (an unlinked file's blocks with it).

    Args:
        fd: the open file (read-only is enough).
        name: the file, for messages.
    """

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self.name = name
        self._regions: list[weakref.ref[_Region]] = []

    @property
    def mappings(self) -> int:
        """Mappings made here that are still alive."""
        return sum(1 for ref in self._regions if ref() is not None)

    def view(self, offset: int, length: int, *, covering: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """`length` bytes of the file from `offset`, as a host ``uint8`` tensor over a
        private mapping (one already made, when it covers them; else a new one that covers
        them and `covering`).

        Args:
            offset: the file offset of the first byte.
            length: bytes; 0 gives an empty tensor (nothing mapped).
            covering: file bytes [start, end) a new mapping covers too: the whole file, or
                a segment of it (bytes past the file's end are never read through a view).

        Raises:
            ExecutionError: the file cannot be mapped (the message says why).
        """
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        end = offset + length
        for ref in self._regions:
            region = ref()
            if region is not None and region.start <= offset and end <= region.end:
                return region.view(offset, length)
        low = min(offset, covering[0]) if covering[1] > covering[0] else offset
        start = low - low % mmap.PAGESIZE
        stop = -(-max(end, covering[1]) // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            region = _Region(self._fd, start, stop)
        except (OSError, ValueError) as exc:
            raise ExecutionError(f"mapping {stop - start} bytes at offset {start} of {self.name} failed: {exc}",
                                 name="offset", value=offset) from exc
        self._regions = [ref for ref in self._regions if ref() is not None] + [weakref.ref(region)]
        return region.view(offset, length)


@final
class SpillFile:
    """A spill file in `directory`, unlinked once open (see the module docstring).

    Args:
        directory: where to make it (a filesystem with room for the disk tier's spilled bytes).
        pwrite: ``os.pwrite``, injectable so that tests can fail it (ENOSPC).

    Raises:
        ExecutionError: the file cannot be made (the directory is missing or read-only).
    """

    def __init__(self, directory: str | os.PathLike[str], *,
                 pwrite: Callable[[int, memoryview, int], int] = os.pwrite) -> None:
        self._pwrite = pwrite
        self._written = 0
        try:
            fd, path = tempfile.mkstemp(prefix="offload-spill-", dir=directory)
        except OSError as exc:
            raise ExecutionError(f"cannot make a spill file in {os.fspath(directory)!r}: {exc}",
                                 name="spill_dir", value=os.fspath(directory)) from exc
        try:
            try:
                reader = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                reader = os.open(path, os.O_RDONLY)  # the filesystem refuses O_DIRECT: read buffered
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.unlink(path)  # from here nothing is left behind, whatever happens
        self._fd, self._reader, self.name = fd, reader, f"spill file in {os.fspath(directory)}"
        self._map = FileMap(fd, self.name)
        log.debug("spill file opened in %s (unlinked)", os.fspath(directory))

    @property
    def read_fd(self) -> int:
        """The fd to read with (`DiskReader.submit` takes it): ``O_DIRECT`` where the
        filesystem takes it."""
        return self._reader

    @property
    def nbytes(self) -> int:
        """Bytes written so far, the padding between tensors included."""
        return self._written

    def append(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Write `tensor`'s bytes (its whole strided span, as its host copy holds it) at
        the next block boundary.

        Returns:
            (file offset, length), in bytes: where to read it back from.

        Raises:
            ExecutionError: the write failed (a full disk: ENOSPC) or came up short, or the
                spill file is closed. Nothing of `tensor` is kept (the file is cut back to
                where it ended); what was appended before stays, readable and mapped, and
                the file takes appends again (closing it, or the last mapping, frees it).
        """
        if self._fd < 0:
            raise ExecutionError(f"the {self.name} is closed", name="spill_dir", value=self.name)
        if tensor.device.type != "cpu":
            raise ExecutionError(f"a spill file takes host tensors, got one on {tensor.device}", name="device",
                                 value=str(tensor.device))
        data = _span(tensor)
        if not len(data):
            return self._written, 0
        offset = -(-self._written // ALIGN_BYTES) * ALIGN_BYTES
        done = 0
        try:
            while done < len(data):
                wrote = self._pwrite(self._fd, data[done:], offset + done)
                if wrote <= 0:
                    raise OSError(errno.EIO, "write returned nothing")
                done += wrote
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._written)  # the part written goes (nothing maps it)
            except OSError:
                pass
            raise ExecutionError(f"writing {len(data)} bytes to the {self.name} at offset {offset} failed: {exc} "
                                 "(nothing of it is kept; what was written before stays readable)",
                                 name="spill_dir", value=errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc
        self._written = offset + len(data)
        return offset, len(data)

    def map(self, offset: int, length: int) -> torch.Tensor:
        """What `append` wrote at `offset` (`length` bytes), as a `FileMap` view: in a
        segment of the file mapped already, else in a new one (at least `SEGMENT_BYTES`, and
        at least as long as the file before it).

        Raises:
            ExecutionError: the spill file is closed, or the mapping failed.
        """
        if self._fd < 0:
            raise ExecutionError(f"the {self.name} is closed", name="spill_dir", value=self.name)
        return self._map.view(offset, length, covering=(offset, offset + max(length, offset, SEGMENT_BYTES)))

    @property
    def mappings(self) -> int:
        """Segments of the file mapped now (each with views alive)."""
        return self._map.mappings

    def flush(self) -> None:
        """Write everything to the disk and drop the written pages from the page cache
        (they would otherwise count against the container's memory limit): after the last
        `append`, before reading.

        Raises:
            ExecutionError: the write-back failed, or the spill file is closed (it stays
                open: the caller decides whether to trust what it appended since the last
                flush).
        """
        if self._fd < 0:
            raise ExecutionError(f"the {self.name} is closed", name="spill_dir", value=self.name)
        try:
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise ExecutionError(f"writing the {self.name} back to disk failed: {exc} (what was appended since the "
                                 "last flush may not be on disk)", name="spill_dir",
                                 value=errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc

    def close(self) -> None:
        """Close both fds (the blocks are freed with them and the last mapping). Idempotent."""
        for fd in (self._fd, self._reader):
            if fd >= 0:
                os.close(fd)
        self._fd = self._reader = -1

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
