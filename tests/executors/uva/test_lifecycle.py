"""UVAOffloader's lifecycle: each step once and in order, errors that change nothing,
the plan checks at construction, and a mismatched model refused before anything moves."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadPlan, PinDecision, PlanError
from offload.pure import PinReason
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import assert_restored, inputs, patched_layers, snapshot, uva
from tests.executors.models import TransformerBlock, layer_list, transformer_model
from tests.executors.uva_helpers import on_demand_plan, view_plan


def test_wrap_twice_is_an_error_and_changes_nothing() -> None:
    model = transformer_model(3)
    layers = layer_list(model)
    off = uva(on_demand_plan(model))
    off.wrap_modules(layers)
    during = snapshot(model)
    with pytest.raises(ExecutionError, match="already") as info:
        off.wrap_modules(layers)
    assert info.value.name == "state"
    assert_restored(model, during, same_storage=True)


def test_post_init_before_wrap_and_twice_are_errors() -> None:
    model = transformer_model(2)
    off = uva(on_demand_plan(model))
    with pytest.raises(ExecutionError, match="wrap_modules first") as info:
        off.post_init()
    assert info.value.value == "new"
    off.wrap_modules(layer_list(model))
    off.post_init()
    with pytest.raises(ExecutionError, match="runs once") as info:
        off.post_init()
    assert info.value.value == "ready"


def test_on_demand_forward_before_post_init_is_an_error_uva_layers_already_work() -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    x = next(inputs(seed=11))
    on_demand = uva(on_demand_plan(model))
    on_demand.wrap_modules(layer_list(model))
    with pytest.raises(ExecutionError, match="before post_init") as info:
        model(x)
    assert (info.value.name, info.value.value) == ("state", "wrapped")
    on_demand.restore()
    viewed = uva(view_plan(model), FakeRuntime())
    viewed.wrap_modules(layer_list(model))
    assert torch.equal(model(x), reference(x))  # views exist from wrap_modules on


def test_sync_needs_post_init_and_neither_sync_nor_join_does_anything() -> None:
    model = transformer_model(2)
    runtime = FakeRuntime()
    off = uva(on_demand_plan(model), runtime)
    off.wrap_modules(layer_list(model))
    with pytest.raises(ExecutionError, match="post_init first"):
        off.sync_prev_onload()
    off.post_init()
    logged = len(runtime.log)
    off.sync_prev_onload()
    off.join_after_forward()
    assert len(runtime.log) == logged  # nothing in flight: no wait, no sync


def test_restore_before_wrap_and_twice_are_errors_and_stats_keep_counters() -> None:
    model = transformer_model(2)
    off = uva(on_demand_plan(model))
    with pytest.raises(ExecutionError, match="restore needs a wrapped model"):
        off.restore()
    off.wrap_modules(layer_list(model))
    off.post_init()
    model(next(inputs(seed=12)))
    issued = off.stats().copies_issued
    off.restore()
    with pytest.raises(ExecutionError, match="restore needs a wrapped model") as info:
        off.restore()
    assert info.value.value == "restored"
    stats = off.stats()
    assert (stats.params_offloaded, stats.host_bytes) == (0, 0)
    assert stats.copies_issued == issued > 0


def test_a_plan_placing_uva_without_pinning_is_refused() -> None:
    model = transformer_model(2)
    plan = view_plan(model)
    unpinned: OffloadPlan = attrs.evolve(plan, pin=PinDecision(pin=False, reason=PinReason.DISABLED_BY_ENV))
    with pytest.raises(PlanError, match="needs both") as info:
        uva(unpinned, FakeRuntime())
    assert info.value.value == "uva"


def test_mismatched_model_raises_plan_error_before_anything_moves() -> None:
    planned = transformer_model(3)
    plan = on_demand_plan(planned)
    model = nn.Sequential(TransformerBlock(), TransformerBlock(), TransformerBlock(inner=32))
    before = snapshot(model)
    off = uva(plan)
    with pytest.raises(PlanError, match="layer 2") as info:
        off.wrap_modules(layer_list(model))
    assert info.value.name == "mlp.up.weight"
    assert_restored(model, before, same_storage=True)
    assert patched_layers(layer_list(model)) == []
    reference = copy.deepcopy(planned)
    off.wrap_modules(layer_list(planned))  # nothing happened: the right model still wraps
    off.post_init()
    x = next(inputs(seed=13))
    assert torch.equal(planned(x), reference(x))
