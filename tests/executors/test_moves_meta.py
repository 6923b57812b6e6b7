"""The engine lifecycle from meta: build the model on the meta device, plan from it, wrap,
let a loader fill every weight (in place, or by assigning ``param.data``), post_init, run,
restore.

Meta Parameters cannot take real data, so wrapping replaces them by new Parameters; the
loader finds them by name after wrapping. Ties (one Parameter under two names) stay ties.
Run on a CPU plan (``FakeRuntime()``) and on a CUDA-like plan with the played device
(``FakeRuntime(device="cuda:0")``), pinning on and off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadPlan, Placement, create_offloader
from offload.pure.decide.moves import Move
from tests.executors.fakes import CopyTo, FakeRuntime, HostCopy, HostEmpty
from tests.executors.helpers import inputs, tie_groups
from tests.executors.models import TiedBlock, layer_list
from tests.executors.moves_helpers import build_model, cpu_plan_for, gpu_plan, same_bits, storages_with

#: (platform, pin): the CPU plan, and the CUDA-like plan with pinning on and off.
TARGETS = {"cpu": ("cpu", False), "gpu-pin-on": ("cuda:0", True), "gpu-pin-off": ("cuda:0", False)}


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return build_model()


def plan_for(model: nn.Module, kind: str, device: str, pin: bool) -> OffloadPlan:
    return cpu_plan_for(model, kind) if device == "cpu" else gpu_plan(model, kind, pin=pin)


def load(model: nn.Module, weights: dict[str, torch.Tensor], *, in_place: bool, runtime: FakeRuntime,
         resident: set[str]) -> None:
    """What an engine's loader does after wrap_modules: each weight by name, into
    ``param.data`` in place, or by assigning a new tensor where the parameter is (on the
    device for `resident` names, a host tensor for offloaded ones)."""
    for name, w in weights.items():
        param = model.get_parameter(name)
        if in_place:
            param.data.copy_(w)
        elif name in resident:
            param.data = runtime.copy_to(w, runtime.device)
        else:
            param.data = w.clone()


def tied_blocks(model: nn.Module) -> list[TiedBlock]:
    return [layer for layer in model.children() if isinstance(layer, TiedBlock)]


@pytest.mark.parametrize("in_place", [True, False], ids=["copy_", "assign"])
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kind", ["prefetch", "uva", "on_demand", "none"])
def test_a_meta_model_is_wrapped_loaded_run_and_restored(kind: str, target: str, in_place: bool) -> None:
    device, pin = TARGETS[target]
    twin = build_model()  # the resident model, with the weights the loader reads
    model = meta_model()
    ties = tie_groups(twin)
    originals = dict(model.named_parameters(remove_duplicate=False))
    plan = plan_for(model, kind, device, pin)
    offloaded = {f"{p.layer}.{p.name}" for p in plan.offloaded_params}
    assert bool(offloaded) is (kind != "none")
    if kind in ("uva", "on_demand"):  # zero-copy views need a GPU plan with pinning and UVA on
        views = kind == "uva" and device != "cpu" and pin
        assert {p.placement for p in plan.offloaded_params} == {Placement.UVA if views else Placement.ON_DEMAND}
    assert {plan.move_of(p) for p in plan.offloaded_params} <= {Move.NEW_ON_HOST}
    assert {plan.move_of(p) for p in plan.params if not p.offloaded} == {Move.NEW_ON_DEVICE}
    runtime = FakeRuntime(device=device)
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))

    # Every name has real, uninitialised storage now, in a new Parameter; ties kept.
    now = dict(model.named_parameters(remove_duplicate=False))
    assert sorted(now) == sorted(originals)
    for name, param in now.items():
        assert param.device.type != "meta", name
        assert param is not originals[name], name
        assert param.requires_grad is originals[name].requires_grad, name
    for block in tied_blocks(model):
        assert block.a.weight is block.b.weight
    empties = runtime.entries(HostEmpty)
    assert len(empties) == storages_with(plan, Move.NEW_ON_HOST)
    assert {e.pin for e in empties} <= {plan.pin.method}
    assert not runtime.entries(HostCopy)
    assert not runtime.entries(CopyTo)
    if device != "cpu":
        for name, param in now.items():
            assert runtime.on_device(param) is (name not in offloaded), name

    load(model, twin.state_dict(), in_place=in_place, runtime=runtime, resident=set(now) - offloaded)
    off.post_init()
    for x in inputs(seed=11):
        assert torch.equal(model(x), twin(x))
    state = model.state_dict()
    reference = twin.state_dict()
    assert sorted(state) == sorted(reference)
    for name, value in reference.items():
        assert same_bits(state[name], value), name
    # Filled in place, the host copies are the weights; assigned, they are copied into
    # page-locked memory at post_init (pinning on) or adopted (off).
    pinned_again = pin and not in_place
    assert len(runtime.entries(HostCopy)) == (storages_with(plan, Move.NEW_ON_HOST) if pinned_again else 0)

    off.restore()
    # Offloaded weights come back in host memory, resident ones keep their place; every
    # weight is the loaded one, ties intact.
    after = dict(model.named_parameters(remove_duplicate=False))
    for name, value in reference.items():
        assert same_bits(after[name], value), name
        if device != "cpu":
            assert runtime.on_device(after[name]) is (name not in offloaded), name
    for block in tied_blocks(model):
        assert block.a.weight is block.b.weight
    assert tie_groups(model) == ties
    for x in inputs(seed=12):
        assert torch.equal(model(x), twin(x))


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kind", ["prefetch", "uva", "on_demand"])
def test_post_init_names_a_parameter_the_loader_left_on_meta(kind: str, target: str) -> None:
    device, pin = TARGETS[target]
    model = meta_model()
    plan = plan_for(model, kind, device, pin)
    victim = plan.offloaded_params[0]
    off = create_offloader(plan, FakeRuntime(device=device))
    off.wrap_modules(layer_list(model))
    # The loader replaced the Parameter by a new one on meta (torch refuses to assign a
    # meta tensor to the data of a real one) and never filled it.
    module_name, _, leaf = victim.name.rpartition(".")
    layer = layer_list(model)[victim.layer]
    module = layer.get_submodule(module_name) if module_name else layer
    setattr(module, leaf, nn.Parameter(torch.empty(victim.shape, device="meta")))
    with pytest.raises(ExecutionError, match="still on the meta device at post_init") as info:
        off.post_init()
    assert info.value.name == victim.name
    assert repr(victim.name) in str(info.value)
    assert f"layer {victim.layer}" in str(info.value)


def test_uva_weights_loaded_after_wrapping_are_written_to_their_host_copies_and_viewed_at_post_init() -> None:
    """Between wrap and post_init a UVA parameter from meta points at its host copy, not a
    device view of it: a loader's host-to-device copy into a view of host memory is outside
    what CUDA defines. post_init then gives it its view, and the layer reads it in place."""
    model = meta_model()
    runtime = FakeRuntime(device="cuda:0")
    plan = plan_for(model, "uva", "cuda:0", True)
    uva_params = [p for p in plan.offloaded_params if p.placement is Placement.UVA]
    assert uva_params
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))
    assert runtime.device_views == 0  # no view yet
    assert [p for p in off.plan.offloaded_params if p.placement is Placement.ON_DEMAND] == []  # not demoted
    reference = build_model()
    load(model, dict(reference.named_parameters()), in_place=True, runtime=runtime,
         resident={f"{p.layer}.{p.name}" for p in plan.params if not p.offloaded})
    off.post_init()
    assert runtime.device_views == len({p.tied_to or (p.layer, p.name) for p in uva_params})
    assert {p.placement for p in off.plan.offloaded_params} == {Placement.UVA}
    for x in inputs(seed=31):
        assert torch.equal(model(x), reference(x))
    off.restore()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        assert same_bits(param, expected[name]), name
