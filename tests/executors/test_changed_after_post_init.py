"""A model changed after `post_init`: conversions (``model.to``),
writes in place (``load_state_dict``, ``param.copy_()``) and new Parameters. A prefetched
parameter points at a static slot that several layers share, so each of these used to go
silently wrong: restore gave a layer another layer's weights, a reload was overwritten
by the next copy, a new Parameter ran. Each is now refused at the next forward, by name,
and `restore` gives back what the model really holds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, create_offloader
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, pinned_plan
from tests.executors.models import TransformerBlock, bits, layer_list, transformer_model
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan, view_plan

#: A configuration where a slot is shared: six layers, every second one offloaded, one slot for all of
#: them (layers 1, 3 and 5 share it), so a slot holds whichever ran last.
SHARED_SLOT = OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1)
EVERY_LAYER = OffloadConfig(group_size=1, prefetch_step=1)

PLANS = {
    "prefetch": lambda m, c: cpu_plan(m, c),
    "prefetch-pinned": lambda m, c: pinned_plan(m, c),
    "uva": lambda m, c: view_plan(m),
    "on-demand": lambda m, c: cpu_on_demand_plan(m),
    "on-demand-pinned": lambda m, c: on_demand_plan(m),
}
PREFETCH = ["prefetch", "prefetch-pinned"]


def linears(seed: int, count: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(count)])


def ready(kind: str, model: nn.Module, config: OffloadConfig = SHARED_SLOT) -> tuple[object, OffloadPlan]:
    plan: OffloadPlan = PLANS[kind](model, config)
    off = create_offloader(plan, FakeRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    with torch.no_grad():
        model(torch.randn(2, 3, 16))  # every slot has held some layer
    return off, plan


# ---- case 1: a conversion, then restore ---------------------------------------------------


@pytest.mark.parametrize("config", [SHARED_SLOT, EVERY_LAYER], ids=["every-2nd", "every-layer"])
@pytest.mark.parametrize("kind", list(PLANS))
def test_to_dtype_then_restore_gives_each_layer_its_own_weights_converted(kind: str, config: OffloadConfig) -> None:
    model = linears(0)
    reference = copy.deepcopy(model).to(torch.float64)
    off, plan = ready(kind, model, config)
    assert plan.offloaded_params
    model.to(torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    if kind == "uva":
        # Views of each layer's own host copy: converted, they are the converted weights,
        # now in device memory of their own, and the layers (which carry no hook) run on.
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    else:
        with pytest.raises(ExecutionError, match="changed after post_init"):
            with torch.no_grad():
                model(x)
    off.restore()  # type: ignore[attr-defined]
    for name, want in reference.named_parameters():
        got = model.get_parameter(name)
        assert got.dtype == torch.float64, name
        assert torch.equal(bits(got), bits(want)), name
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", PREFETCH)
def test_converting_one_layer_converts_its_own_host_copies(kind: str) -> None:
    model = transformer_model(4)
    reference = copy.deepcopy(model)
    off, plan = ready(kind, model, OffloadConfig(group_size=1, prefetch_step=1))
    layers = layer_list(model)
    target = layers[2]
    assert isinstance(target, TransformerBlock)
    target.mlp.half()  # a part of one layer: its holders convert, wherever the call starts
    off.restore()  # type: ignore[attr-defined]
    twin = layer_list(reference)[2]
    assert isinstance(twin, TransformerBlock)
    twin.mlp.half()
    for name, want in reference.named_parameters():
        got = model.get_parameter(name)
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), name


@pytest.mark.parametrize("kind", PREFETCH)
def test_a_conversion_that_changes_nothing_keeps_the_slots_and_runs(kind: str) -> None:
    model = linears(0)
    reference = copy.deepcopy(model)
    off, plan = ready(kind, model)
    model.float()  # already float32
    model.cpu()  # the compute device of the CPU runtime: nothing moves
    model.to(torch.float32)
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert off.check().ok  # type: ignore[attr-defined]  # every offloaded parameter still in its slot
    off.restore()  # type: ignore[attr-defined]
    for name, want in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), want), name


# ---- case 2: written in place --------------------------------------------------------------


@pytest.mark.parametrize("kind", PREFETCH)
def test_an_in_place_op_on_a_prefetched_weight_is_refused(kind: str) -> None:
    model = linears(0)
    off, plan = ready(kind, model)
    layer = plan.offloaded_params[-1].layer
    with torch.no_grad():
        model.get_parameter(f"{layer}.bias").mul_(2)
    with pytest.raises(ExecutionError, match="written in place") as info:
        with torch.no_grad():
            model(torch.randn(2, 16))
    assert (info.value.name, info.value.value) == ("bias", layer)


@pytest.mark.parametrize("kind", PREFETCH)
def test_an_in_place_op_is_refused_and_restore_gives_back_the_weights_before_it(kind: str) -> None:
    model = linears(0)
    reference = copy.deepcopy(model)
    off, plan = ready(kind, model)
    offloaded = sorted({p.layer for p in plan.offloaded_params})
    with torch.no_grad():
        for layer in range(6):
            model.get_parameter(f"{layer}.weight").add_(1.0)  # into a shared slot, for the offloaded ones
    with pytest.raises(ExecutionError, match=r"written in place after post_init.*load_weights") as info:
        with torch.no_grad():
            model(torch.randn(2, 16))
    assert (info.value.name, info.value.value) == ("weight", offloaded[0])
    off.restore()  # type: ignore[attr-defined]
    for name, old in reference.named_parameters():
        layer = int(name.split(".")[0])
        want = old if layer in offloaded or name.endswith("bias") else old + 1.0
        assert torch.equal(model.get_parameter(name), want), name


@pytest.mark.parametrize("kind", ["uva", "on-demand", "on-demand-pinned"])
def test_in_place_writes_reach_uva_and_on_demand_weights(kind: str) -> None:
    """These point at their own host copies (or a view of one): a write in place is a
    write of the real weight, and the next forward computes with it."""
    model = linears(0)
    fresh = linears(1)
    off, _ = ready(kind, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(fresh.get_parameter(name))
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    off.restore()  # type: ignore[attr-defined]
    for name, want in fresh.named_parameters():
        assert torch.equal(model.get_parameter(name), want), name


# ---- case 3: a new Parameter ------------------------------------------------------------------


@pytest.mark.parametrize("kind", PREFETCH + ["on-demand", "on-demand-pinned"])
def test_a_new_parameter_on_an_offloaded_layer_is_refused_and_kept_by_restore(kind: str) -> None:
    model = linears(0)
    off, plan = ready(kind, model)
    layer = plan.offloaded_params[0].layer
    linear = model[layer]
    assert isinstance(linear, nn.Linear)
    linear.weight = nn.Parameter(torch.full((16, 16), 0.5))
    with pytest.raises(ExecutionError, match="weight") as info:
        with torch.no_grad():
            model(torch.randn(2, 16))
    assert (info.value.name, info.value.value) == ("weight", layer)
    assert "after post_init" in str(info.value)
    off.restore()  # type: ignore[attr-defined]
    assert torch.equal(linear.weight, torch.full((16, 16), 0.5))


@pytest.mark.parametrize("kind", PREFETCH)
def test_a_deleted_parameter_is_refused_by_name(kind: str) -> None:
    model = linears(0)
    off, plan = ready(kind, model)
    layer = plan.offloaded_params[0].layer
    linear = model[layer]
    assert isinstance(linear, nn.Linear)
    del linear.bias
    linear.bias = None  # type: ignore[assignment]  # nn.Linear reads it; None is how torch spells no bias
    with pytest.raises(ExecutionError, match="'bias' was deleted after post_init") as info:
        with torch.no_grad():
            model(torch.randn(2, 16))
    assert info.value.value == layer


@pytest.mark.parametrize("kind", PREFETCH)
def test_a_conversion_holds_a_second_copy_of_the_offloaded_weights_until_restore(kind: str) -> None:
    # What docs/guarantees.md says a conversion costs: the converted copies (here half the
    # bytes, float32 to float16) beside the host copies, which the offloader keeps until
    # restore() gives the model the converted ones.
    model = linears(0)
    off, plan = ready(kind, model, EVERY_LAYER)
    held = off.stats().host_bytes  # type: ignore[attr-defined]
    assert held == plan.host_bytes > 0
    model.to(torch.float16)
    converted = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                 for p in model.parameters() if p.dtype == torch.float16}
    assert sum(converted.values()) == plan.host_bytes // 2  # every weight converted, each a storage of its own
    assert off.stats().host_bytes == held  # type: ignore[attr-defined]  # the host copies are still held: 1.5x in all
    off.restore()  # type: ignore[attr-defined]
    assert all(p.dtype == torch.float16 for p in model.parameters())
