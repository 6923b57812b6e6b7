"""`schedule_prefetch` and `check_schedule`, and an independent simulation of both.

The simulation below is written from the schedule's rules as stated here, not from the checker: positions
``0..n-1`` run again and again; the ``initial`` positions are copied once at start;
after position ``i`` runs, the copy of ``next_after[i]`` is issued into that position's
slot, unless ``next_after[i]`` is the only position that uses its slot: such a position
is loaded once, by the initial copies, and keeps its slot, so no later copy of it is
issued. It then demands that every run finds its own data in its slot (copied at some
time, possibly in an earlier pass, and not overwritten since), that no position is
copied twice before it runs, and that no copy lands in a slot whose current data belongs
to a position that has been copied and not yet run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import PrefetchSchedule, check_schedule, schedule_prefetch


class Hazard(Exception):
    """The simulation found a stale read, a live overwrite or a double copy."""


def simulate(schedule: PrefetchSchedule) -> tuple[int, int]:
    """Run passes until the state at a pass boundary repeats.

    Returns:
        (passes run, copies issued in the last pass: the copies of every steady-state pass).

    Raises:
        Hazard: naming what went wrong.
    """
    n = len(schedule.slots)
    data: dict[int, int] = {}  # slot -> position whose weights it holds
    copies_since_run = [0] * n  # copies of each position since it last ran
    alone = {i for i in range(n) if schedule.slots.count(schedule.slots[i]) == 1}

    def copy(target: int) -> None:
        slot = schedule.slots[target]
        owner = data.get(slot)
        if owner is not None and owner != target and copies_since_run[owner]:
            raise Hazard(f"copy of {target} overwrites slot {slot} holding {owner}, which has not run")
        copies_since_run[target] += 1
        if copies_since_run[target] > 1:
            raise Hazard(f"position {target} copied twice before it runs")
        data[slot] = target

    for target in schedule.initial:
        copy(target)
    seen: set[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = set()
    passes = copies = 0
    while True:
        state = (tuple(sorted(data.items())), tuple(copies_since_run))
        if state in seen:
            return passes, copies
        seen.add(state)
        copies = 0
        for position in range(n):
            slot = schedule.slots[position]
            if data.get(slot) != position:
                raise Hazard(f"pass {passes}: position {position} reads slot {slot}, which holds "
                             f"{data.get(slot)}'s data")
            copies_since_run[position] = 0
            after = schedule.next_after[position]
            if after is not None and after not in alone:
                copy(after)
                copies += 1
        passes += 1


def lone_owners(n: int, step: int) -> set[int]:
    """The positions with a slot of their own, from the slot rule ``i mod s`` alone: slot
    ``k`` is used by ``k, k + s, k + 2s, ...``, so position ``i`` is alone in its slot when
    it is a chain's first owner (``i < s``) and the chain has no second one (``i + s >= n``)."""
    s = min(step, n)
    return {i for i in range(n) if i < s and i + s >= n}


def naive(n: int, step: int) -> PrefetchSchedule:
    """The rule FACTS.md warns about: slot = i mod s, next = (i + s) mod n."""
    s = min(step, n)
    return PrefetchSchedule(
        num_slots=s,
        initial=tuple(range(s)),
        slots=tuple(i % s for i in range(n)),
        next_after=tuple((i + s) % n for i in range(n)),
    )


# ---------------------------------------------------------------------------- schedule_prefetch


