"""`fit` over mixture-of-experts models: the expert caches' device bytes are in its figures.

The search costs each prefetched experts module at one slot (or the user's C); the winner's
caches then take the default slots where the budget has room for them, or the largest C
that fits. The plan `fit` returns fits the budget by its own numbers, and fit is as fast as
a brute-force oracle over every configuration with one slot per cache.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import EnvFlags, EnvSnapshot, LayerSpec, ModelSpec, OffloadConfig, ParamSpec, make_plan
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.size import default_slots
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import DeviceProfile, planning_env
from offload.pure.fit.render import render_fit
from offload.pure.fit.search import FitResult, fit
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import contiguous_stride
from tests.pure.fit.test_search import MAX_STEP, TOY, oracle

#: UVA off, so that prefetch wins most budgets below the whole model.
NO_UVA = EnvSnapshot(flags=EnvFlags(disable_uva=True))
ENVS = st.sampled_from((NO_UVA, EnvSnapshot()))


def _param(name: str, shape: tuple[int, ...]) -> ParamSpec:
    return ParamSpec(name=name, shape=shape, stride=contiguous_stride(shape), dtype="float32", itemsize=4)


def moe_spec(layers: list[tuple[int, int | None]], *, hidden: int = 4, ffn: int = 2,
             top_k: int | None = None) -> ModelSpec:
    """A model of one attention weight of `size` floats per layer, and `E` experts
    (gate_up (E, 2 ffn, hidden), down (E, hidden, ffn)) in the layers whose E is not None,
    each token routed to min(`top_k`, E) of them (None: the modules do not say)."""
    specs, groups = [], []
    for index, (size, experts) in enumerate(layers):
        params = [_param("attn.weight", (size,))]
        if experts is not None:
            names = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
            params += [_param(names[0], (experts, 2 * ffn, hidden)), _param(names[1], (experts, hidden, ffn))]
            groups.append(ExpertGroup(layer=index, module="mlp.experts", num_experts=experts, params=names,
                                      expert_bytes=3 * ffn * hidden * 4, routing=Routing.INDICES,
                                      top_k=None if top_k is None else min(top_k, experts)))
        specs.append(LayerSpec(index=index, name=f"model.layers.{index}", params=tuple(params)))
    return ModelSpec(layers=tuple(specs), experts=tuple(groups))


@st.composite
def moe_specs(draw: st.DrawFn) -> ModelSpec:
    """1 to 5 layers, each with an attention weight and, most of the time, 2 to 16 experts;
    a top-k of 1 to 4 or none."""
    count = draw(st.integers(1, 5))
    layers = [(draw(st.integers(1, 64)), draw(st.one_of(st.none(), st.integers(2, 16)))) for _ in range(count)]
    return moe_spec(layers, hidden=draw(st.integers(1, 4)), ffn=draw(st.integers(1, 3)),
                    top_k=draw(st.one_of(st.none(), st.integers(1, 4))))


def at_call(spec: ModelSpec) -> bool:
    """Whether `fit` searches `spec` with the caches and streaming whole: it costs the
    caches' misses at their calls (over a trace, or their worst case) wherever it has any."""
    return bool(spec.experts)


def run(spec: ModelSpec, env: EnvSnapshot, budget: int, tokens: int = 1, profile: DeviceProfile = TOY,
        expert_cache: bool = True, expert_slots: int | None = None, routing: RoutingTrace | None = None
        ) -> FitResult:
    return fit(spec, env, profile, Workload(tokens_per_step=tokens), budget, max_prefetch_step=MAX_STEP,
               expert_cache=expert_cache, expert_slots=expert_slots, routing=routing)


def _fits(result: FitResult) -> int:
    """Device bytes of the result by its plan and estimate (with UVA's on-demand copy)."""
    plan = result.plan
    transient = max((layer.on_demand_bytes for layer in result.estimate.layers), default=0)
    return plan.device_bytes_resident + plan.device_bytes_buffers + transient


