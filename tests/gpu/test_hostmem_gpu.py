"""Page-locked host memory on a real device: a tensor registered in several pieces is
copied piece by piece, including inside a CUDA graph capture (weights over PIECE_BYTES are
registered that way); exact-size registrations and allocations, views, release."""

from __future__ import annotations

import pytest
import torch

from offload.pure import PinMethod
from offload.runtime.copies import span_chunks
from offload.runtime.cuda import CudaRuntime
from offload.runtime.cudart import copy_stream
from offload.runtime.hostmem import register_host_tensor


def test_a_tensor_registered_in_several_pieces_is_pinned_and_capturable() -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
    elements = 3 << 20  # 12 MiB of float32, registered in three 4 MiB pieces
    held = register_host_tensor(
        (elements,), (1,), torch.float32,
        register=lambda pointer, nbytes: int(cudart.cudaHostRegister(pointer, nbytes, 0)),
        unregister=lambda pointer: int(cudart.cudaHostUnregister(pointer)),
        piece_bytes=4 << 20,
    )
    assert len(held.pieces) == 3
    source = held.tensor
    source.copy_(torch.arange(elements, dtype=torch.float32))
    assert source.is_pinned()
    target = torch.zeros(elements, device="cuda")
    chunks = span_chunks(target, source, held.pieces)  # one memcpy per registered piece
    assert len(chunks) == 3
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for d, s in chunks:
            d.copy_(s, non_blocking=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    target.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for d, s in chunks:
            d.copy_(s, non_blocking=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(target.cpu(), source)
    del chunks
    assert held.release() == []


@pytest.mark.parametrize("method", [PinMethod.REGISTER, PinMethod.ALLOC])
def test_runtime_host_copies_are_exact_size_viewable_and_released(method: PinMethod) -> None:
    runtime = CudaRuntime()
    weight = torch.randn(1000, 3000, device="cuda", dtype=torch.bfloat16)
    host = runtime.host_copy(weight, pin=method)
    assert runtime.is_pinned(host) and host.is_pinned()
    assert runtime.pin_fallbacks == 0
    assert host.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert torch.equal(host, weight.cpu())
    view = runtime.device_view(host)
    assert view.device.type == "cuda" and view.data_ptr() == host.data_ptr()
    assert torch.equal(view, weight)
    del view
    torch.cuda.synchronize()
    runtime.release_host(host)
    # Registered pages are unregistered at once; an allocation stays page-locked until
    # its last tensor (here `host`) dies, then the next drain frees it.
    assert runtime.is_pinned(host) is (method is PinMethod.ALLOC)
    del host
    runtime.synchronize()


def test_runtime_copies_a_host_copy_in_several_pieces_inside_a_capture() -> None:
    """A host copy registered in three pieces is copied piece by piece (each memcpy within
    one registration), captured and replayed."""
    runtime = CudaRuntime(piece_bytes=4 << 20)
    weight = torch.randn(3 << 20, device="cuda")  # 12 MiB of float32
    host = runtime.host_copy(weight, pin=PinMethod.REGISTER)
    assert runtime.is_pinned(host) and runtime.pin_fallbacks == 0
    buffer = runtime.device_empty((3 << 20,), (1,), torch.float32)
    runtime.synchronize()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runtime.wait(runtime.copy_after(buffer, host, runtime.record()))  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    buffer.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runtime.wait(runtime.copy_after(buffer, host, runtime.record()))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buffer, weight)
    runtime.release_host(host)


def test_the_copy_stream_is_its_own_never_one_from_the_pool() -> None:
    """PyTorch's pool hands out 32 streams round-robin (graph captures take theirs from it);
    the copy stream is none of them, and every runtime on the device shares it."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = copy_stream(device)
    assert copy_stream(device) is stream
    pool = {torch.cuda.Stream().cuda_stream for _ in range(80)}  # type: ignore[no-untyped-call]  # unannotated
    assert stream.cuda_stream not in pool
    assert stream.cuda_stream != torch.cuda.current_stream().cuda_stream
    runtime = CudaRuntime()
    weight = torch.randn(1 << 20, device="cuda")
    host = runtime.host_copy(weight, pin=PinMethod.REGISTER)
    buffer = runtime.device_empty((1 << 20,), (1,), torch.float32)
    runtime.wait(runtime.copy_after(buffer, host, runtime.record()))
    torch.cuda.synchronize()
    assert torch.equal(buffer, weight)
    runtime.release_host(host)
