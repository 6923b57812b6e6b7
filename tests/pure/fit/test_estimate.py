"""`estimate` against hand-computed steps, its limit as a property, and the profiles.

The toy profile makes the arithmetic easy: copies from pinned memory at 100 B/s, from
pageable memory at 10 B/s, zero-copy reads at 0.5 of the pinned rate (50 B/s), 1000
FLOP/s, no weight-read roofline. Every toy parameter is a bf16 vector of 50 elements:
100 bytes, a 1 s pinned copy, and ``2 x 50 x tokens / 1000`` s of compute.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError
from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    ParamSpec,
    Placement,
    Platform,
    PrefetchSchedule,
    WarningCode,
    make_plan,
    schedule_prefetch,
)
from offload.pure.fit.estimate import StepEstimate, Workload, estimate, simulate_prefetch
from offload.pure.fit.profiles import (
    GB,
    PROFILES,
    DeviceProfile,
    planning_env,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
)
from tests.pure.strategies import model_specs

TOY = DeviceProfile(name="toy", device_name="toy", pinned_h2d_bytes_per_s=100.0, pageable_h2d_bytes_per_s=10.0,
                    zero_copy_fraction=0.5, bf16_flops_per_s=1000.0)
CUDA = Platform(has_cuda=True, device_name="toy", device_total_bytes=10**6, can_map_host_memory=True)
ENV = EnvSnapshot(platform=CUDA)


def vec(name: str = "w", elements: int = 50, key: str | None = None) -> ParamSpec:
    return ParamSpec(name=name, shape=(elements,), stride=(1,), dtype="bfloat16", itemsize=2, storage_key=key)


def model(*layers: tuple[ParamSpec, ...]) -> ModelSpec:
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=p) for i, p in enumerate(layers)))


def uniform(layers: int) -> ModelSpec:
    return model(*((vec(),) for _ in range(layers)))


def run(spec: ModelSpec, config: OffloadConfig, *, tokens: int = 1, env: EnvSnapshot = ENV,
        profile: DeviceProfile = TOY, measured: float | None = None) -> StepEstimate:
    return estimate(make_plan(spec, config, env), profile, Workload(tokens_per_step=tokens,
                                                                    resident_step_seconds=measured))


def stalls(step: StepEstimate) -> list[float]:
    return [layer.stall_seconds for layer in step.layers]


def test_resident_model_is_its_compute() -> None:
    """3 layers, backend none, 1 token: each 2 x 50 x 1 / 1000 = 0.1 s; step 0.3 s = limit."""
    step = run(uniform(3), OffloadConfig(backend="none"))
    assert [layer.compute_seconds for layer in step.layers] == pytest.approx([0.1, 0.1, 0.1])
    assert step.step_seconds == pytest.approx(0.3)
    assert step.limit_seconds == pytest.approx(0.3)
    assert step.offloaded_bytes_per_step == 0


def test_every_layer_prefetched_one_slot_stalls_for_each_copy() -> None:
    """3 layers all offloaded, depth 1, 1 token: compute 0.1 s, copy 100 B / 100 B/s = 1 s.

    A copy is issued only after the layer before it ran (one slot), and the next layer
    follows at once, so each layer waits the whole 1 s copy: step 3 x (1 + 0.1) = 3.3 s.
    Limit: max(0.3, 300 B / 100 B/s) = 3.0 s.
    """
    step = run(uniform(3), OffloadConfig(group_size=1, prefetch_step=1))
    assert stalls(step) == pytest.approx([1.0, 1.0, 1.0])
    assert [layer.copy_seconds for layer in step.layers] == pytest.approx([1.0, 1.0, 1.0])
    assert step.step_seconds == pytest.approx(3.3)
    assert step.limit_seconds == pytest.approx(3.0)
    assert step.ratio_to_limit == pytest.approx(1.1)


def test_alternate_layers_one_slot_overlap_half_the_copy() -> None:
    """4 layers, group 2 / 1 in group: layers 1 and 3 offloaded; depth 1; 5 tokens.

    Compute 2 x 50 x 5 / 1000 = 0.5 s a layer; a copy 1 s. Layer 3's copy is issued when
    layer 1 ends and overlaps layer 2 (0.5 s), so layer 3 waits 0.5 s; likewise layer 1's
    copy overlaps layer 0. Step 4 x 0.5 + 2 x 0.5 = 3.0 s; limit max(2.0, 2.0) = 2.0 s.
    """
    step = run(uniform(4), OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1), tokens=5)
    assert stalls(step) == pytest.approx([0.0, 0.5, 0.0, 0.5])
    assert step.step_seconds == pytest.approx(3.0)
    assert step.limit_seconds == pytest.approx(2.0)


def test_alternate_layers_two_slots_reach_the_limit() -> None:
    """As above with depth 2: two offloaded layers, two slots, one layer each. Each is
    copied once before the first step and keeps its slot, so nothing crosses the link per
    step: no stall, step = compute = 2.0 s; limit max(2.0, 0 B / 100 B/s) = 2.0 s."""
    step = run(uniform(4), OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2), tokens=5)
    assert stalls(step) == pytest.approx([0.0, 0.0, 0.0, 0.0])
    assert step.step_seconds == pytest.approx(2.0)
    assert step.ratio_to_limit == pytest.approx(1.0)
    assert [layer.copy_bytes for layer in step.layers] == [0, 0, 0, 0]
    assert [layer.copy_seconds for layer in step.layers] == [0.0, 0.0, 0.0, 0.0]
    assert [layer.loaded_once_bytes for layer in step.layers] == [0, 100, 0, 100]
    assert step.offloaded_bytes_per_step == 0
    assert step.loaded_once_bytes == 200
    assert step.link_seconds == 0.0


def test_three_positions_two_slots_wrap_around() -> None:
    """3 layers all offloaded, depth 2 (3 is not a multiple of 2), 5 tokens: compute 0.5 s,
    copies 1 s. Slot 0 holds layers 0 and 2, slot 1 only layer 1, which is loaded once.
    Schedule: initial copies 0, 1; after 0 copy 2; after 1 nothing; after 2 copy 0 (next
    pass). By hand, from pass 1 on every pass repeats (T its start, the link idle):

    - layer 0's copy, issued when layer 2 ended at T, lands at T + 1.0: stall 1.0, ends
      T + 1.5; copy 2 is issued then and lands at T + 2.5;
    - layer 1 is in its slot since the start: no stall, ends T + 2.0;
    - layer 2 waits for its copy until T + 2.5: stall 0.5, ends T + 3.0.

    Step 3 x 0.5 + 1.0 + 0.5 = 3.0 s; the link moves 200 B a step (layers 0 and 2), so the
    limit is max(1.5, 200 / 100) = 2.0 s.
    """
    step = run(uniform(3), OffloadConfig(group_size=1, prefetch_step=2), tokens=5)
    assert stalls(step) == pytest.approx([1.0, 0.0, 0.5])
    assert step.step_seconds == pytest.approx(3.0)
    assert step.limit_seconds == pytest.approx(2.0)
    assert step.period == 1
    assert [layer.copy_bytes for layer in step.layers] == [100, 0, 100]
    assert [layer.copy_seconds for layer in step.layers] == pytest.approx([1.0, 0.0, 1.0])
    assert [layer.loaded_once_bytes for layer in step.layers] == [0, 100, 0]
    assert step.offloaded_bytes_per_step == 200


def test_an_old_schedule_that_copies_a_lone_owner_again_is_estimated_as_kept() -> None:
    """A plan written before lone owners were loaded once says next_after[1] = 1 for the
    3-layer, depth-2 case; that copy is redundant (layer 1's slot still holds it), and
    the executor skips it: the same steady state as the schedule without it."""
    new = schedule_prefetch(3, 2)
    old = PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 0), next_after=(2, 1, 0))
    busy, copy, positions = [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0, 1, 2]
    assert simulate_prefetch(busy, copy, positions, old) == simulate_prefetch(busy, copy, positions, new)
    assert simulate_prefetch(busy, copy, positions, old)[0] == pytest.approx((1.0, 0.0, 0.5))
    plan = make_plan(uniform(3), OffloadConfig(group_size=1, prefetch_step=2), ENV)
    step = estimate(attrs.evolve(plan, schedule=old), TOY, Workload(tokens_per_step=5))
    assert step == estimate(plan, TOY, Workload(tokens_per_step=5))


def test_a_run_with_a_layer_loaded_once_still_stalls_as_the_plan_warns() -> None:
    """8 layers, group 8 / 3 in group: layers 5, 6, 7 offloaded, depth 2, 5 tokens (0.5 s a
    layer, copies 1 s). Layer 6 is alone in slot 1 and loaded once; layers 5 and 7 share
    slot 0. Layer 7's copy is issued when layer 5 ends and overlaps only layer 6: it waits
    0.5 s. Layer 5's copy, issued when layer 7 ends, overlaps layers 0-4 of the next step
    (2.5 s): no wait. Step 8 x 0.5 + 0.5 = 4.5 s. The plan's PREFETCH_STALLS warning (3
    adjacent layers, depth 2) still holds."""
    config = OffloadConfig(group_size=8, num_in_group=3, prefetch_step=2)
    plan = make_plan(uniform(8), config, ENV)
    assert plan.offloaded_layers == (5, 6, 7)
    assert [w.code for w in plan.warnings if w.code is WarningCode.PREFETCH_STALLS] == [WarningCode.PREFETCH_STALLS]
    step = estimate(plan, TOY, Workload(tokens_per_step=5))
    assert stalls(step) == pytest.approx([0.0] * 7 + [0.5])
    assert step.step_seconds == pytest.approx(4.5)
    assert [layer.loaded_once_bytes for layer in step.layers] == [0] * 6 + [100, 0]


def test_one_offloaded_layer_is_loaded_once() -> None:
    """One layer, prefetched, depth 1: its one slot has no other owner, so the layer is
    copied once before the first step and stays: a step is its compute, 2 x 50 x 1 / 1000
    = 0.1 s, and nothing is moved per step; the 100 B are loaded once."""
    step = run(uniform(1), OffloadConfig(group_size=1, prefetch_step=1))
    assert step.step_seconds == pytest.approx(0.1)
    assert step.limit_seconds == pytest.approx(0.1)
    assert (step.layers[0].copy_bytes, step.layers[0].copy_seconds, step.layers[0].stall_seconds) == (0, 0.0, 0.0)
    assert step.layers[0].loaded_once_bytes == 100
    data = json.loads(step.to_json())
    assert data["layers"][0]["loaded_once_bytes"] == 100
    assert data["layers"][0]["copy_bytes"] == 0


def test_unpinned_prefetch_copies_at_the_pageable_rate() -> None:
    """Pinning off: the 3-layer, depth-1 case copies at 10 B/s, 10 s a layer, all stalled:
    step 3 x (10 + 0.1) = 30.3 s. The limit still uses the pinned rate: 3.0 s."""
    env = EnvSnapshot(flags=EnvFlags(disable_pin_memory=True), platform=CUDA)
    step = run(uniform(3), OffloadConfig(group_size=1, prefetch_step=1), env=env)
    assert stalls(step) == pytest.approx([10.0, 10.0, 10.0])
    assert step.step_seconds == pytest.approx(30.3)
    assert step.limit_seconds == pytest.approx(3.0)


def test_uva_reads_add_to_the_layer() -> None:
    """2 layers, UVA budget 100 B: layer 0's weight is read in place at 0.5 x 100 = 50 B/s,
    2 s; compute 0.5 s a layer (5 tokens). Step 0.5 + 2 + 0.5 = 3.0 s; limit
    max(1.0, 100 B / 100 B/s) = 1.0 s."""
    step = run(uniform(2), OffloadConfig(backend="uva", uva_max_bytes=100), tokens=5)
    assert [layer.uva_read_seconds for layer in step.layers] == pytest.approx([2.0, 0.0])
    assert step.step_seconds == pytest.approx(3.0)
    assert step.limit_seconds == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("flags", "expected_on_demand", "expected_step"),
    [
        # UVA switched off, pinned: 100 B / 100 B/s = 1 s; step 0.5 + 1 + 0.5 = 2.0 s.
        (EnvFlags(disable_uva=True), 1.0, 2.0),
        # Pinning off (so no UVA either): 100 B / 10 B/s = 10 s; step 0.5 + 10 + 0.5 = 11.0 s.
        (EnvFlags(disable_pin_memory=True), 10.0, 11.0),
    ],
)
def test_on_demand_copies_do_not_overlap(flags: EnvFlags, expected_on_demand: float, expected_step: float) -> None:
    """2 layers, UVA budget 100 B without zero-copy views: layer 0 is copied before it runs."""
    step = run(uniform(2), OffloadConfig(backend="uva", uva_max_bytes=100), tokens=5,
               env=EnvSnapshot(flags=flags, platform=CUDA))
    assert step.layers[0].on_demand_seconds == pytest.approx(expected_on_demand)
    assert step.layers[0].on_demand_bytes == 100
    assert step.step_seconds == pytest.approx(expected_step)


def test_measured_step_time_is_split_by_parameters() -> None:
    """Layers of 50, 50 and 100 elements and a measured 2.0 s resident step: 2.0 x 50/200 =
    0.5, 0.5 and 1.0 s, whatever the profile's FLOP/s."""
    spec = model((vec(),), (vec(),), (vec(elements=100),))
    step = run(spec, OffloadConfig(backend="none"), measured=2.0)
    assert [layer.compute_seconds for layer in step.layers] == pytest.approx([0.5, 0.5, 1.0])
    assert step.compute_from == "measured"


