"""The caches' size (`offload.pure.experts.size`): the C a budget gives fits it and C + 1
does not (or C is the smallest E); a budget short of one slot each is refused naming what
one slot each takes; the default C and the check of a user's C in tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure.experts.size import cache_slots, check_slots, default_slots
from offload.pure.spec.experts import ExpertGroup
from tests.pure.experts.cases import group

groups_strategy = st.lists(
    st.builds(lambda layer, e, b: group(e, layer=layer, expert_bytes=b), st.integers(0, 60), st.integers(2, 300),
              st.integers(1, 1 << 30)),
    min_size=1, max_size=6).map(tuple)


@settings(max_examples=200, deadline=None)
@given(groups_strategy, st.integers(0, 1 << 42))
def test_the_budgets_c_fits_and_one_more_does_not(groups: tuple[ExpertGroup, ...], spare: int) -> None:
    per_slot = sum(g.expert_bytes for g in groups)
    if per_slot > spare:
        with pytest.raises(PlanError, match=f"at least {per_slot} bytes"):
            cache_slots(groups, spare)
        return
    c = cache_slots(groups, spare)
    assert 1 <= c <= min(g.num_experts for g in groups)
    assert sum(min(c, g.num_experts) * g.expert_bytes for g in groups) <= spare
    assert c == min(g.num_experts for g in groups) or (c + 1) * per_slot > spare
    check_slots(groups, c)


@pytest.mark.parametrize(
    ("experts", "expert_bytes", "spare", "slots"),
    [
        ((8,), (100,), 100, 1),
        ((8,), (100,), 799, 7),
        ((8,), (100,), 800, 8),
        ((8,), (100,), 10**9, 8),
        ((64, 64), (3 << 20, 3 << 20), 96 << 20, 16),
        ((16, 64), (10, 10), 10**6, 16),  # no more than the smallest E
    ],
)
def test_known_budgets(experts: tuple[int, ...], expert_bytes: tuple[int, ...], spare: int, slots: int) -> None:
    groups = tuple(group(e, layer=i, expert_bytes=b) for i, (e, b) in enumerate(zip(experts, expert_bytes,
                                                                                     strict=True)))
    assert cache_slots(groups, spare) == slots


def test_a_budget_short_of_one_slot_each_names_the_minimum_and_the_spare() -> None:
    groups = (group(8, layer=0, expert_bytes=3 << 20), group(8, layer=1, expert_bytes=3 << 20))
    with pytest.raises(PlanError) as info:
        cache_slots(groups, 5 << 20)
    message = str(info.value)
    assert f"at least {6 << 20} bytes (6.0 MiB" in message and f"but {5 << 20} bytes (5.0 MiB)" in message
    assert "2 experts modules" in message
    assert info.value.name == "spare_device_bytes" and info.value.value == 5 << 20


@pytest.mark.parametrize("spare", [-1, 1.5, True, None])
def test_a_bad_budget_is_refused(spare: object) -> None:
    with pytest.raises(PlanError, match="spare_device_bytes"):
        cache_slots((group(8),), spare)  # type: ignore[arg-type]


@pytest.mark.parametrize("groups", [(), [group(8)], (group(8), "x")])
def test_bad_groups_are_refused(groups: object) -> None:
    with pytest.raises(PlanError, match="non-empty tuple of ExpertGroups"):
        cache_slots(groups, 10)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="non-empty tuple of ExpertGroups"):
        check_slots(groups, 1)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="must be an ExpertGroup"):
        default_slots(groups)  # type: ignore[arg-type]


@pytest.mark.parametrize(("experts", "slots"), [(2, 1), (8, 1), (15, 1), (16, 2), (64, 8), (128, 16), (256, 32)])
def test_default_slots(experts: int, slots: int) -> None:
    assert default_slots(group(experts)) == slots
    check_slots((group(experts),), default_slots(group(experts)))


@pytest.mark.parametrize(
    ("slots", "words"),
    [
        (0, "must be at least 1, got 0: a cache of no slot holds no expert"),
        (-3, "must be at least 1, got -3"),
        (65, "expert_slots (C) 65 is more than the 64 experts of layer 2 (mlp.experts): C must be 1 to 64"),
        (1.0, "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_a_bad_user_c_is_refused(slots: object, words: str) -> None:
    groups = (group(128, layer=0), group(128, layer=1), group(64, layer=2))
    with pytest.raises(PlanError) as info:
        check_slots(groups, slots)  # type: ignore[arg-type]
    assert words in str(info.value) and info.value.name == "slots" and info.value.value is slots


def test_a_good_user_c_passes() -> None:
    for c in (1, 32, 64):
        check_slots((group(64), group(128, layer=1)), c)