def test_a_set_whose_layers_all_stay_in_their_slots_is_not_pruned_by_the_expert_rows() -> None:
    """Every layer offloaded at depth 4 keeps each alone in its slot and fits, because the
    expert rows are one buffer for all slots. The search's bound once judged whether a
    depth fits by whole layers in each slot, experts included, so it bounded this set
    too high and pruned it: fit was slower than the best configuration."""
    spec = moe_spec([(1, 3), (1, 3), (1, None), (1, None)], hidden=1, ffn=1)
    budget = int(spec.nbytes * 0.875)
    best = oracle(spec, NO_UVA, 1, budget, 0, (), expert_slots=1)
    result = run(spec, NO_UVA, budget)
    assert best is not None and result.chosen.step_seconds == pytest.approx(best, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(spec=moe_specs(), env=ENVS, tokens=st.integers(1, 64), fraction=st.floats(0.0, 1.2))
def test_fit_of_a_moe_model_fits_by_its_plan_and_is_as_fast_as_any_configuration(
        spec: ModelSpec, env: EnvSnapshot, tokens: int, fraction: float) -> None:
    budget = int(spec.nbytes * fraction)
    found = [oracle(spec, env, tokens, budget, 0, (), expert_slots=1)]
    if at_call(spec):  # the caches wait for their misses at their calls: streaming whole may win
        found.append(oracle(spec, env, tokens, budget, 0, (), expert_cache=False))
    steps = [step for step in found if step is not None]
    best = min(steps) if steps else None
    if best is None:
        with pytest.raises(PlanError, match="more than the budget"):
            run(spec, env, budget, tokens)
        return
    result = run(spec, env, budget, tokens)
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    assert _fits(result) == result.chosen.device_bytes <= budget
    caches = result.plan.experts
    config = result.chosen.config
    if config.backend != "prefetch" or not caches:
        assert caches == () and config.expert_slots is None
        return
    offloaded = {p.layer for p in result.plan.offloaded_params}
    assert {c.layer for c in caches} == {g.layer for g in spec.experts if g.layer in offloaded}
    if config.expert_slots is None:  # the default of every module
        assert all(c.slots == default_slots(c.group) for c in caches)
    else:  # one C, the largest that fits (or every expert)
        assert {c.slots for c in caches} <= {config.expert_slots}
        more = sum(c.group.expert_bytes for c in caches)
        assert (config.expert_slots == min(c.group.num_experts for c in caches)
                or _fits(result) + more > budget)
        assert any(default_slots(c.group) > config.expert_slots for c in caches)


#: Two MoE layers of 16 experts of 96 bytes (default 2 slots each): one layer of 1568
#: bytes resident and the other's slot take more than the budgets below, so fit offloads
#: both, at depth 1 or, where 32 bytes more allow, at depth 2 (each layer then alone in its
#: slot: the expert rows are one buffer for both slots), and what is left goes to the caches.
#: Two experts a token: at one token a step the caches copy 2 of 16 experts a call.
SPEC = moe_spec([(8, 16), (8, 16)], top_k=2)
EXPERT = 96
#: Zero-copy reads so slow that UVA never beats prefetch (the tests below size the caches
#: of a prefetch plan).
SLOW_UVA = attrs.evolve(TOY, zero_copy_fraction=0.001)


def _run(budget: int, *, expert_cache: bool = True, expert_slots: int | None = None) -> FitResult:
    return run(SPEC, EnvSnapshot(), budget, profile=SLOW_UVA, expert_cache=expert_cache, expert_slots=expert_slots)


def _lean(spec: ModelSpec, step: int = 1) -> int:
    """Device bytes of prefetching every layer at depth `step` with one slot per cache: its
    slots, both caches' one expert each."""
    plan = make_plan(spec, OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=step,
                                         expert_slots=1), planning_env(EnvSnapshot(), SLOW_UVA))
    return plan.device_bytes_resident + plan.device_bytes_buffers


def test_a_generous_budget_gives_every_cache_its_default_slots() -> None:
    result = _run(_lean(SPEC) + 10 * EXPERT)
    assert result.chosen.config.backend == "prefetch"
    assert result.chosen.config.expert_slots is None
    assert [c.slots for c in result.plan.experts] == [2, 2]


