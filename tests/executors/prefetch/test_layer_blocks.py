"""One copy per prefetched layer: host blocks, device arenas, merged copies
(`offload.pure.plan.blocks`), run by the prefetch executor."""

from __future__ import annotations

import copy
import gc
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from offload import ExecutionError, OffloadConfig
from offload.executors import ops
from offload.pure import LayerBlocks
from offload.pure.check import Location
from offload.pure.plan.blocks import copies_per_step, layer_copies
from offload.runtime.cpu import CpuRuntime
from tests.executors.blocks_helpers import BlockRuntime, OddMiddle, linear_stack, odd_middle_model
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import assert_restored, cpu_plan, pinned_plan, prefetch, snapshot
from tests.executors.models import Int8Linear, layer_list

LAYER_BYTES = 64 * 64 * 4 + 64 * 4  # a TanhLinear layer: weight and bias


def activations(seed: int = 1) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    for batch, tokens in ((2, 5), (1, 3), (3, 7), (2, 5)):
        yield torch.randn(batch, tokens, 64, generator=generator)


def config(step: int = 2, blocks: LayerBlocks = "auto", group_size: int = 1) -> OffloadConfig:
    return OffloadConfig(group_size=group_size, prefetch_step=step, layer_blocks=blocks)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("defer", [False, True], ids=["sync", "deferred"])
