"""PrefetchOffloader on the CPU: parity with a resident copy, torch.compile, special
weights (transposed, int8, float8, tied), restore, lifecycle errors, mismatched models,
rollback after a failed host copy, and the pin decision reaching the runtime unchanged.

Post-processing is in test_post_processing.py; copy/compute ordering and CUDA-graph
logic (with a recording fake runtime) are in test_streams.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, PlanError, WarningCode
from offload.pure import PinMethod, PinReason
from offload.pure.plan.layout import owns_buffer
from offload.runtime.cpu import CpuRuntime
from tests.executors.fakes import WAIT_SECONDS, FakeRuntime, HostCopy, HostEmpty, InjectedFailure, Wait
from tests.executors.helpers import (
    assert_restored,
    cpu_plan,
    cuda_like_plan,
    inputs,
    patched_layers,
    pinned_plan,
    prefetch,
    snapshot,
    tie_groups,
)
from tests.executors.models import (
    HIDDEN,
    Float8Linear,
    Int8Linear,
    SharedStorageBlock,
    SlicedBlock,
    TiedBlock,
    TransformerBlock,
    TransposedBlock,
    bits,
    layer_list,
    mixed_model,
    replace_up_weight_data,
    transformer_model,
)


def owner_params(plan: OffloadPlan) -> list[tuple[int, str, int]]:
    """(layer, name, bytes) of each offloaded parameter that owns a buffer (one copy each)."""
    return [(p.layer, p.name, p.nbytes) for p in plan.offloaded_params if owns_buffer(p)]


def expected_copies(plan: OffloadPlan, forwards: int) -> tuple[int, int]:
    """(copies issued, bytes copied) after post_init and `forwards` full forwards: the
    first ``s = min(prefetch_step, n)`` positions are copied at post_init, and every step
    copies each position again except a lone owner of its slot (slot ``i`` is owned by
    positions ``i, i + s, ...``: alone when ``i + s >= n``), which stays loaded."""
    owners = owner_params(plan)
    n = len(plan.offloaded_layers)
    s = min(plan.config.prefetch_step, n)
    lone = {plan.offloaded_layers[i] for i in range(s) if i + s >= n}
    initial = [nbytes for layer, _, nbytes in owners if layer in set(plan.offloaded_layers[:s])]
    per_step = [nbytes for layer, _, nbytes in owners if layer not in lone]
    return len(initial) + forwards * len(per_step), sum(initial) + forwards * sum(per_step)


# ---- parity over configurations -------------------------------------------------------

NUM_LAYERS = 7

# (config, offloaded layers): counts that are and are not multiples of the step, steps
# above 1, the stalling default (step 1), a step covering every layer, a single layer.
CONFIGS = [
    pytest.param(OffloadConfig(group_size=1), (0, 1, 2, 3, 4, 5, 6), id="default-every-layer-step1"),
    pytest.param(OffloadConfig(group_size=1, prefetch_step=2), (0, 1, 2, 3, 4, 5, 6), id="7-layers-step2"),
    pytest.param(OffloadConfig(group_size=1, prefetch_step=3), (0, 1, 2, 3, 4, 5, 6), id="7-layers-step3"),
    pytest.param(OffloadConfig(group_size=2, prefetch_step=2), (1, 3, 5), id="every-2nd-3-layers-step2"),
    pytest.param(OffloadConfig(group_size=3, num_in_group=2, prefetch_step=2), (1, 2, 4, 5), id="4-layers-step2"),
    pytest.param(OffloadConfig(group_size=4, num_in_group=2, prefetch_step=3), (2, 3, 6), id="3-layers-step3"),
    pytest.param(OffloadConfig(group_size=1, prefetch_step=9), (0, 1, 2, 3, 4, 5, 6), id="step-above-count"),
    pytest.param(OffloadConfig(group_size=7, prefetch_step=2), (6,), id="one-layer"),
]


@pytest.mark.parametrize(("config", "offloaded"), CONFIGS)
def test_parity_with_resident_copy_over_several_forwards(config: OffloadConfig, offloaded: tuple[int, ...]) -> None:
    model = transformer_model(NUM_LAYERS)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    plan = cpu_plan(model, config)
    assert plan.offloaded_layers == offloaded
    off = prefetch(plan)
    before = snapshot(model)

    assert off.wrap_modules(layers) == layers
    assert patched_layers(layers) == list(offloaded)
    for index, layer in enumerate(layers):  # resident layers are untouched
        if index not in offloaded:
            for name, p in layer.named_parameters():
                assert p.data_ptr() == before[f"{index}.{name}"].ptr
    off.post_init()
    assert off.plan is plan  # nothing was post-processed
    forwards = 0
    for x in inputs(seed=1):
        assert torch.equal(model(x), reference(x))
        forwards += 1

    stats = off.stats()
    assert stats.params_offloaded == len(plan.offloaded_params) > 0
    assert stats.host_bytes == plan.host_bytes
    assert stats.device_buffer_bytes == plan.device_bytes_buffers
    assert (stats.copies_issued, stats.bytes_copied) == expected_copies(plan, forwards)
    assert stats.realignments == 0  # lone owners stay loaded: no layer ran without its weights
    assert stats.params_dropped == 0
    assert stats.wait_seconds is None  # the CPU runtime cannot measure waiting

    off.restore()
    assert_restored(model, before, same_storage=False)
    assert patched_layers(layers) == []
    for x in inputs(seed=2):
        assert torch.equal(model(x), reference(x))


def test_default_step_warns_that_it_stalls_and_still_computes_exactly() -> None:
    model = transformer_model(3)
    plan = cpu_plan(model, OffloadConfig(group_size=1))
    assert WarningCode.PREFETCH_STALLS in plan.warning_codes()
    reference = copy.deepcopy(model)
    off = prefetch(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=3):
        assert torch.equal(model(x), reference(x))


def test_offloaded_parameters_point_at_static_buffers_that_take_turns() -> None:
    """After post_init a parameter's data is its slot; layers sharing a slot share memory."""
    model = transformer_model(5)
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    layers = layer_list(model)
    off = prefetch(plan)
    off.wrap_modules(layers)
    off.post_init()
    ptr = [layer.get_parameter("mlp.up.weight").data_ptr() for layer in layers]
    assert plan.schedule.slots == (0, 1, 0, 1, 0)
    assert ptr[0] == ptr[2] == ptr[4] != ptr[1] == ptr[3]