def test_a_tight_budget_gives_the_caches_the_slots_it_has_room_for() -> None:
    lean = _lean(SPEC)
    at_least = _run(lean)
    assert _fits(at_least) == lean
    assert at_least.chosen.config.expert_slots == 1
    assert [c.slots for c in at_least.plan.experts] == [1, 1]
    assert "prefetch_step 1, expert_slots 1" in render_fit(at_least)
    deep = _lean(SPEC, step=2)
    assert deep == lean + 8 * 4  # a second attention slot; the experts' rows stay one buffer
    tight = _run(deep + 2 * EXPERT - 1)
    assert tight.chosen.config.prefetch_step == 2 and [c.slots for c in tight.plan.experts] == [1, 1]
    roomy = _run(deep + 2 * EXPERT)
    assert [c.slots for c in roomy.plan.experts] == [2, 2] and _fits(roomy) == deep + 2 * EXPERT


def test_below_the_leanest_with_caches_fit_leaves_the_caches_out() -> None:
    """One byte below prefetch's leanest with caches: no plan with caches fits, and the
    search without them (streaming the MoE layers whole) finds the plan
    `expert_cache=False` finds, which beats the slow UVA."""
    lean = _lean(SPEC)
    result = _run(lean - 1)
    assert result.chosen.config.backend == "prefetch"
    assert result.plan.experts == () and result.chosen.config.expert_cache is False
    assert _fits(result) == lean - 2 * EXPERT
    assert result.chosen == _run(lean - 1, expert_cache=False).chosen


def test_the_users_slots_are_costed_and_kept() -> None:
    result = _run(_lean(SPEC) + 8 * EXPERT, expert_slots=5)
    assert result.chosen.config.expert_slots == 5
    assert [c.slots for c in result.plan.experts] == [5, 5]
    assert _fits(result) == result.chosen.device_bytes == _lean(SPEC) + 8 * EXPERT
    # A byte less and no prefetch at C 5 fits: streaming whole does (and states no C).
    less = _run(_lean(SPEC) + 8 * EXPERT - 1, expert_slots=5).chosen.config
    assert (less.backend, less.expert_cache, less.expert_slots) == ("prefetch", False, None)


def test_slots_above_the_expert_count_are_refused() -> None:
    with pytest.raises(PlanError, match="16"):
        _run(1 << 20, expert_slots=17)


def test_without_expert_caches_fit_streams_the_moe_layers_whole() -> None:
    result = _run(_lean(SPEC), expert_cache=False)
    assert result.plan.experts == ()
    assert all(not c.config.expert_cache for c in (result.chosen, *result.runners_up)
               if c.config.backend == "prefetch")
    assert "expert_cache off" in render_fit(result)


@settings(max_examples=60, deadline=None)
@given(spec=moe_specs(), env=ENVS, tokens=st.integers(1, 64), fraction=st.floats(0.0, 1.2),
       steps=st.integers(1, 8), seed=st.integers(0, 2**31), batch=st.integers(1, 3))
def test_fit_over_a_routing_trace_is_as_fast_as_any_configuration_over_it(
        spec: ModelSpec, env: EnvSnapshot, tokens: int, fraction: float, steps: int, seed: int, batch: int) -> None:
    """With a trace, the search costs each MoE layer's waits at its experts' calls as
    `estimate(..., routing=)` does: at one slot per cache it is as fast as the oracle
    over the same trace, with caches or streaming whole, and its plan's estimate is that
    step."""
    budget = int(spec.nbytes * fraction)
    smallest = min((g.num_experts for g in spec.experts), default=2)
    trace = zipf_trace(spec.experts, steps=steps, top_k=min(2, smallest), tokens=batch, seed=seed)
    found = [step for step in (oracle(spec, env, tokens, budget, 0, (), expert_slots=1, routing=trace),
                               oracle(spec, env, tokens, budget, 0, (), routing=trace, expert_cache=False))
             if step is not None]
    best = min(found) if found else None
    if best is None:
        with pytest.raises(PlanError, match="more than the budget"):
            run(spec, env, budget, tokens, expert_slots=1, routing=trace)
        return
    result = run(spec, env, budget, tokens, expert_slots=1, routing=trace)
    assert result.chosen.step_seconds == pytest.approx(best, rel=1e-9)
    assert result.estimate == estimate(result.plan, TOY, Workload(tokens_per_step=tokens), routing=trace)
    assert _fits(result) == result.chosen.device_bytes <= budget


