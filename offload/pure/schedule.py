"""The prefetch schedule: which static slot each offloaded layer uses, and which copy is
issued after each layer's forward, proven free of overwrites by `check_schedule`.

Positions are the offloaded layers in execution order, ``0 .. n-1``, run again and again.
There are ``s = min(step, n)`` slots. Slot ``k`` is owned by the chain of positions
``k, k+s, k+2s, ...``. After a position runs, its slot is free, and the copy issued is
the *next owner in the same chain*, wrapping to the chain's first owner for the next
pass. The naive rule ``next = (i + s) mod n`` breaks this when ``n`` is not a multiple of
``s``: with 3 positions and 2 slots, the wrap-around copy of position 0 lands in the slot
that position 2 is about to read (FACTS.md). Per-chain cycling cannot do that, because a
copy into a slot is only ever issued right after that slot's current owner has run.
"""

from __future__ import annotations

from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import check_int_at_least, int_at_least

__all__ = ["PrefetchSchedule", "check_schedule", "schedule_prefetch"]


def _int_tuple(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise PlanError(f"{attribute.name} must be a tuple of integers, got {value!r}",
                        name=attribute.name, value=value)


def _next_tuple(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(
        v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in value
    ):
        raise PlanError(f"{attribute.name} must be a tuple of integers or None, got {value!r}",
                        name=attribute.name, value=value)


@attrs.frozen(kw_only=True)
class PrefetchSchedule:
    """Slots and copy order for ``n`` offloaded positions.

    The structure is validated on construction (lengths, ranges); whether it is free of
    hazards is what `check_schedule` proves.

    Attributes:
        num_slots: static buffer slots per parameter key.
        initial: positions copied once at start, in this order, before the first pass.
        slots: ``slots[i]`` is the slot position ``i`` is copied into and read from.
        next_after: ``next_after[i]`` is the position whose copy is issued right after
            position ``i``'s forward, or None for no copy.
    """

    num_slots: int = attrs.field(validator=int_at_least(0, PlanError))
    initial: tuple[int, ...] = attrs.field(validator=_int_tuple)
    slots: tuple[int, ...] = attrs.field(validator=_int_tuple)
    next_after: tuple[int | None, ...] = attrs.field(validator=_next_tuple)

    def __attrs_post_init__(self) -> None:
        n = len(self.slots)
        if len(self.next_after) != n:
            raise PlanError(
                f"slots has {n} entries but next_after has {len(self.next_after)}",
                name="next_after",
                value=self.next_after,
            )
        for i, slot in enumerate(self.slots):
            if not 0 <= slot < self.num_slots:
                raise PlanError(f"position {i} uses slot {slot}, outside 0..{self.num_slots - 1}",
                                name="slots", value=slot)
        for i, target in enumerate(self.next_after):
            if target is not None and not 0 <= target < n:
                raise PlanError(f"next_after[{i}] = {target} is not a position 0..{n - 1}",
                                name="next_after", value=target)
        for target in self.initial:
            if not 0 <= target < n:
                raise PlanError(f"initial copy of position {target} is not a position 0..{n - 1}",
                                name="initial", value=target)

    @property
    def num_positions(self) -> int:
        """How many offloaded positions the schedule covers."""
        return len(self.slots)


def schedule_prefetch(num_offloaded: int, prefetch_step: int) -> PrefetchSchedule:
    """Build the per-chain cycling schedule.

    Args:
        num_offloaded: offloaded positions per pass (0 gives an empty schedule).
        prefetch_step: copies in flight ahead of compute; the slot count is
            ``min(prefetch_step, num_offloaded)``.

    Returns:
        A schedule that `check_schedule` accepts for every count and step.

    Raises:
        PlanError: a negative count or a step below 1.
    """
    check_int_at_least("num_offloaded", num_offloaded, 0, PlanError)
    check_int_at_least("prefetch_step", prefetch_step, 1, PlanError)
    n = num_offloaded
    s = min(prefetch_step, n)
    slots = tuple(i % s for i in range(n)) if s else ()
    # The next owner of the slot position i just released: the next position in its chain,
    # or, past the end of the pass, the chain's first owner (which runs in the next pass).
    next_after: tuple[int | None, ...] = tuple(i + s if i + s < n else i % s for i in range(n))
    return PrefetchSchedule(num_slots=s, initial=tuple(range(s)), slots=slots, next_after=next_after)


def check_schedule(schedule: PrefetchSchedule) -> None:
    """Prove that a schedule never reads a stale slot nor overwrites a live one.

    Simulates passes until the state at the start of a pass repeats, which covers every
    later pass. In each pass every position must be copied exactly once before it runs,
    into a slot no other position still needs: a copy into a slot is refused while the
    slot's current occupant has been copied and not yet run.

    Args:
        schedule: the schedule to check.

    Raises:
        PlanError: naming the first hazard found (the pass, the position and the slot).
    """
    n = schedule.num_positions
    occupant: dict[int, int] = {}  # slot -> position whose data it holds
    # Positions copied for their next run and not run yet. A position copied twice before
    # it runs, or a position that runs without being in here, is a hazard.
    pending: set[int] = set()

    def issue(target: int, when: str) -> None:
        slot = schedule.slots[target]
        holder = occupant.get(slot)
        if holder is not None and holder in pending and holder != target:
            raise PlanError(
                f"{when}: copy of position {target} into slot {slot} overwrites position "
                f"{holder}, which was copied and has not run yet",
                name="slots",
                value=slot,
            )
        if target in pending:
            raise PlanError(
                f"{when}: position {target} is copied twice before it runs",
                name="next_after",
                value=target,
            )
        occupant[slot] = target
        pending.add(target)

    for first in schedule.initial:
        issue(first, "initial copies")
    seen_states: set[tuple[tuple[tuple[int, int], ...], frozenset[int]]] = set()
    pass_number = 0
    while True:
        state = (tuple(sorted(occupant.items())), frozenset(pending))
        if state in seen_states:
            return
        seen_states.add(state)
        for position in range(n):
            when = f"pass {pass_number}, after position {position}"
            if position not in pending or occupant.get(schedule.slots[position]) != position:
                raise PlanError(
                    f"pass {pass_number}: position {position} runs before its copy into slot "
                    f"{schedule.slots[position]} was issued",
                    name="next_after",
                    value=position,
                )
            pending.discard(position)
            following = schedule.next_after[position]
            if following is not None:
                issue(following, when)
        pass_number += 1
