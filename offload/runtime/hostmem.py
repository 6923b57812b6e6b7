"""Exact-size page-locked host memory for weights: registered in place in bounded pieces,
or allocated page-locked at exactly the size asked.

PyTorch's pinned allocator (``pin_memory=True``) rounds every request up to a power of
two: 1.78-1.98 resident bytes per byte asked for, measured (FACTS.md). Weights are the
largest thing we put in host memory, so we never use it for them. Instead, as the plan's
`PinMethod` says:

- `register_host_tensor`: map exactly the pages a tensor spans (anonymous ``mmap``,
  page-aligned) and page-lock them with ``cudaHostRegister``, in pieces of at most
  `PIECE_BYTES` (one huge registration can fail and leave a sticky error).
- `alloc_host_tensor`: one ``cudaHostAlloc`` of exactly the span, for devices that cannot
  register memory in place or cannot read registered memory through the host pointer.

Registered memory can be placed on a NUMA node: the `Place` callable given to
`register_host_tensor` (`offload.runtime.numa.HostPlacer.place`) sets the mapping's
memory policy after ``mmap`` and before anything touches its pages (registering faults
them all in, on the policy's node). An allocation is placed by the driver, not here.

Either memory is what zero-copy device views read. Registered pages are unregistered by
`HostAllocation.release`; an allocation, and any memory whose last tensor died
unreleased, is given back by the next `drain_retired` (never inside a CUDA graph
capture). Nothing here decides whether or how to pin: `CudaRuntime` calls it as the plan
says, with the CUDA calls injected (so tests can fail them).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "PIECE_BYTES",
    "Alloc",
    "Free",
    "HostAllocation",
    "HostRegisterError",
    "Place",
    "Register",
    "Unregister",
    "Layout",
    "alloc_host_block",
    "alloc_host_tensor",
    "block_bytes",
    "drain_retired",
    "pageable_block",
    "register_host_block",
    "register_host_tensor",
    "retired_count",
    "span_bytes",
]

#: The largest range registered in one cudaHostRegister call, in bytes. Large enough that
#: almost every weight is one registration, small enough to stay clear of the sizes where
#: one call is known to fail. Copies are cut at piece ends (`offload.runtime.copies`).
PIECE_BYTES = 2 << 30

#: ``(pointer, nbytes) -> cudaError`` (0 for success): ``cudaHostRegister`` with flags 0.
Register = Callable[[int, int], int]
#: ``pointer -> cudaError``: ``cudaHostUnregister``.
Unregister = Callable[[int], int]
#: ``nbytes -> (cudaError, pointer)``: ``cudaHostAlloc``, portable and mapped.
Alloc = Callable[[int], tuple[int, int]]
#: ``pointer -> cudaError``: ``cudaFreeHost``.
Free = Callable[[int], int]
#: ``(address, nbytes) -> placed``: sets the NUMA policy of a fresh, untouched, page-aligned
#: mapping; never raises (it logs and returns False when the memory stays unplaced).
Place = Callable[[int, int], bool]
#: Gives memory back; returns the CUDA errors of the calls that failed, if any.
Release = Callable[[], list[int]]


class HostRegisterError(RuntimeError):
    """cudaHostRegister or cudaHostAlloc refused; nothing stays registered or allocated."""


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the first to the last element of a strided tensor (0 when empty)."""
    if math.prod(shape) == 0:
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1) * itemsize


@attrs.frozen
class HostAllocation:
    """A host tensor over page-locked memory taken for it, and the way to give it back.

    Attributes:
        tensor: the host tensor (shape, strides and dtype as asked).
        pieces: (pointer, bytes) of each range registered separately, in address order;
            empty for one allocation (a copy from it never needs cutting).
        reserved_bytes: host bytes taken: the span rounded up to whole pages.
        in_place: True for registered pages (they stay readable, as pageable memory, once
            unregistered); False for an allocation, which must not be freed while any
            tensor may still read it.
        finalizer: retires the memory when the last tensor over it dies without
            `release` (see `drain_retired`).
        numa_placed: the mapping's memory policy was set before its first touch (by the
            `Place` given to `register_host_tensor`); False when none was asked or it failed.
        members: for a block (`register_host_block`, `alloc_host_block`), the tensors it
            holds back to back, each over its own storage; `tensor` is then a flat
            ``uint8`` view of the whole block. Empty for a single tensor.
    """

    tensor: torch.Tensor
    pieces: tuple[tuple[int, int], ...]
    reserved_bytes: int
    in_place: bool
    finalizer: weakref.finalize[Any, Any]
    numa_placed: bool = False
    members: tuple[torch.Tensor, ...] = ()

    def release(self) -> list[int]:
        """Give the memory back as soon as that is safe. Registered pages are unregistered
        now (last piece first) and the finalizer cancelled; an allocation is left to the
        finalizer, so it is freed by the first `drain_retired` after the last tensor over
        it died (freeing it now could leave someone's tensor reading freed memory). Later
        calls do nothing.

        Returns:
            The CUDA errors of the calls made now that failed, if any.
        """
        if not self.in_place:
            return []
        detached = self.finalizer.detach()
        if detached is None:
            return []  # already released or retired
        release: Release = detached[2][0]
        return release()


