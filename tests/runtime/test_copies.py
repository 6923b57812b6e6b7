"""Span copies (offload.runtime.copies): flat byte views, cut at registration pieces."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from offload.pure import PinMethod
from offload.runtime.copies import byte_span, is_dense, span_chunks
from offload.runtime.cpu import CpuRuntime
from offload.runtime.hostmem import register_host_tensor, span_bytes
from tests.runtime.test_hostmem import FakeCudart


def gappy(rows: int = 6, cols: int = 10) -> torch.Tensor:
    """Every other column of a (rows, 2 * cols) float32 tensor: stride (2 * cols, 2)."""
    return torch.arange(rows * 2 * cols, dtype=torch.float32).reshape(rows, 2 * cols)[:, ::2]


def like(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of zeros with `tensor`'s shape, strides and dtype, in its own storage."""
    return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype).zero_()


def run(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in pairs:
        d.copy_(s)


def test_byte_span_covers_first_to_last_element_with_gaps() -> None:
    src = gappy()[1:]  # a storage offset too
    flat = byte_span(src)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numel() == ((5 - 1) * 20 + (10 - 1) * 2 + 1) * 4
    assert flat.data_ptr() == src.data_ptr()
    # Its first and last four bytes are the first and last elements.
    assert flat[:4].view(torch.float32).item() == src[0, 0].item()
    assert flat[-4:].view(torch.float32).item() == src[-1, -1].item()


def test_dense_tensors_copy_as_they_are() -> None:
    for src in (torch.randn(4, 6), torch.randn(4, 6).t(), torch.randn(2, 3, 4).permute(2, 0, 1)):
        dst = like(src)
        assert is_dense(src)
        [(d, s)] = span_chunks(dst, src)
        assert d is dst and s is src


def test_a_gappy_tensor_copies_as_one_flat_span_and_arrives_equal() -> None:
    src = gappy()
    dst = like(src)
    assert not is_dense(src)
    pairs = span_chunks(dst, src)
    assert [(d.dtype, d.dim(), s.numel()) for d, s in pairs] == [(torch.uint8, 1, span_bytes((6, 10), (20, 2), 4))]
    run(pairs)
    assert torch.equal(dst, src) and dst.stride() == src.stride()


def test_different_layouts_copy_element_by_element() -> None:
    src = gappy()
    dst = torch.zeros(6, 10)  # contiguous: not the same strides
    [(d, s)] = span_chunks(dst, src)
    assert d is dst and s is src


def test_a_registered_copy_is_cut_at_every_piece_end() -> None:
    cudart = FakeCudart()
    shape, stride = (64, 40), (40, 1)
    held = register_host_tensor(shape, stride, torch.float32, register=cudart.register,
                                unregister=cudart.unregister, piece_bytes=4096)
    held.tensor.copy_(torch.randn(shape))
    dst = torch.zeros(shape)
    pairs = span_chunks(dst, held.tensor, held.pieces)
    # One chunk per piece, each exactly that piece's range.
    assert [(s.data_ptr(), s.numel()) for _, s in pairs] == list(held.pieces)
    assert len(pairs) == -(-64 * 40 * 4 // 4096)
    run(pairs)
    assert torch.equal(dst, held.tensor)
    del pairs, held


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    row_gap=st.integers(0, 5),
    col_step=st.integers(1, 3),
    transpose=st.booleans(),
    cuts=st.lists(st.integers(1, 2000), max_size=6),
)
def test_span_copies_arrive_equal_and_never_cross_a_piece_end(
    rows: int, cols: int, row_gap: int, col_step: int, transpose: bool, cuts: list[int]
) -> None:
    base = torch.randn(rows, cols * col_step + row_gap, dtype=torch.float64)
    src = base[:, ::col_step][:, :cols]
    if transpose:
        src = src.t()
    dst = like(src)
    start = src.data_ptr()
    pieces = [(start + lo, hi - lo) for lo, hi in zip([0, *sorted(set(cuts))], sorted(set(cuts)), strict=False)]
    pairs = span_chunks(dst, src, pieces)
    run(pairs)
    assert torch.equal(dst, src)
    ends = {address + length - start for address, length in pieces}
    for _, s in pairs:
        lo, hi = s.data_ptr() - start, s.data_ptr() - start + s.numel() * s.element_size()
        assert not any(lo < end < hi for end in ends)


def test_cpu_runtime_copies_gappy_weights_by_span() -> None:
    """Both runtimes copy the span, gaps included (one memcpy): the gap bytes arrive too."""
    runtime = CpuRuntime()
    src = gappy()
    host = runtime.host_copy(src, pin=PinMethod.NONE)
    assert host.stride() == src.stride()
    byte_span(host).fill_(0x7F)
    host.copy_(src)  # the elements again; the gaps keep 0x7F
    buffer = runtime.device_empty(tuple(src.shape), tuple(src.stride()), src.dtype)
    byte_span(buffer).zero_()
    runtime.copy_after(buffer, host, runtime.record())
    assert torch.equal(buffer, src)
    assert torch.equal(byte_span(buffer), byte_span(host))
    on_device = runtime.to_device(host)
    assert torch.equal(byte_span(on_device), byte_span(host)) and on_device.stride() == src.stride()
