"""One copy per prefetched layer on a real CUDA device: each layer's host copies in one
page-locked block (registered in pieces), its slot in one device arena, one memcpy per
layer (or per piece), bit for bit, in eager mode and in CUDA graph replay."""

from __future__ import annotations

import copy

import pytest
import torch

from offload import OffloadConfig, create_offloader
from offload.executors import PrefetchOffloader
from offload.graphs import capture_forward
from offload.pure import LayerBlocks
from offload.runtime.cuda import CudaRuntime
from tests.executors.models import layer_list
from tests.gpu.test_prefetch_gpu import gpu_inputs, gpu_model, plan_for

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]


def offload_with(model: torch.nn.Module, runtime: CudaRuntime, blocks: LayerBlocks = "auto",
                 step: int = 2) -> PrefetchOffloader:
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=step, layer_blocks=blocks))
    off = create_offloader(plan, runtime)
    assert isinstance(off, PrefetchOffloader)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off


@pytest.mark.parametrize("blocks", ["auto", "never"])
def test_each_layer_is_one_copy_from_pinned_blocks_and_bit_exact(blocks: LayerBlocks) -> None:
    model = gpu_model()
    reference = copy.deepcopy(model)
    runtime = CudaRuntime()
    off = offload_with(model, runtime, blocks)
    hosts = off._host.tensors()
    assert hosts and all(runtime.is_pinned(t) and t.is_pinned() for t in hosts)
    params_per_layer = len(list(layer_list(model)[0].parameters()))
    start = off.stats().copies_issued
    for x in gpu_inputs(seed=1, count=4):
        assert torch.equal(model(x), reference(x))
    per_forward = (off.stats().copies_issued - start) / 4
    layers = len(off.plan.offloaded_layers)
    assert per_forward == (layers if blocks == "auto" else layers * params_per_layer)
    assert off.stats().host_bytes == off.plan.host_bytes
    assert off.stats().device_buffer_bytes == off.plan.device_bytes_buffers
    off.restore()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.device == want.device and torch.equal(got, want)
    assert not runtime._range_starts and not runtime._member_of  # every block given back


def test_blocks_registered_in_pieces_copy_piece_by_piece_and_replay_in_a_graph() -> None:
    model = gpu_model(4)
    reference = copy.deepcopy(model)
    runtime = CudaRuntime(piece_bytes=1 << 20)  # a layer of 24 MiB and 24 KiB in 25 registered pieces
    off = offload_with(model, runtime)
    for x in gpu_inputs(seed=2, count=2):
        assert torch.equal(model(x), reference(x))
    xs = list(gpu_inputs(seed=3, count=3))
    static_x, ref_x = xs[0].clone(), xs[0].clone()
    graph, out = capture_forward(model, static_x, off)
    ref_graph, ref_out = capture_forward(reference, ref_x, None)
    for x in xs:
        static_x.copy_(x)
        ref_x.copy_(x)
        off.sync_prev_onload()
        graph.replay()
        ref_graph.replay()
        assert torch.equal(out, ref_out)
    off.restore()
    assert not runtime._range_starts


def test_inductor_with_arenas_matches_eager_and_hands_the_ops_the_real_slots() -> None:
    """Slots shared by several layers (3 layers, 2 slots), arena members over storages of
    their own: inductor compiles them as separate inputs, and the ops get the slots.
    Inductor fuses differently around the ops, so within bf16 tolerance (as
    `test_compiled_inductor_matches_eager_within_bf16_tolerance`), not bit for bit."""
    from offload.executors import ops

    torch._dynamo.reset()
    model = gpu_model(3, hidden=512)
    reference = copy.deepcopy(model)
    off = offload_with(model, CudaRuntime())
    assert off.stats().copies_issued == 2  # post_init copied the first two layers, one copy each
    compiled = torch.compile(model, fullgraph=True)
    for x in gpu_inputs(seed=4, count=3, hidden=512):
        torch.testing.assert_close(compiled(x), reference(x), atol=3e-2, rtol=3e-2)
    assert off._handle not in ops._copied_once
    off.restore()
    torch._dynamo.reset()