# Memory whose last tensor died without an explicit release: it stays mapped or allocated
# (each entry's closure holds what it needs) until `drain_retired` gives it back, which
# must not happen inside a CUDA graph capture, where a finalizer may run (gc) but CUDA
# calls of this kind are not allowed.
_retired: list[Release] = []
_retired_lock = threading.Lock()


def _retire(release: Release) -> None:
    with _retired_lock:
        _retired.append(release)


def drain_retired() -> list[int]:
    """Give back the memory of host tensors that died without being released. Call
    outside CUDA graph capture. Returns the CUDA errors, if any."""
    with _retired_lock:
        pending = list(_retired)
        _retired.clear()
    return [status for release in pending for status in release()]


def retired_count() -> int:
    """How many allocations or registrations wait for `drain_retired`."""
    with _retired_lock:
        return len(_retired)


def _unregister_pieces(unregister: Unregister, pieces: tuple[tuple[int, int], ...], mapping: mmap.mmap) -> Release:
    """Unregisters `pieces`, last first. The closure holds `mapping`, so a registration
    never outlives its memory (a stale one makes later registrations there fail)."""

    def release() -> list[int]:
        _ = mapping
        return [status for pointer, _ in reversed(pieces) if (status := unregister(pointer)) != 0]

    return release


def _free_pointer(free: Free, pointer: int) -> Release:
    def release() -> list[int]:
        status = free(pointer)
        return [status] if status != 0 else []

    return release


def _over(buffer: memoryview, nbytes: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
          *, pieces: tuple[tuple[int, int], ...], reserved: int, in_place: bool, release: Release,
          numa_placed: bool = False) -> HostAllocation:
    """The tensor of `shape`, `stride` and `dtype` over `buffer`'s first `nbytes` (an empty
    one still holds the buffer), with a finalizer that retires `release` when the last
    tensor over `buffer` dies: tensors hold the buffer, so the memory is valid until then."""
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1))  # storage: the span, not the pages
    tensor = torch.as_strided(flat[:nbytes].view(dtype), shape, stride)
    finalizer = weakref.finalize(buffer, _retire, release)
    finalizer.atexit = False
    return HostAllocation(tensor=tensor, pieces=pieces, reserved_bytes=reserved, in_place=in_place,
                          finalizer=finalizer, numa_placed=numa_placed)


#: (shape, stride, dtype) of one tensor of a block.
Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def block_bytes(layouts: Sequence[Layout]) -> list[int]:
    """The span in bytes of each tensor of a block (they lie back to back)."""
    return [span_bytes(shape, stride, torch.empty((), dtype=dtype).element_size()) for shape, stride, dtype in layouts]


def _block_over(buffer: memoryview, layouts: Sequence[Layout], sizes: Sequence[int], *,
                pieces: tuple[tuple[int, int], ...], reserved: int, in_place: bool, release: Release | None,
                numa_placed: bool = False) -> HostAllocation:
    """The tensors of `layouts` back to back over `buffer`, each over a storage of its own
    (so that nothing sees them as views of one tensor: a state dict of them saves each
    alone), and a flat ``uint8`` view of them all; with `_over`'s finalizer (none that
    does anything when `release` is None: the memory is the buffer's, gone with it)."""
    total = sum(sizes)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=max(total, 1))[:total]
    members: list[torch.Tensor] = []
    offset = 0
    for (shape, stride, dtype), nbytes in zip(layouts, sizes, strict=True):
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1), offset=offset)[:nbytes]
        members.append(torch.as_strided(raw.view(dtype), shape, stride))
        offset += nbytes
    finalizer = weakref.finalize(buffer, _retire, release) if release is not None else weakref.finalize(buffer, _keep)
    finalizer.atexit = False
    return HostAllocation(tensor=flat, pieces=pieces, reserved_bytes=reserved, in_place=in_place,
                          finalizer=finalizer, numa_placed=numa_placed, members=tuple(members))


def _register_pages(nbytes: int, *, register: Register, unregister: Unregister, piece_bytes: int,
                    place: Place | None) -> tuple[memoryview, tuple[tuple[int, int], ...], int, Release, bool]:
    """Map the pages `nbytes` span and register them in pieces: (buffer, pieces, pages
    mapped, release, placed on the NUMA node).

    Raises:
        HostRegisterError: a registration failed; nothing stays registered.
    """
    pages = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    mapping = mmap.mmap(-1, pages)
    buffer = memoryview(mapping)
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    # Before anything writes a page: registering faults every page in, where the policy says.
    placed = place(base, pages) if place is not None else False
    done: list[tuple[int, int]] = []
    for offset in range(0, nbytes, piece_bytes):
        length = min(piece_bytes, nbytes - offset)
        status = register(base + offset, length)
        if status != 0:
            for pointer, _ in reversed(done):
                unregister(pointer)
            raise HostRegisterError(
                f"cudaHostRegister of {length} bytes at offset {offset} of {nbytes} failed with cudaError {status}"
            )
        done.append((base + offset, length))
    pieces = tuple(done)
    return buffer, pieces, pages, _unregister_pieces(unregister, pieces, mapping), placed


