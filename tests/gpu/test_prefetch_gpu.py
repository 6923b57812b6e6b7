"""PrefetchOffloader on a real CUDA device: parity with real streams, CUDA-graph capture
and replay, torch.compile, device memory freed as planned, pinning exactly as planned.

Skipped without CUDA (see conftest.py). Models are a few tens of MiB per layer in bf16, so
copies take long enough for a missing wait to show, and the tier stays well under a minute.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from offload import (
    EnvSnapshot,
    ExecutionError,
    OffloadConfig,
    OffloadPlan,
    capture_env,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.executors import PrefetchOffloader
from offload.graphs import capture_forward
from offload.pure import ENV_VARIABLES
from tests.executors.models import Int8Linear, SlicedBlock, TransformerBlock, bits, layer_list
from tests.gpu.runtimes import RecordingCudaRuntime, measure_freed

# Importing inductor reaches torch.jit.script(_method), deprecated since torch 2.10; on
# float32 GEMMs inductor warns that TF32 is available but off (the eager reference does not
# use it either, so it stays off).
pytestmark = [
    # By message only: the category changed between releases (DeprecationWarning in 2.10
    # and 2.11, FutureWarning later).
    pytest.mark.filterwarnings("ignore:`torch.jit.script"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use the new API settings to control TF32:UserWarning"),
]

HIDDEN = 1024  # qkv 6 MiB, out 2 MiB, up and down 8 MiB each: about 24 MiB per layer in bf16
TOKENS = 128
NUM_LAYERS = 6


def env_with_pinning(pin: bool) -> EnvSnapshot:
    """This machine, with the pin switch forced (whatever the caller's environment says)."""
    environ = {k: v for k, v in os.environ.items() if k not in ENV_VARIABLES["disable_pin_memory"]}
    if not pin:
        environ["OFFLOAD_DISABLE_PIN_MEMORY"] = "1"
    return capture_env(environ)


def gpu_model(num_layers: int = NUM_LAYERS, *, seed: int = 0, hidden: int = HIDDEN) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = nn.Sequential(*[TransformerBlock(hidden, 4 * hidden, heads=8) for _ in range(num_layers)])
    return model.to(torch.bfloat16).requires_grad_(False)  # inference, as served


def plan_for(model: nn.Module, config: OffloadConfig, *, pin: bool = True) -> OffloadPlan:
    plan = make_plan(describe_layers(layer_list(model)), config, env_with_pinning(pin))
    assert plan.compute_device == "cuda"
    assert plan.pin.pin is pin
    return plan


def offload(model: nn.Module, plan: OffloadPlan) -> PrefetchOffloader:
    off = create_offloader(plan)  # the default runtime for a CUDA plan: CudaRuntime
    assert isinstance(off, PrefetchOffloader)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off


def gpu_inputs(seed: int, count: int, hidden: int = HIDDEN) -> Iterator[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(count):
        yield torch.randn(2, TOKENS, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)


CONFIGS = [
    pytest.param(OffloadConfig(group_size=1, prefetch_step=2), id="every-layer-step2"),
    pytest.param(OffloadConfig(group_size=1, prefetch_step=4), id="every-layer-step4"),
    pytest.param(OffloadConfig(group_size=2, prefetch_step=2), id="every-2nd-3-layers-step2"),
    pytest.param(OffloadConfig(group_size=1), id="every-layer-step1"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_parity_with_real_streams(config: OffloadConfig) -> None:
    model = gpu_model()
    reference = copy.deepcopy(model)
    before = {n: (p, bits(p).clone(), p.stride(), p.device) for n, p in model.named_parameters()}
    plan = plan_for(model, config)
    off = offload(model, plan)
    for x in gpu_inputs(seed=1, count=6):
        assert torch.equal(model(x), reference(x))
    assert off.stats().host_bytes == plan.host_bytes
    off.restore()
    for name, p in model.named_parameters():
        param, data, stride, device = before[name]
        assert p is param and p.stride() == stride and p.device == device, name
        assert torch.equal(bits(p), data), name
    for x in gpu_inputs(seed=2, count=2):
        assert torch.equal(model(x), reference(x))


class ReplayPair:
    """The offloaded model and its resident twin, each captured in a CUDA graph, so that
    both sides run the same captured kernels and can be compared bit for bit."""

    def __init__(self, model: nn.Module, reference: nn.Module, off: PrefetchOffloader, first: torch.Tensor) -> None:
        self.off = off
        self.static_x, self.ref_x = first.clone(), first.clone()
        self.graph, self.out = capture_forward(model, self.static_x, off)
        self.ref_graph, self.ref_out = capture_forward(reference, self.ref_x, None)

    def replay(self, x: torch.Tensor, *, sync: bool) -> None:
        """Replay both on `x` (after `sync_prev_onload` when `sync`) and check they agree."""
        self.static_x.copy_(x)
        self.ref_x.copy_(x)
        if sync:
            self.off.sync_prev_onload()
        self.graph.replay()
        self.ref_graph.replay()
        assert torch.equal(self.out, self.ref_out)


@pytest.mark.parametrize("config", CONFIGS[:3])
def test_cuda_graph_capture_and_replay_parity(config: OffloadConfig) -> None:
    model = gpu_model()
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, config))
    xs = list(gpu_inputs(seed=3, count=5))
    pair = ReplayPair(model, reference, off, xs[0])
    for x in xs:
        pair.replay(x, sync=True)
        # ... and it is this input's output (eager kernels may round differently from replay)
        torch.testing.assert_close(pair.out, reference(x), atol=2e-2, rtol=2e-2)
    for x in xs:  # back to back (no sync in between), as a serving loop runs them
        pair.replay(x, sync=False)


def test_compiled_parity_aot_eager() -> None:
    torch._dynamo.reset()
    model = gpu_model(4)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=2)))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    issued = off.stats().copies_issued
    for x in gpu_inputs(seed=4, count=4):
        assert torch.equal(compiled(x), reference(x))
    assert off.stats().copies_issued > issued  # the custom ops ran inside the compiled graph
    torch._dynamo.reset()


