"""``state_dict()`` of an offloaded model holds every weight's real values.

A prefetch parameter points at a static slot that several offloaded layers share, so its
own data holds whichever layer was copied in last; before the state_dict hooks, 35 of 57
entries of a small Llama were another layer's weights. Each offloaded entry is now its
host copy; after restore the hooks are gone and entries are the parameters' own data.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import EnvFlags, EnvSnapshot, OffloadConfig, OffloadPlan, create_offloader, describe_layers, make_plan
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE, inputs
from tests.executors.models import layer_list, transformer_model
from tests.executors.moves_helpers import cpu_plan_for, gpu_plan, same_bits

#: (runtime device, pin): the CPU plan, and the CUDA-like plan with pinning on and off.
TARGETS = {"cpu": ("cpu", False), "gpu-pin-on": ("cuda:0", True), "gpu-pin-off": ("cuda:0", False)}


def plan_for(model: nn.Module, kind: str, device: str, pin: bool) -> OffloadPlan:
    if kind == "prefetch":  # every layer offloaded, through the same few slots
        env = EnvSnapshot() if device == "cpu" else EnvSnapshot(
            platform=CUDA_LIKE, flags=EnvFlags(disable_pin_memory=not pin))
        return make_plan(describe_layers(layer_list(model)), OffloadConfig(group_size=1), env)
    return cpu_plan_for(model, kind) if device == "cpu" else gpu_plan(model, kind, pin=pin)


def assert_equal_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert same_bits(state[name], value), name


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kind", ["prefetch", "uva", "on_demand"])
def test_state_dict_of_an_offloaded_model_holds_the_real_weights(kind: str, target: str) -> None:
    device, pin = TARGETS[target]
    model = transformer_model(6)
    reference = copy.deepcopy(model)
    expected = reference.state_dict()
    plan = plan_for(model, kind, device, pin)
    offloaded = [f"{p.layer}.{p.name}" for p in plan.offloaded_params]
    assert len({p.layer for p in plan.offloaded_params}) >= 3
    runtime = FakeRuntime(device=device)
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    for x in inputs(seed=40):
        assert torch.equal(model(x), reference(x))

    assert_equal_state(model.state_dict(), expected)
    state = model.state_dict(keep_vars=True)
    for name in offloaded:
        assert not runtime.on_device(state[name]), name  # the host copy
    if kind == "prefetch":
        # What state_dict would say without the hooks: the parameters point at shared
        # slots, so most layers' weights are another layer's.
        assert len({model.get_parameter(n).data_ptr() for n in offloaded}) < len(offloaded)
        weights = [n for n in offloaded if n.endswith("qkv.weight")]
        wrong = [n for n in weights if not same_bits(model.get_parameter(n), expected[n])]
        assert len(wrong) >= len(weights) // 2, wrong

    off.restore()
    state = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in state.items():
        assert value is params[name], name  # the ordinary state_dict: no hook rewrites it
    assert not [n for n, m in model.named_modules() if m._state_dict_hooks]
    assert_equal_state(model.state_dict(), expected)
