"""UVAOffloader on the CPU: parity with a resident copy for both placements (UVA, whose
device view on the CPU is the host copy itself, and ON_DEMAND, copied per call through
functional_call), ties within and across layers, special weights, strides, hooks and
restore.

Lifecycle errors and mismatched models are in test_lifecycle.py; host memory (the pin
regression, one copy per storage, failures, fallbacks, capture) in test_host_memory.py;
post-processing in test_post_processing.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from offload import Placement
from offload.pure import UvaReason
from tests.executors.fakes import FakeRuntime, ToDevice, View
from tests.executors.helpers import assert_restored, inputs, patched_layers, snapshot, tie_groups, uva
from tests.executors.models import (
    HIDDEN,
    TiedBlock,
    TransformerBlock,
    TransposedBlock,
    layer_list,
    mixed_model,
    transformer_model,
)
from tests.executors.uva_helpers import (
    ALL,
    copies_per_forward,
    cross_layer_tied_model,
    on_demand_plan,
    storages,
    view_plan,
)

#: Bytes of one TransformerBlock's parameters (float32, HIDDEN 16): 11 tensors.
BLOCK_BYTES = 4 * sum(p.numel() for p in TransformerBlock().parameters())


@pytest.mark.parametrize("budget", [1, 2 * BLOCK_BYTES, ALL], ids=["first-param", "two-layers", "all"])
def test_on_demand_parity_over_several_forwards(budget: int) -> None:
    model = transformer_model(5)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    plan = on_demand_plan(model, budget)
    assert (plan.uva.enabled, plan.uva.reason) == (False, UvaReason.DISABLED_BY_ENV)
    assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    offloaded = sorted({p.layer for p in plan.offloaded_params})
    assert offloaded == {1: [0], 2 * BLOCK_BYTES: [0, 1], ALL: [0, 1, 2, 3, 4]}[budget]
    off = uva(plan)

    assert off.wrap_modules(layers) == layers
    assert patched_layers(layers) == offloaded
    for p in plan.offloaded_params:  # each parameter now holds its own host copy
        param = layers[p.layer].get_parameter(p.name)
        was = before[f"{p.layer}.{p.name}"]
        assert param is was.param and param.data_ptr() != was.ptr
        assert torch.equal(param, was.param)
    for name, was in before.items():  # the rest is untouched
        if int(name.split(".")[0]) not in offloaded or (budget == 1 and name != "0.attn.norm.weight"):
            assert model.get_parameter(name).data_ptr() == was.ptr, name
    off.post_init()
    assert off.plan is plan
    forwards = 0
    for x in inputs(seed=1):
        assert torch.equal(model(x), reference(x))
        forwards += 1

    copies, nbytes = copies_per_forward(plan)
    stats = off.stats()
    assert (stats.copies_issued, stats.bytes_copied) == (forwards * copies, forwards * nbytes)
    assert stats.params_offloaded == len(plan.offloaded_params)
    assert stats.host_bytes == plan.host_bytes > 0
    assert (stats.device_buffer_bytes, stats.params_dropped, stats.pin_fallbacks) == (0, 0, 0)

    off.restore()
    assert_restored(model, before, same_storage=False)
    assert patched_layers(layers) == []
    for x in inputs(seed=2):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("budget", [2 * BLOCK_BYTES, ALL], ids=["two-layers", "all"])
def test_uva_parity_reads_the_host_copies_in_place(budget: int) -> None:
    model = transformer_model(5)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    plan = view_plan(model, budget)
    assert (plan.uva.enabled, plan.pin.pin) == (True, True)
    assert {p.placement for p in plan.offloaded_params} == {Placement.UVA}
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layers)
    assert patched_layers(layers) == []  # no hook: plain kernels over the views
    assert len(runtime.entries(View)) == storages(plan)
    off.post_init()
    for x in inputs(seed=3):
        assert torch.equal(model(x), reference(x))
    assert runtime.entries(ToDevice) == []
    assert (off.stats().copies_issued, off.stats().bytes_copied) == (0, 0)
    assert off.stats().host_bytes == plan.host_bytes
    off.restore()
    assert_restored(model, before, same_storage=False)


@pytest.mark.parametrize("mode", ["uva", "on-demand"])
def test_mixed_model_parity_ties_and_restore(mode: str) -> None:
    """Transposed, int8, float8, tied and shared-storage weights, all offloaded."""
    model = mixed_model()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    ties = tie_groups(model)
    plan = view_plan(model) if mode == "uva" else on_demand_plan(model)
    assert len({p.layer for p in plan.offloaded_params}) == 10
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layer_list(model))
    assert runtime.host_copies == storages(plan)
    assert tie_groups(model) == ties  # tied names share the one copy (or view)
    off.post_init()
    assert off.plan is plan
    for x in inputs(seed=4):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    for x in inputs(seed=5):
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("mode", ["uva", "on-demand"])
def test_ties_across_layers_share_one_host_copy(mode: str) -> None:
    model = cross_layer_tied_model()
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    before = snapshot(model)
    ties = tie_groups(model)
    assert ties == {frozenset({"0.up.weight", "3.up.weight"}), frozenset({"1.down.weight", "4.down.weight"})}
    by_storage = {p.data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    plan = view_plan(model) if mode == "uva" else on_demand_plan(model)
    tied = {(p.layer, p.name): p.tied_to for p in plan.offloaded_params if p.tied_to is not None}
    assert tied == {(3, "up.weight"): (0, "up.weight"), (4, "down.weight"): (1, "down.weight")}
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layers)
    assert runtime.host_copies == storages(plan) == len(plan.offloaded_params) - 2
    assert off.stats().host_bytes == plan.host_bytes == sum(by_storage.values())  # each storage once
    assert tie_groups(model) == ties
    off.post_init()
    assert off.plan is plan
    for x in inputs(seed=6):
        assert torch.equal(model(x), reference(x))
    if mode == "on-demand":
        # Layer 3 copies layer 0's storage for its own call: per call, per storage, once.
        copies, _ = copies_per_forward(plan)
        assert len(runtime.entries(ToDevice)) == 4 * copies == 4 * len(plan.offloaded_params)
    off.restore()
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    assert layers[3].get_parameter("up.weight") is layers[0].get_parameter("up.weight")


def test_a_tied_storage_is_copied_once_per_call() -> None:
    model = nn.Sequential(*[TiedBlock() for _ in range(3)])
    reference = copy.deepcopy(model)
    plan = on_demand_plan(model)
    runtime = FakeRuntime()
    off = uva(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    x = next(inputs(seed=7))
    assert torch.equal(model(x), reference(x))
    # a.weight and b.weight are one storage, b.bias another: two copies per layer.
    assert [entry.shape for entry in runtime.entries(ToDevice)] == [(HIDDEN, HIDDEN), (HIDDEN,)] * 3


@pytest.mark.parametrize("mode", ["uva", "on-demand"])
def test_transposed_weights_keep_their_strides(mode: str) -> None:
    model = nn.Sequential(*[TransposedBlock() for _ in range(3)])
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    stride = layers[1].get_parameter("weight_t").stride()
    assert stride == (1, 3 * HIDDEN)
    off = uva(view_plan(model) if mode == "uva" else on_demand_plan(model), FakeRuntime())
    off.wrap_modules(layers)
    assert all(layer.get_parameter("weight_t").stride() == stride for layer in layers)
    off.post_init()
    for x in inputs(seed=8):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert layers[1].get_parameter("weight_t").stride() == stride
    assert torch.equal(layers[1].get_parameter("weight_t"), reference[1].get_parameter("weight_t"))


class KeywordBlock(nn.Module):
    """A block whose forward takes a keyword argument and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, skip: bool = False) -> tuple[torch.Tensor, int]:
        return (x if skip else x + scale * self.proj(x)), 7


