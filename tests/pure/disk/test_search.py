"""`fit` with a host budget (`fit_with_tier`): the disk tier inside the search.

The oracle enumerates every configuration of a small model with `make_plan`,
`plan_disk_tier` and `estimate_with_tier` only (none; prefetch over every group size,
number in group and depth, its last layers on disk where the host budget needs; UVA over
every prefix, whose host copies must fit), and keeps those that meet both budgets. `fit`
must give a plan whenever one does, as fast as the fastest, and otherwise an error whose
named budgets each work.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import EnvSnapshot, LayerSpec, ModelSpec, OffloadConfig, ParamSpec, make_plan
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.search import TierFit, fit_with_tier
from offload.pure.disk.tier import plan_disk_tier
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import planning_env
from offload.pure.fit.search import fit
from offload.pure.plan.plan import Backend, OffloadPlan
from tests.pure.fit.test_search import ENVS, MAX_STEP, SPECS, TOKENS, TOY, device_bytes
from tests.pure.fit.test_search_experts import NO_UVA, at_call, moe_spec, moe_specs

#: A disk as slow as the toy link (1000 bytes/s), so that reads matter beside copies.
DISK_GBPS = 1e-6


@st.composite
def weighty_specs(draw: st.DrawFn, min_layers: int = 1) -> ModelSpec:
    """Models whose layers (16 to 384 KiB) dwarf a staging buffer's alignment block, so that
    disk tiers fit host budgets; some parameters not on the compute device (never offloaded);
    half of them of identical layers."""
    layers = []
    for index in range(draw(st.integers(min_layers, 7))):
        params = []
        for name in draw(st.lists(st.sampled_from(["a.weight", "b.weight", "c.bias"]), min_size=1, max_size=3,
                                  unique=True)):
            rows = draw(st.integers(1, 8)) * 256
            params.append(ParamSpec(name=name, shape=(rows, 16), stride=(16, 1), dtype="float32", itemsize=4,
                                    device=draw(st.sampled_from(["compute", "compute", "compute", "cpu"]))))
        layers.append(LayerSpec(index=index, name=f"model.layers.{index}", params=tuple(params)))
    if draw(st.booleans()):  # identical layers, as in most real stacks
        layers = [LayerSpec(index=i, name=f"model.layers.{i}", params=layers[0].params) for i in range(len(layers))]
    return ModelSpec(layers=tuple(layers))


@st.composite
def weighty_moe_specs(draw: st.DrawFn) -> ModelSpec:
    """3 to 5 layers (half the time identical), most of 2 to 6 experts of 12 KiB (and an
    attention weight of up to 16 KiB), so that disk tiers fit host budgets; a top-k of 1
    or 2, or none."""
    count = draw(st.integers(3, 5))
    layers: list[tuple[int, int | None]]
    if draw(st.booleans()):  # identical layers, as in most real stacks
        layers = [(draw(st.integers(1, 4096)), draw(st.integers(2, 6)))] * count
    else:
        layers = [(draw(st.integers(1, 4096)), draw(st.one_of(st.none(), st.integers(2, 6)))) for _ in range(count)]
    return moe_spec(layers, hidden=64, ffn=16, top_k=draw(st.one_of(st.none(), st.integers(1, 2))))


def tiered(plan: OffloadPlan, host_budget: int, tokens: int, read_ahead: int,
           routing: RoutingTrace | None = None) -> tuple[int, float] | None:
    """(host bytes, step seconds) of `plan` within `host_budget` (over `routing`, where
    given), or None when it cannot."""
    workload = Workload(tokens_per_step=tokens)
    if plan.host_bytes <= host_budget:
        return plan.host_bytes, estimate(plan, TOY, workload, routing=routing).step_seconds
    if plan.backend is not Backend.PREFETCH:
        return None
    try:
        tier = plan_disk_tier(plan, host_budget_bytes=host_budget, disk_gbps=DISK_GBPS, read_ahead=read_ahead)
    except PlanError:
        return None
    return tier.host_bytes, estimate_with_tier(plan, tier, TOY, workload, routing=routing).step_seconds


def configs(spec: ModelSpec, env: EnvSnapshot, expert_slots: int | None = None,
            both: bool = False) -> list[OffloadConfig]:
    """Every configuration; `both`: prefetch's with the expert caches and streaming whole."""
    layers = len(spec.layers)
    found = [OffloadConfig(backend="none")]
    found += [OffloadConfig(backend="prefetch", group_size=g, num_in_group=k, prefetch_step=d,
                            expert_slots=expert_slots if cache else None, expert_cache=cache)
              for g in range(1, layers + 1) for k in range(1, g + 1) for d in range(1, layers + 1)
              for cache in ((True, False) if both else (True,))]
    every = make_plan(spec, OffloadConfig(backend="uva", uva_max_bytes=1 << 60), planning_env(env, TOY))
    prefix = 0
    for p in every.params:
        if p.offloaded and p.tied_to is None and p.nbytes:
            prefix += p.nbytes
            found.append(OffloadConfig(backend="uva", uva_max_bytes=prefix))
    return found


