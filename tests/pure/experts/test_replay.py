"""Replaying traces (`offload.pure.experts.replay`): the replay's counts and bytes are the
policy's calls exactly; Belady's optimum equals an exhaustive search on tiny traces and is
never below any policy; Zipf traces are deterministic and valid; the default policy is
within a point of the best any online policy can expect on Zipf traces, which is itself
more than 5 points below Belady's optimum."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure.experts.policy import admit, initial_state
from offload.pure.experts.replay import BELADY, Replay, belady, replay, zipf_trace
from offload.pure.experts.values import CachePolicy, ExpertCachePlan, RoutingTrace
from offload.pure.spec.experts import ExpertGroup, Routing
from tests.pure.experts.cases import cache_cases, group, plan, trace_of

Calls = tuple[tuple[int, ...], ...]


def exhaustive_hits(cache: ExpertCachePlan, calls: Calls) -> int:
    """The most hits of any cache that, after each call, keeps any C - h of the experts it
    held or the call routed (besides the h held ones): a search over every such choice."""
    held = frozenset(cache.held)
    room = cache.slots - len(held)

    @functools.cache
    def best(t: int, cached: frozenset[int]) -> int:
        if t == len(calls):
            return 0
        routed = frozenset(calls[t])
        hits = len(routed & (cached | held))
        pool = sorted(cached | (routed - held))
        options = (frozenset(c) for n in range(min(room, len(pool)) + 1) for c in itertools.combinations(pool, n))
        return hits + max(best(t + 1, option) for option in options)

    return best(0, frozenset())


@st.composite
def two_group_cases(draw: st.DrawFn) -> tuple[tuple[ExpertCachePlan, ...], RoutingTrace]:
    """Two caches of different layers (and E, C, policy), and a trace of both."""
    first, calls = draw(cache_cases(max_experts=6, max_calls=10))
    e = draw(st.integers(2, 6))
    second = plan(e, draw(st.integers(1, e)), policy=draw(st.sampled_from(CachePolicy)), layer=first.layer + 1,
                  expert_bytes=draw(st.integers(1, 4096)))
    call = st.sets(st.integers(0, e - 1)).map(lambda chosen: tuple(sorted(chosen)))
    other = tuple(draw(st.lists(call, min_size=len(calls), max_size=len(calls))))
    plans = (first, second)
    return plans, trace_of(plans, tuple(zip(calls, other, strict=True)))


@settings(max_examples=150, deadline=None)
@given(two_group_cases())
def test_replay_counts_and_bytes_are_the_policys_exactly(case: tuple[tuple[ExpertCachePlan, ...], RoutingTrace]
                                                        ) -> None:
    plans, trace = case
    result = replay(plans[::-1], trace)  # matched by module, not by position
    states = [initial_state(p) for p in plans]
    step_bytes = []
    totals = [[0, 0, 0], [0, 0, 0]]
    for step in trace.steps:
        nbytes = 0
        for g, cache in enumerate(plans):
            access = admit(cache, states[g], step[g])
            states[g] = access.state
            totals[g][0] += len(access.hits)
            totals[g][1] += len(access.misses)
            totals[g][2] += len(access.evicted)
            nbytes += len(access.misses) * cache.group.expert_bytes
        step_bytes.append(nbytes)
    assert result.step_bytes == tuple(step_bytes)
    assert [(g.hits, g.misses, g.evictions) for g in result.groups] == [tuple(t) for t in totals]
    assert [(g.layer, g.policy) for g in result.groups] == [(p.layer, p.policy.value) for p in plans]
    for g, group_replay in enumerate(result.groups):
        assert group_replay.routed == sum(len(step[g]) for step in trace.steps)
        assert group_replay.hits + group_replay.misses == group_replay.routed
        assert group_replay.miss_bytes == group_replay.misses * plans[g].group.expert_bytes
    assert result.total_bytes == sum(g.miss_bytes for g in result.groups)
    assert 0.0 <= result.hit_rate <= 1.0


@settings(max_examples=200, deadline=None)
@given(cache_cases(max_experts=5, max_calls=6))
def test_belady_equals_the_exhaustive_search(case: tuple[ExpertCachePlan, Calls]) -> None:
    cache, calls = case
    result = belady((cache,), trace_of((cache,), tuple((c,) for c in calls)))
    assert result.hits == exhaustive_hits(cache, calls)
    assert result.groups[0].policy == BELADY


@settings(max_examples=150, deadline=None)
@given(cache_cases(max_experts=8, max_calls=30))
def test_no_policy_beats_belady(case: tuple[ExpertCachePlan, Calls]) -> None:
    cache, calls = case
    trace = trace_of((cache,), tuple((c,) for c in calls))
    best = belady((cache,), trace)
    for policy in CachePolicy:
        ran = replay((ExpertCachePlan(group=cache.group, slots=cache.slots, held=cache.held, policy=policy),), trace)
        assert ran.hits <= best.hits
        assert ran.routed == best.routed
        assert best.total_bytes <= ran.total_bytes


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 3), st.integers(1, 3), st.floats(0.0, 2.0))
def test_zipf_traces_are_deterministic_and_valid(seed: int, top_k: int, tokens: int, s: float) -> None:
    groups = (group(4, layer=0), group(9, layer=2))
    trace = zipf_trace(groups, steps=20, top_k=top_k, tokens=tokens, s=s, seed=seed)
    assert trace == zipf_trace(groups, steps=20, top_k=top_k, tokens=tokens, s=s, seed=seed)
    assert trace.groups == groups and len(trace.steps) == 20
    for step in trace.steps:
        for routed in step:
            assert top_k <= len(routed) <= top_k * tokens


def test_zipf_traces_follow_their_popularity() -> None:
    trace = zipf_trace((group(16),), steps=3000, top_k=1, s=1.0, seed=3)
    counts = Counter(step[0][0] for step in trace.steps)
    ranked = [n for _, n in counts.most_common()]
    # Zipf s = 1 over 16: the hottest expert draws 1 / H(16) = 29.6% of the calls, the
    # second half of that; and other seeds put another expert on top.
    assert 0.26 < ranked[0] / 3000 < 0.33 and 0.4 < ranked[1] / ranked[0] < 0.6
    assert zipf_trace((group(16),), steps=50, top_k=1, seed=4) != zipf_trace((group(16),), steps=50, top_k=1, seed=3)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"steps": -1}, "steps"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 5}, "top_k"),
        ({"tokens": 0}, "tokens"),
        ({"s": -0.5}, "s"),
        ({"s": float("nan")}, "s"),
        ({"s": True}, "s"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_zipf_arguments_are_refused(kwargs: dict[str, object], name: str) -> None:
    arguments: dict[str, object] = {"steps": 3, "top_k": 2, **kwargs}
    with pytest.raises(PlanError) as info:
        zipf_trace((group(4),), **arguments)  # type: ignore[arg-type]
    assert info.value.name == name


def test_a_trace_group_without_a_plan_or_of_another_e_is_refused() -> None:
    trace = trace_of((plan(4, 2, layer=1),), (((0, 1),),))
    with pytest.raises(PlanError, match="1:mlp.experts has no expert cache plan"):
        replay((plan(4, 2, layer=0),), trace)
    with pytest.raises(PlanError, match="1:mlp.experts has 4 experts, its plan 6") as info:
        belady((plan(6, 2, layer=1),), trace)
    assert info.value.name == "num_experts"
    with pytest.raises(PlanError, match="two expert cache plans for 1:mlp.experts"):
        replay((plan(4, 2, layer=1), plan(4, 1, layer=1)), trace)
    # A plan the trace does not name is not used.
    assert replay((plan(4, 2, layer=1), plan(8, 2, layer=5)), trace).routed == 2


def test_known_replay_and_belady() -> None:
    cache = plan(4, 1, expert_bytes=10)
    trace = trace_of((cache,), tuple((c,) for c in [(0,), (1,), (0,), (1,), (0,)]))
    lru = replay((cache,), trace)
    assert (lru.hits, lru.misses, lru.step_bytes) == (0, 5, (10, 10, 10, 10, 10))
    best = belady((cache,), trace)
    assert (best.hits, best.misses, best.step_bytes) == (2, 3, (10, 10, 0, 10, 0))  # keep 0, bypass 1
    assert best.groups[0].evictions == 0
    assert best.hit_rate == pytest.approx(0.4)


def test_nothing_routed_is_a_hit_rate_of_one() -> None:
    cache = plan(4, 2)
    result = replay((cache,), trace_of((cache,), (((),),) * 3))
    assert (result.hit_rate, result.groups[0].hit_rate, result.total_bytes, result.mean_step_bytes) == (1.0, 1.0, 0,
                                                                                                          0.0)
    empty = replay((cache,), trace_of((cache,), ()))
    assert (empty.step_bytes, empty.mean_step_bytes, empty.hit_rate) == ((), 0.0, 1.0)
    assert isinstance(empty, Replay)


def static_hits(trace: RoutingTrace, slots: int) -> int:
    """The hits of keeping, all along, the `slots` experts routed most often over the
    whole trace: on a trace of independent calls, what no online policy beats in
    expectation (its expected hits at a call are those of what it holds, which are at
    most the C most likely experts')."""
    hits = 0
    for g in range(len(trace.groups)):
        counts = Counter(e for step in trace.steps for e in step[g])
        hits += sum(n for _, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:slots])
    return hits


