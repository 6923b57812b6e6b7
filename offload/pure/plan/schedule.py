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

A lone owner is loaded once. A chain of one position (``k + s >= n``, which happens when
``n < 2s``; every chain when ``n <= s``) has nobody to hand its slot to: the position is
copied by ``initial`` and keeps its slot, so ``next_after[k]`` is None, and its data stays
valid across steps without a new copy (`PrefetchSchedule.kept_positions`; it is copied
again only when its host copy changes, which is the executor's business). A copy that
``next_after`` names for a kept position is never issued (`PrefetchSchedule.issued_after`):
schedules written before this rule say ``next_after[k] = k`` for a lone owner, a copy of
what its slot already holds, and they run and pass unchanged.

Several stacks. A model with several layer stacks (an encoder and a decoder, a vision
tower and a language model) runs each stack as its own cycle: its positions in order,
again and again, as often as the model calls it, whatever the other stacks do meanwhile
(a decoder runs once per generated token, its encoder once per request). The schedule
then has one cycle per stack (``cycles``: positions per cycle, in execution order), each
built by the rule above with slots of its own: no copy of one cycle lands in another's
slot, and no position hands its slot to another cycle's position, so every cycle is
hazard-free on its own and the interleaving of cycles cannot matter.

The rule `check_schedule` proves, over the copies issued (every ``initial`` copy, then
`issued_after`): a position may run when its slot holds its own data (copied, possibly in
an earlier pass, and not overwritten since), never before; no copy overwrites a slot whose
data was copied for a position that has not run yet; no position is copied twice before
it runs. So a kept position must be among the ``initial`` copies.
"""

from __future__ import annotations

from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import check_int_at_least, int_at_least
from offload.pure.spec.values import runs

__all__ = ["PrefetchSchedule", "check_schedule", "schedule_prefetch", "stack_cycles"]


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
        num_slots: static buffer slots per parameter key (over every cycle).
        initial: positions copied once at start, in this order, before the first pass.
        slots: ``slots[i]`` is the slot position ``i`` is copied into and read from.
        next_after: ``next_after[i]`` is the position whose copy is issued right after
            position ``i``'s forward, or None for no copy (`schedule_prefetch` gives None
            after a kept position: its slot has no other owner to fill). A kept position
            named here is not copied (`issued_after`).
        cycles: positions per cycle, in order (one cycle per stack: see the module
            docstring); empty: one cycle of every position. Cycles use disjoint slots and
            name only their own positions in `next_after`.
    """

    num_slots: int = attrs.field(validator=int_at_least(0, PlanError))
    initial: tuple[int, ...] = attrs.field(validator=_int_tuple)
    slots: tuple[int, ...] = attrs.field(validator=_int_tuple)
    next_after: tuple[int | None, ...] = attrs.field(validator=_next_tuple)
    cycles: tuple[int, ...] = attrs.field(default=(), validator=_int_tuple)

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
        if not self.cycles:
            return
        if any(size < 1 for size in self.cycles) or sum(self.cycles) != n:
            raise PlanError(f"cycles {self.cycles} do not divide the {n} positions into runs of one or more",
                            name="cycles", value=self.cycles)
        cycle_of = self.cycle_of
        owner: dict[int, int] = {}
        for i, slot in enumerate(self.slots):
            if owner.setdefault(slot, cycle_of[i]) != cycle_of[i]:
                raise PlanError(f"slot {slot} is used by cycles {owner[slot]} and {cycle_of[i]}: each cycle needs "
                                "slots of its own", name="slots", value=slot)
        for i, target in enumerate(self.next_after):
            if target is not None and cycle_of[target] != cycle_of[i]:
                raise PlanError(f"next_after[{i}] = {target} names a position of cycle {cycle_of[target]} after one "
                                f"of cycle {cycle_of[i]}", name="next_after", value=target)

    @property
    def num_positions(self) -> int:
        """How many offloaded positions the schedule covers."""
        return len(self.slots)

    @property
    def cycle_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each cycle's positions as ``(first, stop)``, in order; one cycle of every position
        when `cycles` is empty (none for an empty schedule)."""
        return runs(self.cycles, self.num_positions)

    @property
    def cycle_of(self) -> tuple[int, ...]:
        """Position -> the number of its cycle."""
        return tuple(c for c, (first, stop) in enumerate(self.cycle_ranges) for _ in range(first, stop))

    @property
    def successor(self) -> tuple[int, ...]:
        """Position -> the position that runs after it in its cycle (the cycle's first after
        its last)."""
        return tuple(i + 1 if i + 1 < stop else first for first, stop in self.cycle_ranges for i in range(first, stop))

    @property
    def kept_positions(self) -> frozenset[int]:
        """The positions that are the only owner of their slot, from `slots` alone.

        Such a position, once its copy has landed, stays valid across steps without a new
        copy: no other position's copy ever lands in its slot. It is true of any schedule,
        including one read from a plan written before lone owners were loaded once (those
        say ``next_after[i] = i``). A kept position is loaded by `initial` only: copies
        `next_after` names for it are redundant and never issued (`issued_after`).
        """
        owners: dict[int, int] = {}
        for slot in self.slots:
            owners[slot] = owners.get(slot, 0) + 1
        return frozenset(i for i, slot in enumerate(self.slots) if owners[slot] == 1)

    @property
    def issued_after(self) -> tuple[int | None, ...]:
        """The copies executors issue after each position's forward: `next_after` with
        every copy of a kept position (`kept_positions`) left out (None). Equal to
        `next_after` for a schedule `schedule_prefetch` builds; what `check_schedule`
        proves and `estimate` simulates."""
        kept = self.kept_positions
        return tuple(None if target is not None and target in kept else target for target in self.next_after)


def schedule_prefetch(num_offloaded: int, prefetch_step: int, cycles: tuple[int, ...] = ()) -> PrefetchSchedule:
    """Build the per-chain cycling schedule.

    Args:
        num_offloaded: offloaded positions per pass (0 gives an empty schedule).
        prefetch_step: copies in flight ahead of compute; the slot count is
            ``min(prefetch_step, num_offloaded)``, per cycle.
        cycles: positions per cycle (one per stack; see the module docstring), summing to
            `num_offloaded`; each cycle is scheduled by the same rule with slots of its
            own, numbered after the previous cycle's. Empty, or one cycle: one cycle of
            every position (the schedule has ``cycles == ()``).

    Returns:
        A schedule that `check_schedule` accepts for every count and step. Its first
        ``s = min(prefetch_step, num_offloaded)`` positions are copied by ``initial``; a
        position alone in its slot (``i < s`` and ``i + s >= n``) gets
        ``next_after[i] = None``: ``initial`` is its only copy.

    Raises:
        PlanError: a negative count or a step below 1.
    """
    check_int_at_least("num_offloaded", num_offloaded, 0, PlanError)
    check_int_at_least("prefetch_step", prefetch_step, 1, PlanError)
    if len(cycles) > 1 or (cycles and cycles != (num_offloaded,)):
        return _cycles(num_offloaded, prefetch_step, cycles)
    n = num_offloaded
    s = min(prefetch_step, n)
    slots = tuple(i % s for i in range(n)) if s else ()
    # The next owner of the slot position i just released: the next position in its chain,
    # or, past the end of the pass, the chain's first owner (which runs in the next pass);
    # None when i is that first owner itself (a chain of one): it keeps its slot.
    next_after: tuple[int | None, ...] = tuple(
        i + s if i + s < n else (None if i < s else i % s) for i in range(n)
    )
    return PrefetchSchedule(num_slots=s, initial=tuple(range(s)), slots=slots, next_after=next_after)


def stack_cycles(offloaded_layers: tuple[int, ...], stack_ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """The cycles of a schedule over `offloaded_layers` (ascending layer indices) in a model
    whose stacks are `stack_ranges` (``(first, stop)`` layers each, `ModelSpec.stack_ranges`):
    the offloaded layers of each stack, stacks with none left out; ``()`` (one cycle) when
    they all lie in one stack."""
    counts = [sum(1 for layer in offloaded_layers if first <= layer < stop) for first, stop in stack_ranges]
    cycles = tuple(count for count in counts if count)
    return cycles if len(cycles) > 1 else ()


def _cycles(num_offloaded: int, prefetch_step: int, cycles: tuple[int, ...]) -> PrefetchSchedule:
    """`schedule_prefetch` of several cycles: each by the one-cycle rule, its positions and
    slots shifted past the previous cycles'."""
    if any(size < 1 for size in cycles) or sum(cycles) != num_offloaded:
        raise PlanError(f"cycles {cycles!r} must be runs of one or more positions summing to {num_offloaded}",
                        name="cycles", value=cycles)
    initial: list[int] = []
    slots: list[int] = []
    next_after: list[int | None] = []
    first = base = 0
    for size in cycles:
        one = schedule_prefetch(size, prefetch_step)
        initial.extend(first + i for i in one.initial)
        slots.extend(base + slot for slot in one.slots)
        next_after.extend(None if target is None else first + target for target in one.next_after)
        first += size
        base += one.num_slots
    return PrefetchSchedule(num_slots=base, initial=tuple(initial), slots=tuple(slots), next_after=tuple(next_after),
                            cycles=cycles)


def check_schedule(schedule: PrefetchSchedule) -> None:
    """Prove that a schedule never reads a stale slot nor overwrites a live one.

    Simulates passes of the copies issued (``initial``, then `PrefetchSchedule.issued_after`)
    until the state at the start of a pass repeats, which covers every later pass; each
    cycle on its own (their slots are disjoint and their copies stay within them, which
    the schedule's construction checks, so any interleaving of cycles is safe). A
    position may run when its slot holds its own data: copied (possibly in an earlier
    pass: a lone owner is loaded once, by ``initial``) and not overwritten since. A copy
    into a slot is refused while the slot's current occupant has been copied and not yet
    run, and so is a second copy of a position before it has run.

    Args:
        schedule: the schedule to check.

    Raises:
        PlanError: naming the first hazard found (the pass, the position and the slot).
    """
    issued_after = schedule.issued_after
    for first, stop in schedule.cycle_ranges:
        _check_cycle(schedule, issued_after, first, stop)


def _check_cycle(schedule: PrefetchSchedule, issued_after: tuple[int | None, ...], first_position: int,
                 stop: int) -> None:
    """`check_schedule` of the cycle of positions ``first_position .. stop - 1``."""
    occupant: dict[int, int] = {}  # slot -> position whose data it holds
    # Positions copied for their next run and not run yet. A copy over one of them, or a
    # second copy of one of them, is a hazard.
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
        if first_position <= first < stop:
            issue(first, "initial copies")
    seen_states: set[tuple[tuple[tuple[int, int], ...], frozenset[int]]] = set()
    pass_number = 0
    while True:
        state = (tuple(sorted(occupant.items())), frozenset(pending))
        if state in seen_states:
            return
        seen_states.add(state)
        for position in range(first_position, stop):
            when = f"pass {pass_number}, after position {position}"
            slot = schedule.slots[position]
            holder = occupant.get(slot)
            if holder != position:
                if holder is not None:
                    what = f"it holds position {holder}'s data"
                elif position in schedule.kept_positions:
                    what = "it is alone in its slot, and only the initial copies load such a position"
                else:
                    what = "no copy was issued into it"
                raise PlanError(
                    f"pass {pass_number}: position {position} runs before its copy into slot {slot} "
                    f"was issued ({what})",
                    name="next_after",
                    value=position,
                )
            pending.discard(position)
            following = issued_after[position]
            if following is not None:
                issue(following, when)
        pass_number += 1
