"""The expert cache's policy (`offload.pure.experts.policy`): over random plans and calls,
every routed expert is exactly one hit or one miss, a slot holds one expert, there are
never more than C residents, held experts are always hits and never evicted, a routed
expert is never evicted by its own call, a miss is dropped only when the rules say so, and
the residents are in the policy's eviction order; known sequences in tables; bad routed
experts and foreign states are refused."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings

from offload.errors import PlanError
from offload.pure.experts.policy import AGING_CALLS, Access, CacheState, admit, initial_state
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.values import CachePolicy, ExpertCachePlan
from tests.pure.experts.cases import cache_cases, group, plan


def check_access(cache: ExpertCachePlan, before: CacheState, routed: tuple[int, ...], access: Access,
                 device: dict[int, int]) -> None:
    """Every rule of one call; `device` (slot -> expert, as the executor's slots hold them)
    is updated by the executor's copies."""
    after = access.state
    resident = dict(before.residents)
    held = set(cache.held)
    # Every routed expert exactly once: a hit if resident, else a miss.
    assert [e for e, _ in access.hits] == [e for e in routed if e in resident]
    assert [e for e, _ in access.misses] == [e for e in routed if e not in resident]
    # A hit is served from the slot that holds it.
    for expert, slot in access.hits:
        assert resident[expert] == slot and device[slot] == expert
    # Evicted: residents, neither held nor routed, each once.
    assert len(set(access.evicted)) == len(access.evicted)
    for expert in access.evicted:
        assert expert in resident and expert not in held and expert not in routed
    # Kept misses take free slots or the slots of the evicted, each once.
    free = set(range(cache.slots)) - set(resident.values())
    taken = [slot for _, slot in access.misses if slot is not None]
    assert len(set(taken)) == len(taken)
    assert set(taken) <= free | {resident[e] for e in access.evicted}
    assert len(taken) == len(access.evicted) + len(set(taken) & free)
    evicted_slots = {resident[e] for e in access.evicted}
    assert evicted_slots <= set(taken)  # no eviction for nothing
    for expert, kept in access.misses:
        if kept is not None:
            device[kept] = expert
    # The state after: the old residents less the evicted, plus the kept misses.
    expected = {e: s for e, s in resident.items() if e not in access.evicted}
    expected.update((e, s) for e, s in access.misses if s is not None)
    assert dict(after.residents) == expected
    assert len(after.residents) <= cache.slots
    assert len({s for _, s in after.residents}) == len(after.residents)
    assert all(0 <= s < cache.slots for _, s in after.residents)
    assert all(device[s] == e for e, s in after.residents)
    assert held <= set(expected)
    # A miss is dropped only when no slot is free and no resident may be evicted, or (LFU)
    # it is colder than every resident still evictable.
    dropped = [e for e, s in access.misses if s is None]
    if dropped:
        assert not free - set(taken)
        left = [e for e, _ in before.residents
                if e not in held and e not in routed and e not in access.evicted]
        if cache.policy is CachePolicy.LRU:
            assert left == []
        elif after.calls % AGING_CALLS:
            assert all(after.counts[d] < after.counts[v] for d in dropped for v in left)
        else:  # halved since the decision: strictly colder may have become as cold
            assert all(after.counts[d] <= after.counts[v] for d in dropped for v in left)
    # History and order.
    assert after.calls == before.calls + 1
    for expert in routed:
        assert after.last[expert] == after.calls
    key: list[tuple[int, ...]]
    if cache.policy is CachePolicy.LRU:
        key = [(after.last[e], e) for e, _ in after.residents]
    else:
        key = [(after.counts[e], after.last[e], e) for e, _ in after.residents]
    assert key == sorted(key)


def run_checked(cache: ExpertCachePlan, calls: tuple[tuple[int, ...], ...]) -> CacheState:
    state = initial_state(cache)
    device = {slot: expert for expert, slot in state.residents}
    for routed in calls:
        access = admit(cache, state, routed)
        check_access(cache, state, routed, access, device)
        for expert in cache.held:
            assert expert in dict(access.state.residents)
            if expert in routed:
                assert expert in dict(access.hits)
        state = access.state
    return state


@settings(max_examples=250, deadline=None)
@given(cache_cases())
def test_every_call_keeps_the_rules(case: tuple[ExpertCachePlan, tuple[tuple[int, ...], ...]]) -> None:
    cache, calls = case
    run_checked(cache, calls)


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_the_rules_hold_over_a_long_zipf_trace_with_aging(policy: CachePolicy) -> None:
    cache = plan(16, 5, held=(3,), policy=policy)
    trace = zipf_trace((cache.group,), steps=3 * AGING_CALLS + 7, top_k=3, tokens=2, seed=4)
    state = run_checked(cache, tuple(step[0] for step in trace.steps))
    assert state.calls == 3 * AGING_CALLS + 7


@settings(max_examples=100, deadline=None)
@given(cache_cases())
def test_the_same_calls_give_the_same_accesses(case: tuple[ExpertCachePlan, tuple[tuple[int, ...], ...]]) -> None:
    cache, calls = case
    one, two = initial_state(cache), initial_state(cache)
    for routed in calls:
        a, b = admit(cache, one, routed), admit(cache, two, routed)
        assert a == b
        one, two = a.state, b.state


def test_initial_state_puts_the_held_experts_in_the_first_slots() -> None:
    state = initial_state(plan(8, 4, held=(2, 5, 7)))
    assert state.residents == ((2, 0), (5, 1), (7, 2))
    assert state.counts == (0,) * 8 and state.last == (0,) * 8 and state.calls == 0 and state.slots == 4


def _walk(cache: ExpertCachePlan, calls: list[tuple[int, ...]]) -> list[Access]:
    state = initial_state(cache)
    out = []
    for routed in calls:
        access = admit(cache, state, routed)
        out.append(access)
        state = access.state
    return out


def test_lru_known_sequence() -> None:
    steps = _walk(plan(6, 3), [(0, 1), (1, 2), (3,), (0, 4), (1, 2, 3, 4, 5)])
    assert [(a.hits, a.misses, a.evicted) for a in steps] == [
        ((), ((0, 0), (1, 1)), ()),
        (((1, 1),), ((2, 2),), ()),
        ((), ((3, 0),), (0,)),  # 0 is the least recently routed
        ((), ((0, 1), (4, 2)), (1, 2)),
        (((3, 0), (4, 2)), ((1, 1), (2, None), (5, None)), (0,)),  # 3 and 4 routed: not evictable
    ]
    assert steps[-1].state.residents == ((1, 1), (3, 0), (4, 2))


def test_lru_never_evicts_held_experts_and_drops_misses_when_all_are_held_or_routed() -> None:
    steps = _walk(plan(5, 2, held=(4,)), [(0,), (1,), (0, 1, 4)])
    assert steps[0].misses == ((0, 1),)
    assert steps[1].misses == ((1, 1),) and steps[1].evicted == (0,)
    assert steps[2].hits == ((1, 1), (4, 0)) and steps[2].misses == ((0, None),) and steps[2].evicted == ()


def test_lfu_keeps_the_hot_expert_and_refuses_a_colder_miss() -> None:
    # Expert 0 is routed three times; 1, 2 and 3 once each; C 2.
    steps = _walk(plan(4, 2, policy=CachePolicy.LFU), [(0,), (0, 1), (0,), (2,), (3,), (2,)])
    assert steps[1].misses == ((1, 1),)
    assert steps[3].misses == ((2, 1),) and steps[3].evicted == (1,)  # 2's count 1 >= 1's count 1: kept
    assert steps[4].misses == ((3, 1),) and steps[4].evicted == (2,)  # equal counts: the least recent goes
    assert steps[5].misses == ((2, 1),) and steps[5].evicted == (3,)  # 2 now counts 2 > 3's 1
    assert dict(steps[5].state.residents) == {0: 0, 2: 1}
    more = _walk(plan(4, 1, policy=CachePolicy.LFU), [(0,), (0,), (1,)])
    assert more[2].misses == ((1, None),) and more[2].evicted == ()  # 1 (count 1) is colder than 0 (count 2)


def test_lfu_gives_the_hottest_misses_the_slots() -> None:
    steps = _walk(plan(6, 2, policy=CachePolicy.LFU), [(4,), (4,), (5,), (1, 4, 5)])
    # At the last call the cache holds 4 and 5, both routed: 1 is dropped.
    assert steps[-1].misses == ((1, None),)
    steps = _walk(plan(6, 2, policy=CachePolicy.LFU), [(3,), (3,), (0, 1, 3)])
    assert steps[-1].hits == ((3, 0),)
    assert steps[-1].misses == ((0, 1), (1, None))  # equal counts: the lower expert first


def test_lfu_halves_its_counts_every_aging_calls() -> None:
    cache = plan(4, 2, policy=CachePolicy.LFU)
    state = initial_state(cache)
    for _ in range(AGING_CALLS - 1):
        state = admit(cache, state, (0, 1)).state
    assert state.counts == (AGING_CALLS - 1, AGING_CALLS - 1, 0, 0)
    state = admit(cache, state, (0,)).state
    assert state.counts == (AGING_CALLS // 2, (AGING_CALLS - 1) // 2, 0, 0)


@pytest.mark.parametrize(
    ("routed", "name", "words"),
    [
        ((8,), "routed[0]", "routed[0] is 8, not an expert index in 0..7 (E = 8)"),
        ((1, 9), "routed[1]", "routed[1] is 9, not an expert index in 0..7 (E = 8)"),
        ((-1, 2), "routed[0]", "routed[0] is -1"),
        ((3, 2), "routed[1]", "routed[1] is 2 after 3: routed experts must be sorted and distinct (E = 8)"),
        ((2, 2), "routed[1]", "sorted and distinct"),
        ((True,), "routed[0]", "routed[0] is True"),
        ((1.0,), "routed[0]", "routed[0] is 1.0"),
        ([1, 2], "routed", "must be a tuple"),
    ],
)
def test_bad_routed_experts_are_refused(routed: object, name: str, words: str) -> None:
    cache = plan(8, 2, layer=3)
    with pytest.raises(PlanError, match="expert cache of 3:mlp.experts") as info:
        admit(cache, initial_state(cache), routed)  # type: ignore[arg-type]
    assert info.value.name == name and words in str(info.value)


def test_a_state_of_another_cache_is_refused() -> None:
    with pytest.raises(PlanError, match="8 experts in 2 slots, not 8 in 3") as info:
        admit(plan(8, 3), initial_state(plan(8, 2)), (1,))
    assert info.value.name == "state"
    with pytest.raises(PlanError, match="6 experts in 2 slots, not 8 in 2"):
        admit(plan(8, 2), initial_state(plan(6, 2)), (1,))
    with pytest.raises(PlanError, match="lacks some of the held experts"):
        admit(plan(8, 2, held=(1,)), initial_state(plan(8, 2)), (1,))
    with pytest.raises(PlanError, match="must be a CacheState"):
        admit(plan(8, 2), "state", (1,))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"residents": ((1, 0), (1, 1))}, "an expert or a slot twice"),
        ({"residents": ((1, 0), (2, 0))}, "an expert or a slot twice"),
        ({"residents": ((1, 2),)}, "do not fit 2 slots"),
        ({"residents": ((4, 0),)}, "do not fit 2 slots of experts 0..3"),
        ({"residents": ((0, 0), (1, 1), (2, 2))}, "do not fit"),
        ({"residents": [(0, 0)]}, "pairs of integers"),
        ({"residents": ((0, -1),)}, "pairs of integers"),
        ({"counts": (0, 0, 0)}, "one entry per expert"),
        ({"counts": (0, -1, 0, 0)}, "integers >= 0"),
        ({"last": (0, 5, 0, 0)}, "after the 0 admitted"),
        ({"slots": 0}, "slots must be an integer >= 1"),
    ],
)
def test_a_cache_state_that_breaks_a_rule_is_refused(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        attrs.evolve(initial_state(plan(4, 2)), **changes)


def test_held_experts_are_hits_from_the_first_call() -> None:
    cache = ExpertCachePlan(group=group(8), slots=3, held=(0, 6))
    access = admit(cache, initial_state(cache), (0, 5, 6))
    assert access.hits == ((0, 0), (6, 1)) and access.misses == ((5, 2),)


def test_the_default_policy_is_lfu() -> None:
    assert ExpertCachePlan(group=group(8), slots=2).policy is CachePolicy.LFU