@pytest.mark.parametrize(("experts", "tokens", "slots"), [(64, 1, 16), (128, 1, 16), (64, 4, 32)])
def test_the_default_policy_is_within_a_point_of_the_online_bound_on_zipf(experts: int, tokens: int,
                                                                           slots: int) -> None:
    groups = tuple(group(experts, layer=layer) for layer in range(2))
    trace = zipf_trace(groups, steps=1000, top_k=8, tokens=tokens, s=1.0, seed=experts + tokens)
    plans = tuple(ExpertCachePlan(group=g, slots=slots) for g in groups)
    routed = replay(plans, trace).routed
    default = replay(plans, trace).hits / routed
    lru = replay(tuple(ExpertCachePlan(group=g, slots=slots, policy=CachePolicy.LRU) for g in groups),
                 trace).hits / routed
    bound = static_hits(trace, slots) / routed
    optimum = belady(plans, trace).hits / routed
    assert bound - default < 0.015
    assert default - lru > 0.08
    # Belady's optimum knows the future: on these traces it is more than 5 points above
    # what any online policy can expect, so "within 5 points of Belady" is out of reach.
    assert optimum - bound > 0.05


def _calls_group(num_experts: int, expert_bytes: int = 1000) -> ExpertGroup:
    """A ModuleList of experts (`Routing.CALLS`): one weight per expert."""
    return ExpertGroup(layer=0, module="moe.experts", num_experts=num_experts,
                       params=tuple(f"moe.experts.{j}.weight" for j in range(num_experts)),
                       expert_bytes=expert_bytes, routing=Routing.CALLS)


@settings(max_examples=100, deadline=None)
@given(cache_cases(max_experts=6, max_calls=8))
def test_a_list_of_experts_is_replayed_one_call_per_routed_expert(case: tuple[ExpertCachePlan, Calls]) -> None:
    """A step of a `Routing.CALLS` module is one call per routed expert, in index order:
    its replay and Belady are those of the fused module on the trace of single calls,
    summed back per step."""
    fused, calls = case
    listed = attrs.evolve(fused, group=_calls_group(fused.group.num_experts, fused.group.expert_bytes))
    steps = tuple((c,) for c in calls)
    singles = tuple(((e,),) for c in calls for e in c)
    owner = [t for t, c in enumerate(calls) for _ in c]
    for run in (replay, belady):
        got = run((listed,), RoutingTrace(groups=(listed.group,), steps=steps))
        want = run((fused,), trace_of((fused,), singles))
        assert (got.hits, got.misses) == (want.hits, want.misses)
        assert got.groups[0].evictions == want.groups[0].evictions
        per_step = [0] * len(calls)
        for t, nbytes in zip(owner, want.step_bytes, strict=True):
            per_step[t] += nbytes
        assert got.step_bytes == tuple(per_step)
