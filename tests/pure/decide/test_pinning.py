"""The pin and UVA decisions: one table, and the plan obeying them for every backend."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings

from offload.errors import PlanError
from offload.pure import (
    BackendName,
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    PinDecision,
    PinMethod,
    PinReason,
    Placement,
    Platform,
    UvaReason,
    decide_pinning,
    decide_uva,
    make_plan,
)
from tests.pure.strategies import env_snapshots, model_specs, offload_configs

H200 = Platform(has_cuda=True, device_name="NVIDIA H200", device_total_bytes=140 << 30, can_map_host_memory=True,
                can_register_host_memory=True, host_pointer_for_registered_memory=True)
GH200 = Platform(
    has_cuda=True,
    device_name="NVIDIA GH200 480GB",
    device_total_bytes=96 << 30,
    can_map_host_memory=True,
    can_register_host_memory=True,
    host_pointer_for_registered_memory=True,
    pageable_memory_access=True,
    pageable_uses_host_page_tables=True,
)
WSL = Platform(has_cuda=True, device_name="NVIDIA RTX 4090", device_total_bytes=24 << 30, can_map_host_memory=True,
               is_wsl=True)
NO_MAP = Platform(has_cuda=True, device_name="old GPU", device_total_bytes=8 << 30, can_map_host_memory=False)
JETSON = Platform(has_cuda=True, device_name="Orin", device_total_bytes=32 << 30, can_map_host_memory=True,
                  is_integrated=True)
CPU = Platform()

NO_FLAGS = EnvFlags()
NO_PIN = EnvFlags(disable_pin_memory=True)
NO_UVA = EnvFlags(disable_uva=True)
NEITHER = EnvFlags(disable_pin_memory=True, disable_uva=True)

# flags, platform, pin?, pin reason, uva?, acceptable uva reasons (several where more than
# one reason applies and the issue does not rank them).
DECISIONS: list[tuple[str, EnvFlags, Platform, bool, PinReason, bool, set[UvaReason]]] = [
    ("h200", NO_FLAGS, H200, True, PinReason.ENABLED, True, {UvaReason.ENABLED}),
    ("h200 no pin: uva follows pin", NO_PIN, H200, False, PinReason.DISABLED_BY_ENV, False, {UvaReason.NOT_PINNED}),
    ("h200 no uva", NO_UVA, H200, True, PinReason.ENABLED, False, {UvaReason.DISABLED_BY_ENV}),
    ("h200 neither", NEITHER, H200, False, PinReason.DISABLED_BY_ENV, False,
     {UvaReason.DISABLED_BY_ENV, UvaReason.NOT_PINNED}),
    ("gh200", NO_FLAGS, GH200, True, PinReason.ENABLED, True, {UvaReason.ENABLED}),
    ("gh200 no pin", NO_PIN, GH200, False, PinReason.DISABLED_BY_ENV, False, {UvaReason.NOT_PINNED}),
    ("wsl", NO_FLAGS, WSL, False, PinReason.WSL, False, {UvaReason.NOT_PINNED}),
    ("wsl no pin: the switch wins", NO_PIN, WSL, False, PinReason.DISABLED_BY_ENV, False, {UvaReason.NOT_PINNED}),
    ("no host mapping", NO_FLAGS, NO_MAP, True, PinReason.ENABLED, False, {UvaReason.NO_HOST_MAPPING}),
    ("no host mapping no pin", NO_PIN, NO_MAP, False, PinReason.DISABLED_BY_ENV, False,
     {UvaReason.NO_HOST_MAPPING, UvaReason.NOT_PINNED}),
    ("integrated no pin", NO_PIN, JETSON, False, PinReason.DISABLED_BY_ENV, False, {UvaReason.NOT_PINNED}),
    ("cpu", NO_FLAGS, CPU, False, PinReason.NO_ACCELERATOR, False, {UvaReason.NO_ACCELERATOR}),
    ("cpu no pin: the switch wins", NO_PIN, CPU, False, PinReason.DISABLED_BY_ENV, False,
     {UvaReason.NO_ACCELERATOR, UvaReason.NOT_PINNED}),
    ("cpu no uva", NO_UVA, CPU, False, PinReason.NO_ACCELERATOR, False,
     {UvaReason.NO_ACCELERATOR, UvaReason.DISABLED_BY_ENV}),
    ("cpu wsl", NO_FLAGS, Platform(is_wsl=True), False, PinReason.NO_ACCELERATOR, False, {UvaReason.NO_ACCELERATOR}),
]


@pytest.mark.parametrize(
    ("flags", "platform", "pin", "pin_reason", "uva", "uva_reasons"),
    [case[1:] for case in DECISIONS],
    ids=[case[0] for case in DECISIONS],
)
def test_decision_table(
    flags: EnvFlags,
    platform: Platform,
    pin: bool,
    pin_reason: PinReason,
    uva: bool,
    uva_reasons: set[UvaReason],
) -> None:
    env = EnvSnapshot(flags=flags, platform=platform)
    pinning = decide_pinning(env)
    assert (pinning.pin, pinning.reason) == (pin, pin_reason)
    zero_copy = decide_uva(env, pinning)
    assert zero_copy.enabled is uva
    assert zero_copy.reason in uva_reasons
    assert pinning.explanation
    assert zero_copy.explanation


@pytest.mark.parametrize(("register", "host_pointer", "method"), [
    (True, True, PinMethod.REGISTER),
    (True, False, PinMethod.ALLOC),  # registered memory would need cudaHostGetDevicePointer for views
    (False, True, PinMethod.ALLOC),
    (False, False, PinMethod.ALLOC),
])
def test_pinned_copies_are_registered_in_place_only_where_the_device_reads_them_there(
    register: bool, host_pointer: bool, method: PinMethod
) -> None:
    platform = attrs.evolve(H200, can_register_host_memory=register, host_pointer_for_registered_memory=host_pointer)
    pinning = decide_pinning(EnvSnapshot(platform=platform))
    assert (pinning.pin, pinning.method) == (True, method)
    off = decide_pinning(EnvSnapshot(flags=NO_PIN, platform=platform))
    assert (off.pin, off.method) == (False, PinMethod.NONE)


@pytest.mark.parametrize(("pin", "method"), [(False, PinMethod.REGISTER), (False, PinMethod.ALLOC),
                                             (True, PinMethod.NONE)])
def test_a_method_contradicting_pin_is_rejected(pin: bool, method: PinMethod) -> None:
    with pytest.raises(PlanError, match=f"pin method '{method.value}' contradicts pin={pin}"):
        PinDecision(pin=pin, reason=PinReason.ENABLED, method=method)


def test_the_method_defaults_from_pin() -> None:
    assert PinDecision(pin=True, reason=PinReason.ENABLED).method is PinMethod.REGISTER
    assert PinDecision(pin=False, reason=PinReason.WSL).method is PinMethod.NONE


def test_pin_reasons_the_issue_names_exist() -> None:
    assert {r.name for r in PinReason} >= {"ENABLED", "DISABLED_BY_ENV", "NO_ACCELERATOR", "WSL"}


@pytest.mark.parametrize("platform", [H200, GH200, NO_MAP])
def test_uva_follows_the_pin_decision_it_is_given(platform: Platform) -> None:
    env = EnvSnapshot(platform=platform)
    unpinned = PinDecision(pin=False, reason=PinReason.DISABLED_BY_ENV)
    assert decide_uva(env, unpinned).enabled is False


@settings(max_examples=200)
@given(env_snapshots())
def test_the_switches_win_on_every_platform(env: EnvSnapshot) -> None:
    pin = decide_pinning(env)
    uva = decide_uva(env, pin)
    if env.flags.disable_pin_memory:
        assert pin == PinDecision(pin=False, reason=PinReason.DISABLED_BY_ENV)
    if env.flags.disable_uva:
        assert uva.enabled is False
    if pin.pin:
        assert env.platform.has_cuda and not env.platform.is_wsl and not env.flags.disable_pin_memory
    assert (pin.method is PinMethod.NONE) is not pin.pin
    if uva.enabled:
        # UVA needs CUDA, host mapping, pinned memory and the user's consent.
        assert pin.pin and env.platform.has_cuda and env.platform.can_map_host_memory
        assert not env.flags.disable_uva
    assert (uva.reason is UvaReason.ENABLED) == uva.enabled
    assert (pin.reason is PinReason.ENABLED) == pin.pin


# ---------------------------------------------------------------------------- in plans


def _spec() -> ModelSpec:
    params = (
        ParamSpec(name="mlp.up.weight", shape=(64, 32), stride=(32, 1), dtype="bfloat16", itemsize=2),
        ParamSpec(name="mlp.down.weight", shape=(32, 64), stride=(64, 1), dtype="bfloat16", itemsize=2,
                  device="cuda:0"),
    )
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=params) for i in range(4)))


PREFETCH = OffloadConfig(backend="prefetch", group_size=2, num_in_group=1, prefetch_step=1)
UVA_CONFIG = OffloadConfig(backend="uva", uva_max_bytes=1 << 20)


@pytest.mark.parametrize("config", [PREFETCH, UVA_CONFIG], ids=["prefetch", "uva"])
@pytest.mark.parametrize("platform", [H200, GH200, WSL, NO_MAP, JETSON, CPU],
                         ids=["h200", "gh200", "wsl", "no-map", "integrated", "cpu"])
def test_user_switch_turns_pinning_off_for_prefetch_and_uva_alike(config: OffloadConfig, platform: Platform) -> None:
    env = EnvSnapshot(flags=NO_PIN, platform=platform)
    plan = make_plan(_spec(), config, env)
    assert plan.pin.pin is False
    assert plan.pin.reason is PinReason.DISABLED_BY_ENV
    assert plan.uva.enabled is False
    # Something was offloaded, so the decision is not vacuous ...
    assert plan.offloaded_params
    # ... and no parameter is read through a zero-copy view, which would need pinned memory.
    assert all(p.placement is not Placement.UVA for p in plan.params)
    # The decision survives serialisation.
    again = OffloadPlan.from_json(plan.to_json())
    assert again.pin.pin is False
    assert again.pin.reason is PinReason.DISABLED_BY_ENV


@pytest.mark.parametrize("backend", ["prefetch", "uva", "none", "auto"])
def test_without_the_switch_a_cuda_plan_pins_for_every_backend(backend: BackendName) -> None:
    config = OffloadConfig(backend=backend, group_size=2, uva_max_bytes=1 << 20 if backend != "prefetch" else 0)
    plan = make_plan(_spec(), config, EnvSnapshot(platform=H200))
    assert plan.pin == PinDecision(pin=True, reason=PinReason.ENABLED)


def test_uva_backend_reads_in_place_only_when_uva_is_on() -> None:
    on = make_plan(_spec(), UVA_CONFIG, EnvSnapshot(platform=H200))
    assert on.uva.enabled is True
    assert {p.placement for p in on.offloaded_params} == {Placement.UVA}
    off = make_plan(_spec(), UVA_CONFIG, EnvSnapshot(flags=NO_UVA, platform=H200))
    assert off.uva.reason is UvaReason.DISABLED_BY_ENV
    assert off.offloaded_params
    assert {p.placement for p in off.offloaded_params} == {Placement.ON_DEMAND}


@settings(max_examples=60, deadline=None)
@given(model_specs(max_layers=6), offload_configs(), env_snapshots())
def test_every_plan_carries_the_one_decision(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    assert plan.pin == decide_pinning(env)
    assert plan.uva == decide_uva(env, plan.pin)
    if not plan.uva.enabled:
        assert all(p.placement is not Placement.UVA for p in plan.params)