def test_weight_reads_bound_few_tokens() -> None:
    """With weights read at 50 B/s, a 100-byte layer takes max(2 x 50 x 1 / 1000, 100 / 50)
    = max(0.1, 2.0) = 2.0 s at 1 token, and max(2 x 50 x 100 / 1000, 2.0) = 10 s at 100."""
    profile = attrs.evolve(TOY, weight_read_bytes_per_s=50.0)
    assert run(uniform(1), OffloadConfig(backend="none"), profile=profile).step_seconds == pytest.approx(2.0)
    assert run(uniform(1), OffloadConfig(backend="none"), profile=profile,
               tokens=100).step_seconds == pytest.approx(10.0)


def test_tied_parameters_in_one_layer_are_copied_once() -> None:
    """Two layers each holding ``w`` and ``w_alias`` (one storage of 100 B), prefetched,
    depth 1 (one slot, two owners): compute counts both names, 2 x 100 x 1 / 1000 = 0.2 s
    a layer; each copy moves 100 B once, 1 s, issued after the other layer ran: stall 1.0
    each, step 2 x 1.2 = 2.4 s; limit max(0.4, 200 B / 100 B/s) = 2.0 s."""
    spec = model(*((vec("w", key=f"s{i}"), vec("w_alias", key=f"s{i}")) for i in range(2)))
    step = run(spec, OffloadConfig(group_size=1, prefetch_step=1))
    assert [layer.copy_bytes for layer in step.layers] == [100, 100]
    assert step.step_seconds == pytest.approx(2.4)
    assert step.limit_seconds == pytest.approx(2.0)


