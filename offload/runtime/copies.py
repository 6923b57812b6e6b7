"""Host-to-device copies as flat byte ranges, cut where host registrations end.

``dst.copy_(src)`` between tensors whose strides leave gaps (a weight that is a slice of
a larger one) makes PyTorch stage the copy through contiguous temporaries: on CUDA the
host side of that is a pageable tensor, so the copy is slow and cannot be captured in a
CUDA graph. Our host copies and device buffers have the same shape and strides, so the
same bytes can be copied instead: the whole span from the first element to the last,
gaps included, in one memcpy.

A host copy larger than one registration piece (`hostmem.PIECE_BYTES`) lies in several
registered ranges; a single memcpy across their boundary may be treated as pageable by
the driver. So a span is copied in one chunk per registered range.

Nothing here touches CUDA: the functions build views; the runtime issues the copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offload.runtime.hostmem import span_bytes

__all__ = ["byte_span", "is_dense", "span_chunks"]


def byte_span(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of `tensor`'s bytes, from its first element to its last (the
    gaps between elements included); empty for an empty tensor."""
    itemsize = tensor.element_size()
    nbytes = span_bytes(tuple(tensor.shape), tuple(tensor.stride()), itemsize)
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    if nbytes == 0:
        return flat
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset() * itemsize, (nbytes,), (1,))


def is_dense(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s elements fill its span exactly once: no gaps, no overlap
    (contiguous, or a permutation of contiguous such as a transpose)."""
    if tensor.is_contiguous():
        return True
    itemsize = tensor.element_size()
    return span_bytes(tuple(tensor.shape), tuple(tensor.stride()), itemsize) == tensor.numel() * itemsize


def span_chunks(
    dst: torch.Tensor, src: torch.Tensor, pieces: Sequence[tuple[int, int]] = ()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination, source) pairs that copy `src` into `dst`, as few and as flat as
    possible.

    When both have the same shape, strides and dtype, and `src` is not dense or lies in
    more than one of `pieces`, the pairs are flat byte views of the two spans, cut at the
    ends of the pieces; otherwise the one pair ``(dst, src)`` (PyTorch copies a dense
    tensor in one memcpy, and converts anything else element by element).

    Args:
        dst: the destination, e.g. a static device buffer.
        src: the source, e.g. a host copy.
        pieces: (address, bytes) of each range `src`'s memory is registered in, in any
            order; empty when it is not registered or is one allocation.

    Returns:
        The pairs, in address order; copying each ``d.copy_(s)`` copies `src` into `dst`.
    """
    if not pieces and src.is_contiguous():
        return [(dst, src)]  # the common case, answered first: it is on every copy's path
    same = dst.shape == src.shape and dst.stride() == src.stride() and dst.dtype == src.dtype
    if not same or src.numel() == 0:
        return [(dst, src)]
    start = src.data_ptr()
    nbytes = span_bytes(tuple(src.shape), tuple(src.stride()), src.element_size())
    cuts = sorted({end for address, length in pieces if 0 < (end := address + length - start) < nbytes})
    if not cuts and is_dense(src):
        return [(dst, src)]
    flat_dst, flat_src = byte_span(dst), byte_span(src)
    bounds = [0, *cuts, nbytes]
    return [(flat_dst[lo:hi], flat_src[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
