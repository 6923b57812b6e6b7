"""Misuse that used to go silently wrong, now refused by name or handled:
plan ties that do not hold in the live model, weights replaced between wrapping and
restore, a second offloader on wrapped layers, deepcopy and pickling of an offloaded
model, ``model.to(dtype)`` after post_init, a parameter replaced by a meta tensor before
restore, a stride-0 weight that cannot be copied, and wrapping under inference mode."""

from __future__ import annotations

import copy
import pickle

import attrs
import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, PlanError, create_offloader, describe_layers
from offload.executors.placement.marks import OffloadMark
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import (
    assert_restored,
    cpu_plan,
    inputs,
    patched_layers,
    pinned_plan,
    snapshot,
    tie_groups,
)
from tests.executors.models import (
    FusedBlock,
    TiedBlock,
    TransformerBlock,
    layer_list,
    replace_up_weight_data,
    transformer_model,
)
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan, view_plan

PREFETCH = OffloadConfig(group_size=1, prefetch_step=2)


def _plans(model: nn.Module) -> dict[str, OffloadPlan]:
    return {
        "prefetch": cpu_plan(model, PREFETCH),
        "prefetch-pinned": pinned_plan(model, PREFETCH),
        "uva": view_plan(model),
        "on-demand": cpu_on_demand_plan(model),
        "on-demand-pinned": on_demand_plan(model),
    }


KINDS = ["prefetch", "prefetch-pinned", "uva", "on-demand", "on-demand-pinned"]


def _offloader(kind: str, model: nn.Module) -> tuple[object, FakeRuntime]:
    plan = _plans(model)[kind]
    runtime = FakeRuntime()
    return create_offloader(plan, runtime), runtime


# ---- ties the plan and the model disagree on ---------------------------------------------


def test_a_plan_tie_the_model_does_not_have_is_refused_before_anything_moves() -> None:
    planned = nn.Sequential(TiedBlock(), TiedBlock())
    plan = cpu_plan(planned, PREFETCH)
    assert any(p.tied_to for p in plan.offloaded_params)
    untied = nn.Sequential(TiedBlock(), TiedBlock())
    for layer in untied:
        assert isinstance(layer, TiedBlock)
        layer.b.weight = nn.Parameter(layer.b.weight.detach().clone())  # now separate from a.weight
    before = snapshot(untied)
    with pytest.raises(PlanError, match="tied to .* in the plan, but in the model they hold separate data") as info:
        create_offloader(plan).wrap_modules(layer_list(untied))
    assert info.value.name == "b.weight"
    assert_restored(untied, before, same_storage=True)
    assert patched_layers(layer_list(untied)) == []


def test_a_model_tie_the_plan_does_not_know_is_refused() -> None:
    planned = nn.Sequential(TiedBlock(), TiedBlock())
    for layer in planned:
        assert isinstance(layer, TiedBlock)
        layer.b.weight = nn.Parameter(layer.b.weight.detach().clone())
    plan = cpu_plan(planned, PREFETCH)
    assert not any(p.tied_to for p in plan.offloaded_params)
    tied = nn.Sequential(TiedBlock(), TiedBlock())
    with pytest.raises(PlanError, match="share one storage in the model, but the plan treats them as separate"):
        create_offloader(plan).wrap_modules(layer_list(tied))
    assert tie_groups(tied) == {frozenset({f"{i}.a.weight", f"{i}.b.weight"}) for i in range(2)}


# ---- weights replaced between wrapping and restore ----------------------------------------