# ---- torch.compile ------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("config", [
    pytest.param(OffloadConfig(group_size=1, prefetch_step=2), id="5-layers-step2"),
    pytest.param(OffloadConfig(group_size=2, prefetch_step=1), id="every-2nd-step1"),
])
def test_compiled_fullgraph_parity(config: OffloadConfig) -> None:
    model = transformer_model(5)
    reference = copy.deepcopy(model)
    plan = cpu_plan(model, config)
    off = prefetch(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    shapes = ((2, 5), (2, 5), (2, 5))
    for forwards, x in enumerate(inputs(seed=4, shapes=shapes), start=1):
        assert torch.equal(compiled(x), reference(x))
        # The custom ops ran (they were not traced away): every layer's copy was issued.
        assert off.stats().copies_issued == expected_copies(plan, forwards)[0]


# Importing inductor reaches torch.jit.script(_method), deprecated since torch 2.10.
@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
def test_inductor_keeps_weight_only_math_after_the_wait() -> None:
    """Int8 layers dequantise from their weights alone (``qweight.to(dtype) * scale``),
    which the wait op's mutated activation does not order. Were the compiler to move that
    math ahead of the op that fills the slot, it would read the slot's previous owner (on
    the CPU runtime deterministically: the copy runs inside the op). Inductor fuses
    differently from eager, so the comparison has a tolerance; another layer's weights
    would be off by far more."""
    torch._dynamo.reset()
    model = nn.Sequential(*[Int8Linear() for _ in range(6)]).requires_grad_(False)
    reference = copy.deepcopy(model)
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    off = prefetch(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    compiled = torch.compile(model, fullgraph=True)  # inductor
    for x in inputs(seed=21, shapes=((1, 3), (1, 3))):
        torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    off.restore()
    torch._dynamo.reset()


# ---- special weights ----------------------------------------------------------------------


def test_mixed_model_parity_and_restore() -> None:
    """Transposed, int8, float8, tied and shared-storage weights, all offloaded."""
    model = mixed_model()
    reference = copy.deepcopy(model)
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=3))
    assert len(plan.offloaded_layers) == 10
    off = prefetch(plan)
    before = snapshot(model)
    ties = tie_groups(model)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=5):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    for x in inputs(seed=6):
        assert torch.equal(model(x), reference(x))