def test_on_demand_layers_pass_keywords_and_run_their_hooks_once() -> None:
    block = KeywordBlock()
    reference = copy.deepcopy(block)
    calls: list[str] = []

    def pre_hook(module: nn.Module, args: Any) -> None:
        calls.append("pre")

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        calls.append("post")

    block.register_forward_pre_hook(pre_hook)
    block.register_forward_hook(hook)
    off = uva(on_demand_plan(nn.Sequential(block)))
    off.wrap_modules([block])
    off.post_init()
    x = next(inputs(seed=9))
    for kwargs in ({}, {"scale": 0.5}, {"scale": 2.0, "skip": True}):
        got, extra = block(x, **kwargs)
        want, _ = reference(x, **kwargs)
        assert torch.equal(got, want) and extra == 7
    assert calls == ["pre", "post"] * 3
    assert block.proj.weight.device.type == "cpu" and block.proj.weight.data_ptr() != reference.proj.weight.data_ptr()


def test_restore_puts_back_a_forward_the_user_had_patched() -> None:
    model = transformer_model(3)
    reference = copy.deepcopy(model)
    layers = layer_list(model)
    calls: list[int] = []
    original = layers[1].forward

    def user_forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out: torch.Tensor = original(x)
        return out

    layers[1].forward = user_forward  # an instance-level patch, on purpose
    off = uva(on_demand_plan(model))
    off.wrap_modules(layers)
    off.post_init()
    x = next(inputs(seed=10))
    assert torch.equal(model(x), reference(x))
    assert calls == [1]  # the user's patch ran, with the device copies in place
    off.restore()
    assert layers[1].__dict__["forward"] is user_forward
    assert patched_layers(layers) == [1]
    assert torch.equal(model(x), reference(x))
    assert calls == [1, 1]
