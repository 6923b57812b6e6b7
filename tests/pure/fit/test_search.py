"""`fit`: properties over random models and budgets, a brute-force oracle, and tables.

The oracle enumerates every configuration of a small model with `make_plan` and
`estimate` only (none; prefetch over every group size, number in group and depth; UVA
over every prefix of the parameters) and keeps the fastest that fits; `fit` must find a
configuration exactly as fast, without building those plans.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError, PlanError
from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    ParamSpec,
    Placement,
    Platform,
    make_plan,
    segment_matches,
)
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.candidates import prefetch_candidate
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import DeviceProfile, planning_env, profile_by_name
from offload.pure.fit.render import render_fit
from offload.pure.fit.search import FitCandidate, FitResult, fit
from offload.pure.fit.table import buffer_bytes, build_table, expand, layer_sets
from offload.pure.units import GIB
from tests.pure.strategies import env_flags, model_specs

# Link and compute in the same range as the strategies' tiny weights (bytes to kilobytes),
# so that both prefetch stalls and compute-bound steps occur.
TOY = DeviceProfile(name="toy", device_name="toy", pinned_h2d_bytes_per_s=1000.0, pageable_h2d_bytes_per_s=150.0,
                    zero_copy_fraction=0.9, bf16_flops_per_s=20_000.0, device_memory_bytes=1 << 20)
MAX_STEP = 64  # deeper than any test model has layers: the search covers every depth


def device_bytes(plan_env: EnvSnapshot, config: OffloadConfig, spec: ModelSpec, tokens: int,
                 reserve: int, outside: int = 0, routing: RoutingTrace | None = None) -> tuple[int, float]:
    """(device bytes, step seconds) of one configuration, from its plan and estimate (over
    `routing`, where given)."""
    plan = make_plan(spec, config, plan_env)
    step = estimate(plan, TOY, Workload(tokens_per_step=tokens), routing=routing)
    transient = max((layer.on_demand_bytes for layer in step.layers), default=0)
    return plan.device_bytes_resident + plan.device_bytes_buffers + transient + outside + reserve, step.step_seconds


def oracle(spec: ModelSpec, env: EnvSnapshot, tokens: int, budget: int, reserve: int,
           segments: tuple[str, ...], max_depth: int = MAX_STEP, outside: int = 0,
           expert_slots: int | None = None, routing: RoutingTrace | None = None,
           expert_cache: bool = True) -> float | None:
    """The least step time of any fitting configuration, or None when nothing fits
    (prefetch's expert caches at `expert_slots` slots each: None, the default)."""
    plan_env = planning_env(env, TOY)
    configs = [OffloadConfig(backend="none")]
    layers = len(spec.layers)
    for group in range(1, layers + 1):
        for share in range(1, group + 1):
            for depth in range(1, min(layers, max_depth) + 1):
                configs.append(OffloadConfig(backend="prefetch", group_size=group, num_in_group=share,
                                             prefetch_step=depth, param_filter=segments, expert_slots=expert_slots,
                                             expert_cache=expert_cache))
    every = make_plan(spec, OffloadConfig(backend="uva", uva_max_bytes=1 << 60, param_filter=segments), plan_env)
    prefix = 0
    for p in every.params:
        if p.offloaded and p.tied_to is None:
            prefix += p.nbytes
            if prefix:
                configs.append(OffloadConfig(backend="uva", uva_max_bytes=prefix, param_filter=segments))
    fitting = [step for need, step in (device_bytes(plan_env, c, spec, tokens, reserve, outside, routing)
                                       for c in configs)
               if need <= budget]
    return min(fitting) if fitting else None


def run(spec: ModelSpec, env: EnvSnapshot, tokens: int, budget: int, reserve: int = 0,
        segments: tuple[str, ...] = (), outside: int = 0) -> FitResult:
    return fit(spec, env, TOY, Workload(tokens_per_step=tokens), budget, outside_bytes=outside, reserve_bytes=reserve,
               param_filter=segments, max_prefetch_step=MAX_STEP)


SPECS = model_specs(max_layers=5, max_params=3)
ENVS = st.builds(EnvSnapshot, flags=env_flags())  # no CUDA here: fit plans for the profile's device
TOKENS = st.integers(1, 200)
SEGMENTS = st.sampled_from(((), ("weight",), ("mlp",)))


@settings(max_examples=40, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, fraction=st.floats(0.0, 1.2), reserve=st.integers(0, 64),
       outside=st.integers(0, 64), segments=SEGMENTS)
def test_fit_is_as_fast_as_the_best_fitting_configuration(spec: ModelSpec, env: EnvSnapshot, tokens: int,
                                                          fraction: float, reserve: int, outside: int,
                                                          segments: tuple[str, ...]) -> None:
    budget = int(spec.nbytes * fraction) + (reserve + outside) // 2
    best = oracle(spec, env, tokens, budget, reserve, segments, outside=outside)
    if best is None:
        with pytest.raises(PlanError, match="more than the budget"):
            run(spec, env, tokens, budget, reserve, segments, outside)
        return
    result = run(spec, env, tokens, budget, reserve, segments, outside)
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    assert (result.chosen.outside_bytes, result.chosen.reserve_bytes) == (outside, reserve)
    # The chosen plan fits by the plan's own numbers.
    plan = result.plan
    assert plan.device_bytes_resident + plan.device_bytes_buffers + outside + reserve <= budget
    assert result.chosen.device_bytes <= budget
    # Every runner-up is what its own plan says, fits, and is no better than the winner.
    for candidate in result.runners_up:
        need, step = device_bytes(result.env, candidate.config, spec, tokens, reserve, outside)
        assert candidate.device_bytes == need
        assert candidate.step_seconds == pytest.approx(step, rel=1e-9)
        assert need <= budget
        assert step >= result.chosen.step_seconds * (1 - 1e-9)
    # The filter holds: nothing outside it leaves the device.
    for p in plan.offloaded_params:
        assert not segments or any(segment_matches(s, p.name) for s in segments)


@settings(max_examples=30, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, small=st.floats(0.0, 1.1), extra=st.floats(0.0, 1.0))
def test_a_larger_budget_is_never_slower(spec: ModelSpec, env: EnvSnapshot, tokens: int, small: float,
                                         extra: float) -> None:
    low = int(spec.nbytes * small)
    high = low + int(spec.nbytes * extra)
    try:
        tight = run(spec, env, tokens, low)
    except PlanError:
        return
    roomy = run(spec, env, tokens, high)
    assert roomy.chosen.step_seconds <= tight.chosen.step_seconds * (1 + 1e-9)


@settings(max_examples=30, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, reserve=st.integers(0, 1000), slack=st.integers(0, 1000))
def test_a_budget_that_holds_the_model_keeps_it_resident(spec: ModelSpec, env: EnvSnapshot, tokens: int,
                                                         reserve: int, slack: int) -> None:
    resident = make_plan(spec, OffloadConfig(backend="none"), planning_env(env, TOY)).device_bytes_resident
    result = run(spec, env, tokens, resident + reserve + slack, reserve)
    assert result.plan.config.backend == "none"
    assert result.chosen.device_bytes == resident + reserve
    assert result.runners_up == ()


@settings(max_examples=20, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, fraction=st.floats(0.0, 1.0))
def test_fit_is_deterministic(spec: ModelSpec, env: EnvSnapshot, tokens: int, fraction: float) -> None:
    budget = int(spec.nbytes * fraction)
    outcomes: list[FitResult | str] = []
    for _ in range(2):
        try:
            outcomes.append(run(spec, env, tokens, budget))
        except PlanError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1]


