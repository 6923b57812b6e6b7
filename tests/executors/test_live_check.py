"""`check()`: every planned parameter's actual place in the live model,
against the plan; differences listed, never fixed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import ExecutionError, LiveCheck, OffloadConfig, Placement, create_offloader, render_check
from offload.pure.check import Location
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, pinned_plan, prefetch, uva
from tests.executors.models import layer_list, transformer_model
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan, view_plan

PREFETCH = OffloadConfig(group_size=2, prefetch_step=1)  # every 2nd layer: some weights stay resident


def _counts(check: LiveCheck) -> dict[Location, int]:
    counts: dict[Location, int] = {}
    for p in check.params:
        counts[p.actual] = counts.get(p.actual, 0) + 1
    return counts


def test_prefetch_after_post_init_slots_and_resident_weights() -> None:
    model = transformer_model(4)
    plan = pinned_plan(model, PREFETCH)
    off = prefetch(plan, FakeRuntime())
    off.wrap_modules(layer_list(model))
    before = off.check()  # weights in their pinned host copies until post_init
    assert before.ok
    assert {p.actual for p in before.params if p.placement is Placement.PREFETCH} == {Location.HOST_PINNED}
    off.post_init()
    check = off.check()
    assert check.ok, render_check(check)
    offloaded = len(plan.offloaded_params)
    assert _counts(check) == {Location.SLOT: offloaded, Location.DEVICE: len(plan.params) - offloaded}
    assert check.device_bytes_held == plan.device_bytes_resident + plan.device_bytes_buffers
    assert render_check(check).startswith("live check: every planned parameter is where the plan says")
    off.restore()
    with pytest.raises(ExecutionError, match="check needs a wrapped model"):
        off.check()


def test_a_weight_changed_behind_the_offloader_is_listed_not_fixed() -> None:
    model = transformer_model(4)
    plan = cpu_plan(model, PREFETCH)
    off = prefetch(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    layer = plan.offloaded_layers[0]
    param = layer_list(model)[layer].get_parameter("mlp.up.weight")
    stray = torch.zeros_like(param)
    param.data = stray
    check = off.check()
    assert not check.ok
    (diff,) = check.differences
    assert (diff.layer, diff.name, diff.expected, diff.actual) == (layer, "mlp.up.weight", Location.SLOT,
                                                                   Location.DEVICE)
    text = render_check(check)
    assert "1 of" in text and f"layer {layer} mlp.up.weight: planned prefetch (slot), is device on cpu" in text
    assert param.data_ptr() == stray.data_ptr()  # listed, not fixed
    with pytest.raises(ExecutionError, match="no longer points at its static buffer"):
        model(torch.randn(1, 3, 16))  # and the forward refuses it


@pytest.mark.parametrize(("build", "expected"), [
    (lambda m: view_plan(m), Location.DEVICE_VIEW),
    (lambda m: on_demand_plan(m), Location.HOST_PINNED),
    (lambda m: cpu_on_demand_plan(m), Location.HOST_PAGEABLE),
], ids=["uva", "on-demand-pinned", "on-demand-pageable"])
def test_uva_views_and_on_demand_copies(build: object, expected: Location) -> None:
    assert callable(build)
    model = transformer_model(3)
    plan = build(model)
    off = uva(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    check = off.check()
    assert check.ok, render_check(check)
    assert {p.actual for p in check.params if p.placement is not Placement.RESIDENT} == {expected}
    off.restore()


def test_a_uva_weight_whose_pinning_fell_back_shows_as_a_difference() -> None:
    model = transformer_model(3)
    plan = view_plan(model)
    off = uva(plan, FakeRuntime(fail_pin_at=0))
    off.wrap_modules(layer_list(model))
    off.post_init()
    check = off.check()
    (diff,) = check.differences
    assert (diff.placement, diff.expected, diff.actual) == (Placement.UVA, Location.DEVICE_VIEW,
                                                            Location.HOST_PAGEABLE)
    off.restore()


def test_noop_everything_on_the_device() -> None:
    model = nn.Sequential(*transformer_model(2))
    off = create_offloader(cpu_plan(model, OffloadConfig()))
    with pytest.raises(ExecutionError, match="check needs a wrapped model"):
        off.check()
    off.wrap_modules(layer_list(model))
    check = off.check()
    assert check.ok and _counts(check) == {Location.DEVICE: len(list(model.parameters()))}
    off.restore()


def test_a_write_through_param_data_into_a_slot_is_reported_by_check_and_lost_at_the_next_copy() -> None:
    # param.data.copy_() writes the slot through a tensor that shares no version counter
    # with the Parameter: the forward's check cannot see it; check() compares the slots.
    model = transformer_model(4)
    twin = transformer_model(4)
    plan = cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2))
    off = prefetch(plan)
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        expected = twin(x)
        assert torch.equal(model(x), expected)
    assert off.check().written_in_slots == ()
    # After a step the first positions' copies for the next step are in their slots.
    layer = plan.offloaded_layers[0]
    param = layer_list(model)[layer].get_parameter("mlp.up.weight")
    version = param._version
    with torch.no_grad():
        param.data.copy_(torch.zeros_like(param))
    assert param._version == version  # what the forward's own check reads did not move
    check = off.check()
    assert check.written_in_slots == ((layer, "mlp.up.weight"),)
    assert not check.ok and check.differences == ()  # every parameter is where the plan says
    assert f"layer {layer} mlp.up.weight: its slot holds values written past its host copy" in render_check(check)
    with torch.no_grad():
        assert not torch.equal(model(x), expected)  # the step computes with the write once...
        assert torch.equal(model(x), expected)  # ...and the next copy brings the host copy back: it is lost
    assert off.check().ok
    off.restore()
    assert torch.equal(param, twin[layer].get_parameter("mlp.up.weight"))
