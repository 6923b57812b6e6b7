"""A model larger than the device is allowed to use, on a real CUDA device:
wrapped from host memory or from meta, loaded, post_init, forwards bit for bit equal to
the same math run resident layer by layer, restored; device memory within the plan's
device total (resident weights and static buffers) plus the largest tensor plus the
activations, whatever the weights' source.

No transformers here: the model is 16 plain MLP blocks (LayerNorm, Linear up, GELU, Linear
down, residual) in bf16, 128 MiB each, 2 GiB in all. Each test limits PyTorch's caching
allocator with ``torch.cuda.set_per_process_memory_fraction`` to what the plan needs plus
a little (well below the model's bytes), so a path that put the whole model on the device
first runs out of memory, and checks ``max_memory_allocated`` (reset just before wrapping)
against the bound. The peaks are printed past pytest's capture, for the closing note.

The reference runs each block with `torch.func.functional_call` on a device copy of its
weights, one block at a time (the whole model never on the device): the same kernels on
the same shapes and strides as the offloaded model, so outputs are compared with
`torch.equal`.

Skipped without CUDA (see conftest.py). The weights are made once per module, on the
device (fast), and kept in host memory; every test builds its own model from them. A few
seconds per test on an H200.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from offload import (
    Backend,
    EnvSnapshot,
    OffloadConfig,
    OffloadPlan,
    Placement,
    capture_env,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.executors import PrefetchOffloader, UVAOffloader
from offload.pure import PinMethod
from offload.pure.decide.moves import Move
from offload.runtime.hostmem import retired_count
from tests.executors.models import Mlp, bits, layer_list
from tests.gpu.runtimes import RecordingCudaRuntime

MIB = 1 << 20
HIDDEN = 4096
INNER = 8192  # up and down weights 64 MiB each in bf16: 128 MiB per block
NUM_LAYERS = 16  # 2 GiB
BATCH, TOKENS = 1, 256
NUM_INPUTS = 3
#: Every 4th layer resident, the other 12 streamed three ahead (three slots, so three
#: consecutive offloaded layers never stall): 512 MiB resident + 384 MiB of buffers.
PREFETCH = OffloadConfig(group_size=4, num_in_group=3, prefetch_step=3)
#: What a forward holds on the device besides weights, bounded from above: the block's
#: input, norm, up and GELU outputs, down output and the residual sum (about 2 up-sized
#: and 3 hidden-sized tensors at once), taken as 8 up-sized tensors.
ACTIVATION_BYTES = 8 * BATCH * TOKENS * INNER * 2
#: Room above the bound in the allocator's limit, for its rounding and the segments that
#: small allocations are carved from (the limit counts reserved memory, the bound allocated).
SLACK_BYTES = 128 * MIB
#: How far allocated device memory may be from the expected level after restore: far
#: below one weight (64 MiB).
TOLERANCE_BYTES = 8 * MIB


def env_with(*, pin: bool, uva: bool = True) -> EnvSnapshot:
    """This machine, with the pin and UVA switches forced (whatever the environment says)."""
    env = capture_env(os.environ)
    return attrs.evolve(env, flags=attrs.evolve(env.flags, disable_pin_memory=not pin, disable_uva=not uva))


def skeleton() -> nn.Sequential:
    """The model's blocks on meta (no data), bf16, for inference."""
    with torch.device("meta"):
        model = nn.Sequential(*[Mlp(HIDDEN, INNER) for _ in range(NUM_LAYERS)])
    return model.to(torch.bfloat16).requires_grad_(False)


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    """Every weight by qualified name (``"3.up.weight"``), bf16 in pageable host memory:
    drawn on the device (fast), scaled so the residual stream stays in range."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, p in skeleton().named_parameters():
        values = torch.randn(tuple(p.shape), device="cuda", generator=generator)
        if p.dim() == 2:
            values /= p.shape[1] ** 0.5
        elif name.endswith("norm.weight"):
            values = 1 + 0.1 * values
        else:
            values *= 0.02
        weights[name] = values.to(torch.bfloat16).cpu()
    return weights


def host_model(weights: dict[str, torch.Tensor]) -> nn.Sequential:
    """The model in pageable host memory, over copies of `weights` (so a test that changed
    the model's storages cannot change what it is compared with)."""
    model = skeleton()
    model.load_state_dict({name: w.clone() for name, w in weights.items()}, assign=True)
    assert all(p.device.type == "cpu" and not p.requires_grad for p in model.parameters())
    return model


def reference_outputs(weights: dict[str, torch.Tensor], xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The model's outputs for `xs`, run resident one block at a time: each block's weights
    copied to the device, run on every input, dropped."""
    block = skeleton()[0]
    outs = list(xs)
    for index in range(NUM_LAYERS):
        params = {name: weights[f"{index}.{name}"].to("cuda") for name, _ in block.named_parameters()}
        outs = [functional_call(block, params, (x,)) for x in outs]
        del params
    return tuple(outs)


@attrs.frozen
class World:
    """What every test compares against: the weights (host, bf16, by qualified name), the
    inputs and the reference outputs (on the device)."""

    weights: dict[str, torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    expected: tuple[torch.Tensor, ...]


@pytest.fixture(scope="module")
def world() -> World:
    weights = make_weights(seed=0)
    generator = torch.Generator(device="cuda").manual_seed(1)
    xs = tuple(torch.randn(BATCH, TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(NUM_INPUTS))
    return World(weights=weights, inputs=xs, expected=reference_outputs(weights, xs))


def device_bound(plan: OffloadPlan) -> int:
    """Device bytes the lifecycle may add at its peak: the plan's resident weights and
    static buffers, its largest tensor (one in flight), and the activations."""
    largest = max(p.nbytes for p in plan.params)
    return plan.device_bytes_resident + plan.device_bytes_buffers + largest + ACTIVATION_BYTES


@attrs.define
class Limit:
    """What `device_limited` set up: bytes allocated at the start, and the allocator's
    limit (bytes) while it lasts."""

    baseline: int
    allowed: int

    def peak(self) -> int:
        """Peak device bytes allocated above the baseline so far (after a synchronize)."""
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.baseline


@contextlib.contextmanager
def device_limited(budget: int) -> Iterator[Limit]:
    """Limit the caching allocator to what it holds now plus `budget` bytes, and reset the
    peak counter; undo the limit at the end, whatever happens.

    Cached, free blocks are given back first, so the limit counts live memory (earlier
    tests' caches would otherwise eat the budget); the allocator frees cached blocks
    itself before it refuses an allocation over the limit. A GEMM with and one without a
    bias run first make sure the cuBLAS and cuBLASLt workspaces of this stream (taken
    from the caching allocator on first use, and kept) are in the baseline, not the peak.
    """
    warm = torch.ones(TOKENS, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(warm, warm[:32], warm[0, :32])
    F.linear(warm, warm[:32])
    del warm
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = torch.cuda.memory_reserved(device) + budget
    assert allowed < total
    torch.cuda.set_per_process_memory_fraction(allowed / total, device)
    try:
        torch.cuda.reset_peak_memory_stats(device)
        yield Limit(baseline=torch.cuda.memory_allocated(device), allowed=allowed)
    finally:
        torch.cuda.synchronize()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def report(capsys: pytest.CaptureFixture[str], what: str, limit: Limit, peak: int, bound: int,
           model_bytes: int) -> None:
    """Print the measured peak next to its bound, past pytest's capture (for the log)."""
    with capsys.disabled():
        print(f"\n[load-gpu] {what}: device peak {peak / MIB:.1f} MiB above {limit.baseline / MIB:.1f} MiB "
              f"allocated before wrapping; bound {bound / MIB:.1f} MiB (= {peak / bound:.3f} of it); "
              f"model {model_bytes / MIB:.1f} MiB; allocator limited to {limit.allowed / MIB:.1f} MiB reserved")


def run_forwards(model: nn.Module, world: World, rounds: int = 2) -> None:
    """Every input `rounds` times (the schedule wraps around), each output bit for bit the reference's."""
    for round_ in range(rounds):
        for index, (x, want) in enumerate(zip(world.inputs, world.expected, strict=True)):
            assert torch.equal(model(x), want), (round_, index)


def offloaded_names(plan: OffloadPlan) -> set[str]:
    return {f"{p.layer}.{p.name}" for p in plan.offloaded_params}


def moves(plan: OffloadPlan) -> tuple[set[Move], set[Move]]:
    """(moves of the offloaded parameters, moves of the resident ones), from where the plan found them."""
    return ({plan.move_of(p) for p in plan.params if p.offloaded},
            {plan.move_of(p) for p in plan.params if not p.offloaded})


def assert_weights(model: nn.Module, weights: dict[str, torch.Tensor], on_device: set[str]) -> None:
    """Every parameter holds its weight bit for bit, on the device exactly for `on_device`."""
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(weights)
    for name, param in params.items():
        assert param.device.type == ("cuda" if name in on_device else "cpu"), (name, param.device)
        assert torch.equal(bits(param).cpu(), bits(weights[name])), name


def test_a_host_model_larger_than_the_allowed_device_memory(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """A model larger than the allowed device memory, without transformers: from host memory, pinning on, the
    device limited below the model."""
    model = host_model(world.weights)
    layers = layer_list(model)
    spec = describe_layers(layers)
    plan = make_plan(spec, PREFETCH, env_with(pin=True))
    assert plan.backend is Backend.PREFETCH and plan.compute_device == "cuda" and plan.pin.pin
    assert len(plan.offloaded_layers) == 12
    assert moves(plan) == ({Move.HOST_TO_PINNED}, {Move.TO_DEVICE})
    bound = device_bound(plan)
    assert bound + SLACK_BYTES < spec.nbytes  # the model does not fit in what the device allows
    with device_limited(bound + SLACK_BYTES) as limit:
        off = create_offloader(plan)  # the default runtime for a CUDA plan: CudaRuntime
        assert isinstance(off, PrefetchOffloader)
        off.wrap_modules(layers)
        off.post_init()
        run_forwards(model, world)
        stats = off.stats()
        off.restore()
        peak = limit.peak()
    report(capsys, "host model, prefetch, pinned", limit, peak, bound, spec.nbytes)
    assert stats.copies_issued > 0 and stats.pin_fallbacks == 0
    assert stats.host_bytes == plan.host_bytes
    assert peak <= bound, (peak, bound)
    assert_weights(model, world.weights, on_device=set())  # every weight back in host memory
    assert all(not p.is_pinned() for p in model.parameters())
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - limit.baseline) <= TOLERANCE_BYTES


def test_a_meta_model_is_wrapped_loaded_by_name_run_and_restored(world: World,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The engine lifecycle: build on meta, plan, wrap (offloaded weights get page-locked
    host memory, resident ones device memory), fill every parameter by name, post_init."""
    model = skeleton()
    meta_params = dict(model.named_parameters())
    layers = layer_list(model)
    spec = describe_layers(layers)
    plan = make_plan(spec, PREFETCH, env_with(pin=True))
    assert plan.backend is Backend.PREFETCH and plan.pin.pin
    assert moves(plan) == ({Move.NEW_ON_HOST}, {Move.NEW_ON_DEVICE})
    offloaded = offloaded_names(plan)
    runtime = RecordingCudaRuntime()
    bound = device_bound(plan)
    with device_limited(bound + SLACK_BYTES) as limit:
        off = create_offloader(plan, runtime)
        off.wrap_modules(layers)
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(meta_params)
        for name, param in params.items():
            assert param is not meta_params[name], name  # meta Parameters cannot take data: replaced
            assert param.device.type == ("cpu" if name in offloaded else "cuda"), (name, param.device)
            assert not param.requires_grad, name
            if name in offloaded:
                assert param.is_pinned() and runtime.is_pinned(param.data), name
        assert len(runtime.records) == len(offloaded)  # one exact-size host allocation each
        assert {(r.pin, r.pinned) for r in runtime.records} == {(plan.pin.method, True)}
        for name, w in world.weights.items():  # the loader: by name, after wrapping
            model.get_parameter(name).data.copy_(w)
        off.post_init()
        assert len(runtime.records) == len(offloaded)  # filled in place: nothing copied again
        run_forwards(model, world)
        state = model.state_dict()  # the real weights, not the slots they stream through
        for name, w in world.weights.items():
            assert torch.equal(bits(state[name]).cpu(), bits(w)), name
        del state
        off.restore()
        peak = limit.peak()
    report(capsys, "meta model, prefetch, pinned", limit, peak, bound, spec.nbytes)
    assert peak <= bound, (peak, bound)
    # Offloaded weights come back in host memory, resident ones keep their device memory.
    assert_weights(model, world.weights, on_device=set(meta_params) - offloaded)
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - limit.baseline - plan.device_bytes_resident) <= TOLERANCE_BYTES


def test_uva_from_meta_views_the_loaded_host_copies(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """UVA from meta: until post_init the parameters are their host copies (so the loader
    writes host memory), then CUDA views that read those copies in place."""
    pytest.importorskip("numpy")  # torch parses __cuda_array_interface__ with it
    model = skeleton()
    layers = layer_list(model)
    spec = describe_layers(layers)
    plan = make_plan(spec, OffloadConfig(backend="uva", uva_max_bytes=3 * spec.nbytes // 4),
                     env_with(pin=True, uva=True))
    assert plan.backend is Backend.UVA and plan.pin.pin and plan.uva.enabled
    assert {p.placement for p in plan.offloaded_params} == {Placement.UVA}
    assert plan.device_bytes_buffers == 0
    assert moves(plan) == ({Move.NEW_ON_HOST}, {Move.NEW_ON_DEVICE})
    offloaded = offloaded_names(plan)
    runtime = RecordingCudaRuntime()
    bound = device_bound(plan)
    assert bound + SLACK_BYTES < spec.nbytes
    with device_limited(bound + SLACK_BYTES) as limit:
        off = create_offloader(plan, runtime)
        assert isinstance(off, UVAOffloader)
        off.wrap_modules(layers)
        host_pointers: dict[str, int] = {}
        for name, param in model.named_parameters():
            if name in offloaded:
                # The host copy itself, not a view of it.
                assert param.device.type == "cpu" and runtime.is_pinned(param.data), (name, param.device)
                host_pointers[name] = param.data_ptr()
            else:
                assert param.device.type == "cuda", (name, param.device)
        for name, w in world.weights.items():
            model.get_parameter(name).data.copy_(w)
        off.post_init()
        for name in offloaded:
            param = model.get_parameter(name)
            assert param.device.type == "cuda", (name, param.device)
            assert param.data_ptr() == host_pointers[name], name  # a view of that very host copy
        run_forwards(model, world)
        assert off.stats().copies_issued == 0  # read in place: nothing copied
        off.restore()
        peak = limit.peak()
    report(capsys, "meta model, uva", limit, peak, bound, spec.nbytes)
    assert peak <= bound, (peak, bound)
    assert_weights(model, world.weights, on_device=set(world.weights) - offloaded)
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - limit.baseline - plan.device_bytes_resident) <= TOLERANCE_BYTES


def test_pinning_off_adopts_the_host_weights_and_gives_back_the_same_storages(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    model = host_model(world.weights)
    original = {name: p.data_ptr() for name, p in model.named_parameters()}
    layers = layer_list(model)
    spec = describe_layers(layers)
    plan = make_plan(spec, PREFETCH, env_with(pin=False))
    assert plan.backend is Backend.PREFETCH and not plan.pin.pin and plan.pin.method is PinMethod.NONE
    assert moves(plan) == ({Move.ADOPT}, {Move.TO_DEVICE})
    offloaded = offloaded_names(plan)
    runtime = RecordingCudaRuntime()
    bound = device_bound(plan)
    with device_limited(bound + SLACK_BYTES) as limit:
        off = create_offloader(plan, runtime)
        off.wrap_modules(layers)
        assert runtime.records == []  # nothing copied into, or allocated in, host memory
        for name, param in model.named_parameters():
            if name in offloaded:
                assert param.device.type == "cpu" and param.data_ptr() == original[name], name
                assert not param.is_pinned(), name
            else:
                assert param.device.type == "cuda", (name, param.device)
        off.post_init()
        run_forwards(model, world, rounds=1)  # streamed from pageable memory: slow, but right
        stats = off.stats()
        off.restore()
        peak = limit.peak()
    report(capsys, "host model, prefetch, pinning off", limit, peak, bound, spec.nbytes)
    assert stats.copies_issued > 0 and stats.host_bytes == plan.host_bytes
    assert peak <= bound, (peak, bound)
    assert_weights(model, world.weights, on_device=set())
    for name, param in model.named_parameters():
        if name in offloaded:
            assert param.data_ptr() == original[name], name  # the very storage it had
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - limit.baseline) <= TOLERANCE_BYTES


def test_pinning_on_copies_into_page_locked_memory_and_restore_releases_it(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    model = host_model(world.weights)
    original = {name: p.data_ptr() for name, p in model.named_parameters()}
    layers = layer_list(model)
    spec = describe_layers(layers)
    plan = make_plan(spec, PREFETCH, env_with(pin=True))
    assert plan.pin.pin and plan.pin.method in (PinMethod.REGISTER, PinMethod.ALLOC)
    assert moves(plan) == ({Move.HOST_TO_PINNED}, {Move.TO_DEVICE})
    nbytes = {f"{p.layer}.{p.name}": p.nbytes for p in plan.params}
    offloaded = offloaded_names(plan)
    runtime = RecordingCudaRuntime()
    bound = device_bound(plan)
    with device_limited(bound + SLACK_BYTES) as limit:
        off = create_offloader(plan, runtime)
        off.wrap_modules(layers)
        hosts: dict[str, torch.Tensor] = {}  # held to the end, so their memory stays mapped
        for name in sorted(offloaded):
            param = model.get_parameter(name)
            assert param.device.type == "cpu" and param.is_pinned() and runtime.is_pinned(param.data), name
            assert param.data_ptr() != original[name], name  # a copy (the pageable original is released)
            assert param.untyped_storage().nbytes() == nbytes[name], name  # exact size, no rounding
            hosts[name] = param.data
        assert len(runtime.records) == len(offloaded)
        assert {(r.pin, r.pinned) for r in runtime.records} == {(plan.pin.method, True)}
        off.post_init()
        run_forwards(model, world, rounds=1)
        assert off.stats().pin_fallbacks == 0
        off.restore()
        peak = limit.peak()
    report(capsys, "host model, prefetch, pinned (restore checked)", limit, peak, bound, spec.nbytes)
    assert peak <= bound, (peak, bound)
    copies = {r.ptr for r in runtime.records}
    assert copies <= set(runtime.released)  # every page-locked copy given back to the runtime
    assert_weights(model, world.weights, on_device=set())
    for name, param in model.named_parameters():
        assert not param.is_pinned() and param.data_ptr() not in copies, name  # pageable memory of its own
    # Registered pages are unregistered at once; an allocation stays page-locked until its
    # last tensor (held here) dies, and the next drain frees it.
    registered = plan.pin.method is PinMethod.REGISTER
    assert {name: bool(h.is_pinned()) for name, h in hosts.items()} == {name: not registered for name in hosts}
    gc.collect()
    runtime.synchronize()
    assert retired_count() == 0
    count = len(hosts)
    hosts.clear()
    gc.collect()
    if registered:
        assert retired_count() == 0  # nothing was left to a finalizer: all released explicitly
    else:
        assert retired_count() >= count  # every allocation now waits for the drain ...
    runtime.synchronize()
    assert retired_count() == 0  # ... which gives it back
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - limit.baseline) <= TOLERANCE_BYTES