@pytest.mark.parametrize("step", range(1, 17))
def test_every_count_and_step_passes_the_checker_and_the_simulation(step: int) -> None:
    for n in range(0, 65):
        schedule = schedule_prefetch(n, step)
        check_schedule(schedule)
        passes, copies = simulate(schedule)
        assert passes >= 1
        assert len(schedule.slots) == n
        assert len(schedule.next_after) == n
        assert schedule.num_slots == min(step, n)
        assert all(0 <= slot < step for slot in schedule.slots)
        assert all(0 <= slot < schedule.num_slots for slot in schedule.slots)
        # Every slot is used, so none is allocated for nothing.
        assert set(schedule.slots) == set(range(schedule.num_slots))
        # The first min(step, n) positions are copied once at start.
        assert schedule.initial == tuple(range(min(step, n)))
        kept = lone_owners(n, step)
        assert schedule.kept_positions == kept
        # A lone owner is loaded once (initial) and never copied again; every other
        # position is the copy target after exactly one position's forward.
        assert all(schedule.next_after[i] is None for i in kept)
        targets = [t for t in schedule.next_after if t is not None]
        assert sorted(targets) == sorted(set(range(n)) - kept)
        # So a steady-state pass copies exactly the positions that share a slot, and
        # executors issue every copy the schedule names.
        assert copies == n - len(kept)
        assert schedule.issued_after == schedule.next_after


def test_zero_positions_is_an_empty_schedule() -> None:
    schedule = schedule_prefetch(0, 3)
    assert schedule.slots == ()
    assert schedule.next_after == ()
    assert schedule.initial == ()
    assert schedule.num_slots == 0
    assert schedule.kept_positions == frozenset()
    check_schedule(schedule)
    assert simulate(schedule) == (1, 0)


@pytest.mark.parametrize(
    ("n", "step", "slots"),
    [
        (1, 1, (0,)),
        (1, 4, (0,)),
        (3, 1, (0, 0, 0)),
        (3, 2, (0, 1, 0)),
        (4, 2, (0, 1, 0, 1)),
        (5, 3, (0, 1, 2, 0, 1)),
        (2, 5, (0, 1)),
    ],
)
def test_slots_cycle_through_min_step_n(n: int, step: int, slots: tuple[int, ...]) -> None:
    assert schedule_prefetch(n, step).slots == slots


@pytest.mark.parametrize(("n", "step"), [(4, 2), (6, 3), (8, 1), (9, 3), (2, 1)])
def test_when_the_count_is_a_multiple_of_the_step_copies_run_step_ahead(n: int, step: int) -> None:
    # Then nothing wraps unevenly and every slot has at least two owners: after position
    # i, position i + step (mod n) is copied.
    assert schedule_prefetch(n, step).next_after == tuple((i + step) % n for i in range(n))
    assert schedule_prefetch(n, step).kept_positions == frozenset()


@pytest.mark.parametrize(
    ("n", "step", "next_after", "kept"),
    [
        # 3 positions, 2 slots: slot 0 holds 0 and 2, slot 1 only 1. After 0 its slot goes
        # to 2; after 2 back to 0 for the next pass; 1 is alone in slot 1 and stays there.
        (3, 2, (2, None, 0), {1}),
        # 5 positions, 3 slots: chains (0, 3), (1, 4), (2): 2 is alone.
        (5, 3, (3, 4, None, 0, 1), {2}),
        # 5 positions, 4 slots: chains (0, 4), (1), (2), (3).
        (5, 4, (4, None, None, None, 0), {1, 2, 3}),
        # 7 positions, 3 slots: chains (0, 3, 6), (1, 4), (2, 5): nobody is alone.
        (7, 3, (3, 4, 5, 6, 1, 2, 0), set()),
        # One position, one slot: it is alone.
        (1, 1, (None,), {0}),
    ],
)
def test_a_lone_owner_is_loaded_once(n: int, step: int, next_after: tuple[int | None, ...], kept: set[int]) -> None:
    schedule = schedule_prefetch(n, step)
    assert schedule.next_after == next_after
    assert schedule.kept_positions == kept
    check_schedule(schedule)
    assert simulate(schedule)[1] == n - len(kept)


