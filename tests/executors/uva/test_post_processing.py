"""Weight post-processing between `wrap_modules` and `post_init` on the UVA executor: new
values, shapes, dtypes and strides get a new host copy (and view); deleted parameters are
dropped; broken ties and a deleted tie owner are handled. The same step is applied to a
resident copy; outputs must match bit for bit, and `offloader.plan` must tell the truth."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadPlan, WarningCode
from offload.executors import UVAOffloader
from tests.executors.fakes import FakeRuntime, HostCopy, InjectedFailure, Release, View
from tests.executors.helpers import assert_restored, inputs, snapshot, tie_groups, uva
from tests.executors.models import (
    BroadcastScaleBlock,
    Float8Linear,
    OptionalParamBlock,
    TiedBlock,
    TransposedBlock,
    drop_extra_by_del,
    drop_extra_by_none,
    layer_list,
    make_weight_t_contiguous,
    replace_scale_with_scalar,
    replace_up_weight_data,
    replace_up_weight_parameter,
    scale_weights_in_place,
    transformer_model,
    widen_float8_weight,
)
from tests.executors.uva_helpers import OptionalTiedBlock, on_demand_plan, storages, view_plan

Step = Callable[[nn.Module], None]
MODES = ["uva", "on-demand"]


def run_post_processed(
    model: nn.Sequential, mode: str, steps: dict[int, Step]
) -> tuple[UVAOffloader, OffloadPlan, nn.Sequential, FakeRuntime]:
    """Wrap `model` (UVA views, or on demand), apply `steps` (layer index -> step) to it and
    to a resident copy made before wrapping, post_init, and check parity over several
    forwards. Returns the offloader, its first plan, the resident copy and the runtime."""
    reference = copy.deepcopy(model)
    plan = view_plan(model) if mode == "uva" else on_demand_plan(model)
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    for index, step in steps.items():
        step(layers[index])
        step(reference[index])
    off.post_init()
    for x in inputs(seed=20):
        assert torch.equal(model(x), reference(x))
    stats = off.stats()
    assert stats.host_bytes == off.plan.host_bytes
    assert stats.params_offloaded == len(off.plan.offloaded_params)
    return off, plan, reference, runtime


def revised_message(plan: OffloadPlan) -> str:
    [message] = [w.message for w in plan.warnings if w.code is WarningCode.PLAN_REVISED]
    return message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("step", "copies"), [
    (replace_up_weight_data, 2), (replace_up_weight_parameter, 2), (scale_weights_in_place, 0)])
def test_new_values_of_the_same_shape_get_a_new_copy(mode: str, step: Step, copies: int) -> None:
    model = transformer_model(4)
    off, plan, reference, runtime = run_post_processed(model, mode, {0: step, 3: step})
    assert off.plan is plan  # same shapes: nothing to revise
    # Only replaced data is copied again (in-place changes landed in the host copy itself).
    assert len(runtime.entries(HostCopy)) == storages(plan) + copies
    assert len(runtime.entries(View)) == (storages(plan) + copies if mode == "uva" else 0)
    layers = layer_list(model)
    before = snapshot(model)
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert len(runtime.entries(Release)) == len(runtime.entries(HostCopy))
    for index in (0, 3):
        assert torch.equal(layers[index].get_parameter("mlp.up.weight"),
                           reference[index].get_parameter("mlp.up.weight"))
    for x in inputs(seed=21):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_new_shapes_dtypes_and_strides_revise_the_plan(mode: str) -> None:
    model = nn.Sequential(BroadcastScaleBlock(), Float8Linear(), TransposedBlock(), BroadcastScaleBlock())
    off, plan, reference, _ = run_post_processed(
        model, mode, {0: replace_scale_with_scalar, 1: widen_float8_weight, 2: make_weight_t_contiguous})
    revised = off.plan
    message = revised_message(revised)
    assert "0:scale float32[16] -> float32[1]" in message
    assert "1:fweight float8_e4m3fn[16, 16] -> float32[16, 16]" in message
    assert "2:weight_t" in message and "3:" not in message
    assert revised.buffers == () and revised.device_bytes_buffers == 0  # UVA needs no buffers
    assert revised.host_bytes == plan.host_bytes - 15 * 4 + 16 * 16 * 3
    layers = layer_list(model)
    assert tuple(layers[0].get_parameter("scale").shape) == (1,)
    assert layers[1].get_parameter("fweight").dtype == torch.float32
    assert layers[2].get_parameter("weight_t").stride() == (16, 1)
    off.restore()
    assert layers[2].get_parameter("weight_t").stride() == (16, 1)
    for x in inputs(seed=22):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_deleted_parameters_are_dropped_and_released(mode: str) -> None:
    model = nn.Sequential(*[OptionalParamBlock() for _ in range(4)])
    off, plan, reference, runtime = run_post_processed(model, mode, {1: drop_extra_by_del, 3: drop_extra_by_none})
    revised = off.plan
    assert "1:extra deleted" in revised_message(revised) and "3:extra deleted" in revised_message(revised)
    assert len(revised.offloaded_params) == len(plan.offloaded_params) - 2
    assert revised.host_bytes == plan.host_bytes - 2 * 16 * 4
    assert off.stats().params_dropped == 2
    assert [r.shape for r in runtime.entries(Release)] == [(16,), (16,)]  # released at post_init
    off.restore()
    assert len(runtime.entries(Release)) == len(runtime.entries(HostCopy))
    layers = layer_list(model)
    assert "extra" not in dict(layers[1].named_parameters()) and "extra" in dict(layers[2].named_parameters())
    for x in inputs(seed=23):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_untying_a_tied_weight_gives_each_name_its_own_copy(mode: str) -> None:
    model = nn.Sequential(*[TiedBlock() for _ in range(3)])

    def untie(layer: nn.Module) -> None:
        assert isinstance(layer, TiedBlock)
        layer.b.weight = nn.Parameter(layer.a.weight.detach() * 2)

    off, plan, reference, _ = run_post_processed(model, mode, {1: untie})
    revised = off.plan
    assert "1:b.weight no longer shares storage with 1:a.weight" in revised_message(revised)
    tied = {(p.layer, p.name): p.tied_to for p in revised.params}
    assert tied[(1, "b.weight")] is None and tied[(0, "b.weight")] == (0, "a.weight")
    layers = layer_list(model)
    assert layers[1].get_parameter("a.weight").data_ptr() != layers[1].get_parameter("b.weight").data_ptr()
    assert layers[0].get_parameter("a.weight") is layers[0].get_parameter("b.weight")
    assert revised.host_bytes == plan.host_bytes + 16 * 16 * 4
    off.restore()
    assert layers[0].get_parameter("a.weight") is layers[0].get_parameter("b.weight")
    for x in inputs(seed=24):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_replacing_a_tied_parameters_data_keeps_the_tie(mode: str) -> None:
    """``a.weight`` is ``b.weight``: new data reaches both names, copied once."""
    model = nn.Sequential(*[TiedBlock() for _ in range(2)])

    def rescale(layer: nn.Module) -> None:
        assert isinstance(layer, TiedBlock)
        layer.a.weight.data = layer.a.weight.data * 0.5

    off, plan, reference, runtime = run_post_processed(model, mode, {1: rescale})
    assert off.plan is plan
    assert len(runtime.entries(HostCopy)) == storages(plan) + 1
    assert tie_groups(model) == {frozenset({f"{i}.a.weight", f"{i}.b.weight"}) for i in range(2)}


@pytest.mark.parametrize("mode", MODES)
def test_a_deleted_tie_owner_leaves_its_partner_a_copy_of_its_own(mode: str) -> None:
    model = nn.Sequential(*[OptionalTiedBlock() for _ in range(3)])

    def drop_first(layer: nn.Module) -> None:
        assert isinstance(layer, OptionalTiedBlock)
        del layer.first

    off, plan, reference, runtime = run_post_processed(model, mode, {1: drop_first})
    revised = off.plan
    assert "1:first deleted" in revised_message(revised)
    assert {(p.layer, p.name): p.tied_to for p in revised.offloaded_params}[(1, "second")] is None
    assert revised.host_bytes == plan.host_bytes  # the storage stays, held by its partner
    assert len(runtime.entries(HostCopy)) == storages(plan) + 1
    assert len(runtime.entries(Release)) == 1  # the owner's copy, once its partner had its own
    off.restore()
    assert len(runtime.entries(Release)) == len(runtime.entries(HostCopy))
    layers = layer_list(model)
    assert torch.equal(layers[1].get_parameter("second"), reference[1].get_parameter("second"))
    for x in inputs(seed=25):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_post_init_can_be_retried(mode: str) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    plan = view_plan(model) if mode == "uva" else on_demand_plan(model)
    runtime = FakeRuntime(fail_host_copy_at=storages(plan) + 1)  # the second re-copy fails
    off = uva(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    for index in (0, 1, 2):
        replace_up_weight_data(layers[index])
        replace_up_weight_data(reference[index])
    with pytest.raises(ExecutionError, match="post_init failed, weights left in host memory") as info:
        off.post_init()
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert runtime.entries(Release) == []  # nothing released: every copy may still be read
    off.post_init()
    assert off.stats().params_dropped == 0
    for x in inputs(seed=26):
        assert torch.equal(model(x), reference(x))
    off.restore()
    # One copy failed (logged, never made); every copy made was released once.
    assert len(runtime.entries(HostCopy)) == storages(plan) + 4
    assert len(runtime.entries(Release)) == storages(plan) + 3