def _profiles() -> st.SearchStrategy[DeviceProfile]:
    rates = st.floats(1.0, 1e4)
    return st.builds(
        lambda pinned, slower, fraction, flops: DeviceProfile(
            name="random", device_name="random", pinned_h2d_bytes_per_s=pinned,
            pageable_h2d_bytes_per_s=pinned * slower, zero_copy_fraction=fraction, bf16_flops_per_s=flops),
        rates, st.floats(0.05, 1.0), st.floats(0.05, 1.0), rates,
    )


@settings(max_examples=60, deadline=None)
@given(spec=model_specs(max_layers=8), group=st.integers(1, 8), share=st.integers(1, 8), depth=st.integers(1, 6),
       profile=_profiles(), tokens=st.integers(1, 64), pin=st.booleans())
def test_prefetch_never_beats_the_limit(spec: ModelSpec, group: int, share: int, depth: int,
                                        profile: DeviceProfile, tokens: int, pin: bool) -> None:
    """max(resident compute, offloaded bytes / pinned rate) is a floor, for every plan."""
    config = OffloadConfig(group_size=group, num_in_group=min(share, group), prefetch_step=depth)
    env = EnvSnapshot(flags=EnvFlags(disable_pin_memory=not pin), platform=CUDA)
    step = estimate(make_plan(spec, config, env), profile, Workload(tokens_per_step=tokens))
    floor = max(sum(layer.compute_seconds for layer in step.layers),
                sum(layer.copy_bytes for layer in step.layers) / profile.pinned_h2d_bytes_per_s)
    assert step.step_seconds >= floor * (1 - 1e-9)
    assert step.step_seconds == pytest.approx(sum(layer.seconds for layer in step.layers))
    # Every prefetched byte is moved either every step or once, never both; the layers
    # moved once are exactly those alone in their slot, and they never stall.
    plan = make_plan(spec, config, env)
    kept = {plan.offloaded_layers[i] for i in plan.schedule.kept_positions}
    prefetched = [0] * len(step.layers)
    for p in plan.params:
        if p.placement is Placement.PREFETCH and not (p.tied_to is not None and p.tied_to[0] == p.layer):
            prefetched[p.layer] += p.nbytes
    for layer in step.layers:
        assert layer.copy_bytes + layer.loaded_once_bytes == prefetched[layer.layer]
        assert (layer.loaded_once_bytes > 0) == (layer.layer in kept and prefetched[layer.layer] > 0)
        if layer.layer in kept:
            assert (layer.copy_bytes, layer.copy_seconds, layer.stall_seconds) == (0, 0.0, 0.0)
    assert step.loaded_once_bytes == sum(prefetched[layer] for layer in kept)
    # A faster link never makes the same plan slower.
    faster = attrs.evolve(profile, pinned_h2d_bytes_per_s=profile.pinned_h2d_bytes_per_s * 2,
                          pageable_h2d_bytes_per_s=profile.pageable_h2d_bytes_per_s * 2)
    assert estimate(make_plan(spec, config, env), faster,
                    Workload(tokens_per_step=tokens)).step_seconds <= step.step_seconds * (1 + 1e-9)