@pytest.mark.parametrize(("n", "step"), [(n, s) for s in range(1, 9) for n in range(1, s + 1)])
def test_a_step_that_covers_every_position_copies_nothing_after_the_start(n: int, step: int) -> None:
    # n <= step: n slots, one position each; all are copied at start and kept.
    schedule = schedule_prefetch(n, step)
    assert schedule.next_after == (None,) * n
    assert schedule.kept_positions == frozenset(range(n))
    assert schedule.initial == tuple(range(n))
    assert simulate(schedule)[1] == 0


def test_the_lone_owners_of_an_old_schedule_are_kept_too() -> None:
    # Plans written before a lone owner was loaded once say next_after[i] = i for it: the
    # copy is redundant but safe (its slot holds nobody else), and the position is kept.
    old = PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 0), next_after=(2, 1, 0))
    assert old.kept_positions == {1}
    assert old.issued_after == (2, None, 0) == schedule_prefetch(3, 2).next_after
    check_schedule(old)
    assert simulate(old)[1] == 2  # the copy of 1 is not issued
    covering = PrefetchSchedule(num_slots=3, initial=(0, 1, 2), slots=(0, 1, 2), next_after=(0, 1, 2))
    assert covering.kept_positions == {0, 1, 2}
    assert covering.issued_after == (None, None, None)
    check_schedule(covering)
    assert simulate(covering)[1] == 0


def test_kept_positions_come_from_the_slots_alone() -> None:
    schedule = PrefetchSchedule(num_slots=4, initial=(0, 1, 3, 4), slots=(0, 1, 0, 3, 2, 2),
                                next_after=(2, None, 0, None, 5, 4))
    assert schedule.kept_positions == {1, 3}
    assert isinstance(schedule.kept_positions, frozenset)
    assert schedule.issued_after == schedule.next_after  # no copy names 1 or 3
    check_schedule(schedule)


@pytest.mark.parametrize("bad", [(-1, 1), (3, 0), (3, -2)])
def test_schedule_prefetch_rejects_bad_arguments(bad: tuple[int, int]) -> None:
    with pytest.raises(PlanError):
        schedule_prefetch(*bad)


@settings(max_examples=50)
@given(st.integers(0, 200), st.integers(1, 40))
def test_schedules_are_deterministic_and_safe_beyond_the_table(n: int, step: int) -> None:
    schedule = schedule_prefetch(n, step)
    assert schedule == schedule_prefetch(n, step)
    check_schedule(schedule)
    passes, copies = simulate(schedule)
    assert copies == n - len(lone_owners(n, step))
    assert schedule.kept_positions == lone_owners(n, step)


# ---------------------------------------------------------------------------- hazards


def test_the_facts_md_trap_fails() -> None:
    # 3 offloaded layers, step 2: the wrap-around copy of layer 0 lands in the slot layer 2
    # is about to read.
    trap = naive(3, 2)
    assert trap.next_after == (2, 0, 1)
    with pytest.raises(PlanError):
        check_schedule(trap)
    with pytest.raises(Hazard):
        simulate(trap)


@pytest.mark.parametrize(("n", "step"), [(n, s) for n in range(1, 21) for s in range(1, 7)])
def test_naive_rule_fails_exactly_when_the_count_is_not_a_multiple_of_the_step(n: int, step: int) -> None:
    schedule = naive(n, step)
    hazardous = n % min(step, n) != 0
    if hazardous:
        with pytest.raises(PlanError):
            check_schedule(schedule)
        with pytest.raises(Hazard):
            simulate(schedule)
    else:
        check_schedule(schedule)
        simulate(schedule)


