"""The UVA executor and host memory, with a recording fake runtime: the pin decision
reaching the runtime unchanged (the founding bug, as a named regression test), one host
copy and one view per storage, restore releasing all it took, failures at every position,
pin fallbacks, and CUDA-graph capture of on-demand copies."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import ExecutionError, Placement, WarningCode
from offload.pure import PinMethod, PinReason, UvaReason
from tests.executors.fakes import FakeRuntime, HostCopy, HostEmpty, InjectedFailure, Release, ToDevice, View
from tests.executors.helpers import assert_restored, inputs, patched_layers, snapshot, tie_groups, uva
from tests.executors.models import (
    Int8Linear,
    SharedStorageBlock,
    TiedBlock,
    TransformerBlock,
    TransposedBlock,
    layer_list,
    replace_up_weight_data,
    transformer_model,
)
from tests.executors.uva_helpers import copies_per_forward, cross_layer_tied_model, storages, view_plan


def test_regression_pin_off_means_no_pin_call_uva() -> None:
    """The founding bug: a backend pinned although the user said not to. With
    OFFLOAD_DISABLE_PIN_MEMORY on a CUDA machine that can map host memory, the plan says
    pin=False, so UVA is off too (a view needs pinned memory) and every parameter is
    ON_DEMAND; every host copy the executor asks for (wrapping, and re-copying after
    post-processing) is unpinned, and nothing is ever viewed."""
    model = transformer_model(3)
    plan = view_plan(model, pin=False)
    assert plan.compute_device == "cuda"
    assert (plan.pin.pin, plan.pin.reason) == (False, PinReason.DISABLED_BY_ENV)
    assert (plan.uva.enabled, plan.uva.reason) == (False, UvaReason.NOT_PINNED)
    assert len(plan.offloaded_params) == 3 * 11
    assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    replace_up_weight_data(layers[1])  # post_init must copy this one again, with the same pin
    off.post_init()
    for x in inputs(seed=1):
        model(x)
    off.restore()
    # Host weights are their own pageable host copies: adopted, never copied or pinned
    # (the re-copy after post-processing included).
    assert runtime.entries(HostCopy) == []
    assert runtime.entries(View) == []
    assert {entry.pinned for entry in runtime.entries(ToDevice)} == {False}
    assert {entry.pinned for entry in runtime.entries(Release)} == {False}
    # Weights loaded after wrapping (meta): their host memory is asked for unpinned.
    meta = transformer_model(3).to("meta")
    runtime = FakeRuntime()
    uva(plan, runtime).wrap_modules(layer_list(meta))
    assert [e.pin for e in runtime.entries(HostEmpty)] == [PinMethod.NONE] * storages(plan)
    assert runtime.entries(View) == []


@pytest.mark.parametrize("make", [
    pytest.param(lambda: transformer_model(3), id="transformer"),
    pytest.param(cross_layer_tied_model, id="ties-across-layers"),
    pytest.param(lambda: nn.Sequential(TiedBlock(), SharedStorageBlock(), TiedBlock()), id="ties-within-layers"),
])
def test_pin_on_uva_on_one_pinned_copy_and_one_view_per_storage(make: Callable[[], nn.Module]) -> None:
    model = make()
    reference = copy.deepcopy(model)
    ties = tie_groups(model)
    plan = view_plan(model)
    assert (plan.uva.enabled, plan.uva.reason) == (True, UvaReason.ENABLED)
    assert {p.placement for p in plan.offloaded_params} == {Placement.UVA}
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    copies, views = runtime.entries(HostCopy), runtime.entries(View)
    assert len(copies) == len(views) == storages(plan)
    assert {c.pin for c in copies} == {plan.pin.method} and {v.pinned for v in views} == {True}
    assert [c.shape for c in copies] == [v.shape for v in views]
    assert tie_groups(model) == ties  # tied names point at the one view
    for x in inputs(seed=2):
        assert torch.equal(model(x), reference(x))
    assert runtime.entries(ToDevice) == []
    off.restore()
    releases = runtime.entries(Release)
    assert len(releases) == len(copies) and {r.pinned for r in releases} == {True}


def test_pin_on_uva_off_copies_pinned_memory_on_demand() -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    plan = view_plan(model, uva=False)
    assert (plan.pin.pin, plan.uva.reason) == (True, UvaReason.DISABLED_BY_ENV)
    assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=3):
        assert torch.equal(model(x), reference(x))
    assert {c.pin for c in runtime.entries(HostCopy)} == {plan.pin.method} != {PinMethod.NONE}
    assert runtime.entries(View) == []
    moved = runtime.entries(ToDevice)
    assert len(moved) == 4 * copies_per_forward(plan)[0] and {m.pinned for m in moved} == {True}
    # Copies from pinned memory can be captured: no refusal.
    off.sync_prev_onload()
    runtime.capturing = True
    x = next(inputs(seed=4))
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("pin", [True, False], ids=["pin-on", "pin-off"])
def test_restore_releases_every_host_copy_it_took(pin: bool) -> None:
    model = transformer_model(4)
    plan = view_plan(model, pin=pin)
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    replace_up_weight_data(layers[2])  # one more copy, and the one it replaces is released
    before = snapshot(model)  # the values restore must give back: post-processed ones
    off.post_init()
    model(next(inputs(seed=5)))
    assert off.stats().host_bytes == off.plan.host_bytes > 0
    off.restore()
    copies, releases = runtime.entries(HostCopy), runtime.entries(Release)
    assert len(releases) == storages(plan) + 1
    assert len(copies) == (storages(plan) + 1 if pin else 0)  # pinning off: adopted in place
    assert {r.pinned for r in releases} == {pin}
    assert off.stats().host_bytes == 0
    assert_restored(model, before, same_storage=False)


# ---- a failure at every position -------------------------------------------------------


def failure_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(TransformerBlock(), TiedBlock(), SharedStorageBlock(), TransposedBlock(), Int8Linear())


#: Host copies (and views) wrap_modules makes for `failure_model`: 11 + 2 + 1 + 3 + 2.
FAILURE_MODEL_STORAGES = 19


@pytest.mark.parametrize("views", [True, False], ids=["uva", "on-demand"])
@pytest.mark.parametrize("k", range(FAILURE_MODEL_STORAGES))
def test_a_failed_host_copy_at_any_position_leaves_the_model_as_it_was(k: int, views: bool) -> None:
    model = failure_model()
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    ties = tie_groups(model)
    plan = view_plan(model, uva=views)
    assert storages(plan) == FAILURE_MODEL_STORAGES
    runtime = FakeRuntime(fail_host_copy_at=k)
    off = uva(plan, runtime)
    with pytest.raises(ExecutionError, match=f"model left as it was: injected host_copy failure #{k}") as info:
        off.wrap_modules(layers)
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert (info.value.name, info.value.value) == ("wrap_modules", "InjectedFailure")
    assert runtime.host_copies == k + 1  # it stopped at the failure ...
    assert len(runtime.entries(Release)) == k  # ... and gave back every copy it had made
    # The pageable originals were released as their pinned copies were made (the host
    # bound); undoing brought them back from those copies: same values, new storage.
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    assert patched_layers(layers) == []
    assert off.stats().host_bytes == 0
    x = next(inputs(seed=6))
    assert torch.equal(model(x), reference(x))
    off.wrap_modules(layers)  # the same offloader wraps again: later copies succeed
    off.post_init()
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("k", range(0, FAILURE_MODEL_STORAGES, 3))
def test_a_failed_view_leaves_the_model_as_it_was(k: int) -> None:
    model = failure_model()
    before = snapshot(model)
    runtime = FakeRuntime(fail_device_view_at=k)
    off = uva(view_plan(model), runtime)
    with pytest.raises(ExecutionError, match=f"injected device_view failure #{k}"):
        off.wrap_modules(layer_list(model))
    assert (runtime.host_copies, len(runtime.entries(Release))) == (k + 1, k + 1)
    assert_restored(model, before, same_storage=False)  # recovered from the pinned copies


# ---- pin fallbacks and capture ------------------------------------------------------------


@pytest.mark.parametrize("fail_pin_at", [0, 7, 12])
def test_a_failed_pin_falls_back_to_on_demand_and_the_model_keeps_working(fail_pin_at: int) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    plan = view_plan(model)
    runtime = FakeRuntime(fail_pin_at=fail_pin_at)
    off = uva(plan, runtime)
    off.wrap_modules(layers)
    fallen = plan.offloaded_params[fail_pin_at]  # transformer blocks have no ties
    assert patched_layers(layers) == [fallen.layer]  # only its layer copies on demand
    assert layers[fallen.layer].get_parameter(fallen.name).data_ptr() != 0
    off.post_init()
    for x in inputs(seed=7):
        assert torch.equal(model(x), reference(x))
    views = runtime.entries(View)
    assert len(views) == storages(plan) - 1 and {v.pinned for v in views} == {True}  # never a pageable view
    assert {(m.shape, m.pinned) for m in runtime.entries(ToDevice)} == {(fallen.shape, False)}
    stats = off.stats()
    assert (stats.pin_fallbacks, stats.copies_issued) == (1, 4)
    # The reported plan shows how it runs: that one parameter on demand, and why.
    reported = {(q.layer, q.name): q.placement for q in off.plan.offloaded_params}
    assert reported[(fallen.layer, fallen.name)] is Placement.ON_DEMAND
    assert sum(placement is Placement.UVA for placement in reported.values()) == len(reported) - 1
    assert WarningCode.PLAN_REVISED in off.plan.warning_codes()
    assert plan.warning_codes() == off.plan.warning_codes() - {WarningCode.PLAN_REVISED}
    # A graph capture needs pinned memory for the copy: refused for that layer, by name.
    off.sync_prev_onload()
    runtime.capturing = True
    x = next(inputs(seed=8))
    for layer in layers[:fallen.layer]:
        x = layer(x)  # earlier layers read views: capturable
    with pytest.raises(ExecutionError, match="pinning failed for 1 of its host copies") as info:
        layers[fallen.layer](x)
    assert (info.value.name, info.value.value) == ("pin_fallbacks", 1)
    assert f"layer {fallen.layer}" in str(info.value)


def test_capture_with_pinning_off_raises_before_any_copy() -> None:
    model = transformer_model(2)
    reference = copy.deepcopy(model)
    runtime = FakeRuntime()
    off = uva(view_plan(model, pin=False), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    off.sync_prev_onload()
    runtime.capturing = True
    with pytest.raises(ExecutionError, match="pinning is off") as info:
        model(next(inputs(seed=9)))
    assert (info.value.name, info.value.value) == ("pin", False)
    assert "OFFLOAD_DISABLE_PIN_MEMORY" in str(info.value)
    assert runtime.entries(ToDevice) == []  # refused before PyTorch would have been asked
    runtime.capturing = False
    x = next(inputs(seed=10))
    assert torch.equal(model(x), reference(x))


def test_capture_of_a_uva_model_runs_plain_kernels() -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    runtime = FakeRuntime()
    off = uva(view_plan(model), runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    off.sync_prev_onload()
    runtime.capturing = True
    for x in inputs(seed=11):
        assert torch.equal(model(x), reference(x))
    off.join_after_forward()
    assert runtime.entries(ToDevice) == []