def test_h200_preset_holds_the_measured_numbers() -> None:
    """FACTS.md: 55.4 GB/s pinned, 8.4 GB/s pageable, zero-copy reads 0.90 of a copy."""
    h200 = profile_by_name("h200-pcie5")
    assert h200.pinned_h2d_bytes_per_s == pytest.approx(55.4e9)
    assert h200.pageable_h2d_bytes_per_s == pytest.approx(8.4e9)
    assert h200.zero_copy_bytes_per_s == pytest.approx(0.9 * 55.4e9)


@pytest.mark.parametrize("name", ["h100-pcie5", "h200-pcie5", "a100-pcie4", "l40s", "rtx4090", "gh200"])
def test_presets_are_complete_and_plausible(name: str) -> None:
    profile = PROFILES[name]
    assert profile.name == name
    assert profile.source
    assert profile.pageable_h2d_bytes_per_s < profile.pinned_h2d_bytes_per_s
    assert 1e12 < profile.bf16_flops_per_s < 1e15  # between 1 TFLOP/s and 1 PFLOP/s
    assert profile.device_memory_bytes >= 24 * GB
    assert profile.coherent_unified_memory == (name == "gh200")


def test_unknown_profile_names_the_ones_there_are() -> None:
    with pytest.raises(ConfigError, match="h200-pcie5") as caught:
        profile_by_name("h300")
    assert (caught.value.name, caught.value.value) == ("profile", "h300")