HAZARDS: list[tuple[str, PrefetchSchedule]] = [
    ("runs before its copy: nothing copied at start",
     PrefetchSchedule(num_slots=1, initial=(), slots=(0,), next_after=(0,))),
    ("runs before its copy: position 1 never copied",
     PrefetchSchedule(num_slots=1, initial=(0,), slots=(0, 0), next_after=(None, 0))),
    ("runs before its copy: a shared slot gets no copy for the second pass",
     PrefetchSchedule(num_slots=1, initial=(0,), slots=(0, 0), next_after=(1, None))),
    ("runs on another's data: 2 takes slot 0 and nothing copies 0 back",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 0), next_after=(2, None, None))),
    ("runs before its copy: copied after it would run",
     PrefetchSchedule(num_slots=2, initial=(0,), slots=(0, 1), next_after=(None, 1))),
    ("double copy at start",
     PrefetchSchedule(num_slots=1, initial=(0, 0), slots=(0,), next_after=(0,))),
    ("double copy: position 2 copied after 0 and again after 1",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 0, 1), next_after=(2, 2, 0, 1))),
    ("runs before its copy: a lone owner is loaded by the initial copies only",
     PrefetchSchedule(num_slots=2, initial=(0,), slots=(0, 1), next_after=(1, None))),
    ("overwrite at start: two positions, one slot, both copied",
     PrefetchSchedule(num_slots=1, initial=(0, 1), slots=(0, 0), next_after=(1, 0))),
    ("overwrite: copy into the slot of a position not yet run",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 1), next_after=(2, 0, 1))),
]


@pytest.mark.parametrize("schedule", [h[1] for h in HAZARDS], ids=[h[0] for h in HAZARDS])
def test_hand_made_hazards_fail(schedule: PrefetchSchedule) -> None:
    with pytest.raises(PlanError):
        check_schedule(schedule)
    with pytest.raises(Hazard):
        simulate(schedule)


SAFE: list[tuple[str, PrefetchSchedule]] = [
    ("two lone owners loaded once, no copies after the start",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1), next_after=(None, None))),
    ("a lone owner named again after it ran (not issued)",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1), next_after=(None, 0))),
    ("a lone owner named again before it runs (not issued, so not a second copy)",
     PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1), next_after=(1, 0))),
]


@pytest.mark.parametrize("schedule", [h[1] for h in SAFE], ids=[h[0] for h in SAFE])
def test_hand_made_safe_schedules_pass(schedule: PrefetchSchedule) -> None:
    check_schedule(schedule)
    simulate(schedule)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_slots": 1, "initial": (0,), "slots": (1,), "next_after": (0,)},  # slot out of range
        {"num_slots": 1, "initial": (0,), "slots": (0,), "next_after": (0, 0)},  # lengths differ
        {"num_slots": 1, "initial": (0,), "slots": (0,), "next_after": (1,)},  # no such position
        {"num_slots": 1, "initial": (2,), "slots": (0,), "next_after": (0,)},  # no such position
        {"num_slots": 1, "initial": (0,), "slots": (-1,), "next_after": (0,)},
        {"num_slots": 1, "initial": (0,), "slots": (True,), "next_after": (0,)},
    ],
)
def test_schedule_structure_is_checked_at_construction(kwargs: dict[str, object]) -> None:
    with pytest.raises(PlanError):
        PrefetchSchedule(**kwargs)  # type: ignore[arg-type]


@st.composite
def random_schedules(draw: st.DrawFn) -> PrefetchSchedule:
    n = draw(st.integers(1, 5))
    num_slots = draw(st.integers(1, 3))
    return PrefetchSchedule(
        num_slots=num_slots,
        initial=tuple(draw(st.lists(st.integers(0, n - 1), max_size=4))),
        slots=tuple(draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n))),
        next_after=tuple(draw(st.lists(st.one_of(st.none(), st.integers(0, n - 1)), min_size=n, max_size=n))),
    )


@settings(max_examples=400)
@given(random_schedules())
def test_checker_agrees_with_the_independent_simulation(schedule: PrefetchSchedule) -> None:
    try:
        simulate(schedule)
    except Hazard:
        safe = False
    else:
        safe = True
    if safe:
        check_schedule(schedule)
    else:
        with pytest.raises(PlanError):
            check_schedule(schedule)
