"""Exact-size page-locked host memory for weights, registered in place in bounded pieces.

PyTorch's pinned allocator (``pin_memory=True``) rounds every request up to a power of
two: 1.78-1.98 resident bytes per byte asked for, measured (FACTS.md). Weights are the
largest thing we put in host memory, so we never use it for them. Instead we map exactly
the pages a tensor spans (anonymous ``mmap``, page-aligned) and page-lock them with
``cudaHostRegister``, in pieces of at most `PIECE_BYTES` (one huge registration can fail
and leave a sticky error). Registered memory is what zero-copy device views read.

Nothing here decides whether to pin: `CudaRuntime` calls it when the plan says so.
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

__all__ = [
    "PIECE_BYTES",
    "HostRegisterError",
    "RegisteredHost",
    "drain_retired",
    "register_host_tensor",
    "retired_count",
    "span_bytes",
]

#: The largest range registered in one cudaHostRegister call, in bytes. Large enough that
#: almost every weight is one registration (a copy spanning two may be treated as
#: pageable), small enough to stay clear of the sizes where one call is known to fail.
PIECE_BYTES = 2 << 30

#: ``(pointer, nbytes) -> cudaError`` (0 for success): ``cudaHostRegister`` with flags 0.
Register = Callable[[int, int], int]
#: ``pointer -> cudaError``: ``cudaHostUnregister``.
Unregister = Callable[[int], int]


class HostRegisterError(RuntimeError):
    """cudaHostRegister refused a piece; every piece registered before it was undone."""


def span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the first to the last element of a strided tensor (0 when empty)."""
    if math.prod(shape) == 0:
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1) * itemsize


@attrs.frozen
class RegisteredHost:
    """A host tensor over mapped pages and the pieces registered for it.

    Attributes:
        tensor: the host tensor (shape, strides and dtype as asked).
        pieces: (pointer, bytes) of each registered range, to unregister.
        mapping: the anonymous mapping the tensor lives in; kept alive with it.
        finalizer: retires the registration when the last tensor over the memory dies
            without `unregister_now` (see `drain_retired`).
    """

    tensor: torch.Tensor
    pieces: tuple[tuple[int, int], ...]
    mapping: mmap.mmap
    finalizer: weakref.finalize[Any, Any]

    def unregister_now(self, unregister: Unregister) -> list[int]:
        """Unregister every piece (last first) and cancel the finalizer; the CUDA errors of
        pieces that failed, if any."""
        if self.finalizer.detach() is None:
            return []  # already retired
        return [status for pointer, _ in reversed(self.pieces) if (status := unregister(pointer)) != 0]


# Registrations whose memory's last tensor died without an explicit release: the memory
# stays mapped (the entry holds the mapping) until `drain_retired` unregisters it, which
# must not happen inside a CUDA graph capture, where a finalizer may run (gc) but CUDA
# calls of this kind are not allowed.
_retired: list[tuple[Unregister, tuple[tuple[int, int], ...], mmap.mmap]] = []
_retired_lock = threading.Lock()


def _retire(unregister: Unregister, pieces: tuple[tuple[int, int], ...], mapping: mmap.mmap) -> None:
    with _retired_lock:
        _retired.append((unregister, pieces, mapping))


def drain_retired() -> list[int]:
    """Unregister the memory of host tensors that died without being released, then let
    it be unmapped. Call outside CUDA graph capture. Returns the CUDA errors, if any."""
    with _retired_lock:
        pending = list(_retired)
        _retired.clear()
    return [status for unregister, pieces, _ in pending for pointer, _ in reversed(pieces)
            if (status := unregister(pointer)) != 0]


def retired_count() -> int:
    """How many registrations wait for `drain_retired`."""
    with _retired_lock:
        return len(_retired)


def register_host_tensor(
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    *,
    register: Register,
    unregister: Unregister,
    piece_bytes: int = PIECE_BYTES,
) -> RegisteredHost:
    """An uninitialised host tensor of exactly the pages it spans, page-locked in place.

    Args:
        shape, stride: in elements; the tensor keeps them.
        dtype: its dtype.
        register, unregister: the CUDA runtime calls (injected, so tests can fail them).
        piece_bytes: the largest range registered at once.

    Raises:
        HostRegisterError: a registration failed; nothing stays registered.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = span_bytes(shape, stride, itemsize)
    pages = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    mapping = mmap.mmap(-1, pages)
    # Tensors over the memory keep this memoryview alive, so its finalizer runs exactly
    # when the last of them dies, while the mapping is still mapped: registration never
    # outlives the memory (a stale registration makes later ones at that address fail).
    buffer = memoryview(mapping)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1))
    base = flat.data_ptr()
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
    typed = flat[:nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)
    tensor = torch.as_strided(typed, shape, stride) if nbytes else torch.empty_strided(shape, stride, dtype=dtype)
    pieces = tuple(done)
    finalizer = weakref.finalize(buffer, _retire, unregister, pieces, mapping)
    finalizer.atexit = False
    return RegisteredHost(tensor=tensor, pieces=pieces, mapping=mapping, finalizer=finalizer)