def oracle(spec: ModelSpec, env: EnvSnapshot, tokens: int, device_budget: int, host_budget: int,
           read_ahead: int = 2, expert_slots: int | None = None,
           routing: RoutingTrace | None = None) -> list[tuple[float, int, OffloadConfig]]:
    """(step, host bytes, config) of every configuration meeting both budgets (prefetch's
    expert caches at `expert_slots` slots each: None, the default; and streaming whole
    where a trace or the top-k bounds cost the caches' misses at their calls), over
    `routing` where given."""
    penv = planning_env(env, TOY)
    out = []
    for config in configs(spec, env, expert_slots, both=routing is not None or at_call(spec)):
        need, _ = device_bytes(penv, config, spec, tokens, 0, routing=routing)
        if need > device_budget:
            continue
        found = tiered(make_plan(spec, config, penv), host_budget, tokens, read_ahead, routing)
        if found is not None:
            out.append((found[1], found[0], config))
    return out


def run(spec: ModelSpec, env: EnvSnapshot, tokens: int, device_budget: int, host_budget: int,
        read_ahead: int = 2, routing: RoutingTrace | None = None, expert_slots: int | None = None) -> TierFit:
    return fit_with_tier(spec, env, TOY, Workload(tokens_per_step=tokens), device_budget,
                         host_budget_bytes=host_budget, disk_gbps=DISK_GBPS, read_ahead=read_ahead,
                         max_prefetch_step=MAX_STEP, routing=routing, expert_slots=expert_slots)


def check_budgets(spec: ModelSpec, env: EnvSnapshot, tokens: int, device: float, host: float,
                  read_ahead: int, expert_slots: int | None = None, routing: RoutingTrace | None = None) -> None:
    """Both budgets (fractions of the model's bytes) against the oracle (the module
    docstring); a MoE model's caches at `expert_slots` slots in the oracle (1: what the
    search costs them at before it sizes the winner's), over `routing` where given (the
    oracle then takes streaming whole too, as the search does: `oracle`)."""
    # Over a trace the winner keeps the oracle's C (its step at another C is another);
    # without one its caches are sized, which changes no step.
    slots = expert_slots if routing is not None else None
    device_budget, host_budget = int(spec.nbytes * device), int(spec.nbytes * host)
    meeting = oracle(spec, env, tokens, device_budget, host_budget, read_ahead, expert_slots, routing)
    if not meeting:
        with pytest.raises(PlanError) as caught:
            run(spec, env, tokens, device_budget, host_budget, read_ahead, routing, slots)
        if caught.value.name != "host_budget_bytes":
            event("nothing fits the device")
            return  # nothing fits the device at all: fit's own refusal
        event("refused for the host budget")
        # The named budgets work: each with the other budget as given.
        message = caught.value.message
        least_host = int(message.split("the least host budget is ")[1].split("(")[1].split(" bytes")[0])
        least_device = int(message.split("the least device budget is ")[1].split("(")[1].split(" bytes")[0])
        assert least_host > host_budget and least_device > device_budget
        assert oracle(spec, env, tokens, device_budget, least_host, read_ahead, expert_slots, routing)
        assert oracle(spec, env, tokens, least_device, host_budget, read_ahead, expert_slots, routing)
        # And they are the least: a byte less meets neither.
        assert not oracle(spec, env, tokens, device_budget, least_host - 1, read_ahead, expert_slots, routing)
        assert not oracle(spec, env, tokens, least_device - 1, host_budget, read_ahead, expert_slots, routing)
        run(spec, env, tokens, device_budget, least_host, read_ahead, routing, slots)
        run(spec, env, tokens, least_device, host_budget, read_ahead, routing, slots)
        return
    result = run(spec, env, tokens, device_budget, host_budget, read_ahead, routing, slots)
    best = min(step for step, _, _ in meeting)
    assert result.fit.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    plan, tier = result.fit.plan, result.tier
    # The plan meets both budgets by its own numbers.
    assert result.fit.chosen.device_bytes <= device_budget
    assert (tier.host_bytes if tier is not None else plan.host_bytes) <= host_budget
    assert result.fit.chosen.host_bytes == (tier.host_bytes if tier is not None else plan.host_bytes)
    # Its estimate is the tier's, exactly as estimate_with_tier gives it.
    expected = estimate_with_tier(plan, tier, TOY, Workload(tokens_per_step=tokens), routing=routing) \
        if tier is not None else estimate(plan, TOY, Workload(tokens_per_step=tokens), routing=routing)
    assert result.fit.estimate == expected
    event(f"{plan.backend.value}, {'a disk tier' if tier is not None else 'no disk tier'}")
    if tier is not None:
        assert plan.backend is Backend.PREFETCH
        assert result.fit.chosen.disk_positions == tier.disk_positions