def test_compiled_inductor_matches_eager_within_bf16_tolerance() -> None:
    """Inductor fuses differently around the custom ops, so not bit for bit; a layer that
    read another layer's (or half-copied) weights would be off by far more than this."""
    torch._dynamo.reset()
    model = gpu_model(3, hidden=512)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=2)))
    compiled = torch.compile(model, fullgraph=True)
    for x in gpu_inputs(seed=5, count=3, hidden=512):
        torch.testing.assert_close(compiled(x), reference(x), atol=3e-2, rtol=3e-2)
    off.restore()
    torch._dynamo.reset()


def test_device_memory_freed_matches_the_plan() -> None:
    model = gpu_model()
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2))
    expected = plan.device_bytes_freed - plan.device_bytes_buffers
    assert expected > 0
    off, before, freed = measure_freed(lambda: offload(model, plan))
    assert abs(freed - expected) <= 0.01 * expected, (freed, expected)
    assert off.stats().device_buffer_bytes == plan.device_bytes_buffers
    off.restore()
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - before) <= 0.01 * expected  # all back, buffers gone


@pytest.mark.parametrize("pin", [True, False], ids=["pin-on", "pin-disabled"])
def test_host_storage_is_pinned_exactly_when_the_plan_says(pin: bool) -> None:
    model = gpu_model(3)
    reference = copy.deepcopy(model)
    plan = plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=pin)
    runtime = RecordingCudaRuntime()
    off = create_offloader(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    # Before post_init the offloaded parameters hold their host copies.
    for p in plan.offloaded_params:
        param = layers[p.layer].get_parameter(p.name)
        assert param.device.type == "cpu"
        assert param.is_pinned() is pin, (p.layer, p.name)
    # Post-processing hands back a new device tensor: post_init re-copies it, pinned as planned.
    for model_ in (model, reference):
        up = model_[1].get_submodule("mlp.up")
        assert isinstance(up, nn.Linear)
        up.weight.data = (up.weight.data.to("cuda") * 2).contiguous()
    off.post_init()
    assert len(runtime.host_copies) > len(plan.offloaded_params)
    assert set(runtime.host_copies) == {(pin, pin)}
    for x in gpu_inputs(seed=6, count=2):
        assert torch.equal(model(x), reference(x))


def test_capture_with_pinning_disabled_raises_execution_error() -> None:
    model = gpu_model(3)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=2), pin=False))
    static_x = next(gpu_inputs(seed=7, count=1))
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    off.sync_prev_onload()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ExecutionError, match="pinning is off") as info:
        with torch.cuda.graph(graph):
            # One kernel first, so that ending the aborted capture does not warn about an
            # empty graph (which this suite's filterwarnings=error would turn into the error).
            model(static_x * 1)
    assert "OFFLOAD_DISABLE_PIN_MEMORY" in str(info.value)
    torch.cuda.synchronize()
    off.restore()
    x = next(gpu_inputs(seed=8, count=1))
    assert torch.equal(model(x), reference(x))