def test_over_a_trace_the_caches_win_where_the_link_decides_and_are_sized() -> None:
    """Eight layers of 16 experts, a skewed trace of one token a step, compute fast: the
    caches win, take the budget's room (more than one slot each), and the step is their
    plan's over the trace, below the step at one slot each and below streaming whole."""
    spec = moe_spec([(64, 16)] * 8)
    trace = zipf_trace(spec.experts, steps=64, top_k=2, tokens=1, s=1.2, seed=1)
    budget = int(spec.nbytes * 0.9)
    fast = attrs.evolve(TOY, bf16_flops_per_s=1e12)
    sized = run(spec, NO_UVA, budget, 1, profile=fast, routing=trace)
    one = run(spec, NO_UVA, budget, 1, profile=fast, expert_slots=1, routing=trace)
    whole = run(spec, NO_UVA, budget, 1, profile=fast, expert_cache=False, routing=trace)
    assert sized.chosen.config.expert_cache and min(c.slots for c in sized.plan.experts) > 1
    assert sized.estimate == estimate(sized.plan, fast, Workload(), routing=trace)
    assert sized.chosen.step_seconds == sized.estimate.step_seconds
    assert sized.chosen.step_seconds < one.chosen.step_seconds < whole.chosen.step_seconds
    assert sized.chosen.device_bytes <= budget
    assert sized.estimate.expert_hit_rate is not None and one.estimate.expert_hit_rate is not None
    assert sized.estimate.expert_hit_rate > one.estimate.expert_hit_rate
    assert run(spec, NO_UVA, budget, 1, profile=fast, routing=trace).chosen == sized.chosen


def test_over_a_trace_streaming_whole_wins_where_its_copy_hides_behind_compute() -> None:
    """One MoE layer among dense ones, compute slow beside the link's rate for one
    layer's copy: the whole layer's copy overlaps the dense layers before it, while every
    routed expert of a cold cache is waited for at its call."""
    spec = moe_spec([(4096, None), (4096, None), (4096, None), (8, 16)])
    trace = zipf_trace(spec.experts, steps=4, top_k=8, tokens=4, s=0.0, seed=2)
    slow = attrs.evolve(TOY, bf16_flops_per_s=100.0)
    budget = spec.nbytes - spec.layers[3].params[1].nbytes  # layer 3 must leave the device
    best = run(spec, NO_UVA, budget, 1, profile=slow, routing=trace)
    assert best.chosen.config.expert_cache is False and best.plan.experts == ()
    # the same configuration with its caches, over the same trace
    cached = make_plan(spec, attrs.evolve(best.chosen.config, expert_cache=True, expert_slots=1),
                       planning_env(NO_UVA, slow))
    assert cached.experts
    assert best.chosen.step_seconds < estimate(cached, slow, Workload(), routing=trace).step_seconds


def test_a_trace_without_a_cached_module_is_refused() -> None:
    spec = moe_spec([(64, 16)] * 4)
    short = RoutingTrace(groups=spec.experts[:3], steps=(((0,),) * 3,))
    with pytest.raises(PlanError, match="no steps of 3:mlp.experts"):
        run(spec, NO_UVA, int(spec.nbytes * 0.7), 1, routing=short)


def test_slots_above_the_expert_count_are_refused_where_the_search_tries_streaming_whole_too() -> None:
    """With top-k bounds the search runs with the caches and without: a C above E is
    still refused, not answered by the search without caches."""
    spec = moe_spec([(64, 8)] * 4, top_k=2)
    with pytest.raises(PlanError, match="expert_slots") as caught:
        run(spec, NO_UVA, int(spec.nbytes * 0.7), expert_slots=9)
    assert caught.value.value == 9
