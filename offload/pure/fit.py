"""`fit`: the fastest offloading configuration whose device memory fits a budget.

Candidates: backend none (all weights resident); prefetch over group size, number in
group and prefetch depth; UVA over byte budgets. A candidate's device bytes are its
resident weights + static buffers + the largest layer copied on demand (UVA without
zero-copy views) + the caller's reserve; its time is `estimate`'s steady-state step.

Plans are made against `planning_env(env, profile)`: on a machine without CUDA that is a
CUDA platform describing the profile's device, because `make_plan` frees no device memory
when the compute device is the CPU.

The search, and how it is kept fast (a 126-layer model well under a second, where one
`make_plan` alone takes milliseconds). Only the chosen configuration gets a real plan;
the others are predicted from a per-layer table of the model (`_Table`) that reproduces
the planner's selection, buffers and byte totals (tests hold the two equal), with the
same step simulation `estimate` uses.

1. None: if every resident weight plus the reserve fits, it wins outright (no plan with
   offloading is faster than resident compute) and nothing else is searched.
2. UVA: time grows and device bytes shrink with the bytes offloaded, so only the smallest
   fitting prefix of parameters (in layer order) is a candidate.
3. Prefetch: group sizes 1..layers (a larger size repeats a tail run) and 1..size layers
   per group; pairs that offload the same layers are merged (the smallest size wins).
   For each set of layers a lower bound on its step, max(resident compute, copy bytes /
   link rate), and its fewest device bytes (depth 1) come from prefix sums; sets that
   cannot fit are dropped; the rest are simulated in order of that bound and skipped once
   the bound cannot beat the last runner-up. Depths 1..min(positions, max_prefetch_step)
   are simulated upward, stopping at the first that reaches the bound.

Ranking: least predicted step (equal within a relative 1e-9), then fewer host bytes, then
fewer device bytes, then none < prefetch < uva, then smaller group size, number in group,
depth and UVA budget. Equal inputs give equal results.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence

import attrs

from offload.errors import ConfigError, PlanError
from offload.pure.config import OffloadConfig, segment_matches
from offload.pure.decisions import decide_pinning, decide_uva
from offload.pure.env import EnvSnapshot
from offload.pure.estimate import StepEstimate, Workload, estimate, layer_compute_seconds, simulate_prefetch
from offload.pure.plan import OffloadPlan
from offload.pure.planner import make_plan
from offload.pure.profiles import DeviceProfile, planning_env
from offload.pure.schedule import PrefetchSchedule, schedule_prefetch
from offload.pure.select import is_on_compute_device
from offload.pure.serialize import to_data
from offload.pure.spec import ModelSpec, ParamSpec
from offload.pure.units import format_bytes

__all__ = [
    "DEFAULT_MAX_PREFETCH_STEP",
    "DEFAULT_RESERVE_BYTES",
    "DEFAULT_RUNNERS_UP",
    "FitCandidate",
    "FitResult",
    "fit",
]

#: Device bytes set aside for everything that is not a weight, unless the caller says.
DEFAULT_RESERVE_BYTES = 0
#: The deepest prefetch searched: deeper ones rarely help and cost a buffer slot each.
DEFAULT_MAX_PREFETCH_STEP = 16
#: How many runners-up a result lists.
DEFAULT_RUNNERS_UP = 3

_TOL = 1e-9
_BACKEND_ORDER = {"none": 0, "prefetch": 1, "uva": 2}
_MAX_EXACT_SIGNATURES = 16
Key = tuple[str, tuple[int, ...], tuple[int, ...], str]


@attrs.frozen(kw_only=True)
class FitCandidate:
    """One configuration the search evaluated, with what it costs. Bytes and seconds.

    Attributes:
        config: the configuration (backend explicit).
        step_seconds: predicted steady-state step time.
        limit_seconds: max(resident compute, offloaded bytes per step / pinned rate).
        resident_bytes: weights that stay in device memory.
        buffer_bytes: static prefetch buffers in device memory.
        transient_bytes: the largest layer's on-demand copy (0 unless UVA falls back).
        reserve_bytes: the caller's reserve.
        host_bytes: host memory for the host copies.
    """

    config: OffloadConfig
    step_seconds: float
    limit_seconds: float
    resident_bytes: int
    buffer_bytes: int
    transient_bytes: int
    reserve_bytes: int
    host_bytes: int

    @property
    def device_bytes(self) -> int:
        """resident + buffers + transient + reserve: what must fit the budget."""
        return self.resident_bytes + self.buffer_bytes + self.transient_bytes + self.reserve_bytes


@attrs.frozen(kw_only=True)
class FitResult:
    """What `fit` chose, and why.

    Attributes:
        budget_bytes: the device budget, bytes.
        chosen: the winning candidate (its figures are those of `plan` and `estimate`).
        plan: the winning plan, made against `env`.
        estimate: its predicted step.
        runners_up: the next best candidates that fit, best first, one per outcome (step,
            host bytes, device bytes); none when backend none fits.
        profile: the device profile used.
        workload: the workload used.
        env: the snapshot the plan was made against (see `planning_env`).
        simulated: candidates whose step was simulated.
        considered: distinct candidates the search looked at.
    """

    budget_bytes: int
    chosen: FitCandidate
    plan: OffloadPlan
    estimate: StepEstimate
    runners_up: tuple[FitCandidate, ...]
    profile: DeviceProfile
    workload: Workload
    env: EnvSnapshot
    simulated: int
    considered: int

    def to_json(self, *, indent: int | None = None) -> str:
        """The whole result as JSON (values as `offload.pure.serialize.to_data` lays them out)."""
        return json.dumps(to_data(self), indent=indent)


@attrs.frozen(kw_only=True)
class _Cross:
    """A tied storage of several layers that can be offloaded: only when all of them are."""

    layers: frozenset[int]
    host_bytes: int
    members: tuple[tuple[int, Key, int], ...]  # (layer, buffer key, bytes copied for it)


@attrs.frozen(kw_only=True)
class _LayerSet:
    """The layers one (group size, number in group) pair offloads, and what bounds it."""

    group_size: int
    num_in_group: int
    intervals: tuple[tuple[int, int], ...]  # [start, stop) runs of wanted layers
    cross: tuple[_Cross, ...]  # tied storages offloaded with it
    host_bytes: int
    bound_seconds: float  # max(resident compute, copy bytes / copy rate): no depth beats it
    min_device_bytes: int  # a lower bound over depths (exact for a few layer kinds)


@attrs.frozen(kw_only=True)
class _Table:
    """The model, per layer, as the search needs it (what `make_plan` would select)."""

    compute: tuple[float, ...]  # resident compute per layer, seconds
    resident_bytes: int  # weights on the compute device with nothing offloaded
    layer_bytes: tuple[int, ...]  # per layer: offloadable storages confined to it
    layer_has: tuple[bool, ...]  # per layer: it has one
    layer_keys: tuple[tuple[tuple[Key, int], ...], ...]  # their buffer keys and slot bytes
    cross: tuple[_Cross, ...]
    uva_groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (bytes, ((layer, bytes read), ...))
    pinned: bool
    uva_enabled: bool
    profile: DeviceProfile
    workload: Workload
    segments: tuple[str, ...]
    reserve: int

    @property
    def copy_rate(self) -> float:
        return self.profile.h2d_bytes_per_s(pinned=self.pinned)


def _key(param: ParamSpec) -> Key:
    return (param.name, param.shape, param.stride, param.dtype)


def _build_table(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, workload: Workload,
                 segments: tuple[str, ...], reserve: int) -> _Table:
    """Group storages and decide eligibility exactly as `make_plan` does."""
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
    cross: list[_Cross] = []
    uva: list[tuple[int, tuple[tuple[int, int], ...]]] = []
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
        if len(moved) == 1:
            layer_bytes[first_layer] += first.nbytes
            layer_has[first_layer] = True
            keys[first_layer].append((_key(first), first.nbytes))
        else:
            cross.append(_Cross(layers=frozenset(i for i, _ in group), host_bytes=first.nbytes,
                                members=tuple((i, _key(p), p.nbytes) for i, p in moved)))
    return _Table(
        compute=layer_compute_seconds(numels, weight, profile, workload), resident_bytes=resident,
        layer_bytes=tuple(layer_bytes), layer_has=tuple(layer_has),
        layer_keys=tuple(tuple(sorted(set(k))) for k in keys), cross=tuple(cross), uva_groups=tuple(uva),
        pinned=pin.pin, uva_enabled=decide_uva(env, pin).enabled, profile=profile, workload=workload,
        segments=segments, reserve=reserve,
    )


def _candidate(table: _Table, config: OffloadConfig, *, busy: Sequence[float], offloaded_bytes: int,
               host: int, buffers: int = 0, transient: int = 0,
               copy: Sequence[float] = (), positions: Sequence[int] = (),
               schedule: PrefetchSchedule | None = None) -> FitCandidate:
    """A candidate's figures, computed as `estimate` computes them."""
    stalls = simulate_prefetch(busy, copy, positions, schedule)[0] if schedule is not None and positions else ()
    step = sum(b + s for b, s in zip(busy, stalls, strict=True)) if stalls else sum(busy)
    limit = max(sum(table.compute), offloaded_bytes / table.profile.pinned_h2d_bytes_per_s)
    return FitCandidate(config=config, step_seconds=step, limit_seconds=limit,
                        resident_bytes=table.resident_bytes - host, buffer_bytes=buffers,
                        transient_bytes=transient, reserve_bytes=table.reserve, host_bytes=host)