def test_transposed_weight_keeps_its_strides_on_host_in_buffer_and_after_restore() -> None:
    model = nn.Sequential(*[TransposedBlock() for _ in range(3)])
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    original = layers[1].get_parameter("weight_t")
    stride, shape = original.stride(), tuple(original.shape)
    assert not original.is_contiguous()
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    [buffer] = [b for b in plan.buffers if b.name == "weight_t"]
    assert (buffer.shape, buffer.stride) == (shape, stride)
    off = prefetch(plan)
    off.wrap_modules(layers)
    assert layers[1].get_parameter("weight_t").stride() == stride  # the host copy
    off.post_init()
    for layer in layers:  # the buffers
        assert layer.get_parameter("weight_t").stride() == stride
    for x in inputs(seed=7):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert layers[1].get_parameter("weight_t").stride() == stride
    assert torch.equal(layers[1].get_parameter("weight_t"), reference[1].get_parameter("weight_t"))


@pytest.mark.parametrize("block", [Int8Linear, Float8Linear])
def test_int8_and_float8_weights_are_carried_bit_exact(block: type[nn.Module]) -> None:
    model = nn.Sequential(*[block() for _ in range(4)])
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    name = "qweight" if block is Int8Linear else "fweight"
    dtype = torch.int8 if block is Int8Linear else torch.float8_e4m3fn
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    assert {(p.dtype, p.itemsize, p.nbytes) for p in plan.offloaded_params if p.name == name} == {
        (str(dtype).removeprefix("torch."), 1, 16 * 16)}

    def assert_carried(index: int) -> None:
        live = layers[index].get_parameter(name)
        assert live.dtype == dtype
        assert torch.equal(bits(live), bits(reference[index].get_parameter(name)))

    off = prefetch(plan)
    off.wrap_modules(layers)
    for index in range(4):  # the host copies
        assert_carried(index)
    off.post_init()
    for x in inputs(seed=8):
        assert torch.equal(model(x), reference(x))
        # After a whole pass the first positions' slots were refilled for the next pass.
        for position in plan.schedule.initial:
            assert_carried(plan.offloaded_layers[position])
    off.restore()
    for index in range(4):
        assert_carried(index)


@pytest.mark.parametrize("block", [TiedBlock, SharedStorageBlock])
def test_tied_weights_share_one_buffer_and_one_host_copy(block: type[nn.Module]) -> None:
    model = nn.Sequential(*[block() for _ in range(3)])
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    names = ("a.weight", "b.weight") if block is TiedBlock else ("first", "second")
    ties = tie_groups(model)
    assert ties == {frozenset(f"{i}.{n}" for n in names) for i in range(3)}
    plan = pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    assert [p.tied_to for p in plan.offloaded_params if p.name == names[1]] == [(i, names[0]) for i in range(3)]
    storages = {p.data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}  # tied names once
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    before = snapshot(model)
    off.wrap_modules(layers)
    assert runtime.host_copies == len(storages)
    off.post_init()

    assert runtime.host_copies == len(storages)  # post_init copied nothing again
    assert [w.message for w in off.plan.warnings if w.code is WarningCode.PLAN_REVISED] == []
    assert off.plan is plan  # nothing changed: the tie is intact, the plan needs no revision
    for layer in layers:
        assert layer.get_parameter(names[0]).data_ptr() == layer.get_parameter(names[1]).data_ptr()
    assert off.stats().host_bytes == plan.host_bytes == sum(storages.values())  # each storage once
    for x in inputs(seed=9):
        assert torch.equal(model(x), reference(x))

    off.restore()
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    if block is TiedBlock:
        for layer in layers:
            assert layer.get_parameter("a.weight") is layer.get_parameter("b.weight")


def test_post_init_copies_unchanged_weights_no_second_time() -> None:
    """Weights nobody replaced are already in host storage: post_init must not copy them
    again (a second pinned copy of a whole model is seconds and gigabytes on a GPU)."""
    model = transformer_model(4)
    runtime = FakeRuntime()
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    off.wrap_modules(layer_list(model))
    after_wrap = runtime.host_copies
    assert after_wrap == len(off.plan.offloaded_params)
    replace_up_weight_data(layer_list(model)[2])
    off.post_init()
    assert runtime.host_copies == after_wrap + 1  # only the replaced weight


