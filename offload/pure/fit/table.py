"""The model as `fit`'s search sees it: a per-layer table, and the layer sets it offloads.

`make_plan` takes milliseconds; the search looks at thousands of configurations. It reads
them off a `Table` instead, built once per call, which reproduces what the planner would
select (eligible storages, ties, buffer keys) and the byte totals it would report (tests
hold the two equal). A `LayerSet` is what one (group size, number in group) pair
offloads, with a lower bound on its step and on its device bytes from prefix sums; an
`Expanded` set spells out its schedule positions and buffer keys to cost each depth.
Prefetch never offloads a storage tied across layers (`offload.pure.decide.selection`: one
Parameter cannot point at two layers' buffers), so no layer set holds one; UVA may.

The expert caches of a mixture-of-experts model (`offload.pure.plan.experts`) are device
memory beside the slots: the table holds, per layer, what its caches take at the search's
C (the user's `expert_slots`, or one slot each: `fit` sizes the winner's afterwards), and
`buffer_bytes` counts them with the slots. The rows the caches serve are one buffer per key
for all slots (`BufferPlan.shared`), counted once (`Expanded.rows_bytes`). Given a routing
trace, a layer's experts are not in its copy: at its experts' call it waits for the misses
and hits the trace gives its caches at the search's C (`expert_wait`), as `estimate(...,
routing=)` costs them; without one, for their worst case
(`offload.pure.fit.experts.bounded_waits`), as `estimate` costs it.

A model of several layer stacks (`ModelSpec.stacks`) is scheduled as one cycle per stack
with slots of its own (`offload.pure.plan.schedule`): its slots, the layers alone in one,
and its schedule are worked out per cycle here too (`Expanded.cycles`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import attrs

from offload.pure.config import segment_matches
from offload.pure.decide.pinning import decide_pinning
from offload.pure.decide.selection import is_on_compute_device
from offload.pure.decide.uva import decide_uva
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import Workload, layer_compute_seconds
from offload.pure.fit.experts import CacheCosts, Key, cache_costs, cache_waits
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.plan.schedule import stack_cycles
from offload.pure.spec.values import ModelSpec, ParamSpec

__all__ = [
    "Expanded",
    "Key",
    "LayerSet",
    "Table",
    "buffer_bytes",
    "build_table",
    "cycle_slots",
    "expand",
    "kept_bytes",
    "kept_layers",
    "layer_sets",
]

#: Above this many kinds of layer (distinct buffer-key signatures), a layer set's fewest
#: device bytes leaves the buffers out rather than counting them exactly.
_MAX_EXACT_SIGNATURES = 16


@attrs.frozen(kw_only=True)
class LayerSet:
    """The layers one (group size, number in group) pair offloads, and what bounds it."""

    group_size: int
    num_in_group: int
    intervals: tuple[tuple[int, int], ...]  # [start, stop) runs of wanted layers
    host_bytes: int
    # max(resident compute, fewest bytes copied per step at any depth searched that may fit
    # / copy rate): no such depth beats it. Layers alone in their slot are loaded once, not
    # per step (`kept_bytes`), but only deep depths keep any, and each slot takes device
    # memory (`_most_kept`).
    bound_seconds: float
    min_device_bytes: int  # a lower bound over depths (exact for a few layer kinds)


@attrs.frozen(kw_only=True)
class Table:
    """The model, per layer, as the search needs it (what `make_plan` would select)."""

    compute: tuple[float, ...]  # resident compute per layer, seconds
    resident_bytes: int  # weights on the compute device with nothing offloaded
    layer_bytes: tuple[int, ...]  # per layer: offloadable storages confined to it (prefetch)
    layer_has: tuple[bool, ...]  # per layer: it has one
    layer_keys: tuple[tuple[tuple[Key, int], ...], ...]  # their buffer keys and slot bytes
    uva_groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (bytes, ((layer, bytes read), ...))
    pinned: bool
    uva_enabled: bool
    profile: DeviceProfile
    workload: Workload
    segments: tuple[str, ...]
    reserve: int
    outside: int  # weights outside the layers, always resident, bytes
    stack_ranges: tuple[tuple[int, int], ...] = ()  # the model's stacks, (first, stop) layers each
    cache_bytes: tuple[int, ...] = ()  # per layer: its expert caches' bytes if prefetched; (): none
    cache_keys: tuple[frozenset[Key], ...] = ()  # per layer: the buffer keys its caches serve; (): none
    served_bytes: tuple[int, ...] = ()  # per layer: the bytes of the parameters its caches serve; (): none
    # Per layer: its wait at its experts' calls for its hits (seconds) and the bytes its
    # caches copy from host memory, per step, over a trace or their worst case; (): no caches.
    expert_wait: tuple[float, ...] = ()
    expert_moved: tuple[float, ...] = ()
    expert_cache: bool = True  # the plans' `OffloadConfig.expert_cache`
    # The search's C, its plans' `OffloadConfig.expert_slots`: the user's, or 1 where the
    # model has caches to cost.
    expert_slots: int | None = None

    @property
    def fixed_bytes(self) -> int:
        """Device bytes every candidate holds whatever it offloads: outside + reserve."""
        return self.outside + self.reserve

    @property
    def copied_bytes(self) -> tuple[int, ...]:
        """Per layer, the bytes its prefetch copy moves: its offloadable storages, less
        those its expert caches serve (copied at their calls)."""
        if not self.expert_wait:
            return self.layer_bytes
        return tuple(b - s for b, s in zip(self.layer_bytes, self.served_bytes, strict=True))

    @property
    def copy_rate(self) -> float:
        """Host-to-device copy rate, bytes/s, pinned or pageable as the plan would pin."""
        return self.profile.h2d_bytes_per_s(pinned=self.pinned)


@attrs.frozen(kw_only=True)
class Expanded:
    """A layer set spelled out: its schedule positions, what each copies, its buffer keys."""

    layer_set: LayerSet
    positions: tuple[int, ...]  # offloaded layers, in order
    copy_bytes: tuple[int, ...]  # per layer of the model
    kinds: tuple[tuple[int, ...], ...]  # position indices of each kind (same buffer keys)
    keys: tuple[tuple[int, tuple[int, ...]], ...]  # per buffer key: (slot bytes, kinds using it)
    cycles: tuple[int, ...] = ()  # positions per schedule cycle (one per stack); (): one cycle
    cache_bytes: int = 0  # the expert caches of its layers
    rows_bytes: int = 0  # the keys that are one buffer for all slots (expert rows), not in `keys`


def _key(param: ParamSpec) -> Key:
    return (param.name, param.shape, param.stride, param.dtype)


def build_table(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, workload: Workload,
                segments: tuple[str, ...], reserve: int, outside: int = 0, *, expert_cache: bool = True,
                expert_slots: int | None = None, routing: RoutingTrace | None = None) -> Table:
    """Group storages and decide eligibility exactly as `make_plan` does; the expert caches
    are costed at `expert_slots` slots each, or one where it is None, and with `routing`
    by the trace, without it by their worst case (`offload.pure.fit.experts.cache_waits`).

    Raises:
        PlanError: `routing` lacks an experts module that may be cached, names one the model
            does not have, or has no steps (`offload.pure.experts.expected`).
    """
    platform = env.platform
    pin = decide_pinning(env)
    groups: list[list[tuple[int, ParamSpec]]] = []
    by_key: dict[str, list[tuple[int, ParamSpec]]] = {}
    num = len(spec.layers)
    numels, weight = [0] * num, [0] * num
    for layer in spec.layers:
        for param in layer.params:
            numels[layer.index] += math.prod(param.shape)
            if param.storage_key is None:
                groups.append([(layer.index, param)])
            elif param.storage_key in by_key:
                by_key[param.storage_key].append((layer.index, param))
            else:
                groups.append(by_key.setdefault(param.storage_key, [(layer.index, param)]))
    resident = 0
    layer_bytes, layer_has = [0] * num, [False] * num
    keys: list[list[tuple[Key, int]]] = [[] for _ in range(num)]
    uva: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    owners: dict[tuple[int, str], Key] = {}  # storages a prefetch plan gives a buffer of their own
    for group in groups:
        first_layer, first = group[0]
        # A member in the first member's layer shares its buffer and is moved once.
        moved = [(i, p) for n, (i, p) in enumerate(group) if n == 0 or i != first_layer]
        for i, p in moved:
            weight[i] += p.nbytes
        if is_on_compute_device(first.device, platform):
            resident += first.nbytes
        if not all(is_on_compute_device(p.device, platform)
                   and (not segments or any(segment_matches(s, p.name) for s in segments)) for _, p in group):
            continue  # never offloaded: ineligible, or a tie only partly eligible
        uva.append((first.nbytes, tuple((i, p.nbytes) for i, p in moved)))
        if len(moved) == 1:  # in one layer; one tied across layers stays resident under prefetch
            layer_bytes[first_layer] += first.nbytes
            layer_has[first_layer] = True
            keys[first_layer].append((_key(first), first.nbytes))
            owners[(first_layer, first.name)] = _key(first)
    costs = cache_costs(spec, owners, expert_slots or 1) if expert_cache else CacheCosts()
    waits, missed = cache_waits(spec, costs.groups, expert_slots or 1, routing, workload, profile)
    return Table(
        compute=layer_compute_seconds(numels, weight, profile, workload, spec.stack_ranges), resident_bytes=resident,
        layer_bytes=tuple(layer_bytes), layer_has=tuple(layer_has),
        layer_keys=tuple(tuple(sorted(set(k))) for k in keys), uva_groups=tuple(uva),
        pinned=pin.pin, uva_enabled=decide_uva(env, pin).enabled, profile=profile, workload=workload,
        segments=segments, reserve=reserve, outside=outside, stack_ranges=spec.stack_ranges,
        cache_bytes=costs.device_bytes, cache_keys=costs.keys, served_bytes=costs.served_bytes,
        expert_cache=expert_cache, expert_slots=(expert_slots or 1) if costs.groups else expert_slots,
        expert_wait=waits, expert_moved=missed,
    )


def _rows(table: Table, positions: Iterable[int]) -> dict[Key, int]:
    """The buffer keys of `positions` that a prefetch plan makes one buffer for all slots
    (`offload.pure.plan.layout.shared_keys`): each served by an expert cache wherever a
    position has it; their slot bytes."""
    if not table.cache_keys:
        return {}
    rows: dict[Key, int] = {}
    copied: set[Key] = set()
    for layer in positions:
        served = table.cache_keys[layer]
        for key, nbytes in table.layer_keys[layer]:
            if key in served:
                rows[key] = nbytes
            else:
                copied.add(key)
    return {key: nbytes for key, nbytes in rows.items() if key not in copied}


def _prefix_sums(values: Iterable[int]) -> list[int]:
    """``[0, v0, v0 + v1, ...]``: the sum over layers [a, b) is ``sums[b] - sums[a]``."""
    return list(itertools.accumulate(values, initial=0))


def kept_bytes(copy_bytes: Sequence[int], positions: Sequence[int], depth: int, cycles: Sequence[int] = ()) -> int:
    """Bytes (`copy_bytes`, per layer of the model) of the layers alone in their slot at
    `depth` (`kept_layers`), which are loaded once and never copied per step."""
    return sum(copy_bytes[layer] for layer in kept_layers(positions, depth, cycles))


def kept_layers(positions: Sequence[int], depth: int, cycles: Sequence[int] = ()) -> list[int]:
    """The offloaded layers (`positions`, in order) alone in their slot at `depth`: with ``n``
    positions and ``s = min(depth, n)`` slots, positions ``n - s .. s - 1`` (none unless
    ``n < 2s``; see `offload.pure.plan.schedule`), in each cycle (`cycles`: positions per
    cycle; empty: one)."""
    out: list[int] = []
    first = 0
    for n in cycles or (len(positions),):
        s = min(depth, n)
        out.extend(positions[first + i] for i in range(n - s, s))
        first += n
    return out


def cycle_slots(num_positions: int, depth: int, cycles: Sequence[int] = ()) -> list[int]:
    """Each position's slot at `depth`, as `schedule_prefetch` numbers them: ``i mod s``
    within each cycle, every cycle's slots after the previous cycle's."""
    out: list[int] = []
    base = 0
    for n in cycles or (num_positions,):
        s = min(depth, n)
        out.extend(base + i % s for i in range(n))
        base += s
    return out


def _most_kept(table: Table, intervals: tuple[tuple[int, int], ...], max_step: int, room: int) -> int:
    """The most bytes a layer set's depths 1 .. `max_step` leave alone in a slot
    (`kept_bytes`) at a depth whose buffers may fit in `room` device bytes. Each of the
    ``s`` slots holds at least its first owner's copy (positions ``0 .. s-1``) but for the
    parameters its expert caches serve, whose rows may be one buffer for all slots
    (`_rows`), so a depth whose first ``s`` positions take more than `room` bytes so
    counted cannot fit."""
    positions = [i for a, b in intervals for i in range(a, b) if table.layer_has[i]]
    n = len(positions)
    sums = _prefix_sums(table.copied_bytes[i] for i in positions)
    served = table.served_bytes or (0,) * len(table.layer_bytes)
    in_slots = _prefix_sums(table.layer_bytes[i] - served[i] for i in positions)
    # Both the kept range n - s .. s - 1 and the first owners grow with s = min(depth, n).
    for s in range(min(max_step, n), 0, -1):
        if in_slots[s] <= room:
            return sums[s] - sums[n - s] if 2 * s > n else 0
    return 0


def _most_kept_per_cycle(table: Table, intervals: tuple[tuple[int, int], ...], max_step: int) -> int:
    """At most the bytes a layer set's cycles (one per stack) leave alone in a slot over the
    depths 1 .. `max_step`: `kept_bytes` of each cycle at its deepest depth, which keeps the
    most (the range ``n - s .. s - 1`` grows with ``s``)."""
    positions = [i for a, b in intervals for i in range(a, b) if table.layer_has[i]]
    total = 0
    for first, stop in table.stack_ranges:
        mine = [i for i in positions if first <= i < stop]
        n = len(mine)
        if n < 2 * max_step:
            s = min(max_step, n)
            total += sum(table.copied_bytes[mine[i]] for i in range(n - s, s))
    return total


def layer_sets(table: Table, max_step: int, budget: int) -> list[LayerSet]:
    """Every distinct non-empty set of layers a (group size, number in group) pair offloads,
    bounded over the depths 1 .. `max_step` the search tries within `budget` device bytes."""
    num = len(table.compute)
    prefix_bytes = _prefix_sums(table.layer_bytes)
    prefix_copied = _prefix_sums(table.copied_bytes)
    prefix_wait = list(itertools.accumulate(table.expert_wait or [0.0] * num, initial=0.0))
    prefix_missed = list(itertools.accumulate(table.expert_moved or [0.0] * num, initial=0.0))
    prefix_has = _prefix_sums(table.layer_has)
    prefix_cache = _prefix_sums(table.cache_bytes or [0] * num)
    signatures: dict[tuple[tuple[Key, int], ...], list[int]] = {}
    for layer, keys in enumerate(table.layer_keys):
        if keys:
            signatures.setdefault(keys, []).append(layer)
    exact = len(signatures) <= _MAX_EXACT_SIGNATURES
    prefix_sig = ({sig: _prefix_sums(i in set(ls) for i in range(num)) for sig, ls in signatures.items()}
                  if exact else {})
    compute = sum(table.compute)
    rate = table.copy_rate
    having = [i for i, has in enumerate(table.layer_has) if has]
    everywhere = len(having) == num
    seen: set[tuple[object, ...]] = set()
    out: list[LayerSet] = []
    for g in range(1, num + 1):
        for k in range(1, g + 1):
            runs: list[tuple[int, int]] = []
            for start in range(g - k, num, g):
                stop = min(start + k, num)
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], stop)
                else:
                    runs.append((start, stop))
            intervals = tuple(runs)
            # Pairs that offload the same storages give the same plan: keep the first. When
            # some layers have nothing to offload, compare the layers that do.
            same = intervals if everywhere else tuple(i for i in having if i % g >= g - k)
            if same in seen:
                continue
            seen.add(same)
            count = sum(prefix_has[b] - prefix_has[a] for a, b in intervals)  # schedule positions
            if not count:
                continue  # offloads nothing: the same as backend none
            host = sum(prefix_bytes[b] - prefix_bytes[a] for a, b in intervals)
            copied = sum(prefix_copied[b] - prefix_copied[a] for a, b in intervals)
            waits = sum(prefix_wait[b] - prefix_wait[a] for a, b in intervals)
            missed = sum(prefix_missed[b] - prefix_missed[a] for a, b in intervals) / rate  # waited for, on the link
            if len(table.stack_ranges) > 1:
                # One cycle per stack, each of which may leave some alone in a slot: at most
                # what the deepest depth leaves in each (a bound, as `_most_kept` gives).
                copied -= _most_kept_per_cycle(table, intervals, max_step)
            elif count < 2 * max_step:
                # Few enough positions that a deep depth leaves some alone in a slot.
                copied -= _most_kept(table, intervals, max_step, budget - table.resident_bytes + host - table.fixed_bytes)
            # At least one slot per key present (without an exact count, no slots at all), and
            # the expert caches.
            present = {key: nbytes for sig, ps in prefix_sig.items() if any(ps[b] - ps[a] for a, b in intervals)
                       for key, nbytes in sig}
            buffers = sum(present.values()) + sum(prefix_cache[b] - prefix_cache[a] for a, b in intervals)
            out.append(LayerSet(group_size=g, num_in_group=k, intervals=intervals, host_bytes=host,
                                bound_seconds=max(compute + waits + missed, copied / rate + missed),
                                min_device_bytes=table.resident_bytes - host + buffers + table.fixed_bytes))
    return out


def expand(table: Table, layer_set: LayerSet) -> Expanded:
    """`layer_set`'s schedule positions, copy bytes per layer, kinds of layer and buffer keys."""
    wanted = {i for a, b in layer_set.intervals for i in range(a, b)}
    positions = tuple(i for a, b in layer_set.intervals for i in range(a, b) if table.layer_has[i])
    kinds: dict[tuple[tuple[Key, int], ...], list[int]] = {}
    for index, layer in enumerate(positions):
        kinds.setdefault(table.layer_keys[layer], []).append(index)
    rows = _rows(table, positions)
    users: dict[Key, tuple[int, list[int]]] = {}
    for number, signature in enumerate(kinds):
        for key, nbytes in signature:
            if key not in rows:
                users.setdefault(key, (nbytes, []))[1].append(number)
    return Expanded(layer_set=layer_set, positions=positions,
                    copy_bytes=tuple(c if i in wanted else 0 for i, c in enumerate(table.copied_bytes)),
                    kinds=tuple(tuple(v) for v in kinds.values()),
                    keys=tuple((nbytes, tuple(used)) for nbytes, used in users.values()),
                    cycles=stack_cycles(positions, table.stack_ranges),
                    cache_bytes=sum(table.cache_bytes[i] for i in positions) if table.cache_bytes else 0,
                    rows_bytes=sum(rows.values()))


def buffer_bytes(expanded: Expanded, depth: int) -> int:
    """Static buffer bytes at `depth`: each key x the slots its positions use (``i mod depth``,
    per cycle: `cycle_slots`), the expert rows once per key, and the expert caches of its
    layers."""
    if expanded.cycles:
        slot_of = cycle_slots(len(expanded.positions), depth, expanded.cycles)
        slots = [{slot_of[index] for index in kind} for kind in expanded.kinds]
    else:
        slots = [{index % depth for index in kind} for kind in expanded.kinds]
    return expanded.cache_bytes + expanded.rows_bytes + sum(
        nbytes * len(slots[used[0]] if len(used) == 1 else set().union(*(slots[k] for k in used)))
        for nbytes, used in expanded.keys)
