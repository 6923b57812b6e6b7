"""A spill file: where the disk tier keeps weights that are not in a checkpoint as the model
holds them (converted at load, fused, quantised, or from a model that came from no
checkpoint), written once and read many times.

The file is unlinked as soon as it is open, so nothing is left behind whatever happens to
the process (a crash, a kill): its blocks are freed when its last fd closes. Two fds are
kept: one to write through, one to read with ``O_DIRECT`` (`offload.runtime.diskio`) where
the filesystem takes it. Each tensor starts on a block boundary, so that a read into a
buffer aligned like the file goes straight in.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Callable
from types import TracebackType
from typing import final

import torch

from offload.errors import ExecutionError
from offload.logs import logger

__all__ = ["SpillFile", "map_file", "read_exact"]

log = logger("offload.disk")

#: Where each tensor starts: a multiple of this many bytes (the ``O_DIRECT`` block).
ALIGN_BYTES = 4096


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
    `fd`, from `offset`, read with ``pread`` (not through a mapping), then ask the page
    cache to let go of them (best effort: they were read once).

    Raises:
        OSError: the read failed, or the file ended first (saying after how many bytes).
    """
    view: memoryview = dest.reshape(-1).view(torch.uint8).numpy().data
    view = view.cast("B")
    length, done = len(view), 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"end of file after {done} of {length} bytes")
        done += got
    if length:  # (a length of 0 would mean to the end of the file)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def map_file(fd: int, offset: int, length: int) -> torch.Tensor:
    """`length` bytes of the file open as `fd`, from `offset`, as a host ``uint8`` tensor
    over a private mapping of the file: reading it reads the file (through the page
    cache); a write goes to a private copy of the page and never to the file. The mapping
    lives as long as the tensor (and keeps an unlinked file's blocks with it).

    Raises:
        ExecutionError: the file cannot be mapped (the message says why).
    """
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        region = mmap.mmap(fd, offset + length - start, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError) as exc:
        raise ExecutionError(f"mapping {length} bytes at offset {offset} of fd {fd} failed: {exc}", name="offset",
                             value=offset) from exc
    return torch.frombuffer(region, dtype=torch.uint8, count=length, offset=offset - start)


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
            ExecutionError: the write failed (a full disk: ENOSPC) or came up short; the
                spill file is closed (and was unlinked: nothing is left), and is unusable.
        """
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
            self.close()
            raise ExecutionError(f"writing {len(data)} bytes to the {self.name} at offset {offset} failed: {exc} "
                                 "(the spill file is gone; nothing is left on disk)", name="spill_dir",
                                 value=errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc
        self._written = offset + len(data)
        return offset, len(data)

    def map(self, offset: int, length: int) -> torch.Tensor:
        """What `append` wrote at `offset` (`length` bytes), as `map_file` maps it.

        Raises:
            ExecutionError: the spill file is closed, or the mapping failed.
        """
        if self._fd < 0:
            raise ExecutionError(f"the {self.name} is closed", name="spill_dir", value=self.name)
        return map_file(self._fd, offset, length)

    def flush(self) -> None:
        """Write everything to the disk and drop the written pages from the page cache
        (they would otherwise count against the container's memory limit): after the last
        `append`, before reading.

        Raises:
            ExecutionError: the write-back failed (as `append`: the spill file is gone).
        """
        try:
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            self.close()
            raise ExecutionError(f"writing the {self.name} back to disk failed: {exc} (the spill file is gone)",
                                 name="spill_dir", value=errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc

    def close(self) -> None:
        """Close both fds (the blocks are freed with the last). Idempotent."""
        for fd in (self._fd, self._reader):
            if fd >= 0:
                os.close(fd)
        self._fd = self._reader = -1

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