def test_profile_from_flags() -> None:
    """--link-gbps 25 --tflops 100: 25e9 B/s pinned, 1e14 FLOP/s, pageable 6.6x slower."""
    profile = profile_from_numbers(link_gbps=25, tflops=100, device_gib=2)
    assert profile.pinned_h2d_bytes_per_s == pytest.approx(25e9)
    assert profile.pageable_h2d_bytes_per_s == pytest.approx(25e9 * 8.4 / 55.4)
    assert profile.bf16_flops_per_s == pytest.approx(1e14)
    assert profile.device_memory_bytes == 2 << 30
    assert profile.weight_read_bytes_per_s is None


def test_profile_from_numbers_over_a_base_keeps_the_rest() -> None:
    base = profile_by_name("h200-pcie5")
    profile = profile_from_numbers(tflops=500, base=base)
    assert profile.bf16_flops_per_s == pytest.approx(5e14)
    assert profile.pinned_h2d_bytes_per_s == base.pinned_h2d_bytes_per_s
    assert profile.pageable_h2d_bytes_per_s == base.pageable_h2d_bytes_per_s
    assert profile.device_memory_bytes == base.device_memory_bytes


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"link_gbps": 25}, "tflops"),
        ({"tflops": 100}, "link_gbps"),
        ({"link_gbps": 0, "tflops": 100}, "link_gbps"),
        ({"link_gbps": math.nan, "tflops": 100}, "link_gbps"),
        ({"link_gbps": 25, "tflops": -1}, "tflops"),
        ({"link_gbps": 25, "tflops": 100, "zero_copy_fraction": 1.5}, "zero_copy_fraction"),
    ],
)
def test_bad_numbers_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        profile_from_numbers(**kwargs)
    assert caught.value.name == name