def vec(name: str, elements: int) -> ParamSpec:
    return ParamSpec(name=name, shape=(elements,), stride=(1,), dtype="bfloat16", itemsize=2)


def uniform(layers: int, elements: int = 50) -> ModelSpec:
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=(vec("w", elements),))
                                  for i in range(layers)))


@pytest.mark.parametrize("tokens", [1, 40])
def test_many_kinds_of_layer(tokens: int) -> None:
    """18 layers whose weights all differ in shape (18 kinds of layer, more than the search
    counts buffers for exactly while screening), against the oracle at depths up to 3."""
    spec = ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=(vec("w", 40 + 3 * i),))
                                  for i in range(18)))
    budget = spec.nbytes * 6 // 10
    best = oracle(spec, EnvSnapshot(), tokens, budget, 0, (), max_depth=3)
    result = fit(spec, EnvSnapshot(), TOY, Workload(tokens_per_step=tokens), budget, max_prefetch_step=3)
    assert best is not None
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    assert result.chosen.device_bytes <= budget


@pytest.mark.parametrize(
    ("flags", "leanest", "needs"),
    [
        # UVA views: every weight off the device, only the 50-byte reserve stays: 50 - 10 = 40.
        (EnvFlags(), "uva with uva_max_bytes 400", 50),
        # No UVA: on demand copies one 100-byte layer at a time, prefetch needs one 100-byte
        # slot; both need 100 + 50; prefetch ranks first: 150 - 10 = 140.
        (EnvFlags(disable_uva=True), "prefetch with group_size 1, num_in_group 1, prefetch_step 1", 150),
    ],
)
def test_nothing_fits_says_by_how_much(flags: EnvFlags, leanest: str, needs: int) -> None:
    """4 layers of one 100-byte weight, a 50-byte reserve, a 10-byte budget."""
    with pytest.raises(PlanError) as caught:
        fit(uniform(4), EnvSnapshot(flags=flags), TOY, Workload(), 10, reserve_bytes=50)
    assert caught.value.name == "device_budget_bytes"
    assert caught.value.value == 10
    assert leanest in str(caught.value)
    assert f"needs {needs} B ({needs} bytes" in str(caught.value)
    assert f"{needs - 10} bytes" in str(caught.value)


