"""Shared-memory segments: the one host copy of a host's offloaded weights, mapped by
every member of the sharing group on that host.

Why POSIX shared memory by name (a file in ``/dev/shm``, ``os.open`` and ``mmap``) and
not a memfd: the members are independent processes (started by torchrun or an engine's
launcher) that share nothing but a torch.distributed store. A name travels through the
store as a string; a memfd would have to be passed over a Unix socket with SCM_RIGHTS,
with a listener on the leader and a socket path to agree on: one more thing to hang or
leak. What a name costs is the window in which it exists, and that is kept short and
empty:

- the leader creates the file sparse (``ftruncate``: no pages) and publishes its name;
  every member maps it; the leader unlinks the name as soon as they all have (or any
  failed). From then on a crash of any process leaves nothing in ``/dev/shm``: the
  memory lives exactly as long as some process maps it;
- only after the unlink does the leader reserve the pages (``posix_fallocate``), so a
  crash inside the window leaves a name holding no memory, and a ``/dev/shm`` too small
  for the copy is an error at reservation (ENOSPC), never a SIGBUS at a first touch.

Followers open the file ``O_RDONLY`` and map it ``MAP_SHARED`` with ``PROT_READ``: the
kernel refuses any write, so no follower can change what the others read (a write
through a follower's tensor is a fault in that process), and CUDA can page-lock the
range with ``cudaHostRegisterReadOnly`` without copy-on-write. ``torch.frombuffer`` warns
that such a buffer is not writable; the warning is expected here and silenced.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
import warnings
from typing import final

import torch

from offload.errors import ExecutionError
from offload.logs import logger
from offload.pure.units import format_bytes

__all__ = [
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "SegmentMapping",
    "check_room",
    "create_segment",
    "leftover_segments",
    "new_segment_name",
    "open_segment",
    "reserve_segment",
    "shm_free_bytes",
    "shm_identity",
    "unlink_segment",
]

log = logger("offload.sharing")

#: Every segment's name starts with this (``offload-<32 hex digits>``), so that one left
#: behind is recognisable.
SEGMENT_PREFIX = "offload-"

#: Where Linux keeps POSIX shared memory (what ``shm_open`` uses).
SHM_DIR = "/dev/shm"

_NOT_WRITABLE = "The given buffer is not writable"


def new_segment_name() -> str:
    """A fresh segment name: `SEGMENT_PREFIX` and a random UUID."""
    return f"{SEGMENT_PREFIX}{uuid.uuid4().hex}"


@final
class SegmentMapping:
    """One process's mapping of a segment, and tensors over it.

    Tensors hold the mapping (``torch.frombuffer`` keeps the mmap object alive), so the
    memory stays mapped while any of them lives, whatever happens to this object; it is
    never unmapped by hand (that would leave them pointing at nothing).

    Args:
        name: the segment's name (for messages; it may be unlinked already).
        mapped: the ``mmap`` of the whole segment.
        writable: mapped ``PROT_READ | PROT_WRITE`` (the leader) or ``PROT_READ`` only.
    """

    def __init__(self, name: str, mapped: mmap.mmap, *, writable: bool) -> None:
        self.name = name
        self.nbytes = len(mapped)
        self.writable = writable
        self._mm: mmap.mmap | None = mapped
        self.base = self._frombuffer(mapped, 0, 1).data_ptr()

    @staticmethod
    def _frombuffer(mapped: mmap.mmap, offset: int, count: int) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_WRITABLE)
            return torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=offset)

    def view(self, offset: int, nbytes: int, shape: tuple[int, ...], stride: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape`, `stride` and `dtype` over bytes ``[offset, offset + nbytes)``
        (its own storage of exactly those bytes, as an exact-size host copy has).

        Raises:
            ExecutionError: the mapping was dropped, or the range is outside it.
        """
        mapped = self._mm
        if mapped is None:
            raise ExecutionError(f"segment {self.name} is no longer held by this process", name="segment",
                                 value=self.name)
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.nbytes:
            raise ExecutionError(f"bytes [{offset}, {offset + nbytes}) are outside segment {self.name} of "
                                 f"{self.nbytes} bytes", name="segment", value=(offset, nbytes))
        flat = self._frombuffer(mapped, offset, nbytes)
        return torch.as_strided(flat.view(dtype), shape, stride)

    def contains(self, tensor: torch.Tensor) -> bool:
        """True when `tensor`'s data lies in this mapping."""
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        return self.base <= tensor.data_ptr() < self.base + self.nbytes

    def drop(self) -> None:
        """Stop holding the mapping (tensors over it keep it mapped until they die)."""
        self._mm = None