@pytest.mark.parametrize("after_post_init", [False, True], ids=["before-post-init", "after-post-init"])
@pytest.mark.parametrize("kind", KINDS)
def test_weights_replaced_after_wrapping_are_what_restore_gives_back(kind: str, after_post_init: bool) -> None:
    model = transformer_model(3)
    off, _ = _offloader(kind, model)
    layers = layer_list(model)
    off.wrap_modules(layers)  # type: ignore[attr-defined]
    if after_post_init:
        off.post_init()  # type: ignore[attr-defined]
    replace_up_weight_data(layers[1])  # a loader or post-processing gives it new values
    new = layers[1].get_parameter("mlp.up.weight").detach().clone()
    off.restore()  # type: ignore[attr-defined]
    assert torch.equal(layers[1].get_parameter("mlp.up.weight"), new)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_post_init_then_restore_keeps_the_new_weights(kind: str) -> None:
    model = transformer_model(3)
    plan = _plans(model)[kind]
    runtime = FakeRuntime(fail_device_empty_at=0, fail_device_view_at=10**6)
    off = create_offloader(plan, runtime)
    layers = layer_list(model)
    off.wrap_modules(layers)
    replace_up_weight_data(layers[2])
    new = layers[2].get_parameter("mlp.up.weight").detach().clone()
    if plan.backend.value == "prefetch":
        with pytest.raises(ExecutionError, match="post_init failed"):
            off.post_init()
    off.restore()
    assert torch.equal(layers[2].get_parameter("mlp.up.weight"), new)


@pytest.mark.parametrize("kind", ["prefetch", "on-demand-pinned"])
def test_a_parameter_replaced_by_meta_before_restore_is_named_and_restore_can_be_retried(kind: str) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    off, _ = _offloader(kind, model)
    layers = layer_list(model)
    off.wrap_modules(layers)  # type: ignore[attr-defined]
    off.post_init()  # type: ignore[attr-defined]
    up = layers[1].get_submodule("mlp.up")
    assert isinstance(up, nn.Linear)
    kept = up.weight
    up.weight = nn.Parameter(torch.empty(kept.shape, device="meta"))
    with pytest.raises(ExecutionError, match="replaced by a meta tensor: restore cannot give it back") as info:
        off.restore()  # type: ignore[attr-defined]
    assert info.value.name == "mlp.up.weight"
    up.weight = kept  # the user puts it back
    off.restore()  # type: ignore[attr-defined]
    for name, p in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name


# ---- one offloader per layer, no copies of an offloaded model ---------------------------


@pytest.mark.parametrize("second", KINDS)
@pytest.mark.parametrize("first", ["prefetch", "uva", "on-demand"])
def test_a_second_offloader_on_wrapped_layers_is_refused_by_name(first: str, second: str) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    off, _ = _offloader(first, model)
    layers = layer_list(model)
    off.wrap_modules(layers)  # type: ignore[attr-defined]
    off.post_init()  # type: ignore[attr-defined]
    other, _ = _offloader(second, reference)  # planned from an identical model
    with pytest.raises(ExecutionError, match=r"layers\[0\] \(TransformerBlock\) is already offloaded by") as info:
        other.wrap_modules(layers)  # type: ignore[attr-defined]
    assert info.value.name == "layers[0]"
    x = next(inputs(seed=1))
    assert torch.equal(model(x), reference(x))  # the first offloader is untouched
    off.restore()  # type: ignore[attr-defined]
    again, _ = _offloader(second, model)
    again.wrap_modules(layers)  # type: ignore[attr-defined]  # after restore the layers are free again
    again.post_init()  # type: ignore[attr-defined]
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_and_pickle_of_an_offloaded_model_are_refused(kind: str) -> None:
    model = transformer_model(2)
    off, _ = _offloader(kind, model)
    off.wrap_modules(layer_list(model))  # type: ignore[attr-defined]
    off.post_init()  # type: ignore[attr-defined]
    with pytest.raises(ExecutionError, match="cannot deepcopy an offloaded model"):
        copy.deepcopy(model)
    with pytest.raises(ExecutionError, match="cannot pickle an offloaded model"):
        pickle.dumps(model)
    off.restore()  # type: ignore[attr-defined]
    assert not any(isinstance(v, OffloadMark) for layer in model for v in vars(layer).values())
    twin = copy.deepcopy(model)  # restored: an ordinary model again
    x = next(inputs(seed=2))
    assert torch.equal(twin(x), model(x))