@pytest.mark.parametrize(("field", "value"), [("tokens_per_step", 0), ("resident_step_seconds", 0.0),
                                              ("resident_step_seconds", math.inf)])
def test_bad_workloads_are_named(field: str, value: float) -> None:
    arguments: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError) as caught:
        Workload(**arguments)
    assert caught.value.name == field


def test_planning_env_describes_the_profiles_device_without_cuda() -> None:
    """Without CUDA the plan is made for the profile's device; the switches are kept."""
    gh200 = profile_by_name("gh200")
    env = EnvSnapshot(flags=EnvFlags(disable_uva=True), platform=Platform(host_available_bytes=1 << 30))
    planned = planning_env(env, gh200)
    assert planned.flags == env.flags
    assert planned.platform.has_cuda
    assert planned.platform.device_total_bytes == gh200.device_memory_bytes
    assert planned.platform.is_coherent_unified_memory
    assert planned.platform.host_available_bytes == 1 << 30  # the host is this machine (the profile names a device)
    assert planning_env(ENV, gh200) is ENV


def test_rendering_collapses_identical_layers_and_shows_the_arithmetic() -> None:
    """3 resident layers of 0.1 s: one row "0-2" at 100 ms each, a total of 300 ms, and the
    limit max(300 ms, 0 s)."""
    from offload.pure.fit.render import render_estimate

    text = render_estimate(run(uniform(3), OffloadConfig(backend="none")))
    rows = [line.split() for line in text.splitlines()]
    assert ["0-2", "100.000", "0.000", "0.000", "0.000", "0.000", "100.000", "0", "B"] in rows
    assert ["total", "300.000", "0.000", "0.000", "0.000", "0.000", "300.000", "0", "B"] in rows
    assert "limit            = max(300.000 ms, 0 s) = 300.000 ms" in text


