"""Layers run out of order, skipped, twice, or a forward that stops part way (an
exception, Ctrl-C, early-exit generation): the prefetch schedule is realigned and every
output stays exactly the resident one; the next forward simply works. Copies
are deferred until waited on (`FakeRuntime(defer=True)`), so a layer that read a slot
before its copy landed would give a wrong result."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload import ExecutionError, OffloadConfig
from offload.executors import PrefetchOffloader
from tests.executors.fakes import Copy, FakeRuntime, Wait
from tests.executors.helpers import cpu_plan, inputs, pinned_plan, prefetch
from tests.executors.models import TransformerBlock, layer_list, transformer_model

CONFIGS = [
    OffloadConfig(group_size=1, prefetch_step=2),
    OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1),
    OffloadConfig(group_size=3, num_in_group=2, prefetch_step=2),
]


def _ready(config: OffloadConfig, layers: int = 6) -> tuple[nn.Sequential, nn.Sequential, PrefetchOffloader]:
    model = transformer_model(layers)
    reference = copy.deepcopy(model)
    off = prefetch(cpu_plan(model, config), FakeRuntime(defer=True))
    off.wrap_modules(layer_list(model))
    off.post_init()
    return model, reference, off


@pytest.mark.parametrize("config", CONFIGS)
def test_a_layer_run_twice_is_correct_and_counted(config: OffloadConfig) -> None:
    model, reference, off = _ready(config)
    x = next(inputs(seed=1))
    first = off.plan.offloaded_layers[0]
    assert torch.equal(model[first](x), reference[first](x))
    assert torch.equal(model[first](x), reference[first](x))  # again: its own copy, not a stale slot
    assert off.stats().realignments == 1
    for x in inputs(seed=2):  # then whole forwards, prefetching again
        assert torch.equal(model(x), reference(x))
    assert off.stats().realignments == 2  # the first whole forward began a new step


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("config", CONFIGS)
def test_after_a_forward_that_stopped_part_way_the_next_forward_simply_works(
    config: OffloadConfig, error: type[BaseException]
) -> None:
    model, reference, off = _ready(config)
    stop_at = off.plan.offloaded_layers[-1]

    def explode(*_: object) -> None:
        raise error("stop")

    handle = model[stop_at].register_forward_pre_hook(explode)
    with pytest.raises(error):
        model(next(inputs(seed=3)))
    handle.remove()
    for x in inputs(seed=4):
        assert torch.equal(model(x), reference(x))
    assert off.stats().realignments == 1
    off.restore()


@pytest.mark.parametrize("config", CONFIGS)
def test_a_bad_input_shape_does_not_leave_the_offloader_stuck(config: OffloadConfig) -> None:
    model, reference, off = _ready(config)
    with pytest.raises(RuntimeError):
        model(torch.zeros(2, 3, 5))  # the wrong hidden size: the first layer's matmul fails
    for x in inputs(seed=5):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("config", CONFIGS)
def test_early_exit_running_only_the_first_layers_stays_exact(config: OffloadConfig) -> None:
    """Like Hugging Face's assistant_early_exit: some steps run only a prefix of the layers."""
    model, reference, off = _ready(config)
    for step, x in enumerate(inputs(seed=6, shapes=[(1, 3)] * 6)):
        depth = 2 if step % 2 else len(model)
        out, want = x, x
        for index in range(depth):
            out, want = model[index](out), reference[index](want)
        assert torch.equal(out, want), step


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.integers(0, 5), min_size=1, max_size=14))
def test_any_order_of_layer_calls_gives_the_resident_results(order: list[int]) -> None:
    model, reference, off = _ready(CONFIGS[2])
    x = next(inputs(seed=7))
    for index in order:
        assert torch.equal(model[index](x), reference[index](x)), order
    for x in inputs(seed=8):
        assert torch.equal(model(x), reference(x))


def test_out_of_order_inside_a_capture_is_refused() -> None:
    model = transformer_model(4)
    runtime = FakeRuntime()
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=2)), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = next(inputs(seed=9))
    off.sync_prev_onload()
    runtime.capturing = True
    with pytest.raises(ExecutionError, match="out of order inside a CUDA graph capture") as info:
        model[1](x)
    assert info.value.value == 1


def test_a_capture_that_ends_inside_a_layer_leaves_the_next_layer_waiting_for_its_copy() -> None:
    """Capture state is read when each copy is issued: after a capture ended inside layer
    1's forward (a manual capture_end in a submodule), the copy issued after layer 1 is an
    eager one, and layer 2 must wait for it. Copies are deferred until waited on, and all
    layers share one slot: a layer that skipped the wait would compute with layer 1's
    weights."""
    model = transformer_model(4)
    reference = copy.deepcopy(model)
    runtime = FakeRuntime(defer=True)
    off = prefetch(pinned_plan(model, OffloadConfig(group_size=1, prefetch_step=1)), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    assert off.plan.schedule.num_slots == 1
    off.sync_prev_onload()

    def end_capture(module: nn.Module, args: object) -> None:
        runtime.capturing = False

    block = model[1]
    assert isinstance(block, TransformerBlock)
    hook = block.mlp.register_forward_pre_hook(end_capture)
    x = next(inputs(seed=10))
    runtime.capturing = True
    begun = len(runtime.log)
    with torch.no_grad():
        out = model(x)
        want = reference(x)
    hook.remove()
    assert torch.equal(out, want)
    ended = next(i for i, e in enumerate(runtime.log) if isinstance(e, Copy) and not e.capturing and i > begun)
    assert [e.capturing for e in runtime.log[ended:] if isinstance(e, Wait)] == [False, False]  # layers 2 and 3
    off.restore()