@pytest.mark.parametrize(
    ("tokens", "expected", "step_seconds"),
    [
        # 1 token: compute 2 x 50 x 1 / 20000 = 5 ms a layer, 40 ms in all. UVA of the first
        # 3 weights: 300 B read at 900 B/s = 333.3 ms, step 373.3 ms; prefetch of n >= 4
        # layers moves at least 400 B at 1000 B/s, 400 ms. UVA wins.
        (1, OffloadConfig(backend="uva", uva_max_bytes=300), 0.04 + 300 / 900),
        # 20 tokens: compute 100 ms a layer, 800 ms in all; UVA now takes 800 + 333 ms.
        # Layers 1, 3, 5, 7 (group 2, 1 in group) at depth 1: each 100 ms copy is issued
        # when the offloaded layer before ends and overlaps the 100 ms layer in between:
        # no stall, step = compute = 800 ms.
        (20, OffloadConfig(backend="prefetch", group_size=2, num_in_group=1, prefetch_step=1), 0.8),
    ],
)
def test_a_tight_budget_on_a_uniform_model(tokens: int, expected: OffloadConfig, step_seconds: float) -> None:
    """8 layers of one 100-byte weight, budget 500 B: resident 800 B does not fit. UVA
    must move 300 B off the device; prefetch of n layers at depth d needs
    (8 - n) x 100 + d x 100 <= 500, so n >= 4."""
    result = fit(uniform(8), EnvSnapshot(), TOY, Workload(tokens_per_step=tokens), 500)
    assert result.chosen.config == expected
    assert result.chosen.device_bytes == 500
    assert result.chosen.step_seconds == pytest.approx(step_seconds)