def _none(table: _Table) -> FitCandidate:
    return _candidate(table, OffloadConfig(backend="none"), busy=table.compute, offloaded_bytes=0, host=0)


def _uva(table: _Table, budget: int) -> tuple[FitCandidate | None, FitCandidate | None]:
    """(the smallest UVA prefix that fits, the prefix that needs the fewest device bytes)."""
    fits: FitCandidate | None = None
    leanest: tuple[int, int] | None = None  # (device bytes, prefix length)
    per_layer = [0] * len(table.compute)
    host = largest = 0
    for m, (nbytes, reads) in enumerate(table.uva_groups, start=1):
        host += nbytes
        for layer, moved in reads:
            per_layer[layer] += moved
            largest = max(largest, per_layer[layer])
        transient = 0 if table.uva_enabled else largest
        device = table.resident_bytes - host + transient + table.reserve
        if host > 0 and (leanest is None or device < leanest[0]):
            leanest = (device, m)
        if host > 0 and device <= budget:
            fits = _uva_candidate(table, m)
            break
    return fits, (_uva_candidate(table, leanest[1]) if leanest is not None else None)


def _uva_candidate(table: _Table, m: int) -> FitCandidate:
    per_layer = [0] * len(table.compute)
    for _, reads in table.uva_groups[:m]:
        for layer, moved in reads:
            per_layer[layer] += moved
    host = sum(nbytes for nbytes, _ in table.uva_groups[:m])
    rate = table.profile.zero_copy_bytes_per_s if table.uva_enabled else table.copy_rate
    busy = [c + b / rate for c, b in zip(table.compute, per_layer, strict=True)]
    config = OffloadConfig(backend="uva", uva_max_bytes=host, param_filter=table.segments)
    return _candidate(table, config, busy=busy, offloaded_bytes=sum(per_layer), host=host,
                      transient=0 if table.uva_enabled else max(per_layer))


