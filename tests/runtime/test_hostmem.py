"""Exact-size registered host memory (offload.runtime.hostmem), with injected CUDA calls."""

from __future__ import annotations

import ctypes
import gc
import mmap

import pytest
import torch

from offload import ExecutionError
from offload.pure import PinMethod
from offload.runtime.copies import span_chunks
from offload.runtime.cpu import CpuRuntime
from offload.runtime.hostmem import (
    HostRegisterError,
    Layout,
    alloc_host_block,
    alloc_host_tensor,
    drain_retired,
    pageable_block,
    register_host_block,
    register_host_tensor,
    retired_count,
    span_bytes,
)


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; fails the k-th registration."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, pointer: int, nbytes: int) -> int:
        if len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((pointer, nbytes))
        return 0

    def unregister(self, pointer: int) -> int:
        self.unregistered.append(pointer)
        return 0


class FakeHostAlloc:
    """Plays cudaHostAlloc / cudaFreeHost with ctypes buffers; fails the k-th allocation."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.live: dict[int, ctypes.Array[ctypes.c_char]] = {}  # pointer -> its memory
        self.sizes: list[int] = []
        self.freed: list[int] = []

    def alloc(self, nbytes: int) -> tuple[int, int]:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            return 2, 0  # cudaErrorMemoryAllocation
        memory = ctypes.create_string_buffer(nbytes)
        self.live[ctypes.addressof(memory)] = memory
        self.sizes.append(nbytes)
        return 0, ctypes.addressof(memory)

    def free(self, pointer: int) -> int:
        self.freed.append(pointer)
        del self.live[pointer]
        return 0


@pytest.mark.parametrize(
    ("shape", "stride", "dtype"),
    [((1000, 3), (3, 1), torch.bfloat16), ((3, 1000), (1, 3), torch.float32), ((7,), (1,), torch.int8),
     ((5, 2), (4, 1), torch.float8_e4m3fn)],
)
def test_pages_are_exactly_the_span_registered_in_bounded_pieces(
    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> None:
    cudart = FakeCudart()
    piece = 4096
    held = register_host_tensor(shape, stride, dtype, register=cudart.register, unregister=cudart.unregister,
                                piece_bytes=piece)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = span_bytes(shape, stride, itemsize)
    assert (tuple(held.tensor.shape), held.tensor.stride(), held.tensor.dtype) == (shape, stride, dtype)
    # Exact size: at most one page of rounding, never a power of two.
    assert nbytes <= held.reserved_bytes < nbytes + mmap.PAGESIZE and held.in_place
    assert held.tensor.untyped_storage().nbytes() == nbytes  # what stats and plans count
    assert held.tensor.data_ptr() % mmap.PAGESIZE == 0
    # The pieces tile the span in order, none larger than the bound.
    assert held.pieces == tuple(cudart.registered)
    assert sum(n for _, n in held.pieces) == nbytes
    assert all(n <= piece for _, n in held.pieces)
    assert [p for p, _ in held.pieces] == [held.tensor.data_ptr() + i * piece for i in range(len(held.pieces))]


def test_values_survive_and_the_mapping_lives_as_long_as_the_tensor() -> None:
    cudart = FakeCudart()
    source = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    held = register_host_tensor(tuple(source.shape), tuple(source.stride()), source.dtype,
                                register=cudart.register, unregister=cudart.unregister)
    tensor = held.tensor
    tensor.copy_(source)
    del held
    gc.collect()
    assert torch.equal(tensor, source)
    assert tensor.stride() == source.stride()


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_a_failed_piece_undoes_every_earlier_one(fail_at: int) -> None:
    cudart = FakeCudart(fail_at=fail_at)
    with pytest.raises(HostRegisterError, match="cudaError 2"):
        register_host_tensor((4096,), (1,), torch.float32, register=cudart.register, unregister=cudart.unregister,
                             piece_bytes=4096)
    assert len(cudart.registered) == fail_at
    assert cudart.unregistered == [p for p, _ in reversed(cudart.registered)]


def test_empty_tensors_register_nothing() -> None:
    cudart = FakeCudart()
    held = register_host_tensor((0, 5), (5, 1), torch.float16, register=cudart.register, unregister=cudart.unregister)
    assert held.pieces == () and cudart.registered == []
    assert tuple(held.tensor.shape) == (0, 5)


def test_cpu_runtime_views_are_the_host_tensor_and_copies_are_separate() -> None:
    runtime = CpuRuntime()
    source = torch.randn(4, 6).t()
    host = runtime.host_copy(source, pin=PinMethod.NONE)
    assert runtime.device_view(host) is host
    moved = runtime.to_device(host)
    assert torch.equal(moved, source) and moved.stride() == source.stride()
    assert moved.data_ptr() != host.data_ptr()
    assert runtime.is_pinned(host) is False and runtime.pin_fallbacks == 0
    runtime.release_host(host)
    assert torch.equal(host, source)  # releasing gives back registration only, never data
    for method in (PinMethod.REGISTER, PinMethod.ALLOC):
        with pytest.raises(ExecutionError, match="cannot pin"):
            runtime.host_copy(source, pin=method)


def test_memory_that_dies_unreleased_is_unregistered_by_the_next_drain() -> None:
    cudart = FakeCudart()
    drain_retired()  # start from nothing pending
    held = register_host_tensor((3000,), (1,), torch.float32, register=cudart.register,
                                unregister=cudart.unregister, piece_bytes=4096)
    pieces = held.pieces
    view = held.tensor[10:20]
    del held
    gc.collect()
    assert retired_count() == 0  # a view of the memory is still alive
    del view
    gc.collect()
    assert retired_count() == 1
    assert cudart.unregistered == []  # nothing is unregistered until the drain (not inside a capture)
    assert drain_retired() == []
    assert cudart.unregistered == [p for p, _ in reversed(pieces)]
    assert retired_count() == 0


def test_an_explicit_release_cancels_the_finalizer() -> None:
    cudart = FakeCudart()
    drain_retired()
    held = register_host_tensor((1000,), (1,), torch.int8, register=cudart.register, unregister=cudart.unregister)
    assert held.release() == []
    assert held.release() == []  # at most once
    assert cudart.unregistered == [held.pieces[0][0]]
    del held
    gc.collect()
    assert retired_count() == 0 and drain_retired() == []
    assert len(cudart.unregistered) == 1


@pytest.mark.parametrize(("shape", "stride", "dtype"), [((1000, 3), (3, 1), torch.bfloat16),
                                                         ((3, 1000), (1, 3), torch.float32),
                                                         ((6, 5), (20, 2), torch.float8_e4m3fn)])
def test_an_allocation_is_exactly_the_span_and_keeps_shape_strides_values(
    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> None:
    cuda = FakeHostAlloc()
    held = alloc_host_tensor(shape, stride, dtype, alloc=cuda.alloc, free=cuda.free)
    nbytes = span_bytes(shape, stride, torch.empty((), dtype=dtype).element_size())
    assert cuda.sizes == [nbytes]  # exactly the span: no power-of-two rounding
    assert nbytes <= held.reserved_bytes < nbytes + mmap.PAGESIZE
    assert held.tensor.untyped_storage().nbytes() == nbytes
    assert (tuple(held.tensor.shape), held.tensor.stride(), held.tensor.dtype) == (shape, stride, dtype)
    assert held.tensor.data_ptr() in cuda.live and held.pieces == () and not held.in_place
    source = torch.randn(shape).to(dtype)
    held.tensor.copy_(source)
    assert torch.equal(held.tensor.float(), source.float())


def test_a_failed_allocation_raises_and_takes_nothing() -> None:
    cuda = FakeHostAlloc(fail_at=0)
    with pytest.raises(HostRegisterError, match="cudaHostAlloc of 400 bytes failed with cudaError 2"):
        alloc_host_tensor((100,), (1,), torch.float32, alloc=cuda.alloc, free=cuda.free)
    assert cuda.live == {} and cuda.freed == []


def test_an_allocation_is_freed_only_after_its_last_tensor_dies() -> None:
    """Freeing page-locked memory a tensor still reads would be a use after free: release
    leaves it to the finalizer, and the next drain frees it."""
    cuda = FakeHostAlloc()
    drain_retired()
    held = alloc_host_tensor((64, 8), (8, 1), torch.float32, alloc=cuda.alloc, free=cuda.free)
    [pointer] = cuda.live
    user = held.tensor[3]  # someone still reads a row
    assert held.release() == []
    del held
    gc.collect()
    assert cuda.freed == [] and retired_count() == 0
    user.fill_(1.0)  # still valid memory
    del user
    gc.collect()
    assert retired_count() == 1 and cuda.freed == []  # nothing is freed until the drain
    assert drain_retired() == []
    assert cuda.freed == [pointer] and cuda.live == {}


# ---- blocks: several tensors back to back in one allocation -------------------------------

BLOCK: list[Layout] = [((64, 4), (4, 1), torch.float32), ((4, 64), (1, 4), torch.float32), ((128,), (1,), torch.bfloat16)]
BLOCK_BYTES = [1024, 1024, 256]


def _check_members(flat: torch.Tensor, members: tuple[torch.Tensor, ...]) -> None:
    """Members keep their layouts, lie back to back from the block's start, each over a
    storage of its own, and write through to the flat view."""
    assert flat.dtype == torch.uint8 and flat.numel() == sum(BLOCK_BYTES)
    offsets = [0, 1024, 2048]
    for member, (shape, stride, dtype), offset, nbytes in zip(members, BLOCK, offsets, BLOCK_BYTES, strict=True):
        assert (tuple(member.shape), member.stride(), member.dtype) == (shape, stride, dtype)
        assert member.data_ptr() == flat.data_ptr() + offset
        assert member.untyped_storage().nbytes() == nbytes  # each counted alone
    assert len({m.untyped_storage().data_ptr() for m in members}) == len(members)
    flat.zero_()
    members[1].fill_(1.0)
    assert torch.equal(flat[1024:1028], torch.tensor([0, 0, 128, 63], dtype=torch.uint8))  # 1.0f, little-endian
    assert int(flat[:1024].count_nonzero()) == 0 and int(flat[2048:].count_nonzero()) == 0  # only its own bytes


def test_a_registered_block_is_one_mapping_registered_in_pieces_and_released_whole() -> None:
    cudart = FakeCudart()
    drain_retired()
    held = register_host_block(BLOCK, register=cudart.register, unregister=cudart.unregister, piece_bytes=1024)
    _check_members(held.tensor, held.members)
    assert held.in_place and held.reserved_bytes == mmap.PAGESIZE
    assert cudart.registered == [(held.tensor.data_ptr() + 1024 * i, n) for i, n in enumerate([1024, 1024, 256])]
    assert held.pieces == tuple(cudart.registered)
    # A copy from a slice across members is cut where a registered piece ends.
    dst = torch.empty(1536, dtype=torch.uint8)
    chunks = span_chunks(dst, held.tensor[512:2048], held.pieces)
    assert [s.numel() for _, s in chunks] == [512, 1024]
    assert held.release() == []
    assert cudart.unregistered == [p for p, _ in reversed(held.pieces)]


def test_a_block_that_dies_unreleased_is_retired_with_its_last_member() -> None:
    cudart = FakeCudart()
    drain_retired()
    held = register_host_block(BLOCK, register=cudart.register, unregister=cudart.unregister)
    last = held.members[2]
    del held
    gc.collect()
    assert retired_count() == 0  # a member still holds the mapping
    last.fill_(2.0)  # still valid memory
    del last
    gc.collect()
    assert retired_count() == 1
    assert drain_retired() == [] and len(cudart.unregistered) == 1


def test_an_allocated_block_is_exactly_its_members_bytes() -> None:
    cuda = FakeHostAlloc()
    held = alloc_host_block(BLOCK, alloc=cuda.alloc, free=cuda.free)
    assert cuda.sizes == [sum(BLOCK_BYTES)] and held.pieces == () and not held.in_place
    _check_members(held.tensor, held.members)


def test_a_failed_block_registration_takes_nothing() -> None:
    cudart = FakeCudart(fail_at=1)
    with pytest.raises(HostRegisterError):
        register_host_block(BLOCK, register=cudart.register, unregister=cudart.unregister, piece_bytes=1024)
    assert cudart.unregistered == [cudart.registered[0][0]]


def test_a_pageable_block_holds_its_members_and_needs_no_release() -> None:
    drain_retired()
    held = pageable_block(BLOCK)
    _check_members(held.tensor, held.members)
    assert held.pieces == () and held.tensor.data_ptr() % mmap.PAGESIZE == 0
    first = held.members[0]
    del held
    gc.collect()
    first.fill_(3.0)
    del first
    gc.collect()
    assert retired_count() == 0  # nothing to give back: the mapping went with its tensors


def test_cpu_runtime_blocks_refuse_pinning_by_name() -> None:
    likes = [torch.empty(shape, dtype=dtype, device="meta").as_strided(shape, stride) for shape, stride, dtype in BLOCK]
    flat, members = CpuRuntime().host_block(likes, pin=PinMethod.NONE)
    _check_members(flat, tuple(members))
    with pytest.raises(ExecutionError) as info:
        CpuRuntime().host_block(likes, pin=PinMethod.REGISTER)
    assert info.value.name == "pin"