def test_unpinned_hosts_prefer_resident_weights() -> None:
    """Same model with pinning off: copies at 150 B/s cost more, but the budget still forces
    4 layers out; every candidate the result lists fits and ranks no better than the winner."""
    result = fit(uniform(8), EnvSnapshot(flags=EnvFlags(disable_pin_memory=True)), TOY, Workload(), 500)
    assert not result.plan.pin.pin
    assert all(c.device_bytes <= 500 for c in (result.chosen, *result.runners_up))
    assert all(c.step_seconds >= result.chosen.step_seconds for c in result.runners_up)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"device_budget_bytes": -1}, "device_budget_bytes"),
        ({"device_budget_bytes": 100, "reserve_bytes": -5}, "reserve_bytes"),
        ({"device_budget_bytes": 100, "outside_bytes": -1}, "outside_bytes"),
        ({"device_budget_bytes": 100, "outside_bytes": 1.5}, "outside_bytes"),
        ({"device_budget_bytes": 100, "max_prefetch_step": 0}, "max_prefetch_step"),
        ({"device_budget_bytes": 100, "param_filter": ("mlp..up",)}, "param_filter"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        fit(uniform(2), EnvSnapshot(), TOY, Workload(), **kwargs)
    assert caught.value.name == name


def test_outside_bytes_are_resident_device_bytes() -> None:
    """4 layers of one 100-byte weight (400 B) in a 450-byte budget: resident fits alone,
    not with 100 bytes of embeddings and head beside it; they are always resident, so the
    device sum counts them once, in every candidate, apart from the reserve."""
    alone = fit(uniform(4), EnvSnapshot(), TOY, Workload(), 450)
    assert alone.chosen.config.backend == "none"
    result = fit(uniform(4), EnvSnapshot(), TOY, Workload(), 450, outside_bytes=100, reserve_bytes=20)
    assert result.chosen.config.backend != "none"
    for candidate in (result.chosen, *result.runners_up):
        assert (candidate.outside_bytes, candidate.reserve_bytes) == (100, 20)
        assert candidate.device_bytes == (candidate.resident_bytes + candidate.buffer_bytes
                                          + candidate.transient_bytes + 100 + 20) <= 450
    text = render_fit(result, plan=False, estimate=False)
    assert "+ outside layers 100 B + reserve 20 B =" in text


def test_the_leanest_names_its_outside_bytes_when_nothing_fits() -> None:
    with pytest.raises(PlanError) as caught:
        fit(uniform(4), EnvSnapshot(), TOY, Workload(), 60, outside_bytes=70)
    assert "+ outside 70 + reserve 0)" in str(caught.value)
    assert "needs 70 B (70 bytes = resident 0 + buffers 0 + on-demand 0 + outside 70" in str(caught.value)


@settings(max_examples=20, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, fraction=st.floats(0.0, 1.2), outside=st.integers(0, 200))
def test_outside_bytes_weigh_like_a_reserve(spec: ModelSpec, env: EnvSnapshot, tokens: int, fraction: float,
                                            outside: int) -> None:
    budget = int(spec.nbytes * fraction) + outside
    outcomes: list[tuple[object, ...] | str] = []
    for kwargs in ({"outside": outside}, {"reserve": outside}):
        try:
            chosen = run(spec, env, tokens, budget, **kwargs).chosen  # type: ignore[arg-type]
            outcomes.append((chosen.config, chosen.device_bytes, chosen.step_seconds))
        except PlanError as error:
            outcomes.append(str(error).split(" bytes = ")[0])
    assert outcomes[0] == outcomes[1]


def test_llama_70b_in_40_gib_on_an_h200() -> None:
    """A user's case: llama-70b (127.5 GiB of bf16 weights) in 40 GiB, 1 token. The
    plan is made for an H200 although this machine has no GPU, and it frees device memory;
    at 1 token the link decides, so the step is within 1% of the offloaded bytes / 55.4 GB/s."""
    from offload.pure import preset_spec

    result = fit(preset_spec("llama-70b"), EnvSnapshot(platform=Platform()), profile_by_name("h200-pcie5"),
                 Workload(tokens_per_step=1), 40 * GIB)
    plan = result.plan
    assert plan.device_bytes_resident + plan.device_bytes_buffers <= 40 * GIB
    assert plan.device_bytes_freed == plan.offloaded_bytes > 87 * GIB
    assert result.chosen.step_seconds <= 1.01 * plan.offloaded_bytes / 55.4e9
    assert all(p.placement is Placement.PREFETCH for p in plan.offloaded_params)
    text = render_fit(result)
    assert "chosen:" in text and "limit" in text and "runners" not in text.split("chosen:")[0]
    assert isinstance(result.runners_up[0], FitCandidate)
    assert result.to_json().startswith("{")


def _prefetch_candidates(spec: ModelSpec, env: EnvSnapshot, tokens: int, max_step: int = MAX_STEP,
                         budget: int = 1 << 60) -> list[tuple[OffloadConfig, FitCandidate, float]]:
    """Every prefetch candidate the search can cost within `budget`, with its layer set's
    bound."""
    plan_env = planning_env(env, TOY)
    table = build_table(spec, plan_env, TOY, Workload(tokens_per_step=tokens), (), 0)
    out = []
    for layer_set in layer_sets(table, max_step, budget):
        expanded = expand(table, layer_set)
        for depth in range(1, min(len(expanded.positions), max_step) + 1):
            candidate = prefetch_candidate(table, expanded, depth, buffer_bytes(expanded, depth))
            assert candidate is not None  # without a host budget every candidate is costed
            if candidate.device_bytes <= budget:
                out.append((candidate.config, candidate, layer_set.bound_seconds))
    return out


@settings(max_examples=40, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, max_step=st.integers(1, 6), fraction=st.floats(0.0, 1.2))
def test_every_prefetch_candidate_is_what_its_plan_and_estimate_say(spec: ModelSpec, env: EnvSnapshot, tokens: int,
                                                                    max_step: int, fraction: float) -> None:
    """The search's figures for each prefetch configuration (step, limit, device bytes)
    are those of `make_plan` and `estimate`, layers loaded once included; and each layer
    set's bound is below the step of every depth searched that fits the budget, or
    pruning by it would be wrong."""
    check_prefetch_candidates(spec, env, tokens, max_step, int(spec.nbytes * fraction))


def check_prefetch_candidates(spec: ModelSpec, env: EnvSnapshot, tokens: int, max_step: int, budget: int) -> None:
    """Each prefetch candidate's figures are its plan's and estimate's, and its layer set's
    bound is below its step."""
    plan_env = planning_env(env, TOY)
    for config, candidate, bound in _prefetch_candidates(spec, env, tokens, max_step, budget):
        plan = make_plan(spec, config, plan_env)
        step = estimate(plan, TOY, Workload(tokens_per_step=tokens))
        assert candidate.step_seconds == pytest.approx(step.step_seconds, rel=1e-9)
        assert candidate.limit_seconds == pytest.approx(step.limit_seconds, rel=1e-9)
        assert candidate.buffer_bytes == plan.device_bytes_buffers
        assert candidate.host_bytes == plan.host_bytes
        assert candidate.resident_bytes == plan.device_bytes_resident
        assert bound <= step.step_seconds * (1 + 1e-9)


def test_a_layer_loaded_once_costs_the_link_nothing_in_the_search() -> None:
    """3 layers of one 100-byte weight, all offloaded at depth 2, 1 token: compute
    2 x 50 / 20000 = 5 ms a layer, copies 100 B / 1000 B/s = 100 ms. Layer 1 is alone in
    slot 1 and loaded once; layers 0 and 2 share slot 0. Steady state (T: a step's start):
    layer 0's copy, issued when layer 2 ended, lands at T + 100 ms (stall 100), it ends at
    T + 105; layer 2's copy, issued then, lands at T + 205 while layer 1 ran T + 105..110
    (stall 95). Step 15 + 195 = 210 ms; the link moves 200 B a step: limit 200 ms. With
    room for every slot, the layer set's bound (depths up to 3: at depth 3 all three are
    loaded once and nothing moves) is its compute, 15 ms; in 200 B of device memory (depth
    2 at most: one layer kept), 200 B must move: 200 ms."""
    found = {c: (cand, bound) for c, cand, bound in _prefetch_candidates(uniform(3), EnvSnapshot(), 1)
             if (c.group_size, c.num_in_group) == (1, 1)}
    candidate, bound = found[OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=2)]
    assert candidate.step_seconds == pytest.approx(0.210)
    assert candidate.limit_seconds == pytest.approx(0.200)
    assert candidate.buffer_bytes == 200
    assert bound == pytest.approx(0.015)
    every, _ = found[OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=3)]
    assert every.step_seconds == pytest.approx(0.015)  # all three loaded once: compute alone
    assert every.limit_seconds == pytest.approx(0.015)
    tight = {c: bound for c, _, bound in _prefetch_candidates(uniform(3), EnvSnapshot(), 1, budget=200)
             if (c.group_size, c.num_in_group) == (1, 1)}
    assert tight == {OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=d): pytest.approx(0.2)
                     for d in (1, 2)}


