"""Predict the steady-state time of one step (a forward over every layer) under a plan.

The model, per layer ``l`` of a step:

- *compute*: the layer's time with every weight resident. From the profile it is the
  larger of ``2 x parameters x tokens / bf16 FLOP/s`` and ``weight bytes / weight-read
  bytes/s`` (a roofline: few tokens are bound by reading the weights); given a measured
  resident step time, that time split over the layers in proportion to their parameters.
- *prefetch copy*: ``copy bytes / link rate`` on the one host-to-device link, at the
  pinned or pageable rate the plan's pin decision implies. Copies are issued as the
  plan's schedule says (``initial`` before the first pass, then ``next_after[i]`` right
  after offloaded position ``i`` finishes), run one at a time in issue order, and overlap
  compute. A layer starts when the layer before it has finished and its own copy has
  landed; the wait is its *stall*. A layer alone in its slot
  (`PrefetchSchedule.kept_positions`) is copied once, before the first pass, and keeps
  its slot: in the steady state it moves nothing and never stalls (copies an old
  schedule names for it are not issued, `PrefetchSchedule.issued_after`, as the
  executor does not issue them); its bytes are reported as *loaded once*, not per step.
- *UVA read*: ``UVA bytes / (pinned rate x zero-copy fraction)``, added to the layer.
- *on demand*: ``bytes / link rate`` (pinned or pageable per the plan), added to the
  layer; nothing overlaps it.
- *experts*, given a routing trace (`estimate`'s ``routing``): an expert cache's experts
  are not in its layer's prefetch copy. At the module's call its misses are copied from
  host memory (``miss bytes / link rate``, after ``miss bytes / disk rate`` where its
  experts are on the disk tier) and its hits from their slots into their rows (``2 x hit
  bytes / weight-read rate``: a read and a write; 0 where the profile has no such rate),
  and the layer waits for them (no expert is copied ahead of its call). The misses' reads
  and copies take the one disk and the one link: they queue behind the reads and copies
  issued before them (one copy stream), and that wait is the layer's stall. The misses and
  hits per step are the trace's mean through the plan's policy
  (`offload.pure.experts.expected`). Without a trace, the worst case: at each call over T
  tokens, as many of the min(E, T x top_k) experts it may route as can miss do (all E
  where the module does not say its top-k, `ExpertGroup.top_k`; `bounded_loads`), costed
  as a trace's.

Passes are simulated with event times until the pass duration repeats (period 1 to 4
passes), and the steady-state passes are reported, because with circular prefetch the
first layers of the next step load during this one. The limit a step cannot beat is
``max(resident compute, offloaded bytes per step / pinned rate)`` (FACTS.md), counting
the bytes that cross the link every step (layers loaded once are not among them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from offload.errors import PlanError
from offload.pure.experts.expected import ExpectedLoads, LayerLoad, bounded_loads, expected_loads
from offload.pure.experts.values import RoutingTrace, served_refs
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.fit.step import MAX_TOKENS_PER_STEP, DiskReads, LayerEstimate, StepEstimate, Workload
from offload.pure.plan.plan import OffloadPlan, Placement
from offload.pure.plan.schedule import PrefetchSchedule

__all__ = [
    "DiskReads",
    "MAX_TOKENS_PER_STEP",
    "LayerEstimate",
    "StepEstimate",
    "Workload",
    "estimate",
    "expert_seconds",
    "hit_seconds",
    "layer_compute_seconds",
    "simulate_prefetch",
]

_MAX_PASSES = 48
_MAX_PERIOD = 4
_REL_TOL = 1e-9
def layer_compute_seconds(
    numels: Sequence[int], weight_bytes: Sequence[int], profile: DeviceProfile, workload: Workload,
    stack_ranges: tuple[tuple[int, int], ...] = (),
) -> tuple[float, ...]:
    """Each layer's resident compute time, seconds.

    Args:
        numels: parameters (elements) per layer; FLOPs are ``2 x numel x tokens``.
        weight_bytes: bytes of weights each layer reads (tied storage once per layer).
        profile: throughput and weight-read rate.
        workload: tokens per step (per stack, `Workload.stack_tokens`), and a measured
            resident step time if there is one.
        stack_ranges: the layers' stacks (`ModelSpec.stack_ranges`), for `stack_tokens`.

    Returns:
        Per layer: with a measured step time, that time x numel / total numel (evenly when
        there are no parameters); else max(FLOPs / FLOP/s, weight bytes / weight-read rate).
    """
    measured = workload.resident_step_seconds
    if measured is not None:
        total = sum(numels)
        if total == 0:
            return tuple(measured / len(numels) for _ in numels)
        return tuple(measured * n / total for n in numels)
    tokens = workload.tokens_by_layer(stack_ranges, len(numels))
    flops = profile.bf16_flops_per_s
    read = profile.weight_read_bytes_per_s
    return tuple(
        max(2.0 * n * t / flops, b / read if read is not None else 0.0)
        for n, b, t in zip(numels, weight_bytes, tokens, strict=True)
    )


def simulate_prefetch(
    busy: Sequence[float], copy: Sequence[float], positions: Sequence[int], schedule: PrefetchSchedule,
    disk: DiskReads | None = None, at_call: Mapping[int, tuple[float, float]] | None = None,
) -> tuple[tuple[float, ...], int, int]:
    """Event-time simulation of repeated passes; the steady state's stall per layer.

    Args:
        busy: per layer, seconds it occupies the compute stream once it starts, besides
            `at_call`.
        copy: per offloaded position, seconds its copy occupies the link.
        positions: per offloaded position, its layer index (increasing).
        schedule: initial copies and `next_after`, as `schedule_prefetch` builds them;
            the copies simulated are those issued (`PrefetchSchedule.issued_after`: none
            of a kept position after the initial copies).
        disk: the disk tier, if any: one disk reads the disk positions, each after the
            copy out of its staging buffer's previous occupant has landed; the host
            thread waits for a read before it issues the read position's copy (that
            wait is the layer's stall, as the executor's `StagingRing.ready` is).
        at_call: per offloaded layer with expert caches, (its misses' disk reads, their
            copies' seconds on the link) at its experts' call: once the layer has started,
            the reads queue on the disk behind the reads issued before, then the copies on
            the link behind every copy issued before (one copy stream), and the layer
            waits for them; waiting for the disk or the link is stall.

    Returns:
        (stall seconds per layer averaged over the steady-state period, passes simulated,
        period in passes).

    Raises:
        PlanError: `positions`, `copy` and the schedule disagree on how many positions
            there are.
    """
    if not len(positions) == len(copy) == schedule.num_positions:
        raise PlanError(
            f"{len(positions)} positions, {len(copy)} copy times and a schedule of "
            f"{schedule.num_positions} positions do not match",
            name="positions", value=len(positions),
        )
    # Layers that are not offloaded never wait: only the compute between offloaded layers
    # matters, so a pass steps from one offloaded position to the next.
    before = [sum(busy[(positions[i - 1] + 1 if i else 0):layer]) for i, layer in enumerate(positions)]
    after = sum(busy[positions[-1] + 1:]) if positions else sum(busy)
    own = [busy[layer] for layer in positions]
    calls = [at_call.get(layer, (0.0, 0.0)) if at_call else (0.0, 0.0) for layer in positions]
    ready = [0.0] * len(positions)  # when the copy for a position's next run lands
    issued_after = schedule.issued_after
    read = disk.seconds if disk is not None else (0.0,) * len(positions)
    next_of = dict(disk.next_of) if disk is not None else {}
    read_done = [0.0] * len(positions)  # when a disk position's read into its buffer ends
    disk_free = 0.0
    for first in disk.first if disk is not None else ():
        disk_free += read[first]
        read_done[first] = disk_free
    link_free = 0.0
    now = 0.0

    def issue(target: int, at: float) -> float:
        """Issue `target`'s copy at `at`; when the host thread goes on (after its read)."""
        nonlocal link_free, disk_free
        if read[target]:
            at = max(at, read_done[target])
        link_free = max(link_free, at) + copy[target]
        ready[target] = link_free
        following = next_of.get(target, target)
        if read[target] and following != target:
            disk_free = max(disk_free, link_free) + read[following]
            read_done[following] = disk_free
        return at

    for first in schedule.initial:
        issue(first, 0.0)
    durations: list[float] = []
    waits: list[list[float]] = []
    while True:
        started = now
        pass_waits = [0.0] * len(positions)
        for i, target in enumerate(issued_after):
            now += before[i]
            if ready[i] > now:
                pass_waits[i] = ready[i] - now
                now = ready[i]
            read_first, on_link = calls[i]
            if read_first:  # the misses' reads take the one disk, after the reads issued before
                if disk_free > now:
                    pass_waits[i] += disk_free - now
                    now = disk_free
                disk_free = now = now + read_first
            if on_link:
                if link_free > now:
                    pass_waits[i] += link_free - now
                    now = link_free
                link_free = now = now + on_link
            now += own[i]
            if target is not None:
                went_on = issue(target, now)
                pass_waits[i] += went_on - now
                now = went_on
        now += after
        durations.append(now - started)
        waits.append(pass_waits)
        period = _period(durations)
        if period or len(durations) >= _MAX_PASSES:
            mean = _average(waits[-(period or _MAX_PERIOD):])
            stalls = [0.0] * len(busy)
            for i, layer in enumerate(positions):
                stalls[layer] = mean[i]
            return tuple(stalls), len(durations), period or _MAX_PERIOD


def _period(durations: list[float]) -> int:
    """The steady state's period in passes once the last durations repeat, else 0."""
    for period in range(1, _MAX_PERIOD + 1):
        if len(durations) >= 2 * period + 1 and all(
            math.isclose(durations[-i], durations[-i - period], rel_tol=_REL_TOL, abs_tol=1e-15)
            for i in range(1, period + 1)
        ):
            return period
    return 0


def _average(rows: list[list[float]]) -> tuple[float, ...]:
    return tuple(sum(column) / len(rows) for column in zip(*rows, strict=True))


def estimate(plan: OffloadPlan, profile: DeviceProfile, workload: Workload, *,
             disk: DiskReads | None = None, routing: RoutingTrace | None = None) -> StepEstimate:
    """Predict the steady-state step time of `plan` on `profile` for `workload`.

    Args:
        plan: the plan; its pin decision sets the copy rate, its UVA decision whether
            UVA-planned weights are read in place (UVA) or copied on demand.
        profile: the device's rates.
        workload: tokens per step, or a measured resident step time.
        disk: the plan's disk tier as `offload.pure.disk.estimate.estimate_with_tier`
            gives it; None: every offloaded weight in host memory.
        routing: the routed experts per step (`RoutingTrace`, recorded by
            `offload.executors.experts.record_routing` or drawn by
            `offload.pure.experts.replay.zipf_trace`): the expert caches' copies are its
            mean per step (`LayerEstimate.expert_bytes`). None: the worst case (see the
            module docstring: bounded by each module's top-k).

    Returns:
        The estimate, one `LayerEstimate` per layer index up to the last one with a
        parameter.

    Raises:
        PlanError: `routing` has no steps, lacks an experts module the plan caches, names
            one the model does not have, or gives one another expert count
            (`offload.pure.experts.expected`).
    """
    num_layers = max((p.layer for p in plan.params), default=-1) + 1
    numels = [0] * num_layers
    weight = [0] * num_layers
    moved = {placement: [0] * num_layers for placement in (Placement.PREFETCH, Placement.UVA, Placement.ON_DEMAND)}
    loads = None if routing is None else expected_loads(plan.experts, routing, {(p.layer, p.name) for p in plan.params})
    per_call = loads.layers if loads is not None else \
        bounded_loads(plan.experts, workload.tokens_by_layer(plan.stack_ranges, num_layers))
    served = served_refs(plan.experts)  # copied at their calls, never with their layers
    for p in plan.params:
        numels[p.layer] += math.prod(p.shape)
        if p.tied_to is not None and p.tied_to[0] == p.layer:
            continue  # the same storage as a parameter of this layer: read and moved once
        weight[p.layer] += p.nbytes
        if p.placement is Placement.RESIDENT:
            continue
        if (p.layer, p.name) not in served:
            moved[p.placement][p.layer] += p.nbytes
    compute = layer_compute_seconds(numels, weight, profile, workload, plan.stack_ranges)
    return _from_loads(
        compute=compute,
        copy_bytes=moved[Placement.PREFETCH],
        uva_bytes=moved[Placement.UVA],
        on_demand_bytes=moved[Placement.ON_DEMAND],
        positions=plan.offloaded_layers,
        schedule=plan.schedule,
        pinned=plan.pin.pin,
        profile=profile,
        workload=workload,
        disk=disk,
        load_of={load.layer: load for load in per_call},
        experts=loads,
    )


def _from_loads(
    *,
    compute: Sequence[float],
    copy_bytes: Sequence[int],
    uva_bytes: Sequence[int],
    on_demand_bytes: Sequence[int],
    positions: Sequence[int],
    schedule: PrefetchSchedule,
    pinned: bool,
    profile: DeviceProfile,
    workload: Workload,
    disk: DiskReads | None = None,
    load_of: Mapping[int, LayerLoad] | None = None,
    experts: ExpectedLoads | None = None,
) -> StepEstimate:
    """The estimate from per-layer loads, which `estimate` reads off a plan.

    Args:
        compute: resident compute per layer, seconds.
        copy_bytes: bytes prefetched per layer, each time the layer is copied (a layer
            alone in its slot is copied once: its bytes become `loaded_once_bytes`).
        uva_bytes, on_demand_bytes: bytes per layer per step, by placement.
        positions: the offloaded layers in schedule order (``plan.offloaded_layers``).
        schedule: the prefetch schedule over `positions`.
        pinned: whether host copies are pinned (sets the copy rate).
        profile: the device's rates.
        workload: reported in the estimate.
        disk: the disk tier (`simulate_prefetch`; its `DiskReads.expert_layers` read
            their experts' misses from disk).
        load_of: per layer, what its expert caches copy at their calls per step.
        experts: the routing trace's replay, where the loads come from one; None: none.
    """
    rate = profile.h2d_bytes_per_s(pinned=pinned)
    uva_rate = profile.zero_copy_bytes_per_s
    load_of = load_of or {}
    expert_reads = _expert_reads(load_of, disk)
    # At its experts' call a layer reads its misses from disk (on the disk tier), copies
    # them over the link (simulated: they queue behind the copies issued before), and
    # copies its hits from their slots (with its compute).
    calls = {layer: (expert_reads.get(layer, 0.0), load.miss_bytes / rate) for layer, load in load_of.items()}
    hits = [hit_seconds(load_of[layer], profile) if layer in load_of else 0.0 for layer in range(len(compute))]
    waits = [calls[layer][1] + hits[layer] + calls[layer][0] if layer in calls else 0.0 for layer in range(len(compute))]
    extra = [u / uva_rate + d / rate + x for u, d, x in zip(uva_bytes, on_demand_bytes, hits, strict=True)]
    busy = [c + e for c, e in zip(compute, extra, strict=True)]
    copy = [copy_bytes[layer] / rate for layer in positions]
    once = {positions[i] for i in schedule.kept_positions}
    per_step = [0 if layer in once else n for layer, n in enumerate(copy_bytes)]
    # A disk layer is read each step unless it is alone in its staging buffer (read once).
    next_of = dict(disk.next_of) if disk is not None else {}
    read_per_step = {} if disk is None else {
        positions[i]: seconds for i, seconds in enumerate(disk.seconds) if seconds and next_of[i] != i}
    passes, period = 1, 1
    if positions:
        stalls, passes, period = simulate_prefetch(busy, copy, positions, schedule, disk, calls)
    else:
        stalls = tuple(0.0 for _ in busy)
    return StepEstimate(
        profile=profile.name,
        tokens_per_step=workload.tokens_per_step,
        stack_tokens=workload.stack_tokens,
        compute_from="flops" if workload.resident_step_seconds is None else "measured",
        copy_bytes_per_s=rate,
        pinned_bytes_per_s=profile.pinned_h2d_bytes_per_s,
        uva_bytes_per_s=uva_rate,
        layers=tuple(
            LayerEstimate(
                layer=layer,
                compute_seconds=compute[layer],
                copy_seconds=per_step[layer] / rate,
                stall_seconds=stalls[layer],
                uva_read_seconds=uva_bytes[layer] / uva_rate,
                on_demand_seconds=on_demand_bytes[layer] / rate,
                copy_bytes=per_step[layer],
                uva_bytes=uva_bytes[layer],
                on_demand_bytes=on_demand_bytes[layer],
                loaded_once_bytes=copy_bytes[layer] - per_step[layer],
                disk_read_seconds=read_per_step.get(layer, 0.0) + expert_reads.get(layer, 0.0),
                expert_seconds=waits[layer],
                expert_bytes=round(load_of[layer].miss_bytes) if layer in load_of else 0,
                expert_routed=load_of[layer].routed if layer in load_of else 0.0,
                expert_hits=load_of[layer].hits if layer in load_of else 0.0,
            )
            for layer in range(len(compute))
        ),
        passes=passes,
        period=period,
        routing_steps=experts.steps if experts is not None and experts.layers else 0,
        belady_hit_rate=experts.optimum.hit_rate if experts is not None and experts.layers else None,
    )


def expert_seconds(load: LayerLoad, rate: float, profile: DeviceProfile) -> float:
    """A layer's wait at its experts' calls for their copies, from host memory: the misses
    over the link, the hits from their slots (`hit_seconds`)."""
    return load.miss_bytes / rate + hit_seconds(load, profile)


def hit_seconds(load: LayerLoad, profile: DeviceProfile) -> float:
    """The hits' copies from their slots into their rows: a read and a write of device
    memory at the profile's weight-read rate (0 where it has none)."""
    read = profile.weight_read_bytes_per_s
    return 2.0 * load.hit_bytes / read if read is not None else 0.0


def _expert_reads(load_of: Mapping[int, LayerLoad], disk: DiskReads | None) -> dict[int, float]:
    """Per layer whose experts lie on the disk tier, seconds its misses take to read per step."""
    if disk is None or not disk.expert_layers:
        return {}
    return {layer: load_of[layer].miss_bytes / disk.bytes_per_s for layer in disk.expert_layers if layer in load_of}