def _layer_sets(table: _Table) -> list[_LayerSet]:
    """Every distinct non-empty set of layers a (group size, number in group) pair offloads."""
    num = len(table.compute)
    prefix_bytes, prefix_has = [0], [0]
    for b, h in zip(table.layer_bytes, table.layer_has, strict=True):
        prefix_bytes.append(prefix_bytes[-1] + b)
        prefix_has.append(prefix_has[-1] + h)
    signatures: dict[tuple[tuple[Key, int], ...], list[int]] = {}
    for layer, keys in enumerate(table.layer_keys):
        if keys:
            signatures.setdefault(keys, []).append(layer)
    exact = len(signatures) <= _MAX_EXACT_SIGNATURES
    prefix_sig = {sig: _prefix([i in set(ls) for i in range(num)]) for sig, ls in signatures.items()} if exact else {}
    compute = sum(table.compute)
    rate = table.copy_rate
    having = [i for i, has in enumerate(table.layer_has) if has]
    everywhere = len(having) == num
    seen: set[tuple[tuple[object, ...], tuple[_Cross, ...]]] = set()
    out: list[_LayerSet] = []
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
            cross = tuple(c for c in table.cross if all(i % g >= g - k for i in c.layers))
            # Pairs that offload the same storages give the same plan: keep the first. When
            # some layers have nothing to offload, compare the layers that do.
            same = intervals if everywhere else tuple(i for i in having if i % g >= g - k)
            if (same, cross) in seen:
                continue
            seen.add((same, cross))
            if not cross and not any(prefix_has[b] - prefix_has[a] for a, b in intervals):
                continue  # offloads nothing: the same as backend none
            host = sum(prefix_bytes[b] - prefix_bytes[a] for a, b in intervals)
            copied = host + sum(m[2] for c in cross for m in c.members)
            host += sum(c.host_bytes for c in cross)
            # At least one slot per key present; without an exact count, no buffers at all.
            present = {key: nbytes for sig, ps in prefix_sig.items() if any(ps[b] - ps[a] for a, b in intervals)
                       for key, nbytes in sig}
            buffers = sum(present.values())
            out.append(_LayerSet(group_size=g, num_in_group=k, intervals=intervals, cross=cross, host_bytes=host,
                                 bound_seconds=max(compute, copied / rate),
                                 min_device_bytes=table.resident_bytes - host + buffers + table.reserve))
    return out