# ---- restore ------------------------------------------------------------------------------


def test_restore_before_post_init_is_bit_identical() -> None:
    model = mixed_model(seed=3)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=2, prefetch_step=2)))
    layers = layer_list(model)
    off.wrap_modules(layers)
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert patched_layers(layers) == []
    assert off.stats().params_offloaded == 0
    assert off.stats().host_bytes == 0
    for x in inputs(seed=10):
        assert torch.equal(model(x), reference(x))


def test_restore_puts_back_a_forward_the_user_had_patched() -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    calls: list[int] = []
    original = layers[1].forward

    def user_forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out: torch.Tensor = original(x)
        return out

    layers[1].forward = user_forward  # an instance-level patch, on purpose
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)))
    off.wrap_modules(layers)
    off.post_init()
    x = next(inputs(seed=11))
    assert torch.equal(model(x), reference(x))
    assert calls == [1]  # the user's patch ran under the executor's hook
    off.restore()
    assert layers[1].__dict__["forward"] is user_forward
    assert "forward" not in layers[0].__dict__ and "forward" not in layers[2].__dict__
    assert torch.equal(model(x), reference(x))
    assert calls == [1, 1]


def test_stats_release_host_and_buffers_on_restore_but_keep_counters() -> None:
    model = transformer_model(3)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)))
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=12)))
    issued = off.stats().copies_issued
    off.restore()
    stats = off.stats()
    assert (stats.params_offloaded, stats.host_bytes, stats.device_buffer_bytes) == (0, 0, 0)
    assert stats.copies_issued == issued > 0


# ---- lifecycle errors -------------------------------------------------------------------




def test_wrap_twice_is_an_error_and_changes_nothing() -> None:
    model = transformer_model(3)
    layers = layer_list(model)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)))
    off.wrap_modules(layers)
    during = snapshot(model)
    with pytest.raises(ExecutionError, match="already") as info:
        off.wrap_modules(layers)
    assert info.value.name == "state"
    assert_restored(model, during, same_storage=True)


def test_post_init_before_wrap_is_an_error() -> None:
    model = transformer_model(2)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1)))
    with pytest.raises(ExecutionError, match="wrap_modules first"):
        off.post_init()


def test_post_init_twice_is_an_error() -> None:
    model = transformer_model(2)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1)))
    off.wrap_modules(layer_list(model))
    off.post_init()
    with pytest.raises(ExecutionError, match="runs once") as info:
        off.post_init()
    assert info.value.value == "ready"


def test_forward_before_post_init_is_an_error() -> None:
    model = transformer_model(3)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)))
    off.wrap_modules(layer_list(model))
    with pytest.raises(ExecutionError, match="before post_init") as info:
        model(next(inputs(seed=13)))
    assert info.value.value == "wrapped"


def test_sync_before_post_init_is_an_error() -> None:
    model = transformer_model(2)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1)))
    off.wrap_modules(layer_list(model))
    with pytest.raises(ExecutionError, match="post_init first"):
        off.sync_prev_onload()


def test_restore_twice_and_restore_before_wrap_are_errors() -> None:
    model = transformer_model(2)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1)))
    with pytest.raises(ExecutionError, match="restore needs a wrapped model"):
        off.restore()
    off.wrap_modules(layer_list(model))
    off.post_init()
    off.restore()
    with pytest.raises(ExecutionError, match="restore needs a wrapped model") as info:
        off.restore()
    assert info.value.value == "restored"


# ---- mismatched models ------------------------------------------------------------------


def _wrong_last_layer(kind: str) -> nn.Module:
    if kind == "shape":
        return TransformerBlock(inner=32)
    if kind == "dtype":
        return TransformerBlock().to(torch.bfloat16)
    assert kind == "missing"
    block = TransformerBlock()
    block.mlp.down.register_parameter("bias", None)  # a planned parameter is gone
    return block


