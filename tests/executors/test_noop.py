"""NoopOffloader: backend none checks the layers and changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from offload import Backend, ExecutionError, OffloadConfig, OffloadStats, Placement, PlanError, create_offloader
from offload.executors import NoopOffloader, PrefetchOffloader
from offload.runtime.cpu import CpuRuntime
from tests.executors.helpers import assert_restored, cpu_plan, inputs, patched_layers, snapshot
from tests.executors.models import layer_list, mixed_model, transformer_model


def noop_for(model: torch.nn.Module) -> NoopOffloader:
    plan = cpu_plan(model, OffloadConfig(backend="none"))
    assert plan.backend is Backend.NONE
    assert {p.placement for p in plan.params} == {Placement.RESIDENT}
    offloader = create_offloader(plan)
    assert isinstance(offloader, NoopOffloader)
    return offloader


def test_noop_changes_nothing_through_the_whole_lifecycle() -> None:
    model = mixed_model()
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    off = noop_for(model)
    returned = off.wrap_modules(layers)
    assert len(returned) == len(layers) and all(a is b for a, b in zip(returned, layers, strict=True))
    off.post_init()
    off.sync_prev_onload()
    for x in inputs(seed=40):
        assert torch.equal(model(x), reference(x))
        off.join_after_forward()
    assert_restored(model, before, same_storage=True)
    assert patched_layers(layers) == []
    assert off.stats() == OffloadStats(wait_seconds=0.0)
    off.restore()
    assert_restored(model, before, same_storage=True)
    off.wrap_modules(layers)  # restore forgot the wrapped state: wrapping again is allowed


def test_noop_wrap_twice_is_an_error() -> None:
    model = transformer_model(2)
    off = noop_for(model)
    off.wrap_modules(layer_list(model))
    with pytest.raises(ExecutionError, match="already"):
        off.wrap_modules(layer_list(model))


def test_noop_checks_the_layer_count() -> None:
    model = transformer_model(3)
    off = noop_for(model)
    with pytest.raises(PlanError, match="3 layers, got 2") as info:
        off.wrap_modules(layer_list(model)[:2])
    assert (info.value.name, info.value.value) == ("layers", 2)
    off.wrap_modules(layer_list(model))  # the failed call left it unwrapped


def test_executors_refuse_plans_of_other_backends() -> None:
    model = transformer_model(2)
    none_plan = cpu_plan(model, OffloadConfig(backend="none"))
    prefetch_plan = cpu_plan(model, OffloadConfig(group_size=1))
    with pytest.raises(PlanError, match="backend none") as info:
        NoopOffloader(prefetch_plan, CpuRuntime())
    assert (info.value.name, info.value.value) == ("backend", "prefetch")
    with pytest.raises(PlanError, match="prefetch plans") as info:
        PrefetchOffloader(none_plan, CpuRuntime())
    assert (info.value.name, info.value.value) == ("backend", "none")