def _prefix(flags: Sequence[bool]) -> list[int]:
    out = [0]
    for flag in flags:
        out.append(out[-1] + flag)
    return out


@attrs.frozen(kw_only=True)
class _Expanded:
    """A layer set spelled out: its schedule positions, what each copies, its buffer keys."""

    layer_set: _LayerSet
    positions: tuple[int, ...]  # offloaded layers, in order
    copy_bytes: tuple[int, ...]  # per layer of the model
    kinds: tuple[tuple[int, ...], ...]  # position indices of each kind (same buffer keys)
    keys: tuple[tuple[int, tuple[int, ...]], ...]  # per buffer key: (slot bytes, kinds using it)


def _expand(table: _Table, layer_set: _LayerSet) -> _Expanded:
    copy = list(table.layer_bytes)
    keys = {i: list(table.layer_keys[i]) for a, b in layer_set.intervals for i in range(a, b) if table.layer_has[i]}
    for cross in layer_set.cross:
        for layer, key, nbytes in cross.members:
            copy[layer] += nbytes
            keys.setdefault(layer, []).append((key, nbytes))
    wanted = {i for a, b in layer_set.intervals for i in range(a, b)}
    positions = tuple(sorted(keys))
    crossed = {layer for cross in layer_set.cross for layer, _, _ in cross.members}
    kinds: dict[tuple[tuple[Key, int], ...], list[int]] = {}
    for index, layer in enumerate(positions):
        signature = tuple(sorted(keys[layer])) if layer in crossed else table.layer_keys[layer]
        kinds.setdefault(signature, []).append(index)
    users: dict[Key, tuple[int, list[int]]] = {}
    for number, signature in enumerate(kinds):
        for key, nbytes in signature:
            users.setdefault(key, (nbytes, []))[1].append(number)
    return _Expanded(layer_set=layer_set, positions=positions,
                     copy_bytes=tuple(c if i in wanted else 0 for i, c in enumerate(copy)),
                     kinds=tuple(tuple(v) for v in kinds.values()),
                     keys=tuple((nbytes, tuple(used)) for nbytes, used in users.values()))


def _buffer_bytes(expanded: _Expanded, depth: int) -> int:
    """Static buffer bytes at `depth`: each key x the slots its positions use (``i mod depth``)."""
    slots = [{index % depth for index in kind} for kind in expanded.kinds]
    return sum(nbytes * len(slots[used[0]] if len(used) == 1 else set().union(*(slots[k] for k in used)))
               for nbytes, used in expanded.keys)


def _prefetch(table: _Table, expanded: _Expanded, depth: int, buffers: int) -> FitCandidate:
    ls = expanded.layer_set
    config = OffloadConfig(backend="prefetch", group_size=ls.group_size, num_in_group=ls.num_in_group,
                           prefetch_step=depth, param_filter=table.segments)
    rate = table.copy_rate
    return _candidate(table, config, busy=table.compute, offloaded_bytes=sum(expanded.copy_bytes),
                      host=ls.host_bytes, buffers=buffers,
                      copy=[expanded.copy_bytes[i] / rate for i in expanded.positions],
                      positions=expanded.positions, schedule=_schedule(len(expanded.positions), depth))


