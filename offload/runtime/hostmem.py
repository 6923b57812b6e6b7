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
from collections.abc import Callable

import attrs
import torch

__all__ = ["PIECE_BYTES", "HostRegisterError", "RegisteredHost", "register_host_tensor", "span_bytes"]

#: The largest range registered in one cudaHostRegister call, in bytes.
PIECE_BYTES = 1 << 30

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
    """

    tensor: torch.Tensor
    pieces: tuple[tuple[int, int], ...]
    mapping: mmap.mmap


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
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=max(nbytes, 1))
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
    return RegisteredHost(tensor=tensor, pieces=tuple(done), mapping=mapping)
