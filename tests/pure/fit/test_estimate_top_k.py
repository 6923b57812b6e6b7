"""The step estimate without a routing trace: each layer's caches are costed at their calls
for the worst case a step can make them copy, bounded by each module's top-k
(`ExpertGroup.top_k`; every expert where a module does not say it:
`offload.pure.experts.expected.bounded_loads`).

The bound is checked against traces, not against a formula: a trace that routes T x top-k
experts no call has seen before (every one a miss) costs exactly the bound, and any Zipf
trace of T tokens and that top-k costs no more bytes, and no longer a step, than it.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import OffloadConfig, OffloadPlan, make_plan
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.tier import plan_disk_tier
from offload.pure.experts.profile import trace_profile
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import planning_env
from offload.pure.fit.render import render_estimate
from offload.pure.fit.search import fit
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes
from tests.pure.fit.test_estimate import ENV, TOY
from tests.pure.fit.test_search import TOY as SEARCH_TOY
from tests.pure.fit.test_search_experts import NO_UVA, moe_spec

#: 4 layers of an 8-float attention weight and 16 experts of 96 bytes, 2 per token.
SPEC = moe_spec([(8, 16)] * 4, top_k=2)
B = 96
#: The search tests' toy: a link ten times faster, so that the disk decides.
FAST_LINK = SEARCH_TOY


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


def test_a_model_whose_modules_do_not_all_say_their_top_k_is_costed_alike_by_fit_and_the_estimate() -> None:
    """Layers 0 and 2 say no top-k (every expert may be routed), 1 and 3 say 1: the
    search and the plan's estimate cost each the same way, whichever layers a candidate
    offloads (the search once costed a candidate without the bound and its plan with it,
    an internal inconsistency)."""
    base = moe_spec([(64, 8)] * 4, hidden=8, ffn=4, top_k=1)
    spec = attrs.evolve(base, experts=tuple(attrs.evolve(g, top_k=None) if g.layer % 2 == 0 else g
                                            for g in base.experts))
    for fraction in [x / 50 for x in range(5, 51)]:
        try:
            result = fit(spec, NO_UVA, TOY, Workload(), int(spec.nbytes * fraction), max_prefetch_step=4)
        except PlanError as exc:
            assert "more than the budget" in exc.message
            continue
        assert result.chosen.step_seconds == pytest.approx(estimate(result.plan, TOY, Workload()).step_seconds)


def test_without_a_top_k_every_expert_may_miss_at_each_call() -> None:
    """No module says its top-k: the worst case is every expert routed at each call."""
    plan = _plan(moe_spec([(8, 16)] * 4))
    for layer in estimate(plan, TOY, Workload()).layers:
        assert (layer.expert_routed, layer.expert_bytes) == (16.0, 16 * B)


@settings(max_examples=60, deadline=None)
@given(experts=st.integers(2, 6), layers=st.integers(2, 5), fraction=st.floats(0.1, 0.9), top_k=st.integers(1, 2),
       gbps=st.sampled_from([1e-7, 1e-6, 1e-5]))
@example(experts=4, layers=4, fraction=0.2, top_k=1, gbps=1e-7)  # every layer on disk, the reads decide
def test_the_misses_disk_reads_share_the_one_disk(experts: int, layers: int, fraction: float, top_k: int,
                                                  gbps: float) -> None:
    """On the disk tier the misses read at their call take the same disk as the staging
    ring's reads: no step is shorter than the disk's reads per step."""
    spec = moe_spec([(4096, experts)] * layers, hidden=64, ffn=16, top_k=top_k)
    plan = make_plan(spec, OffloadConfig(backend="prefetch", group_size=1, prefetch_step=1, expert_slots=1),
                     planning_env(NO_UVA, FAST_LINK))
    try:
        tier = plan_disk_tier(plan, host_budget_bytes=int(plan.host_bytes * fraction), disk_gbps=gbps)
    except PlanError:
        return
    step = estimate_with_tier(plan, tier, FAST_LINK, Workload())
    assert step.step_seconds >= step.disk_read_seconds * (1 - 1e-9)