@functools.lru_cache(maxsize=4096)
def _schedule(num_offloaded: int, depth: int) -> PrefetchSchedule:
    """`schedule_prefetch`, remembered: the search asks for the same few many times."""
    return schedule_prefetch(num_offloaded, depth)


def _best_depth(table: _Table, layer_set: _LayerSet, budget: int, max_step: int) -> tuple[FitCandidate | None, int]:
    """The best fitting depth for one layer set, and how many depths were simulated."""
    expanded = _expand(table, layer_set)
    best: FitCandidate | None = None
    runs = 0
    # One kind of layer at every position: buffers grow with depth, so stop at the first misfit.
    monotone = len(expanded.kinds) == 1
    for depth in range(1, min(len(expanded.positions), max_step) + 1):
        buffers = _buffer_bytes(expanded, depth)
        if table.resident_bytes - layer_set.host_bytes + buffers + table.reserve > budget:
            if monotone:
                break
            continue
        candidate = _prefetch(table, expanded, depth, buffers)
        runs += 1
        if best is None or _compare(candidate, best) < 0:
            best = candidate
        if candidate.step_seconds <= layer_set.bound_seconds or _close(candidate.step_seconds, layer_set.bound_seconds):
            break  # no deeper prefetch is faster than the bound
    return best, runs


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _TOL * max(abs(a), abs(b))


def _tie_key(c: FitCandidate) -> tuple[int, int, int, int, int, int, int]:
    cfg = c.config
    return (c.host_bytes, c.device_bytes, _BACKEND_ORDER[cfg.backend], cfg.group_size,
            cfg.num_in_group, cfg.prefetch_step, cfg.uva_max_bytes)


def _compare(a: FitCandidate, b: FitCandidate) -> int:
    """Negative when `a` ranks before `b` (see the module docstring), 0 when equal."""
    if not _close(a.step_seconds, b.step_seconds):
        return -1 if a.step_seconds < b.step_seconds else 1
    ta, tb = _tie_key(a), _tie_key(b)
    return -1 if ta < tb else (1 if ta > tb else 0)


def _same_outcome(a: FitCandidate, b: FitCandidate) -> bool:
    return _close(a.step_seconds, b.step_seconds) and (a.host_bytes, a.device_bytes) == (b.host_bytes, b.device_bytes)


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}", name=name, value=value)
    return value


