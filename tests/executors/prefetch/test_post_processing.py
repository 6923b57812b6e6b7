"""Weight post-processing between `wrap_modules` and `post_init`: new values, new shapes,
dtypes and strides, deleted parameters, broken ties. The same step is applied to a
resident copy; outputs must match bit for bit, and `offloader.plan` must tell the truth."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from offload import OffloadConfig, OffloadPlan, WarningCode
from offload.executors import PrefetchOffloader
from offload.pure import BufferPlan
from tests.executors.helpers import cpu_plan, inputs, prefetch
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

Step = Callable[[nn.Module], None]


def run_post_processed(
    model: nn.Sequential, config: OffloadConfig, steps: dict[int, Step]
) -> tuple[PrefetchOffloader, OffloadPlan, nn.Sequential]:
    """Wrap `model`, apply `steps` (layer index -> step) to it and to a resident copy made
    before wrapping, post_init, and check parity over several forwards.

    Returns:
        The offloader, the plan it was made with, and the post-processed resident copy.
    """
    reference = copy.deepcopy(model)
    plan = cpu_plan(model, config)
    off = prefetch(plan)
    layers = layer_list(model)
    off.wrap_modules(layers)
    for index, step in steps.items():
        step(layers[index])
        step(reference[index])
    off.post_init()
    for x in inputs(seed=20):
        assert torch.equal(model(x), reference(x))
    return off, plan, reference


def revised_message(plan: OffloadPlan) -> str:
    [message] = [w.message for w in plan.warnings if w.code is WarningCode.PLAN_REVISED]
    return message


def buffer(plan: OffloadPlan, name: str, shape: tuple[int, ...]) -> BufferPlan:
    [found] = [b for b in plan.buffers if b.name == name and b.shape == shape]
    return found


def assert_totals_match(off: PrefetchOffloader) -> None:
    stats = off.stats()
    assert stats.host_bytes == off.plan.host_bytes
    assert stats.device_buffer_bytes == off.plan.device_bytes_buffers
    assert stats.params_offloaded == len(off.plan.offloaded_params)


@pytest.mark.parametrize("step", [replace_up_weight_data, replace_up_weight_parameter, scale_weights_in_place])
def test_new_values_of_the_same_shape_reach_the_buffers(step: Step) -> None:
    model = transformer_model(5)
    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2),
                                              {0: step, 3: step})
    assert WarningCode.PLAN_REVISED not in off.plan.warning_codes()
    assert off.stats().params_dropped == 0
    layers = layer_list(model)
    # The (possibly new) Parameter objects point at the slots: layers 0 and 2 share slot 0.
    assert layers[0].get_parameter("mlp.up.weight").data_ptr() == layers[2].get_parameter("mlp.up.weight").data_ptr()
    off.restore()
    for index in (0, 3):
        assert torch.equal(layers[index].get_parameter("mlp.up.weight"),
                           reference[index].get_parameter("mlp.up.weight"))
    for x in inputs(seed=21):
        assert torch.equal(model(x), reference(x))


def test_a_new_shape_that_broadcasts_revises_the_plan_and_the_buffers_follow() -> None:
    model = nn.Sequential(*[BroadcastScaleBlock() for _ in range(5)])
    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2),
                                              {1: replace_scale_with_scalar, 3: replace_scale_with_scalar})
    revised = off.plan
    assert revised is not plan
    assert WarningCode.PLAN_REVISED in revised.warning_codes()
    message = revised_message(revised)
    assert "1:scale float32[16] -> float32[1]" in message and "3:scale" in message
    shapes = {(p.layer, p.name): p.shape for p in revised.params}
    assert [shapes[(i, "scale")] for i in range(5)] == [(16,), (1,), (16,), (1,), (16,)]
    # Slots alternate 0, 1, 0, 1, 0: the old shape is left in slot 0, the new one in slot 1.
    assert buffer(revised, "scale", (16,)).slots == (0,)
    assert buffer(revised, "scale", (1,)).slots == (1,)
    assert revised.host_bytes == plan.host_bytes - 2 * 15 * 4
    layers = layer_list(model)
    assert [tuple(layer.get_parameter("scale").shape) for layer in layers] == [(16,), (1,), (16,), (1,), (16,)]
    assert_totals_match(off)
    off.restore()
    assert tuple(layers[3].get_parameter("scale").shape) == (1,)
    assert torch.equal(layers[3].get_parameter("scale"), reference[3].get_parameter("scale"))
    for x in inputs(seed=22):
        assert torch.equal(model(x), reference(x))


def test_a_new_dtype_revises_the_plan() -> None:
    model = nn.Sequential(*[Float8Linear() for _ in range(4)])
    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2),
                                              dict.fromkeys(range(4), widen_float8_weight))
    revised = off.plan
    assert "0:fweight float8_e4m3fn[16, 16] -> float32[16, 16]" in revised_message(revised)
    assert {b.dtype for b in revised.buffers if b.name == "fweight"} == {"float32"}
    assert revised.host_bytes == plan.host_bytes + 4 * 16 * 16 * 3
    assert {layer.get_parameter("fweight").dtype for layer in layer_list(model)} == {torch.float32}
    assert_totals_match(off)


def test_new_strides_revise_the_plan_and_the_buffers_keep_them() -> None:
    model = nn.Sequential(*[TransposedBlock() for _ in range(3)])
    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2),
                                              {1: make_weight_t_contiguous})
    revised = off.plan
    assert WarningCode.PLAN_REVISED in revised.warning_codes()
    strides = {b.stride: b.slots for b in revised.buffers if b.name == "weight_t"}
    assert strides == {(1, 48): (0,), (16, 1): (1,)}
    assert [layer.get_parameter("weight_t").stride() for layer in layer_list(model)] == [(1, 48), (16, 1), (1, 48)]
    assert_totals_match(off)


@pytest.mark.parametrize("steps", [
    pytest.param((drop_extra_by_del, drop_extra_by_none), id="del-and-none"),
    pytest.param((drop_extra_by_del, drop_extra_by_del), id="del-twice"),
])
def test_deleted_parameters_are_dropped(steps: Sequence[Step]) -> None:
    model = nn.Sequential(*[OptionalParamBlock() for _ in range(5)])
    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2),
                                              {1: steps[0], 3: steps[1]})
    revised = off.plan
    assert "1:extra deleted" in revised_message(revised) and "3:extra deleted" in revised_message(revised)
    names = {(p.layer, p.name) for p in revised.params}
    assert (1, "extra") not in names and (3, "extra") not in names and (2, "extra") in names
    assert len(revised.offloaded_params) == len(plan.offloaded_params) - 2
    assert buffer(revised, "extra", (16,)).slots == (0,)  # only layers 0, 2, 4 (slot 0) keep it
    assert revised.offloaded_bytes == plan.offloaded_bytes - 2 * 16 * 4
    assert revised.offloaded_layers == plan.offloaded_layers
    stats = off.stats()
    assert stats.params_dropped == 2
    assert_totals_match(off)
    off.restore()
    layers = layer_list(model)
    assert "extra" not in dict(layers[1].named_parameters())
    assert "extra" in dict(layers[2].named_parameters())
    for x in inputs(seed=23):
        assert torch.equal(model(x), reference(x))


def test_deleting_every_offloaded_parameter_of_a_layer_takes_it_out_of_the_schedule() -> None:
    """With a filter that offloads only ``extra``, deleting it in layer 1 leaves layer 1
    with nothing offloaded: the revised schedule has one position fewer, and the layers
    after it move up one position."""
    model = nn.Sequential(*[OptionalParamBlock() for _ in range(5)])
    config = OffloadConfig(group_size=1, prefetch_step=2, param_filter=("extra",))
    off, plan, reference = run_post_processed(model, config, {1: drop_extra_by_del})
    assert plan.offloaded_layers == (0, 1, 2, 3, 4)
    assert off.plan.offloaded_layers == (0, 2, 3, 4)
    assert off.plan.schedule.num_positions == 4
    assert off.stats().params_dropped == 1
    off.restore()
    for x in inputs(seed=24):
        assert torch.equal(model(x), reference(x))


def test_untying_a_tied_weight_gives_each_name_its_own_buffer() -> None:
    model = nn.Sequential(*[TiedBlock() for _ in range(3)])

    def untie(layer: nn.Module) -> None:
        assert isinstance(layer, TiedBlock)
        layer.b.weight = nn.Parameter(layer.a.weight.detach() * 2)

    off, plan, reference = run_post_processed(model, OffloadConfig(group_size=1, prefetch_step=2), {1: untie})
    revised = off.plan
    assert "1:b.weight no longer shares storage with 1:a.weight" in revised_message(revised)
    tied = {(p.layer, p.name): p.tied_to for p in revised.params}
    assert tied[(1, "b.weight")] is None and tied[(0, "b.weight")] == (0, "a.weight")
    layers = layer_list(model)
    assert layers[1].get_parameter("a.weight").data_ptr() != layers[1].get_parameter("b.weight").data_ptr()
    assert layers[0].get_parameter("a.weight") is layers[0].get_parameter("b.weight")
    assert revised.host_bytes == plan.host_bytes + 16 * 16 * 4
    assert_totals_match(off)