@settings(max_examples=120, deadline=None)
@given(spec=st.one_of(SPECS, weighty_specs()), env=ENVS, tokens=TOKENS, device=st.floats(0.0, 1.1),
       host=st.floats(0.0, 1.1), read_ahead=st.sampled_from([1, 2]))
def test_any_pair_of_budgets_some_plan_meets_gets_the_fastest_such_plan(spec: ModelSpec, env: EnvSnapshot,
                                                                        tokens: int, device: float,
                                                                        host: float, read_ahead: int) -> None:
    check_budgets(spec, env, tokens, device, host, read_ahead)


@settings(max_examples=120, deadline=None)
@given(spec=weighty_specs(min_layers=4), env=ENVS, tokens=TOKENS, device=st.floats(0.3, 1.0),
       host=st.floats(0.35, 0.95), read_ahead=st.sampled_from([1, 2]))
def test_budgets_where_disk_tiers_are_the_answer(spec: ModelSpec, env: EnvSnapshot, tokens: int, device: float,
                                                 host: float, read_ahead: int) -> None:
    # Several layers, and host budgets below the offloaded bytes but above a ring: the
    # region where the chosen plan runs with a disk tier.
    check_budgets(spec, env, tokens, device, host, read_ahead)


@settings(max_examples=80, deadline=None)
@given(spec=st.one_of(moe_specs(), weighty_moe_specs()), env=ENVS, tokens=TOKENS, device=st.floats(0.0, 1.1),
       host=st.floats(0.0, 1.1), read_ahead=st.sampled_from([1, 2]))
def test_a_moe_model_gets_the_fastest_plan_that_meets_both_budgets(spec: ModelSpec, env: EnvSnapshot, tokens: int,
                                                                   device: float, host: float,
                                                                   read_ahead: int) -> None:
    """The expert caches' device bytes and their rows, one buffer for all slots, inside
    both budgets; the oracle's caches at one slot each, as the search costs them."""
    check_budgets(spec, env, tokens, device, host, read_ahead, expert_slots=1)


@settings(max_examples=60, deadline=None)
@given(spec=st.one_of(moe_specs(), weighty_moe_specs()), env=ENVS, tokens=TOKENS, device=st.floats(0.0, 1.1),
       host=st.floats(0.0, 1.1), read_ahead=st.sampled_from([1, 2]), steps=st.integers(1, 6),
       seed=st.integers(0, 2**31), batch=st.integers(1, 3))
def test_over_a_routing_trace_a_moe_model_gets_the_fastest_plan_that_meets_both_budgets(
        spec: ModelSpec, env: EnvSnapshot, tokens: int, device: float, host: float, read_ahead: int, steps: int,
        seed: int, batch: int) -> None:
    """A trace and a host budget together: a disk layer's expert misses are read from the
    files at their call, then copied; the search costs them as `estimate_with_tier(...,
    routing=)` does, with the caches at one slot and streaming whole."""
    smallest = min((g.num_experts for g in spec.experts), default=2)
    trace = zipf_trace(spec.experts, steps=steps, top_k=min(2, smallest), tokens=batch, seed=seed)
    check_budgets(spec, env, tokens, device, host, read_ahead, expert_slots=1, routing=trace)


@settings(max_examples=30, deadline=None)
@given(spec=SPECS, env=ENVS, tokens=TOKENS, device=st.floats(0.0, 1.1))
def test_a_host_budget_that_holds_everything_changes_nothing(spec: ModelSpec, env: EnvSnapshot, tokens: int,
                                                             device: float) -> None:
    budget = int(spec.nbytes * device)
    try:
        plain = fit(spec, env, TOY, Workload(tokens_per_step=tokens), budget, max_prefetch_step=MAX_STEP)
    except PlanError:
        return
    roomy = run(spec, env, tokens, budget, spec.nbytes + (1 << 20))
    assert roomy.tier is None
    assert roomy.fit.chosen == plain.chosen
    assert roomy.fit.plan == plain.plan


@settings(max_examples=80, deadline=None)
@given(spec=weighty_moe_specs(), tokens=st.integers(1, 8), device=st.floats(0.3, 0.7), host=st.floats(0.2, 0.95),
       read_ahead=st.sampled_from([1, 2]), traced=st.booleans(), seed=st.integers(0, 2**31))
def test_budgets_where_disk_tiers_hold_a_moe_model(spec: ModelSpec, tokens: int, device: float, host: float,
                                                   read_ahead: int, traced: bool, seed: int) -> None:
    """UVA off, host budgets below the offloaded bytes: the chosen plans run with disk
    tiers, whose layers' misses are read from the files at their call (over a trace, or
    the top-k bound), as `estimate_with_tier` costs them."""
    trace = zipf_trace(spec.experts, steps=4, top_k=min(2, min(g.num_experts for g in spec.experts)),
                       tokens=tokens, seed=seed) if traced and spec.experts else None
    check_budgets(spec, NO_UVA, tokens, device, host, read_ahead, expert_slots=1, routing=trace)