@pytest.mark.parametrize(("kind", "name"), [
    ("count", "layers"),
    ("shape", "mlp.up.weight"),
    ("dtype", "attn.norm.weight"),
    ("missing", "mlp.down.bias"),
    ("not-a-module", "layers[2]"),
])
def test_mismatched_model_raises_plan_error_before_anything_moves(kind: str, name: str) -> None:
    planned = transformer_model(3)
    plan = cpu_plan(planned, OffloadConfig(group_size=1, prefetch_step=2))
    model = transformer_model(3, seed=1)
    layers: list[Any] = list(layer_list(model))
    if kind == "count":
        layers = layers[:2]
    elif kind == "not-a-module":
        layers[2] = torch.zeros(1)
    else:
        layers[2] = _wrong_last_layer(kind)
    kept = nn.Sequential(*layers[:2])
    before = snapshot(kept)
    off = prefetch(plan)
    with pytest.raises(PlanError) as info:
        off.wrap_modules(layers)
    assert info.value.name == name
    if kind in ("shape", "dtype", "missing"):
        assert "layer 2" in str(info.value)
    assert_restored(kept, before, same_storage=True)
    assert patched_layers(layers[:2]) == []
    # Nothing happened: the same offloader still wraps the right model.
    right = copy.deepcopy(planned)
    reference = copy.deepcopy(planned)
    off.wrap_modules(layer_list(right))
    off.post_init()
    x = next(inputs(seed=15))
    assert torch.equal(right(x), reference(x))


# ---- a host copy failing at every position ---------------------------------------------


def failure_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TransformerBlock(), TiedBlock(), SharedStorageBlock(), TransposedBlock(), Int8Linear())


#: Host copies wrap_modules makes for `failure_model` (tied names share one): 11 + 2 + 1 + 3 + 2.
FAILURE_MODEL_HOST_COPIES = 19


def test_failure_model_host_copy_count() -> None:
    model = failure_model()
    runtime = FakeRuntime()
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    off.wrap_modules(layer_list(model))
    assert runtime.host_copies == FAILURE_MODEL_HOST_COPIES


@pytest.mark.parametrize("k", range(FAILURE_MODEL_HOST_COPIES))
def test_host_copy_failure_at_any_position_leaves_the_model_as_it_was(k: int) -> None:
    model = failure_model()
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    ties = tie_groups(model)
    runtime = FakeRuntime(fail_host_copy_at=k)
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    with pytest.raises(ExecutionError, match=f"injected host_copy failure #{k}") as info:
        off.wrap_modules(layers)
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert info.value.value == "InjectedFailure"
    assert runtime.host_copies == k + 1  # it stopped at the failure
    # Pageable weights copied into page-locked memory were released as they went (the
    # host bound); undoing brought them back from their copies: same values, new storage.
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    assert patched_layers(layers) == []
    x = next(inputs(seed=16))
    assert torch.equal(model(x), reference(x))


def test_after_a_failed_wrap_the_same_offloader_can_wrap_again() -> None:
    model = failure_model()
    reference = copy.deepcopy(model)
    runtime = FakeRuntime(fail_host_copy_at=7)
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    with pytest.raises(ExecutionError):
        off.wrap_modules(layer_list(model))
    off.wrap_modules(layer_list(model))  # host copy #8 onwards succeed
    off.post_init()
    for x in inputs(seed=17):
        assert torch.equal(model(x), reference(x))


def test_an_execution_error_from_the_runtime_passes_through_unwrapped() -> None:
    """A runtime raising its own ExecutionError (a pin request on the CPU) is not rewrapped,
    and the model is left as it was."""
    model = transformer_model(2)
    before = snapshot(model)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1), disable_pin_memory=False)
    assert plan.pin.pin
    off = prefetch(plan, CpuRuntime())
    with pytest.raises(ExecutionError, match="cannot pin") as info:
        off.wrap_modules(layer_list(model))
    assert info.value.name == "pin"
    assert_restored(model, before, same_storage=True)


@pytest.mark.parametrize("k", [0, 3])
def test_a_failed_post_init_leaves_weights_in_host_storage_and_can_be_retried(k: int) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    runtime = FakeRuntime(fail_device_empty_at=k)
    off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    off.wrap_modules(layers)
    host = snapshot(model)  # the parameters now hold their host copies
    with pytest.raises(ExecutionError, match=f"injected device_empty failure #{k}") as info:
        off.post_init()
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert_restored(model, host, same_storage=False)  # back in host storage, values intact
    off.post_init()  # the next device_empty calls succeed
    for x in inputs(seed=19):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert_restored(model, before, same_storage=False)