def register_host_tensor(
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    *,
    register: Register,
    unregister: Unregister,
    piece_bytes: int = PIECE_BYTES,
    place: Place | None = None,
) -> HostAllocation:
    """An uninitialised host tensor of exactly the pages it spans, page-locked in place.

    Args:
        shape, stride: in elements; the tensor keeps them.
        dtype: its dtype.
        register, unregister: the CUDA runtime calls (injected, so tests can fail them).
        piece_bytes: the largest range registered at once.
        place: sets the fresh mapping's NUMA policy before registration touches its
            pages (`offload.runtime.numa.HostPlacer.place`); None leaves the pages to the
            first-touch default.

    Raises:
        HostRegisterError: a registration failed; nothing stays registered.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = span_bytes(shape, stride, itemsize)
    buffer, pieces, pages, release, placed = _register_pages(nbytes, register=register, unregister=unregister,
                                                             piece_bytes=piece_bytes, place=place)
    return _over(buffer, nbytes, shape, stride, dtype, pieces=pieces, reserved=pages, in_place=True,
                 release=release, numa_placed=placed)


def register_host_block(
    layouts: Sequence[Layout],
    *,
    register: Register,
    unregister: Unregister,
    piece_bytes: int = PIECE_BYTES,
    place: Place | None = None,
) -> HostAllocation:
    """Uninitialised host tensors of `layouts`, back to back in one mapping of exactly the
    pages they span, page-locked in place (as `register_host_tensor`); see
    `HostAllocation.members`. Giving the block back is all or nothing.

    Raises:
        HostRegisterError: a registration failed; nothing stays registered.
    """
    sizes = block_bytes(layouts)
    buffer, pieces, pages, release, placed = _register_pages(sum(sizes), register=register, unregister=unregister,
                                                             piece_bytes=piece_bytes, place=place)
    return _block_over(buffer, layouts, sizes, pieces=pieces, reserved=pages, in_place=True, release=release,
                       numa_placed=placed)


def _alloc_pinned(nbytes: int, *, alloc: Alloc, free: Free) -> tuple[memoryview, int, Release]:
    """One page-locked allocation of `nbytes` (at least 1): (buffer, bytes reserved, release).

    Raises:
        HostRegisterError: the allocation failed; nothing was taken.
    """
    size = max(nbytes, 1)
    status, pointer = alloc(size)
    if status != 0 or pointer == 0:
        raise HostRegisterError(f"cudaHostAlloc of {size} bytes failed with cudaError {status}")
    buffer = memoryview((ctypes.c_ubyte * size).from_address(pointer)).cast("B")
    reserved = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    return buffer, reserved, _free_pointer(free, pointer)


def alloc_host_tensor(
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    *,
    alloc: Alloc,
    free: Free,
) -> HostAllocation:
    """An uninitialised host tensor in one page-locked allocation of exactly its span.

    Args:
        shape, stride: in elements; the tensor keeps them.
        dtype: its dtype.
        alloc, free: the CUDA runtime calls (injected, so tests can fail them); `alloc`
            may raise `HostRegisterError` itself (say, when cudaHostAlloc cannot be found).

    Raises:
        HostRegisterError: the allocation failed; nothing was taken.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = span_bytes(shape, stride, itemsize)
    buffer, reserved, release = _alloc_pinned(nbytes, alloc=alloc, free=free)
    return _over(buffer, nbytes, shape, stride, dtype, pieces=(), reserved=reserved, in_place=False,
                 release=release)


def alloc_host_block(layouts: Sequence[Layout], *, alloc: Alloc, free: Free) -> HostAllocation:
    """Uninitialised host tensors of `layouts`, back to back in one page-locked allocation
    of exactly their bytes (as `alloc_host_tensor`); see `HostAllocation.members`.

    Raises:
        HostRegisterError: the allocation failed; nothing was taken.
    """
    sizes = block_bytes(layouts)
    buffer, reserved, release = _alloc_pinned(sum(sizes), alloc=alloc, free=free)
    return _block_over(buffer, layouts, sizes, pieces=(), reserved=reserved, in_place=False, release=release)


def pageable_block(layouts: Sequence[Layout]) -> HostAllocation:
    """Uninitialised pageable host tensors of `layouts`, back to back in one anonymous
    mapping (page-aligned, so every member keeps the alignment of its offset); see
    `HostAllocation.members`. Nothing is locked; the mapping goes when its last tensor dies."""
    sizes = block_bytes(layouts)
    pages = max(mmap.PAGESIZE, -(-sum(sizes) // mmap.PAGESIZE) * mmap.PAGESIZE)
    return _block_over(memoryview(mmap.mmap(-1, pages)), layouts, sizes, pieces=(), reserved=pages,
                       in_place=False, release=None)


def _keep() -> None:
    """Nothing to give back (see `pageable_block`)."""
