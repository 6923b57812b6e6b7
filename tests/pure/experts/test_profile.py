"""Routing profiles (`offload.pure.experts.profile`): a profile round-trips through JSON;
one of another model is refused naming the module at fault; the held experts are the
hottest, at most C, never an unrouted one; a trace's profile counts its calls; a trace
round-trips through JSON, and a bad one is refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure.experts.profile import (
    PROFILE_FORMAT,
    TRACE_FORMAT,
    check_profile,
    held_from_profile,
    profile_from_json,
    profile_to_json,
    trace_from_json,
    trace_profile,
    trace_to_json,
)
from offload.pure.experts.replay import zipf_trace
from offload.pure.experts.values import RoutingProfile
from offload.pure.spec.experts import ExpertGroup
from tests.pure.experts.cases import group, plan, trace_of


@st.composite
def profiles(draw: st.DrawFn) -> tuple[RoutingProfile, tuple[ExpertGroup, ...]]:
    """A profile and the groups of its model."""
    layers = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5, unique=True))
    groups = tuple(group(draw(st.integers(2, 12)), layer=layer) for layer in layers)
    counts = tuple((g.layer, g.module, tuple(draw(st.lists(st.integers(0, 10**6), min_size=g.num_experts,
                                                            max_size=g.num_experts))))
                   for g in groups)
    return RoutingProfile(counts=counts), groups


@settings(max_examples=100, deadline=None)
@given(profiles())
def test_a_profile_round_trips_through_json_and_fits_its_model(case: tuple[RoutingProfile, tuple[ExpertGroup, ...]]
                                                               ) -> None:
    profile, groups = case
    text = profile_to_json(profile)
    assert json.loads(text)["format"] == PROFILE_FORMAT
    assert profile_from_json(text) == profile
    assert profile_from_json(profile_to_json(profile, indent=2).encode()) == profile
    check_profile(profile, groups)


@settings(max_examples=100, deadline=None)
@given(profiles(), st.integers(0, 14))
def test_held_experts_are_the_hottest_routed_ones(case: tuple[RoutingProfile, tuple[ExpertGroup, ...]],
                                                  slots: int) -> None:
    profile, groups = case
    for g, (_, _, counts) in zip(groups, profile.counts, strict=True):
        held = held_from_profile(profile, g, slots)
        assert list(held) == sorted(set(held)) and len(held) <= slots
        assert all(counts[e] > 0 for e in held)
        assert len(held) == min(slots, sum(1 for c in counts if c > 0))
        others = [e for e in range(g.num_experts) if e not in held]
        for e in held:  # no expert left out is hotter, or as hot at a lower index
            assert all((counts[o], -o) < (counts[e], -e) for o in others)


def test_known_held_experts() -> None:
    g = group(6, layer=2)
    profile = RoutingProfile(counts=((2, "mlp.experts", (5, 0, 9, 5, 1, 9)),))
    assert held_from_profile(profile, g, 1) == (2,)
    assert held_from_profile(profile, g, 2) == (2, 5)
    assert held_from_profile(profile, g, 3) == (0, 2, 5)  # 0 and 3 tie at 5: the lower index
    assert held_from_profile(profile, g, 6) == (0, 2, 3, 4, 5)  # never expert 1, routed 0 times
    assert held_from_profile(profile, g, 0) == ()
    with pytest.raises(PlanError, match="no experts module 3:mlp.experts"):
        held_from_profile(profile, group(6, layer=3), 2)
    with pytest.raises(PlanError, match="counts 6 experts for 2:mlp.experts, which has 8"):
        held_from_profile(profile, group(8, layer=2), 2)
    with pytest.raises(PlanError, match="slots must be an integer >= 0"):
        held_from_profile(profile, g, -1)


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        (((0, "mlp.experts", (1, 2, 3, 4)),), "has no experts module 1:mlp.experts"),
        (((0, "mlp.experts", (1, 2, 3, 4)), (1, "mlp.experts", (0,) * 8), (2, "mlp.experts", (0, 0))),
         "names experts module 2:mlp.experts, which this model does not have"),
        (((0, "mlp.experts", (1, 2, 3, 4)), (1, "moe.experts", (0,) * 8)), "has no experts module 1:mlp.experts"),
        (((0, "mlp.experts", (1, 2, 3)), (1, "mlp.experts", (0,) * 8)),
         "counts 3 experts for 0:mlp.experts, which has 4"),
    ],
)
def test_a_profile_of_another_model_is_refused(counts: tuple[tuple[int, str, tuple[int, ...]], ...],
                                               words: str) -> None:
    groups = (group(4, layer=0), group(8, layer=1))
    with pytest.raises(PlanError, match="not of this model") as info:
        check_profile(RoutingProfile(counts=counts), groups)
    assert words in str(info.value) and info.value.name == "profile"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[]", "not an offload-routing-profile/1 document"),
        ('{"format": "offload-plan/1", "profile": {}}', "not an offload-routing-profile/1 document"),
        ('{"format": "offload-routing-profile/1"}', "expected an object for RoutingProfile"),
        ('{"format": "offload-routing-profile/1", "profile": {"counts": [[0, "m", [1, -2]]]}}',
         "counts per expert >= 0"),
        ('{"format": "offload-routing-profile/1", "profile": {"counts": [[0, "m", [1]], [0, "m", [2]]]}}',
         "names a module twice"),
        ('{"format": "offload-routing-profile/1", "profile": {"counts": [], "extra": 1}}', "only the fields"),
        ("{", "does not parse"),
    ],
)
def test_a_bad_profile_document_is_refused(text: str, words: str) -> None:
    with pytest.raises(PlanError, match=words):
        profile_from_json(text)


def test_a_traces_profile_counts_the_calls_that_routed_each_expert() -> None:
    plans = (plan(4, 2, layer=0), plan(3, 1, layer=5))
    trace = trace_of(plans, (((0, 1), (2,)), ((1,), ()), ((1, 3), (0, 2))))
    assert trace_profile(trace) == RoutingProfile(counts=((0, "mlp.experts", (1, 3, 0, 1)),
                                                          (5, "mlp.experts", (1, 0, 2))))
    check_profile(trace_profile(trace), tuple(p.group for p in plans))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=4), st.integers(0, 6), st.integers(1, 3),
       st.integers(0, 2**31))
def test_a_trace_round_trips_through_json(experts: list[int], steps: int, tokens: int, seed: int) -> None:
    groups = tuple(group(e, layer=layer) for layer, e in enumerate(experts))
    trace = zipf_trace(groups, steps=steps, top_k=min(2, min(experts)), tokens=tokens, seed=seed)
    text = trace_to_json(trace)
    assert json.loads(text)["format"] == TRACE_FORMAT
    assert trace_from_json(text) == trace
    assert trace_from_json(trace_to_json(trace, indent=2).encode()) == trace


@pytest.mark.parametrize(
    ("replace", "words"),
    [
        ((TRACE_FORMAT, PROFILE_FORMAT), "not an offload-routing-trace/1 document"),
        (('"steps": [[[0, 1]]]', '"steps": [[[1, 0]]]'), "sorted tuple of distinct expert indices"),
        (('"steps": [[[0, 1]]]', '"steps": [[[0, 4]]]'), r"not all in 0\.\.3"),
        (('"steps": [[[0, 1]]]', '"steps": [[[0], [1]]]'), "routed experts of 1 groups"),
    ],
)
def test_a_bad_trace_document_is_refused(replace: tuple[str, str], words: str) -> None:
    text = trace_to_json(trace_of((plan(4, 2, layer=0),), (((0, 1),),)))
    assert replace[0] in text
    with pytest.raises(PlanError, match=words):
        trace_from_json(text.replace(*replace))