# ---- the pin decision reaches the runtime unchanged -------------------------------------


def _run_with_post_processing(plan: OffloadPlan, model: nn.Sequential, runtime: FakeRuntime) -> None:
    off = prefetch(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    replace_up_weight_data(layers[1])  # post_init must copy this one again, with the same pin
    off.post_init()
    for x in inputs(seed=18):
        model(x)
    off.restore()


def test_regression_pin_off_means_no_pin_call_prefetch() -> None:
    """The founding bug: a backend pinned although the user said not to. With
    OFFLOAD_DISABLE_PIN_MEMORY on a CUDA machine the plan says pin=False: host weights are
    used in place (no copy, nothing pinned), and every host memory the executor asks for
    (weights loaded after wrapping, re-copies after post-processing) is unpinned."""
    model = transformer_model(3)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=True)
    assert plan.compute_device == "cuda"
    assert (plan.pin.pin, plan.pin.reason) == (False, PinReason.DISABLED_BY_ENV)
    assert len(plan.offloaded_params) == 3 * 11
    runtime = FakeRuntime()
    _run_with_post_processing(plan, model, runtime)
    assert runtime.entries(HostCopy) == []  # adopted in place, re-copy included
    meta = transformer_model(3).to("meta")
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(meta))
    empties = runtime.entries(HostEmpty)
    assert len(empties) == sum(p.tied_to is None for p in plan.offloaded_params)
    assert {e.pin for e in empties} == {PinMethod.NONE}
    assert not any(runtime.is_pinned(p.data) for p in meta.parameters())


def test_pin_on_means_every_host_copy_is_pinned() -> None:
    model = transformer_model(3)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False)
    assert (plan.pin.pin, plan.pin.reason) == (True, PinReason.ENABLED)
    runtime = FakeRuntime()
    _run_with_post_processing(plan, model, runtime)
    pins = [entry.pin for entry in runtime.entries(HostCopy)]
    assert len(pins) >= len(plan.offloaded_params) + 1
    assert set(pins) == {plan.pin.method} and plan.pin.method is not PinMethod.NONE


def test_sliced_weight_with_gaps_keeps_its_strides_and_parity() -> None:
    """Strides that leave gaps: the buffer has them too, and the span copy fills it. The
    reference is the model itself before offloading (a deep copy would be contiguous and
    run a different GEMM)."""
    model = nn.Sequential(*[SlicedBlock() for _ in range(4)])
    layers = layer_list(model)
    weights = [layer.get_parameter("weight").detach().clone() for layer in layers]
    stride = layers[0].get_parameter("weight").stride()
    assert stride == (2 * HIDDEN, 2)
    expected = [model(x) for x in inputs(seed=11)]
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=1))
    assert {(b.stride, b.nbytes) for b in plan.buffers} == {(stride, ((HIDDEN - 1) * (2 * HIDDEN + 2) + 1) * 4)}
    off = prefetch(plan)
    off.wrap_modules(layers)
    off.post_init()
    assert all(layer.get_parameter("weight").stride() == stride for layer in layers)
    for x, want in zip(inputs(seed=11), expected, strict=True):
        assert torch.equal(model(x), want)
    off.restore()
    for layer, weight in zip(layers, weights, strict=True):
        assert layer.get_parameter("weight").stride() == stride
        assert torch.equal(layer.get_parameter("weight"), weight)


def test_stats_report_the_wait_time_the_runtime_measured() -> None:
    """One wait per offloaded layer per forward, and `wait_seconds` is what the runtime
    measured for them (the fake counts a made-up duration per wait)."""
    model = transformer_model(5)
    plan = cuda_like_plan(model, OffloadConfig(group_size=1, prefetch_step=2), disable_pin_memory=False)
    runtime = FakeRuntime()
    off = prefetch(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert off.stats().wait_seconds == 0.0
    forwards = 0
    for x in inputs(seed=19):
        model(x)
        forwards += 1
    waits = runtime.entries(Wait)
    assert len(waits) == forwards * len(plan.offloaded_layers) > 0
    assert off.stats().wait_seconds == WAIT_SECONDS * len(waits)
    off.restore()
