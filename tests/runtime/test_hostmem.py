"""Exact-size registered host memory (offload.runtime.hostmem), with injected CUDA calls."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from offload import CpuRuntime, ExecutionError
from offload.runtime.hostmem import (
    HostRegisterError,
    drain_retired,
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
    assert nbytes <= len(held.mapping) < nbytes + mmap.PAGESIZE
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
    host = runtime.host_copy(source, pin=False)
    assert runtime.device_view(host) is host
    moved = runtime.to_device(host)
    assert torch.equal(moved, source) and moved.stride() == source.stride()
    assert moved.data_ptr() != host.data_ptr()
    assert runtime.is_pinned(host) is False and runtime.pin_fallbacks == 0
    runtime.release_host(host)
    assert torch.equal(host, source)  # releasing gives back registration only, never data
    with pytest.raises(ExecutionError, match="cannot pin"):
        runtime.host_copy(source, pin=True)


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
    assert held.unregister_now(cudart.unregister) == []
    assert held.unregister_now(cudart.unregister) == []  # at most once
    assert cudart.unregistered == [held.pieces[0][0]]
    del held
    gc.collect()
    assert retired_count() == 0 and drain_retired() == []
    assert len(cudart.unregistered) == 1