def shm_identity(shm_dir: str = SHM_DIR) -> str:
    """The identity of the file system at `shm_dir` (its device number): processes that
    see the same one can map each other's segments. ``"none"`` when it cannot be read."""
    try:
        return str(os.stat(shm_dir).st_dev)
    except OSError as exc:
        log.debug("cannot stat %s: %s", shm_dir, exc)
        return "none"


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int | None:
    """Bytes free for an unprivileged process at `shm_dir`, or None when unreadable."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_room(need: int, free: int | None, shm_dir: str = SHM_DIR) -> None:
    """Refuse a segment of `need` bytes where only `free` are (None: not known, allowed).

    Raises:
        ExecutionError: naming both sizes and what to do.
    """
    if free is not None and need > free:
        raise ExecutionError(
            f"the shared host copy needs {format_bytes(need)} in {shm_dir}, which has {format_bytes(free)} free "
            "(containers often get 64 MiB: run with a larger shared-memory size, e.g. docker --shm-size)",
            name="shm_free", value=(need, free))


def create_segment(nbytes: int, shm_dir: str = SHM_DIR) -> tuple[SegmentMapping, int]:
    """A new, sparse segment of `nbytes` bytes mapped read-write, and its open descriptor
    (for `reserve_segment`; the caller closes it).

    Raises:
        ExecutionError: the file could not be created, sized or mapped (nothing is left).
    """
    name = new_segment_name()
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ExecutionError(f"cannot create shared memory {path}: {exc}", name="segment", value=path) from exc
    try:
        os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        unlink_segment(name, shm_dir)
        raise ExecutionError(f"cannot size or map shared memory {path} ({nbytes} bytes): {exc}", name="segment",
                             value=path) from exc
    return SegmentMapping(name, mapped, writable=True), fd


def reserve_segment(fd: int, nbytes: int, shm_dir: str = SHM_DIR) -> None:
    """Allocate every page of the segment behind `fd` now, so that a full `shm_dir` is an
    error here and never a SIGBUS at a later first touch.

    Raises:
        ExecutionError: the file system has no room (ENOSPC) or refused.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        free = shm_free_bytes(shm_dir)
        room = f"; {format_bytes(free)} free there" if free is not None else ""
        what = "not enough room" if exc.errno == errno.ENOSPC else str(exc)
        raise ExecutionError(f"cannot reserve {format_bytes(nbytes)} of shared memory in {shm_dir}: {what}{room} "
                             "(containers often get 64 MiB: run with a larger shared-memory size, e.g. docker "
                             "--shm-size)", name="shm_free", value=(nbytes, free)) from exc


def open_segment(name: str, nbytes: int, shm_dir: str = SHM_DIR) -> SegmentMapping:
    """Map segment `name` read-only (``O_RDONLY``, ``PROT_READ``, ``MAP_SHARED``).

    Raises:
        ExecutionError: it is not there (another host, or another ``/dev/shm``: a
            container with its own IPC namespace), has another size, or cannot be mapped.
    """
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ExecutionError(
            f"cannot open the shared host copy {path}: {exc} (members found on one host must see the same "
            f"{shm_dir}: one IPC namespace)", name="segment", value=path) from exc
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ExecutionError(f"the shared host copy {path} has {size} bytes, the layout {nbytes}",
                                 name="segment", value=size)
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except OSError as exc:
        raise ExecutionError(f"cannot map the shared host copy {path}: {exc}", name="segment", value=path) from exc
    finally:
        os.close(fd)
    return SegmentMapping(name, mapped, writable=False)


def unlink_segment(name: str, shm_dir: str = SHM_DIR) -> bool:
    """Remove the name (mappings stay valid). Returns False when it was not there."""
    try:
        os.unlink(os.path.join(shm_dir, name))
    except FileNotFoundError:
        return False
    return True


def leftover_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """The names of segments of ours in `shm_dir` (`SEGMENT_PREFIX`), sorted."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX))
    except OSError:
        return []
