"""The replacement policy of the device expert cache, as a pure state machine.

The executor (`offload.executors.experts`) and the estimate (`offload.pure.experts.replay`)
both call `admit` once per call of an experts module, with the experts that call routes,
so what the executor copies and what the estimate counts are the same by construction.

- `CacheState`: which expert sits in which slot, in eviction order, and the routing
  history the policy keeps (a count and the last call of each expert).
- `initial_state(plan)`: the held experts in slots 0..h-1, the other slots free.
- `admit(plan, state, routed) -> Access`: the hits (served from their slots), the misses
  (copied from the host, and the slot each is kept in, if any), the evicted experts, and
  the state after the call.

The rules, the same for every policy:

1. A routed resident is a hit; every other routed expert is a miss. Held experts are
   residents that are never evicted, so a routed held expert is always a hit.
2. A slot holds at most one expert, and there are never more than ``plan.slots`` residents.
3. Misses take the free slots first (lowest slot first), then the slots of residents that
   are neither held nor routed by this call, in eviction order. A resident routed by the
   call is never evicted by it. A miss that finds no such slot, or that the policy
   declines to keep (LFU: colder than the resident it would evict), is served from the
   host and not kept: its slot is None.
4. LRU orders residents by the call that last routed them (earliest first, then by
   expert); LFU by their count, then as LRU. LFU's counts are of calls that routed the
   expert, resident or not; every `AGING_CALLS` calls they are halved, so that a change of
   which experts are hot is followed within a few hundred calls.

Per call the cost is O(E + C log C) for E experts and C slots: the counts are one tuple of
E integers, copied once, and the residents are sorted once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, is_int
from offload.pure._slots import slot_setters
from offload.pure.experts.values import CachePolicy, ExpertCachePlan

__all__ = ["AGING_CALLS", "Access", "CacheState", "admit", "initial_state"]

#: LFU halves every count after this many calls of the experts module, so that a count
#: remembers about twice as many calls. Measured on Zipf traces (E 64 and 128, top-8):
#: with 128 the hit rate of a steady popularity is within half a point of never aging,
#: and after a change of which experts are hot it is 9 to 12 points above never aging.
AGING_CALLS = 128


def _residents(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and is_int(p[0]) and is_int(p[1]) and p[0] >= 0 and p[1] >= 0
            for p in value):
        raise PlanError(f"residents must be a tuple of (expert, slot) pairs of integers >= 0, got {value!r}",
                        name="residents", value=value)
    experts = [e for e, _ in value]
    slots = [s for _, s in value]
    if len(set(experts)) != len(experts) or len(set(slots)) != len(slots):
        raise PlanError(f"residents name an expert or a slot twice: {value!r}", name="residents", value=value)


def _history(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(is_int(v) and v >= 0 for v in value):
        raise PlanError(f"{attribute.name} must be a tuple of integers >= 0, got {value!r}",
                        name=attribute.name, value=value)


@attrs.frozen(kw_only=True)
class CacheState:
    """What one expert cache holds between two calls of its experts module.

    Attributes:
        slots: C, the cache's slots.
        residents: ``(expert, slot)`` of each expert on the device, in eviction order
            (the first is evicted first, held experts skipped); at most C pairs, slots
            in 0..C-1, experts in 0..E-1, no expert and no slot twice.
        counts: per expert (E entries), the calls that routed it, halved every
            `AGING_CALLS` calls (LFU orders by it; LRU keeps it but ignores it).
        last: per expert (E entries), the number of the call that last routed it (calls
            count from 1; 0: never).
        calls: the calls admitted so far.
    """

    slots: int = attrs.field(validator=int_at_least(1, PlanError))
    residents: tuple[tuple[int, int], ...] = attrs.field(validator=_residents)
    counts: tuple[int, ...] = attrs.field(validator=_history)
    last: tuple[int, ...] = attrs.field(validator=_history)
    calls: int = attrs.field(validator=int_at_least(0, PlanError))

    def __attrs_post_init__(self) -> None:
        e = len(self.counts)
        if len(self.last) != e:
            raise PlanError(f"counts ({e}) and last ({len(self.last)}) must have one entry per expert each",
                            name="last", value=len(self.last))
        if len(self.residents) > self.slots or any(x >= e or s >= self.slots for x, s in self.residents):
            raise PlanError(f"residents {self.residents} do not fit {self.slots} slots of experts 0..{e - 1}",
                            name="residents", value=self.residents)
        if any(t > self.calls for t in self.last):
            raise PlanError(f"last names a call after the {self.calls} admitted", name="last", value=self.last)


@attrs.frozen(kw_only=True)
class Access:
    """What one call of an experts module does with the cache.

    The executor serves each hit by copying its slot into the call's work row, and each
    miss by copying its expert from the host into the work row, then (slot not None) the
    work row into that slot. Every routed expert is in exactly one of `hits` and `misses`.

    Attributes:
        state: the cache after the call.
        hits: ``(expert, slot)`` of each routed resident, by expert.
        misses: ``(expert, slot)`` of each routed expert that was not resident, by expert:
            the slot it is kept in from now on, or None when it is not kept.
        evicted: the experts whose slots the kept misses took, in eviction order.
    """

    state: CacheState
    hits: tuple[tuple[int, int], ...]
    misses: tuple[tuple[int, int | None], ...]
    evicted: tuple[int, ...]


# The trusted builder: `admit` derives every state from a checked one (see _slots).
_NEW = object.__new__
_STATE_SETTERS = slot_setters(CacheState, ("slots", "residents", "counts", "last", "calls"))


def _state(slots: int, residents: tuple[tuple[int, int], ...], counts: tuple[int, ...], last: tuple[int, ...],
           calls: int) -> CacheState:
    state = _NEW(CacheState)
    for set_field, value in zip(_STATE_SETTERS, (slots, residents, counts, last, calls), strict=True):
        set_field(state, value)
    return state


def initial_state(plan: ExpertCachePlan) -> CacheState:
    """The cache before the first call: held expert ``plan.held[i]`` in slot i, the other
    slots free, no history."""
    e = plan.group.num_experts
    return CacheState(slots=plan.slots, residents=tuple((expert, slot) for slot, expert in enumerate(plan.held)),
                      counts=(0,) * e, last=(0,) * e, calls=0)


def _where(plan: ExpertCachePlan) -> str:
    return f"expert cache of {plan.group.layer}:{plan.group.module}"


def _check_routed(plan: ExpertCachePlan, routed: object) -> None:
    e = plan.group.num_experts
    if (isinstance(routed, tuple) and all(type(x) is int for x in routed)
            and (not routed or (routed[0] >= 0 and routed[-1] < e))
            and all(a < b for a, b in zip(routed, routed[1:], strict=False))):
        return  # the executor's case, checked at C speed; what follows only words the error
    if not isinstance(routed, tuple):
        raise PlanError(f"{_where(plan)}: routed experts must be a tuple, got {routed!r}", name="routed",
                        value=routed)
    previous = -1
    for i, expert in enumerate(routed):
        if type(expert) is not int or not 0 <= expert < e:
            raise PlanError(f"{_where(plan)}: routed[{i}] is {expert!r}, not an expert index in 0..{e - 1} "
                            f"(E = {e})", name=f"routed[{i}]", value=expert)
        if expert <= previous:
            raise PlanError(f"{_where(plan)}: routed[{i}] is {expert} after {previous}: routed experts must be "
                            f"sorted and distinct (E = {e})", name=f"routed[{i}]", value=expert)
        previous = expert
    raise PlanError(f"{_where(plan)}: routed experts {routed!r} are not sorted distinct ints in 0..{e - 1}",
                    name="routed", value=routed)  # defensive: the loop finds whatever the fast check refuses


def _check_state(plan: ExpertCachePlan, state: CacheState, slot_of: dict[int, int]) -> None:
    e = plan.group.num_experts
    if len(state.counts) != e or state.slots != plan.slots:
        raise PlanError(f"{_where(plan)}: the state is of a cache of {len(state.counts)} experts in {state.slots} "
                        f"slots, not {e} in {plan.slots}", name="state", value=(len(state.counts), state.slots))
    if not all(expert in slot_of for expert in plan.held):
        raise PlanError(f"{_where(plan)}: the state lacks some of the held experts {plan.held}", name="state",
                        value=state.residents)


def _key_lfu(counts: list[int], last: list[int]) -> Callable[[tuple[int, int]], tuple[int, int, int]]:
    return lambda pair: (counts[pair[0]], last[pair[0]], pair[0])


def admit(plan: ExpertCachePlan, state: CacheState, routed: tuple[int, ...]) -> Access:
    """One call of the experts module: which routed experts are hits, which are misses and
    where they are kept, which residents are evicted, and the state after.

    Args:
        plan: the cache's plan (slots, held experts, policy).
        state: the cache before the call (`initial_state`, then each `Access.state`).
        routed: the experts the call routes, sorted and distinct (empty when none).

    Returns:
        The call's `Access`, following the rules of this module's docstring.

    Raises:
        PlanError: `routed` is not a sorted tuple of distinct expert indices in 0..E-1
            (naming the first bad index and E), or `state` is not a state of a cache of
            this plan's E and C holding its held experts.
    """
    _check_routed(plan, routed)
    given: object = state
    if not isinstance(given, CacheState):
        raise PlanError(f"{_where(plan)}: state must be a CacheState, got {given!r}", name="state", value=given)
    slot_of = dict(state.residents)
    _check_state(plan, state, slot_of)
    lfu = plan.policy is CachePolicy.LFU
    call = state.calls + 1
    counts = list(state.counts)
    last = list(state.last)
    for expert in routed:
        counts[expert] += 1
        last[expert] = call
    hits = tuple((expert, slot_of[expert]) for expert in routed if expert in slot_of)
    missing = [expert for expert in routed if expert not in slot_of]
    kept_slot: dict[int, int] = {}
    evicted: list[int] = []
    if missing:
        # The hottest misses first, so that they get the free slots and the coldest victims.
        if lfu:
            missing.sort(key=lambda expert: (-counts[expert], expert))
        free = sorted(set(range(plan.slots)).difference(slot_of.values()), reverse=True)
        held = plan.held
        victims = (pair for pair in state.residents if last[pair[0]] != call and pair[0] not in held)
        for expert in missing:
            if free:
                kept_slot[expert] = free.pop()
                continue
            victim = next(victims, None)
            # LFU keeps a miss only if it is at least as hot as its victim: the misses come
            # hottest first and the victims coldest first, so once one is refused, all are.
            if victim is None or (lfu and counts[expert] < counts[victim[0]]):
                break
            evicted.append(victim[0])
            kept_slot[expert] = victim[1]
    if lfu and call % AGING_CALLS == 0:
        counts = [count >> 1 for count in counts]
    # The residents this call did not route keep their keys, so their order; the routed
    # ones (hits and kept misses) are sorted and merged in.
    gone = set(evicted)
    stayed = [pair for pair in state.residents if last[pair[0]] != call and pair[0] not in gone]
    fresh = [(expert, slot_of[expert] if expert in slot_of else kept_slot[expert]) for expert in routed
             if expert in slot_of or expert in kept_slot]
    if lfu:  # one sorted run and a few more: timsort's merge is about linear
        residents = tuple(sorted(stayed + fresh, key=_key_lfu(counts, last)))
    else:
        residents = (*stayed, *fresh)  # all of `fresh` last routed now, sorted by expert
    misses = tuple((expert, kept_slot.get(expert)) for expert in routed if expert not in slot_of)
    return Access(state=_state(plan.slots, residents, tuple(counts), tuple(last), call), hits=hits,
                  misses=misses, evicted=tuple(evicted))
