"""Schedules of several cycles (one per layer stack): each cycle runs its positions in
order, again and again, as often as the model calls its stack, in any interleaving with
the others (an encoder once per request, its decoder once per token).

The simulation here is written from that rule, not from the checker: it runs the cycles
in an order drawn by hypothesis (whole passes of one cycle at a time, or a cycle stopped
nowhere: a stack's forward always runs every one of its layers), issues the copies
``initial`` and then ``next_after`` name (a position alone in its slot is loaded once), and
demands that every run finds its own data in its slot and that no copy overwrites data
copied for a position that has not run yet."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import PrefetchSchedule, check_schedule, schedule_prefetch


class Hazard(Exception):
    """A stale read or a live overwrite."""


def run(schedule: PrefetchSchedule, order: list[int]) -> int:
    """Run whole passes of the cycles in `order` (cycle numbers); the copies issued.

    Raises:
        Hazard: naming what went wrong.
    """
    n = len(schedule.slots)
    alone = {i for i in range(n) if schedule.slots.count(schedule.slots[i]) == 1}
    data: dict[int, int] = {}
    waiting: set[int] = set()  # copied, not run since
    issued = 0

    def copy(target: int) -> None:
        nonlocal issued
        slot = schedule.slots[target]
        if data.get(slot) not in (None, target) and data[slot] in waiting:
            raise Hazard(f"copy of {target} overwrites slot {slot} holding {data[slot]}, which has not run")
        data[slot] = target
        waiting.add(target)
        issued += 1

    for target in schedule.initial:
        copy(target)
    bounds = schedule.cycle_ranges
    for cycle in order:
        first, stop = bounds[cycle]
        for position in range(first, stop):
            if data.get(schedule.slots[position]) != position:
                raise Hazard(f"position {position} reads slot {schedule.slots[position]} holding "
                             f"{data.get(schedule.slots[position])}")
            waiting.discard(position)
            after = schedule.next_after[position]
            if after is not None and after not in alone:
                copy(after)
    return issued


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=2, max_size=4), step=st.integers(1, 5), data=st.data())
def test_every_interleaving_of_cycles_is_hazard_free(sizes: list[int], step: int, data: st.DataObject) -> None:
    cycles = tuple(sizes)
    schedule = schedule_prefetch(sum(cycles), step, cycles)
    check_schedule(schedule)
    assert schedule.cycles == cycles
    assert schedule.num_slots == sum(min(step, size) for size in cycles)
    order = data.draw(st.lists(st.integers(0, len(cycles) - 1), max_size=12))
    run(schedule, order)


def test_a_decoder_runs_many_times_per_encoder_run() -> None:
    schedule = schedule_prefetch(3 + 4, 2, (3, 4))
    assert schedule.cycle_ranges == ((0, 3), (3, 7))
    assert schedule.successor == (1, 2, 0, 4, 5, 6, 3)
    assert schedule.cycle_of == (0, 0, 0, 1, 1, 1, 1)
    assert set(schedule.slots[:3]).isdisjoint(schedule.slots[3:])
    assert all(t is None or (t < 3) == (i < 3) for i, t in enumerate(schedule.next_after))
    run(schedule, [0, 1, 1, 1, 1, 0, 1, 1])


def test_one_cycle_is_the_one_cycle_schedule() -> None:
    assert schedule_prefetch(5, 2, (5,)) == schedule_prefetch(5, 2) == schedule_prefetch(5, 2, ())
    assert schedule_prefetch(5, 2).cycle_ranges == ((0, 5),)
    assert schedule_prefetch(0, 2).cycle_ranges == ()


def test_sharing_slots_across_cycles_would_be_a_hazard_and_is_refused() -> None:
    # The premise: cycles that shared slot 0 would overwrite each other's data.
    shared = PrefetchSchedule(num_slots=1, initial=(0, 1), slots=(0, 0), next_after=(None, None))
    with pytest.raises(Hazard):
        run(shared, [0, 1])
    with pytest.raises(PlanError, match="slot 0 is used by cycles 0 and 1"):
        PrefetchSchedule(num_slots=1, initial=(0, 1), slots=(0, 0), next_after=(None, None), cycles=(1, 1))
    with pytest.raises(PlanError, match="names a position of cycle 1 after one of cycle 0"):
        PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1), next_after=(1, None), cycles=(1, 1))


@pytest.mark.parametrize("cycles", [(2, 2), (3, 0), (5,)])
def test_cycles_that_do_not_cover_the_positions_are_refused(cycles: tuple[int, ...]) -> None:
    with pytest.raises(PlanError, match="cycles"):
        if len(cycles) > 1:
            schedule_prefetch(5, 2, cycles)
        else:
            PrefetchSchedule(num_slots=2, initial=(0, 1), slots=(0, 1, 0, 1), next_after=(2, 3, 0, 1),
                             cycles=cycles)


def test_the_checker_checks_each_cycle() -> None:
    good = schedule_prefetch(4, 1, (2, 2))
    # Position 3 reads slot 1 before anything was copied there: the second cycle's first
    # copy is missing from initial.
    broken = PrefetchSchedule(num_slots=2, initial=(0,), slots=good.slots, next_after=good.next_after,
                              cycles=good.cycles)
    with pytest.raises(PlanError, match="position 2 runs before its copy"):
        check_schedule(broken)