def test_sliced_weights_with_gaps_capture_and_replay() -> None:
    """Weights whose strides leave gaps are copied as one byte span: no pageable staging,
    so the copies can be captured (an element-wise copy_ would be refused in capture)."""

    def sliced_model() -> nn.Sequential:
        torch.manual_seed(9)
        with torch.device("cuda"):
            return nn.Sequential(*[SlicedBlock(HIDDEN, torch.bfloat16) for _ in range(4)]).requires_grad_(False)

    model, reference = sliced_model(), sliced_model()  # equal weights and strides (a deep copy would be contiguous)
    assert model[0].get_parameter("weight").stride() == reference[0].get_parameter("weight").stride() == (
        2 * HIDDEN, 2)
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=2)))
    xs = list(gpu_inputs(seed=10, count=3))
    pair = ReplayPair(model, reference, off, xs[0])
    for x in xs:
        pair.replay(x, sync=True)
    off.restore()
    assert model[0].get_parameter("weight").stride() == (2 * HIDDEN, 2)


def test_wait_seconds_measures_the_compute_streams_stalls() -> None:
    """Tiny compute, every layer streamed one ahead: the compute stream mostly waits for
    copies, so the measured wait is positive and within the elapsed time."""
    model = gpu_model()
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=1)))
    x = next(gpu_inputs(seed=11, count=1))[:, :1]  # one token: compute is nothing next to the copies
    model(x)
    torch.cuda.synchronize()
    before = off.stats().wait_seconds
    assert before is not None
    start = time.perf_counter()
    for _ in range(5):
        model(x)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    waited = off.stats().wait_seconds
    assert waited is not None
    assert 0 < waited - before <= elapsed
    off.restore()


def test_compiled_inductor_keeps_weight_only_math_after_the_wait() -> None:
    """Int8 layers dequantise from their weights alone (``qweight.to(dtype) * scale``):
    nothing ties that math to the activation the wait op mutates, so a compiler that moved
    it ahead of the wait would read a slot before its copy landed (another layer's weights,
    far off). Copies are made slow next to the compute (16 MiB per layer, one token)."""
    check_int8_compiled_parity()


def check_int8_compiled_parity() -> None:
    """Six int8 layers of 4096, every one offloaded at depth 2, compiled with inductor
    (under whatever inductor config the caller patched): close to eager over 4 steps."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    with torch.device("cuda"):
        model = nn.Sequential(*[Int8Linear(4096) for _ in range(6)]).requires_grad_(False)
    reference = copy.deepcopy(model)
    off = offload(model, plan_for(model, OffloadConfig(group_size=1, prefetch_step=2)))
    compiled = torch.compile(model, fullgraph=True)
    generator = torch.Generator(device="cuda").manual_seed(13)
    for _ in range(4):
        x = torch.randn(1, 1, 4096, device="cuda", generator=generator)
        torch.testing.assert_close(compiled(x), reference(x), atol=1e-3, rtol=1e-3)
    off.restore()
    torch._dynamo.reset()