def test_rendering_says_what_is_loaded_once() -> None:
    """3 layers at depth 2: layer 1 is loaded once. Its row moves nothing per step, the
    link counts layers 0 and 2 (200 B), and a line says what is loaded once."""
    from offload.pure.fit.render import render_estimate

    text = render_estimate(run(uniform(3), OffloadConfig(group_size=1, prefetch_step=2), tokens=5))
    rows = [line.split() for line in text.splitlines()]
    assert ["1", "500.000", "0.000", "0.000", "0.000", "0.000", "500.000", "0", "B"] in rows
    assert "link             = 200 B (200 bytes) / 0.00 GB/s = 2.000 s" in text
    assert ("loaded once      = 100 B (100 bytes), 1 layer alone in its slot: copied before the first step, "
            "not per step") in text
    assert "loaded once" not in render_estimate(run(uniform(3), OffloadConfig(group_size=1, prefetch_step=1)))


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_for_device_finds_each_preset_by_its_device_name(name: str) -> None:
    profile = PROFILES[name]
    assert profile_for_device(profile.device_name) is profile
    assert profile_for_device(f"  {profile.device_name.upper()} ") is profile


def test_profile_for_device_without_a_match() -> None:
    assert profile_for_device("cpu") is None
    assert profile_for_device("planned CUDA device") is None


def _two_stacks() -> ModelSpec:
    """A preset's layers as an 'encoder' of 2 layers and a 'decoder' of the rest."""
    from offload.pure.spec.presets import preset_spec

    spec = preset_spec("llama-8b")
    return attrs.evolve(spec, stacks=(2, len(spec.layers) - 2))


def test_each_stack_computes_over_its_own_tokens() -> None:
    from offload.pure.fit.profiles import PROFILES

    spec = _two_stacks()
    profile = PROFILES["h200-pcie5"]
    plan = make_plan(spec, OffloadConfig(backend="none"), EnvSnapshot())
    assert plan.stacks == spec.stacks and plan.stack_ranges == spec.stack_ranges
    mixed = estimate(plan, profile, Workload(stack_tokens=(1500, 4)))
    encoder = estimate(plan, profile, Workload(tokens_per_step=1500))
    decoder = estimate(plan, profile, Workload(tokens_per_step=4))
    assert [layer.compute_seconds for layer in mixed.layers] == \
        [layer.compute_seconds for layer in encoder.layers[:2]] + [layer.compute_seconds for layer in decoder.layers[2:]]
    assert encoder.layers[0].compute_seconds > decoder.layers[0].compute_seconds  # the tokens matter here
    assert mixed.stack_tokens == (1500, 4)


def test_stack_tokens_for_another_number_of_stacks_is_refused_naming_it() -> None:
    from offload.pure.fit.profiles import PROFILES

    plan = make_plan(_two_stacks(), OffloadConfig(backend="none"), EnvSnapshot())
    with pytest.raises(ConfigError, match="stack_tokens gives 3 token counts; the model has 2 layer stacks") as caught:
        estimate(plan, PROFILES["h200-pcie5"], Workload(stack_tokens=(1, 2, 3)))
    assert caught.value.name == "stack_tokens"
    for bad in ((0,), (1, 2**41), [3]):
        with pytest.raises(ConfigError):
            Workload(stack_tokens=bad)  # type: ignore[arg-type]


def test_fit_with_tokens_per_stack_predicts_what_its_plan_estimates() -> None:
    from offload.pure.fit.profiles import PROFILES
    from offload.pure.fit.search import fit

    spec = _two_stacks()
    profile = PROFILES["h200-pcie5"]
    workload = Workload(stack_tokens=(1500, 1))
    result = fit(spec, EnvSnapshot(), profile, workload, spec.nbytes // 3)
    assert result.estimate == estimate(result.plan, profile, workload)
    assert result.chosen.step_seconds == pytest.approx(result.estimate.step_seconds, rel=1e-9)


def test_a_plan_keeps_its_stacks_through_json_and_an_older_plan_reads_as_one_stack() -> None:
    from offload.pure.plan.plan import OffloadPlan

    plan = make_plan(_two_stacks(), OffloadConfig(group_size=2, prefetch_step=1), EnvSnapshot())
    assert OffloadPlan.from_json(plan.to_json()) == plan
    document = json.loads(plan.to_json())
    del document["plan"]["stacks"]
    older = OffloadPlan.from_json(json.dumps(document))
    assert older.stacks == () and older.stack_ranges == ((0, plan.num_layers),)