def test_a_storage_tied_across_layers_stays_resident_in_the_search_as_in_the_plan() -> None:
    """4 layers of one 100-byte weight; layers 0 and 1 also share one 400-byte storage,
    which prefetch keeps resident (one Parameter cannot point at two layers' buffers).
    UVA off, budget 500 B: prefetch of every layer's own weight at depth 1 needs the
    resident 400 B + one 100-byte slot = 500 B. Compute 2 x 250 / 20000 = 25 ms for layers
    0 and 1, 5 ms for 2 and 3; each 100 ms copy is issued after the layer before ran and
    waited for in full: step 60 + 400 = 460 ms. (The search used to count the tie as
    prefetched and its plan disagreed with it.)"""
    def weights(i: int) -> tuple[ParamSpec, ...]:
        shared = ParamSpec(name="shared", shape=(200,), stride=(1,), dtype="bfloat16", itemsize=2, storage_key="tie")
        return (vec("w", 50), shared) if i < 2 else (vec("w", 50),)

    spec = ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=weights(i)) for i in range(4)))
    env = EnvSnapshot(flags=EnvFlags(disable_uva=True))
    result = fit(spec, env, TOY, Workload(), 500, max_prefetch_step=4)
    assert result.chosen.config == OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=1)
    assert (result.chosen.resident_bytes, result.chosen.buffer_bytes) == (400, 100)
    assert result.chosen.step_seconds == pytest.approx(0.460)
    assert oracle(spec, env, 1, 500, 0, (), max_depth=4) == pytest.approx(0.460)
    for config, candidate, _ in _prefetch_candidates(spec, env, 1, 4):
        plan = make_plan(spec, config, planning_env(env, TOY))
        assert candidate.resident_bytes == plan.device_bytes_resident
        assert candidate.step_seconds == pytest.approx(estimate(plan, TOY, Workload()).step_seconds, rel=1e-9)
