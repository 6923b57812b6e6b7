"""Failures while moving weights: a wrap that fails leaves the model exactly as it was
(`Undo`), and a restore that fails part way says how far it got and finishes when called
again (`Restorer`). Run on ``FakeRuntime(device="cuda:0")``, so host models take the GPU
paths (copies to the device, page-locked host copies) and every one of them can fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadPlan, create_offloader
from offload.pure.decide.moves import Move
from tests.executors.fakes import FakeRuntime, HostCopy, HostEmpty, Release
from tests.executors.helpers import assert_restored, inputs, snapshot, tie_groups
from tests.executors.models import TiedBlock, layer_list
from tests.executors.moves_helpers import KINDS, PIN, build_model, cpu_plan_for, gpu_plan, storages_with
from tests.executors.uva_helpers import cross_layer_tied_model


def hooked(model: nn.Module) -> list[str]:
    """Names of modules that carry a state_dict hook or an instance-level forward."""
    return [name for name, m in model.named_modules() if m._state_dict_hooks or "forward" in m.__dict__]


# ============================================================================ a failed wrap


#: (knob, which calls to fail): host copies (pinning on: offloaded host weights) and
#: copies to the device (resident host weights), the first, a middle and the last one.
def failure_points(plan: OffloadPlan) -> list[tuple[str, int]]:
    pinned = storages_with(plan, Move.HOST_TO_PINNED)
    to_device = storages_with(plan, Move.TO_DEVICE)
    points = [("fail_host_copy_at", k) for k in sorted({0, pinned // 2, pinned - 1}) if pinned]
    return points + [("fail_copy_to_at", k) for k in sorted({0, to_device // 2, to_device - 1}) if to_device]


@pytest.mark.parametrize("pin", PIN.values(), ids=PIN)
@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_wrap_of_a_host_model_leaves_it_bit_identical(kind: str, pin: bool) -> None:
    points = failure_points(gpu_plan(build_model(), kind, pin=pin))
    assert points
    for knob, k in points:
        model = build_model()
        before = snapshot(model)
        ties = tie_groups(model)
        plan = gpu_plan(model, kind, pin=pin)
        runtime = FakeRuntime(device="cuda:0", fail_host_copy_at=k if knob == "fail_host_copy_at" else None,
                              fail_copy_to_at=k if knob == "fail_copy_to_at" else None)
        off = create_offloader(plan, runtime)
        with pytest.raises(ExecutionError, match="model left as it was"):
            off.wrap_modules(layer_list(model))
        # The same Parameters with the same devices, strides and bits; adopted pageable
        # weights at the same address; page-locked copies taken all given back.
        assert_restored(model, before, same_storage=not pin)
        assert tie_groups(model) == ties, (knob, k)
        assert hooked(model) == [], (knob, k)
        pinned_released = [r for r in runtime.entries(Release) if r.pinned]
        assert len(pinned_released) == len(runtime.entries(HostCopy)) - (knob == "fail_host_copy_at")
        assert runtime.device_live_bytes == 0, (knob, k)
        for x in inputs(seed=20, shapes=((1, 3),)):
            assert torch.equal(model(x), build_model()(x))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_wrap_of_a_meta_model_puts_the_meta_parameters_back(kind: str, target: str) -> None:
    with torch.device("meta"):
        probe = build_model()
    plan = cpu_plan_for(probe, kind) if target == "cpu" else gpu_plan(probe, kind, pin=True)
    resident = storages_with(plan, Move.NEW_ON_DEVICE)
    for k in sorted({0, resident // 2, resident - 1}):
        with torch.device("meta"):
            model = build_model()
        originals = dict(model.named_parameters(remove_duplicate=False))
        plan = cpu_plan_for(model, kind) if target == "cpu" else gpu_plan(model, kind, pin=True)
        runtime = FakeRuntime(device="cpu" if target == "cpu" else "cuda:0", fail_device_empty_at=k)
        off = create_offloader(plan, runtime)
        with pytest.raises(ExecutionError, match="model left as it was"):
            off.wrap_modules(layer_list(model))
        now = dict(model.named_parameters(remove_duplicate=False))
        assert sorted(now) == sorted(originals)
        for name, param in now.items():
            assert param is originals[name], (name, k)
            assert param.device.type == "meta", (name, k)
        tied = model[1]
        assert isinstance(tied, TiedBlock)
        assert tied.a.weight is tied.b.weight
        assert hooked(model) == []
        # Host memory made for offloaded weights is released, and nothing is left on the device.
        assert len(runtime.entries(Release)) == len(runtime.entries(HostEmpty))
        assert runtime.device_live_bytes == 0


# ============================================================================ restore, retried


def restore_copies(plan: OffloadPlan, pin: bool) -> tuple[int, int]:
    """(storages restore gives back without a copy, storages it copies back): pageable
    host copies are the weights themselves; page-locked ones and device ones are copied."""
    offloaded = sum(p.tied_to is None for p in plan.offloaded_params)
    to_device = storages_with(plan, Move.TO_DEVICE)
    return (0, offloaded + to_device) if pin else (offloaded, to_device)


@pytest.mark.parametrize("pin", PIN.values(), ids=PIN)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [build_model, cross_layer_tied_model], ids=["tied-blocks", "cross-layer-ties"])
def test_a_restore_that_fails_at_any_copy_finishes_when_called_again(make: type[nn.Module], kind: str,
                                                                     pin: bool) -> None:
    free, copied = restore_copies(gpu_plan(make(), kind, pin=pin), pin)
    assert copied
    # A spread of copies, and for the model with ties across layers every copy back of a
    # resident storage (those come last): a failure between two names of one storage, a
    # layer apart, is what could break a tie.
    points = sorted({0, copied // 3, copied // 2, copied - 1})
    if make is cross_layer_tied_model:
        points = sorted({*points, *range(copied - storages_with(gpu_plan(make(), kind, pin=pin), Move.TO_DEVICE),
                                         copied)})
    for k in points:
        model = make()
        reference = make()
        before = snapshot(model)
        ties = tie_groups(model)
        plan = gpu_plan(model, kind, pin=pin)
        runtime = FakeRuntime(device="cuda:0")
        off = create_offloader(plan, runtime)
        off.wrap_modules(layer_list(model))
        off.post_init()
        x = next(inputs(seed=21))
        assert torch.equal(model(x), reference(x))
        runtime.fail_copy_to_at = runtime.copies_to + k
        total = free + copied
        with pytest.raises(ExecutionError, match=(
                rf"restore stopped after giving back {free + k} of {total} storages .*call restore\(\) again")):
            off.restore()
        runtime.fail_copy_to_at = None
        off.restore()
        assert_restored(model, before, same_storage=False)
        assert tie_groups(model) == ties, k
        assert hooked(model) == [], k
        assert off.stats().host_bytes == 0
        assert runtime.device_live_bytes == 0, k
        assert torch.equal(model(x), reference(x))