def test_each_layer_is_one_copy_and_outputs_are_bit_exact(step: int, defer: bool) -> None:
    model = linear_stack(6)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    plan = pinned_plan(model, config(step))
    rt = BlockRuntime(FakeRuntime(defer=defer))
    off = prefetch(plan, rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert rt.blocks_made == 6 and rt.live_blocks == 6
    issued = len(rt.copies)
    forwards = 0
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
            forwards += 1
    per_forward = rt.copies[issued:]
    assert len(per_forward) == forwards * 6  # one copy per layer, not one per parameter
    assert {nbytes for _, _, nbytes in per_forward} == {LAYER_BYTES}
    stats = off.stats()
    assert stats.copies_issued == len(rt.copies)
    assert stats.bytes_copied == sum(n for _, _, n in rt.copies)
    assert stats.host_bytes == plan.host_bytes == 6 * LAYER_BYTES
    assert stats.device_buffer_bytes == plan.device_bytes_buffers
    assert stats.pin_fallbacks == 0
    check = off.check()
    assert check.ok, check.differences
    assert {p.actual for p in check.params} == {Location.SLOT}
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert rt.blocks_released == 6 and rt.live_blocks == 0


def test_never_copies_each_parameter_and_makes_no_block() -> None:
    model = linear_stack(4)
    reference = copy.deepcopy(model)
    rt = BlockRuntime()
    off = prefetch(pinned_plan(model, config(blocks="never")), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    issued = len(rt.copies)
    with torch.no_grad():
        x = next(activations())
        assert torch.equal(model(x), reference(x))
    assert rt.blocks_made == 0
    assert sorted(n for _, _, n in rt.copies[issued:]) == sorted([64 * 64 * 4, 64 * 4] * 4)


def test_a_runtime_without_blocks_copies_each_parameter() -> None:
    model = linear_stack(3)
    rt = FakeRuntime()
    off = prefetch(pinned_plan(model, config(blocks="always")), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert off.stats().host_bytes == 3 * LAYER_BYTES
    assert len({t.untyped_storage().data_ptr() for t in off._host.tensors()}) == 6  # one allocation each


def test_unaligned_parameters_are_copied_alone_beside_the_merged_rest() -> None:
    model = odd_middle_model(4)
    reference = copy.deepcopy(model)
    rt = BlockRuntime()
    off = prefetch(pinned_plan(model, config()), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    issued = len(rt.copies)
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    sizes = Counter(n for _, _, n in rt.copies[issued:])
    # The two 16 KiB weights of each layer are one copy; the 252-byte vector its own.
    assert sizes == Counter({2 * 64 * 64 * 4: 16, 63 * 4: 16})
    assert layer_copies(off.plan) == (2, 2, 2, 2)  # what the plan predicts, and render_plan shows
    assert rt.blocks_made == 4
    assert off.stats().host_bytes == off.plan.host_bytes


@pytest.mark.parametrize(("layers", "step"), [(3, 2), (5, 3), (4, 4)])
def test_measured_copies_are_what_the_plan_predicts_with_layers_kept_in_their_slots(layers: int, step: int) -> None:
    """A layer alone in its slot is copied at post_init only: per step
    the executor copies `copies_per_step`, at post_init `layer_copies` of the first ones."""
    model = linear_stack(layers)
    reference = copy.deepcopy(model)
    plan = pinned_plan(model, config(step))
    assert plan.schedule.kept_positions  # some layer has a slot of its own
    rt = BlockRuntime(FakeRuntime())
    off = prefetch(plan, rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert len(rt.copies) == sum(layer_copies(plan)[i] for i in plan.schedule.initial)
    issued = len(rt.copies)
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    assert len(rt.copies) - issued == 4 * sum(copies_per_step(plan))
    # Slot s is owned by positions s, s + step, ...: alone when s + step >= layers.
    lone = [s for s in range(min(step, layers)) if s + step >= layers]
    assert sum(copies_per_step(plan)) == layers - len(lone)
    assert off.stats().realignments == 0
    off.restore()


def test_on_the_cpu_always_copies_adopted_weights_into_blocks_and_releases_the_originals() -> None:
    model = linear_stack(5)
    reference = copy.deepcopy(model)
    originals = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]  # type: ignore[no-untyped-call]  # unannotated in torch
    off = prefetch(cpu_plan(model, config(blocks="always")), CpuRuntime())
    off.wrap_modules(layer_list(model))
    assert all(ref.expired() for ref in originals)  # type: ignore[no-untyped-call]  # as above
    off.post_init()
    copies = off.stats().copies_issued
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    assert off.stats().copies_issued - copies == 4 * 5
    assert off.stats().host_bytes == off.plan.host_bytes
    off.restore()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, want)


def test_on_the_cpu_auto_keeps_adopted_weights_where_they_are() -> None:
    model = linear_stack(3)
    pointers = [p.data_ptr() for p in model.parameters()]
    off = prefetch(cpu_plan(model, config()), CpuRuntime())
    off.wrap_modules(layer_list(model))
    assert sorted(t.data_ptr() for t in off._host.tensors()) == sorted(pointers)


def test_post_processing_that_keeps_the_layout_is_copied_into_the_block() -> None:
    model = linear_stack(4)
    reference = copy.deepcopy(model)
    rt = BlockRuntime()
    off = prefetch(pinned_plan(model, config()), rt)
    layers = layer_list(model)
    off.wrap_modules(layers)
    for layer, ref_layer in zip(layers, layer_list(reference), strict=True):
        assert isinstance(layer, nn.Linear) and isinstance(ref_layer, nn.Linear)
        layer.weight.data = layer.weight.data * 0.5  # a new tensor, same shape, strides and dtype
        ref_layer.weight.data = ref_layer.weight.data * 0.5
    off.post_init()
    assert rt.blocks_made == 4 and rt.live_blocks == 4
    issued = len(rt.copies)
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    assert len(rt.copies) - issued == 4 * 4  # still one copy per layer
    assert off.stats().host_bytes == off.plan.host_bytes == 4 * LAYER_BYTES


def test_post_processing_that_changes_the_layout_gets_its_own_copy_and_the_block_is_counted() -> None:
    model = linear_stack(3)
    reference = copy.deepcopy(model)
    rt = BlockRuntime()
    off = prefetch(pinned_plan(model, config()), rt)
    layers = layer_list(model)
    off.wrap_modules(layers)
    first, ref_first = layers[0], layer_list(reference)[0]
    assert isinstance(first, nn.Linear) and isinstance(ref_first, nn.Linear)
    first.weight.data = first.weight.data.t().contiguous().t()  # same values, transposed strides
    ref_first.weight.data = ref_first.weight.data.t().contiguous().t()
    off.post_init()
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
    # The old member's bytes stay in its block until the block goes: counted, not hidden.
    assert off.stats().host_bytes == 3 * LAYER_BYTES + 64 * 64 * 4
    off.restore()
    assert rt.live_blocks == 0


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_failed_block_leaves_the_model_as_it_was_and_keeps_no_block(fail_at: int) -> None:
    model = linear_stack(4)
    before = snapshot(model)
    rt = BlockRuntime(fail_block_at=fail_at)
    off = prefetch(pinned_plan(model, config()), rt)
    with pytest.raises(ExecutionError, match="model left as it was"):
        off.wrap_modules(layer_list(model))
    # Same Parameters, values and layouts; the pageable originals went once copied into the
    # (played) pinned blocks, as for any pinned copy, so the data is recovered into new memory.
    assert_restored(model, before, same_storage=False)
    assert rt.live_blocks == 0 and rt.blocks_released == fail_at


def test_a_block_whose_pinning_failed_stays_pageable_and_is_counted() -> None:
    model = linear_stack(3)
    reference = copy.deepcopy(model)
    rt = BlockRuntime(fallback_at=1)
    off = prefetch(pinned_plan(model, config()), rt)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert off.stats().pin_fallbacks == 2  # the two copies of layer 1
    with torch.no_grad():
        x = next(activations())
        assert torch.equal(model(x), reference(x))


def test_state_dict_entries_are_separate_tensors_that_save_with_safetensors(tmp_path: object) -> None:
    model = linear_stack(3)
    reference = copy.deepcopy(model)
    off = prefetch(pinned_plan(model, config()), BlockRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    state = model.state_dict()
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
    path = f"{tmp_path}/weights.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, path)
    loaded = safetensors.torch.load_file(path)
    for name, want in reference.state_dict().items():
        assert torch.equal(loaded[name], want), name


def test_compiled_fullgraph_parity_with_one_copy_per_layer() -> None:
    model = linear_stack(5)
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, config(blocks="always")), CpuRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    start = off.stats().copies_issued
    with torch.no_grad():
        for forwards, x in enumerate([next(activations())] * 3, start=1):
            assert torch.equal(compiled(x), reference(x))
            assert off.stats().copies_issued - start == forwards * 5


# ---- from the CUDA review: compile with arenas, swaps, fully replaced blocks ------------


def int8_model(layers: int, *, seed: int = 0) -> nn.Sequential:
    """Int8 weights with float32 scales: one arena holds two dtypes."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Int8Linear(64) for _ in range(layers)]).requires_grad_(False)


# Importing inductor reaches torch.jit.script(_method), deprecated since torch 2.10.
@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script:FutureWarning")
@pytest.mark.parametrize("build", [lambda: linear_stack(6), lambda: int8_model(5)], ids=["shared-slots", "mixed-dtypes"])
def test_inductor_fullgraph_with_arenas_hands_the_ops_the_real_slots(build: Callable[[], nn.Module]) -> None:
    """Layers sharing slots (6 layers, 2 slots) and arenas of two dtypes compile with
    inductor, match eager, and the ops get the slot tensors themselves (not copies)."""
    model = build()
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, config(2, "always")), CpuRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    compiled = torch.compile(model, fullgraph=True)
    x = next(activations())
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    assert off._handle not in ops._copied_once


def test_arena_members_are_separate_storages_that_keep_the_arena_alive() -> None:
    model = linear_stack(2)
    off = prefetch(cpu_plan(model, config(2, "always")), CpuRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    first = layer_list(model)[0]
    assert isinstance(first, nn.Linear)
    weight, bias = first.weight.data, first.bias.data
    assert weight.untyped_storage().data_ptr() != bias.untyped_storage().data_ptr()
    assert bias.data_ptr() == weight.data_ptr() + weight.numel() * 4  # back to back in one allocation
    off.restore()
    del off
    gc.collect()
    bias.fill_(1.0)  # the slot's memory lives as long as a tensor over it
    assert torch.equal(bias, torch.ones(64))


@pytest.mark.parametrize("across", [False, True], ids=["within-a-block", "across-blocks"])
def test_parameters_swapped_by_post_processing_keep_their_own_values(across: bool) -> None:
    """Post-processing that swaps two same-layout weights of host blocks: each must get the
    other's values, not the value copied in place a moment before."""
    model = odd_middle_model(2)
    reference = copy.deepcopy(model)
    off = prefetch(pinned_plan(model, config()), BlockRuntime())
    off.wrap_modules(layer_list(model))
    for m in (model, reference):
        a, b = m[0], m[1 if across else 0]
        assert isinstance(a, OddMiddle) and isinstance(b, OddMiddle)
        a.first.data, b.second.data = b.second.data, a.first.data
    off.post_init()
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))


def test_a_block_whose_members_were_all_replaced_is_let_go() -> None:
    model = linear_stack(2)
    off = prefetch(pinned_plan(model, config()), BlockRuntime())
    layers = layer_list(model)
    off.wrap_modules(layers)
    first = layers[0]
    assert isinstance(first, nn.Linear)
    member = StorageWeakRef(first.weight.untyped_storage())  # type: ignore[no-untyped-call]  # unannotated in torch
    # Both members of layer 0 get data of another layout: each gets a copy of its own.
    first.weight.data = first.weight.data.t().contiguous().t()
    first.bias.data = first.bias.data.double()
    off.post_init()
    gc.collect()
    assert member.expired()  # type: ignore[no-untyped-call]  # as above
    assert off.stats().host_bytes == LAYER_BYTES + 64 * 64 * 4 + 64 * 8


def test_a_weight_moved_to_another_layer_keeps_its_values_when_its_old_place_is_refilled() -> None:
    """Post-processing gives layer 1 layer 0's weight, and layer 0 new data of the same
    layout: the new data must not be copied into layer 0's block before layer 1 has its
    own copy of what was there."""
    model = odd_middle_model(2)
    reference = copy.deepcopy(model)
    off = prefetch(pinned_plan(model, config()), BlockRuntime())
    off.wrap_modules(layer_list(model))
    for m in (model, reference):
        first, second = m[0], m[1]
        assert isinstance(first, OddMiddle) and isinstance(second, OddMiddle)
        second.second.data = first.second.data
        first.second.data = torch.full_like(first.second.data, 0.5)
    off.post_init()
    with torch.no_grad():
        for x in activations():
            assert torch.equal(model(x), reference(x))
