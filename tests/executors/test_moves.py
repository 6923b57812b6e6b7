"""Executors move each weight as the plan says, from wherever it is.

- A CPU plan adopts the host weights as their own host copies: no copy at all.
- A model on the host run with a CUDA plan (on ``FakeRuntime(device="cuda:0")``, which
  plays the device with CPU tensors and counts its memory): resident weights are copied
  to the device, offloaded ones into page-locked host copies or adopted as they are, and
  restore gives every weight back to the host bit for bit.
- Device memory stays within the plan's device total plus the largest tensor while a
  model larger than that total is wrapped, prepared and run.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from offload import (
    EnvFlags,
    EnvSnapshot,
    OffloadConfig,
    OffloadPlan,
    Placement,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.pure.decide.moves import Move
from tests.executors.fakes import CopyTo, FakeRuntime, HostCopy, HostEmpty, ToDevice
from tests.executors.helpers import (
    CUDA_LIKE,
    assert_restored,
    cpu_plan,
    inputs,
    patched_layers,
    pinned_plan,
    prefetch,
    snapshot,
    tie_groups,
)
from tests.executors.models import layer_list, mixed_model, transformer_model
from tests.executors.moves_helpers import (
    KINDS,
    PIN,
    build_model,
    cpu_plan_for,
    gpu_plan,
    has_bits,
    largest_tensor_bytes,
    model_bytes,
    moved,
    run,
    storages_with,
)


def assert_parity(model: nn.Module, reference: nn.Module, seed: int = 3) -> None:
    for x in inputs(seed=seed):
        assert torch.equal(model(x), reference(x))


# ============================================================================ CPU plans adopt


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_a_cpu_plan_adopts_the_weights_without_copying_them(kind: str) -> None:
    model = mixed_model()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    plan = cpu_plan_for(model, kind)
    offloaded = [f"{p.layer}.{p.name}" for p in plan.offloaded_params]
    assert offloaded
    assert {plan.move_of(p, "cpu", "cpu") for p in plan.offloaded_params} == {Move.ADOPT}
    runtime = FakeRuntime()
    off = run(plan, runtime, model)
    assert runtime.host_copies == 0
    assert not runtime.entries(HostEmpty)
    assert not runtime.entries(CopyTo)
    assert off.stats().host_bytes == plan.host_bytes
    # The host copy is the weight's own storage: state_dict returns it (for prefetch the
    # parameter itself points at a slot), and an on-demand parameter still points at it.
    state = model.state_dict(keep_vars=True)
    for name in offloaded:
        assert state[name].data_ptr() == before[name].ptr, name
        if kind == "uva":
            assert model.get_parameter(name).data_ptr() == before[name].ptr, name
    assert_parity(model, reference)
    off.restore()
    assert_restored(model, before, same_storage=True)
    assert off.stats().host_bytes == 0


# ============================================================================ host model, GPU plan


@pytest.mark.parametrize("pin", PIN.values(), ids=PIN)
@pytest.mark.parametrize("kind", KINDS)
def test_a_host_model_on_a_gpu_plan_goes_to_the_device_and_to_host_copies(kind: str, pin: bool) -> None:
    model = build_model()
    reference = copy.deepcopy(model)
    before = snapshot(model)
    ties = tie_groups(model)
    assert ties
    plan = gpu_plan(model, kind, pin=pin)
    assert plan.pin.pin is pin
    to_device = moved(plan, Move.TO_DEVICE)
    offloaded = [f"{p.layer}.{p.name}" for p in plan.offloaded_params]
    assert to_device
    assert bool(offloaded) is (kind != "none")
    host_move = Move.HOST_TO_PINNED if pin else Move.ADOPT
    assert {plan.move_of(p) for p in plan.offloaded_params} <= {host_move}
    runtime = FakeRuntime(device="cuda:0")
    off = run(plan, runtime, model)

    # Resident weights are on the device, one copy per storage (ties once).
    for name in to_device:
        assert runtime.on_device(model.get_parameter(name)), name
    device_copies = [e for e in runtime.entries(CopyTo) if e.to_device]
    assert len(device_copies) == storages_with(plan, Move.TO_DEVICE)
    # Offloaded ones are in host copies: copied into (played) page-locked memory with
    # pinning on, the weights' own pageable storage with it off.
    host_copies = runtime.entries(HostCopy)
    assert len(host_copies) == (storages_with(plan, Move.HOST_TO_PINNED) if pin else 0)
    assert {c.pin for c in host_copies} <= {plan.pin.method}
    state = model.state_dict(keep_vars=True)
    for name in offloaded:
        host = state[name]
        assert not runtime.on_device(host), name
        assert runtime.is_pinned(host) is pin, name
        assert has_bits(host, before[name].bits), name
        if not pin:
            assert host.data_ptr() == before[name].ptr, name
    assert off.stats().host_bytes == plan.host_bytes
    assert_parity(model, reference)

    off.restore()
    assert_restored(model, before, same_storage=False)
    assert tie_groups(model) == ties
    for name in offloaded:
        if not pin:  # the adopted storage itself is given back
            assert model.get_parameter(name).data_ptr() == before[name].ptr, name
    assert runtime.device_live_bytes == 0
    assert patched_layers(layer_list(model)) == []
    assert_parity(model, reference, seed=4)


@pytest.mark.parametrize("kind", ["prefetch", "uva", "on_demand"])
def test_keep_host_params_leaves_host_weights_where_they_are(kind: str) -> None:
    # Layers 1 and 3 are not loaded yet (meta): they are placed; the host layers stay put.
    model = build_model()
    twin = build_model()
    with torch.device("meta"):
        unloaded = build_model()
    model[1], model[3] = unloaded[1], unloaded[3]
    host_names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "cpu"]
    before = {n: s for n, s in snapshot(model).items() if n in host_names}
    plan = gpu_plan(model, kind, pin=True, keep_host_params=True)
    assert {plan.move_of(p) for p in plan.params if p.layer not in (1, 3)} == {Move.KEEP}
    assert plan.offloaded_params and {p.layer for p in plan.offloaded_params} <= {1, 3}
    runtime = FakeRuntime(device="cuda:0")
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))
    for name, state in twin.state_dict().items():
        if not name.startswith(("1.", "3.")):
            continue
        model.get_parameter(name).data.copy_(state)
    off.post_init()
    now = dict(model.named_parameters(remove_duplicate=False))
    for name, was in before.items():
        assert now[name] is was.param and now[name].data_ptr() == was.ptr, name
        assert not runtime.on_device(now[name]), name
    assert not [e for e in runtime.entries(CopyTo) if e.to_device]
    assert not runtime.entries(HostCopy)
    assert len(runtime.entries(HostEmpty)) == storages_with(plan, Move.NEW_ON_HOST)
    assert_parity(model, twin)
    off.restore()
    now = dict(model.named_parameters(remove_duplicate=False))
    for name, was in before.items():
        assert now[name] is was.param and now[name].data_ptr() == was.ptr, name
        assert has_bits(now[name], was.bits), name
    assert_parity(model, twin, seed=4)


# ============================================================================ the device bound


def bound_plan(model: nn.Module, kind: str, *, pin: bool) -> OffloadPlan:
    """Most of the model offloaded: prefetch 3 layers of every 4, UVA 3/4 of its bytes."""
    if kind == "prefetch":
        config = OffloadConfig(group_size=4, num_in_group=3)
    else:
        config = OffloadConfig(backend="uva", uva_max_bytes=model_bytes(model) * 3 // 4)
    flags = EnvFlags(disable_pin_memory=not pin, disable_uva=kind == "on_demand")
    return make_plan(describe_layers(layer_list(model)), config, EnvSnapshot(platform=CUDA_LIKE, flags=flags))


@pytest.mark.parametrize("source", ["host", "meta"])
@pytest.mark.parametrize("pin", PIN.values(), ids=PIN)
@pytest.mark.parametrize("kind", ["prefetch", "uva", "on_demand"])
def test_device_memory_stays_within_the_plan_for_a_model_bigger_than_it(kind: str, pin: bool, source: str) -> None:
    twin = transformer_model(8)
    if source == "meta":
        with torch.device("meta"):
            model = transformer_model(8)
    else:
        model = copy.deepcopy(twin)
    total = model_bytes(model)
    plan = bound_plan(model, kind, pin=pin)
    device_total = plan.device_bytes_resident + plan.device_bytes_buffers
    bound = device_total + largest_tensor_bytes(plan)
    assert total > 1.5 * bound  # the model does not fit where the plan runs
    runtime = FakeRuntime(device="cuda:0")
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))
    assert runtime.device_peak_bytes <= bound
    if source == "meta":
        for name, w in twin.state_dict().items():
            model.get_parameter(name).data.copy_(w)
    off.post_init()
    assert runtime.device_peak_bytes <= bound
    # Each on-demand call holds device copies of its layer's on-demand weights while it runs.
    per_call = max(sum(p.nbytes for p in plan.params if p.layer == i and p.placement is Placement.ON_DEMAND
                       and p.tied_to is None) for i in range(plan.num_layers))
    assert_parity(model, twin)
    assert runtime.device_peak_bytes <= bound + per_call
    assert runtime.device_peak_bytes < total / 1.5
    assert runtime.device_peak_bytes >= device_total  # the accounting saw the resident weights and buffers
    if kind == "on_demand":
        assert runtime.entries(ToDevice)
    off.restore()
    # Weights from the host go back there; resident ones that were meta keep their place.
    assert runtime.device_live_bytes == (plan.device_bytes_resident if source == "meta" else 0)


def test_progress_is_logged_with_bytes_and_says_what_was_used_in_place(caplog: pytest.LogCaptureFixture) -> None:
    """Long moves log their progress on the ``offload.load`` logger; weights adopted in
    place are reported as such, not as copies at an absurd rate."""
    model = transformer_model(3)
    with caplog.at_level(logging.INFO, logger="offload.load"):
        off = prefetch(cpu_plan(model, OffloadConfig(group_size=1, prefetch_step=2)))
        off.wrap_modules(layer_list(model))
        off.restore()
    messages = [r.getMessage() for r in caplog.records if r.name == "offload.load"]
    assert any(m.startswith("offloading weights: nothing to copy;") and "used in place" in m for m in messages)
    pinned = transformer_model(3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload.load"):
        off = prefetch(pinned_plan(pinned, OffloadConfig(group_size=1, prefetch_step=2)), FakeRuntime())
        off.wrap_modules(layer_list(pinned))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offloading weights")]
    assert "GB/s" in line and "used in place" not in line
