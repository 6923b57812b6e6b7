"""The step estimate without a routing trace, where every experts module says its top-k
(`ExpertGroup.top_k`): each layer's caches are costed at their calls for the worst case a
step can make them copy (`offload.pure.experts.expected.bounded_loads`).

The bound is checked against traces, not against a formula: a trace that routes T x top-k
experts no call has seen before (every one a miss) costs exactly the bound, and any Zipf
trace of T tokens and that top-k costs no more bytes, and no longer a step, than it.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.pure import OffloadConfig, OffloadPlan, make_plan
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.tier import plan_disk_tier
from offload.pure.experts.profile import trace_profile
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.render import render_estimate
from offload.pure.fit.search import fit
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes
from tests.pure.fit.test_estimate import ENV, TOY
from tests.pure.fit.test_search_experts import NO_UVA, moe_spec

#: 4 layers of an 8-float attention weight and 16 experts of 96 bytes, 2 per token.
SPEC = moe_spec([(8, 16)] * 4, top_k=2)
B = 96


def _plan(spec: ModelSpec = SPEC, **config: object) -> OffloadPlan:
    settings: dict[str, object] = {"backend": "prefetch", "group_size": 1, "prefetch_step": 2, "expert_slots": 2,
                                   **config}
    return make_plan(spec, OffloadConfig(**settings), ENV)  # type: ignore[arg-type]


def _cold(spec: ModelSpec, routed: int, steps: int) -> RoutingTrace:
    """Each module routes `routed` experts a step that no step before routed: every one a miss."""
    return RoutingTrace(groups=spec.experts, steps=tuple(
        tuple(tuple(range(t * routed, (t + 1) * routed)) for _ in spec.experts) for t in range(steps)))


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_the_bound_is_the_step_of_a_trace_whose_every_routed_expert_misses(tokens: int) -> None:
    plan = _plan()
    workload = Workload(tokens_per_step=tokens)
    routed = 2 * tokens
    bound = estimate(plan, TOY, workload)
    cold = estimate(plan, TOY, workload, routing=_cold(SPEC, routed, 16 // routed))
    assert bound.routing_steps == 0 and bound.belady_hit_rate is None  # no trace behind it
    assert cold.expert_hit_rate == 0.0
    for mine, theirs in zip(bound.layers, cold.layers, strict=True):
        assert mine.expert_bytes == theirs.expert_bytes == routed * B
        assert mine.expert_routed == theirs.expert_routed == routed
        assert mine.copy_bytes == theirs.copy_bytes  # the experts left the prefetch copy in both
        assert mine.expert_seconds == pytest.approx(theirs.expert_seconds)
    assert bound.step_seconds == pytest.approx(cold.step_seconds)


def test_a_module_that_does_not_say_its_top_k_keeps_the_old_worst_case() -> None:
    """One module without a top-k: the bound does not apply to any; every expert is in its
    layer's prefetch copy, as before top-k was known."""
    unbounded = moe_spec([(8, 16)] * 4)
    mixed = ModelSpec(layers=SPEC.layers, experts=(*SPEC.experts[:3], unbounded.experts[3]))
    old = estimate(_plan(unbounded), TOY, Workload())
    step = estimate(_plan(mixed), TOY, Workload())
    assert step == old
    assert estimate(_plan(), TOY, Workload()) != old


def test_every_expert_routed_misses_but_the_held_ones() -> None:
    """Tokens enough to route all 16 experts at each call: each misses but those a routing
    profile holds, which are hits. Held 2 of 4 slots: 14 misses, 2 hits per call."""
    profile = trace_profile(_cold(SPEC, 2, 1))  # experts 0 and 1 the hottest of each module
    plan = _plan(expert_slots=4, routing_profile=profile)
    assert all(c.held == (0, 1) for c in plan.experts)
    step = estimate(plan, attrs.evolve(TOY, weight_read_bytes_per_s=1000.0), Workload(tokens_per_step=8))
    for layer in step.layers:
        assert (layer.expert_routed, layer.expert_hits, layer.expert_bytes) == (16.0, 2.0, 14 * B)


@settings(max_examples=80, deadline=None)
@given(experts=st.lists(st.integers(2, 12), min_size=1, max_size=4), top_k=st.integers(1, 4),
       tokens=st.integers(1, 4), steps=st.integers(1, 12), slots=st.integers(1, 12), s=st.floats(0.0, 2.0),
       seed=st.integers(0, 2**31))