def fit(
    spec: ModelSpec,
    env: EnvSnapshot,
    profile: DeviceProfile,
    workload: Workload,
    device_budget_bytes: int,
    *,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    param_filter: Sequence[str] = (),
    max_prefetch_step: int = DEFAULT_MAX_PREFETCH_STEP,
    runners_up: int = DEFAULT_RUNNERS_UP,
) -> FitResult:
    """The configuration with the least predicted step time that fits the budget.

    Args:
        spec: the model.
        env: the user's switches and this machine (`planning_env` says what is used).
        profile: the target device's rates.
        workload: tokens per step, or a measured resident step time.
        device_budget_bytes: device bytes that resident weights, static buffers, on-demand
            copies and the reserve may take together.
        reserve_bytes: device bytes kept for everything else (activations, caches).
        param_filter: dotted name segments; only matching parameters are offloaded.
        max_prefetch_step: the deepest prefetch searched (>= 1).
        runners_up: how many runners-up to return (>= 0).

    Returns:
        The chosen configuration with its plan and estimate, and the runners-up.

    Raises:
        ConfigError: a negative budget or reserve, a bad filter segment, a bad limit.
        PlanError: nothing fits; the message names the leanest configuration, the device
            bytes it needs and by how many bytes it misses the budget.
    """
    budget = _check_int("device_budget_bytes", device_budget_bytes, 0)
    reserve = _check_int("reserve_bytes", reserve_bytes, 0)
    max_step = _check_int("max_prefetch_step", max_prefetch_step, 1)
    keep = _check_int("runners_up", runners_up, 0)
    segments = OffloadConfig(param_filter=tuple(param_filter)).param_filter  # validates the segments
    penv = planning_env(env, profile)
    table = _build_table(spec, penv, profile, workload, segments, reserve)

    none = _none(table)
    if none.device_bytes <= budget:
        return _result(spec, penv, table, budget, none, (), simulated=0, considered=1)

    top: list[FitCandidate] = []
    rank = functools.cmp_to_key(_compare)

    def offer(candidate: FitCandidate) -> None:
        # Keep one candidate per outcome (step, host bytes, device bytes): runners-up that
        # differ only in which layers they offload tell the user nothing.
        same = next((c for c in top if _same_outcome(c, candidate)), None)
        if same is not None and _compare(candidate, same) >= 0:
            return
        top[:] = sorted([c for c in top if c is not same] + [candidate], key=rank)[:keep + 1]

    uva, uva_leanest = _uva(table, budget)
    leanest = [none] + ([uva_leanest] if uva_leanest is not None else [])
    simulated = 0
    if uva is not None:
        offer(uva)
    sets = _layer_sets(table)
    everything = next((s for s in sets if s.group_size == 1), None)  # g=1, k=1: every layer
    if everything is not None:
        leanest.append(_prefetch(table, _expand(table, everything), 1, _buffer_bytes(_expand(table, everything), 1)))
    for layer_set in sorted((s for s in sets if s.min_device_bytes <= budget),
                            key=lambda s: (s.bound_seconds, s.host_bytes, s.group_size, s.num_in_group)):
        if len(top) > keep:
            worst = top[-1]
            if _close(layer_set.bound_seconds, worst.step_seconds):
                least = (layer_set.host_bytes, layer_set.min_device_bytes, _BACKEND_ORDER["prefetch"],
                         layer_set.group_size, layer_set.num_in_group, 1, 0)
                if least >= _tie_key(worst):
                    continue  # at best a tie on time, and it loses the tie
            elif layer_set.bound_seconds > worst.step_seconds:
                break  # sorted by bound: no later set can rank either
        best, runs = _best_depth(table, layer_set, budget, max_step)
        simulated += runs
        if best is not None:
            offer(best)
    if not top:
        lean = min(leanest, key=lambda c: (c.device_bytes, _BACKEND_ORDER[c.config.backend]))
        over = lean.device_bytes - budget
        raise PlanError(
            f"no configuration fits the device budget of {format_bytes(budget)} ({budget} bytes): the leanest, "
            f"{_describe(lean.config)}, needs {format_bytes(lean.device_bytes)} ({lean.device_bytes} bytes = "
            f"resident {lean.resident_bytes} + buffers {lean.buffer_bytes} + on-demand {lean.transient_bytes} + "
            f"reserve {lean.reserve_bytes}), {over} bytes ({format_bytes(over)}) more than the budget",
            name="device_budget_bytes",
            value=budget,
        )
    return _result(spec, penv, table, budget, top[0], tuple(top[1:]),
                   simulated=simulated + (uva is not None), considered=1 + (uva is not None) + len(sets))


def _describe(config: OffloadConfig) -> str:
    if config.backend == "prefetch":
        return (f"prefetch with group_size {config.group_size}, num_in_group {config.num_in_group}, "
                f"prefetch_step {config.prefetch_step}")
    if config.backend == "uva":
        return f"uva with uva_max_bytes {config.uva_max_bytes}"
    return "backend none"


def _result(spec: ModelSpec, penv: EnvSnapshot, table: _Table, budget: int, best: FitCandidate,
            others: tuple[FitCandidate, ...], *, simulated: int, considered: int) -> FitResult:
    """Make the real plan of the winner and check it against the search's prediction."""
    plan = make_plan(spec, best.config, penv)
    step = estimate(plan, table.profile, table.workload)
    chosen = attrs.evolve(
        best, step_seconds=step.step_seconds, limit_seconds=step.limit_seconds,
        resident_bytes=plan.device_bytes_resident, buffer_bytes=plan.device_bytes_buffers,
        transient_bytes=max((layer.on_demand_bytes for layer in step.layers), default=0),
        host_bytes=plan.host_bytes,
    )
    if chosen.device_bytes != best.device_bytes or not _close(chosen.step_seconds, best.step_seconds):
        raise PlanError(
            f"internal inconsistency: the search predicted {best.device_bytes} device bytes and a "
            f"{best.step_seconds} s step for {_describe(best.config)}, its plan takes "
            f"{chosen.device_bytes} bytes and {chosen.step_seconds} s; please report this",
            name="config", value=best.config,
        )
    return FitResult(budget_bytes=budget, chosen=chosen, plan=plan, estimate=step, runners_up=others,
                     profile=table.profile, workload=table.workload, env=penv,
                     simulated=simulated, considered=considered)