# ---- changed after post_init ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefetch", "prefetch-pinned", "on-demand", "on-demand-pinned"])
def test_model_to_dtype_after_post_init_is_refused_not_run_with_stale_weights(kind: str) -> None:
    model = transformer_model(3)
    off, _ = _offloader(kind, model)
    off.wrap_modules(layer_list(model))  # type: ignore[attr-defined]
    off.post_init()  # type: ignore[attr-defined]
    model.to(torch.float64)
    with pytest.raises(ExecutionError, match="no longer points at its") as info:
        model(next(inputs(seed=3)).to(torch.float64))
    assert "torch.float64" in str(info.value)
    off.restore()  # type: ignore[attr-defined]
    assert {p.dtype for p in model.parameters()} == {torch.float64}  # restore kept the change: no mix


# ---- odd weights and modes -------------------------------------------------------------------


class Expanded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8).expand(4, 8))  # stride 0 along the first dimension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_weight_that_cannot_be_copied_is_named_with_its_layer() -> None:
    model = nn.Sequential(Expanded(), Expanded())
    before = snapshot(model)
    plan = pinned_plan(model, OffloadConfig(group_size=1))
    with pytest.raises(ExecutionError, match=r"layer 0 parameter 'w': host copy of a \(4, 8\)"):
        create_offloader(plan, FakeRuntime()).wrap_modules(layer_list(model))
    assert_restored(model, before, same_storage=True)


@pytest.mark.parametrize("kind", KINDS)
def test_wrapping_under_inference_mode_leaves_tensors_usable_outside_it(kind: str) -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    off, _ = _offloader(kind, model)
    with torch.inference_mode():
        off.wrap_modules(layer_list(model))  # type: ignore[attr-defined]
        off.post_init()  # type: ignore[attr-defined]
    assert not any(p.is_inference() for p in model.parameters())
    for x in inputs(seed=4):
        assert torch.equal(model(x), reference(x))  # outside inference mode (under no_grad)
    with torch.inference_mode():
        off.restore()  # type: ignore[attr-defined]
    assert not any(p.is_inference() for p in model.parameters())
    assert all(torch.equal(model.get_parameter(n), p) for n, p in reference.named_parameters())


def test_the_plan_made_from_another_model_of_the_same_shapes_still_runs() -> None:
    """A control for the tie checks: identical structure and ties, other values."""
    planned = nn.Sequential(TiedBlock(), TransformerBlock(), TiedBlock())
    plan = cpu_plan(planned, PREFETCH)
    model = nn.Sequential(TiedBlock(), TransformerBlock(), TiedBlock())
    reference = copy.deepcopy(model)
    assert describe_layers(layer_list(model)).num_params == describe_layers(layer_list(planned)).num_params
    off = create_offloader(attrs.evolve(plan), FakeRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = next(inputs(seed=5))
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", ["prefetch-pinned", "uva", "on-demand-pinned", "prefetch"])
def test_views_of_one_storage_come_back_sharing_it(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FusedBlock(), FusedBlock(), FusedBlock())
    reference = copy.deepcopy(model)
    shared = {id(layer): layer.q.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()
              for layer in model if isinstance(layer, FusedBlock)}
    assert all(shared.values())
    plan = _plans(model)[kind]
    off = create_offloader(plan, FakeRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = torch.randn(2, 16)
    assert torch.equal(model(x), reference(x))
    off.restore()
    for layer, twin in zip(model, reference, strict=True):
        assert isinstance(layer, FusedBlock) and isinstance(twin, FusedBlock)
        assert layer.q.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()  # one storage again
        assert layer.k.storage_offset() - layer.q.storage_offset() == 16 * 16
        assert torch.equal(layer.q, twin.q) and torch.equal(layer.k, twin.k)