def test_no_zipf_trace_of_those_tokens_and_top_k_costs_more_than_the_bound(
        experts: list[int], top_k: int, tokens: int, steps: int, slots: int, s: float, seed: int) -> None:
    spec = moe_spec([(8, e) for e in experts], top_k=top_k)
    plan = _plan(spec, expert_slots=min(slots, min(experts)))
    workload = Workload(tokens_per_step=tokens)
    trace = zipf_trace(spec.experts, steps=steps, top_k=min(top_k, min(experts)), tokens=tokens, s=s, seed=seed)
    bound = estimate(plan, TOY, workload)
    over = estimate(plan, TOY, workload, routing=trace)
    for mine, theirs in zip(bound.layers, over.layers, strict=True):
        assert theirs.expert_bytes <= mine.expert_bytes
        assert theirs.expert_routed <= mine.expert_routed
    assert over.step_seconds <= bound.step_seconds * (1 + 1e-12)


def test_on_the_disk_tier_the_bound_reads_its_misses_at_the_call_as_a_trace_does() -> None:
    """Layers of 16 experts of 12 KiB (so that a staging ring fits half the host copies):
    the bound's misses are read from the files at their call, as a cold trace's are."""
    spec = moe_spec([(8, 16)] * 4, hidden=64, ffn=16, top_k=2)
    expert = spec.experts[0].expert_bytes
    plan = _plan(spec, prefetch_step=1)
    tier = plan_disk_tier(plan, host_budget_bytes=plan.host_bytes // 2, disk_gbps=1e-6)
    assert tier.disk_layers
    workload = Workload(tokens_per_step=1)
    bound = estimate_with_tier(plan, tier, TOY, workload)
    cold = estimate_with_tier(plan, tier, TOY, workload, routing=_cold(spec, 2, 8))
    for mine, theirs in zip(bound.layers, cold.layers, strict=True):
        assert mine.disk_read_seconds == pytest.approx(theirs.disk_read_seconds)
        if mine.layer in tier.disk_layers:  # its 2 misses read from the files at 1000 B/s
            assert mine.disk_read_seconds >= 2 * expert / 1000.0
    assert bound.step_seconds == pytest.approx(cold.step_seconds)


def test_without_a_trace_fit_keeps_the_caches_for_few_tokens_and_streams_whole_for_many() -> None:
    """Eight layers of 16 experts, 2 per token: one token a step routes 2 experts a call,
    so the caches copy an eighth of the experts streaming whole does; 64 route all 16 at
    each call, waited for, where streaming whole overlaps them with the compute (at 64
    tokens, 3x a layer's copy)."""
    spec = moe_spec([(64, 16)] * 8, top_k=2)
    budget = int(spec.nbytes * 0.9)
    few = fit(spec, NO_UVA, TOY, Workload(tokens_per_step=1), budget)
    many = fit(spec, NO_UVA, TOY, Workload(tokens_per_step=64), budget)
    assert few.chosen.config.expert_cache and few.plan.experts
    assert not many.chosen.config.expert_cache and many.plan.experts == ()
    for result, tokens in ((few, 1), (many, 64)):
        assert result.estimate == estimate(result.plan, TOY, Workload(tokens_per_step=tokens))
    whole = fit(spec, NO_UVA, TOY, Workload(tokens_per_step=1), budget, expert_cache=False)
    assert few.chosen.step_seconds < whole.chosen.step_seconds
    # many's configuration with caches: every expert waited for at each call
    cached = make_plan(spec, attrs.evolve(many.chosen.config, expert_cache=True), many.env)
    assert cached.experts
    assert many.chosen.step_seconds < estimate(cached, TOY, Workload(tokens_per_step=64)).step_seconds


def test_the_rendering_says_the_bound_is_the_worst_case() -> None:
    step = estimate(_plan(), TOY, Workload())
    text = render_estimate(step)
    assert f"experts          = {format_bytes(4 * 2 * B)} ({4 * 2 * B} bytes) of misses per step at most" in text
    assert "the worst case without a routing trace" in text and "hit rate" not in text
    assert "experts ms" in text
