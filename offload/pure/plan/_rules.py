"""The rules an `OffloadPlan` is checked against on construction.

Executors index layers, schedule positions, buffer keys and tie targets by what the plan
says, so a plan read back from a hand-edited file must hold every index a fresh plan
holds: parameters in layers of the model, in layer order, once each, placed as their
backend runs; offloaded layers in range, increasing, each with a PREFETCH parameter; ties
pointing back at the first parameter of their storage; buffers once each, every slot used.
The checks are O(n) dict and set work, in C where possible, for plans of tens of
thousands of parameters. `make_plan` builds its plans without them
(`offload.pure.plan.plan.trusted_offload_plan`, for its time budget in
``benchmarks/bench_plan.py``); the tests hold every plan it makes to them.
"""

from __future__ import annotations

from typing import Protocol

from offload.errors import PlanError
from offload.pure.experts.values import ExpertCachePlan, served_refs
from offload.pure.plan.layout import BufferKey
from offload.pure.plan.schedule import PrefetchSchedule, check_schedule
from offload.pure.plan.values import Backend, BufferPlan, ParamPlan, Placement, serves_cache

__all__ = ["PlanFields", "check_plan"]


class PlanFields(Protocol):
    """What the rules read of an `offload.pure.plan.plan.OffloadPlan` (which calls
    `check_plan` on itself while it is built)."""

    @property
    def backend(self) -> Backend: ...

    @property
    def params(self) -> tuple[ParamPlan, ...]: ...

    @property
    def offloaded_layers(self) -> tuple[int, ...]: ...

    @property
    def buffers(self) -> tuple[BufferPlan, ...]: ...

    @property
    def schedule(self) -> PrefetchSchedule: ...

    @property
    def device_bytes_buffers(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def experts(self) -> tuple[ExpertCachePlan, ...]: ...


def check_plan(plan: PlanFields) -> None:
    """Check `plan` against every rule; `OffloadPlan` calls it on construction.

    Raises:
        PlanError: naming the first field that breaks a rule (``params[3].layer``,
            ``offloaded_layers[1]``, ``buffers[0].slots``, ...) and its value.
    """
    if plan.schedule.num_positions != len(plan.offloaded_layers):
        raise PlanError(
            f"the schedule covers {plan.schedule.num_positions} positions but "
            f"{len(plan.offloaded_layers)} layers are offloaded",
            name="schedule",
            value=plan.schedule.num_positions,
        )
    check_schedule(plan.schedule)
    _check_offloaded_layers(plan.offloaded_layers, plan.num_layers)
    if plan.device_bytes_buffers != sum(b.nbytes for b in plan.buffers) + sum(c.device_bytes for c in plan.experts):
        raise PlanError(
            f"device_bytes_buffers {plan.device_bytes_buffers} is not the sum of the buffers and expert caches",
            name="device_bytes_buffers",
            value=plan.device_bytes_buffers,
        )
    position_of = _check_param_order(plan.params, plan.num_layers, _PLACEMENTS_OF[plan.backend])
    _check_ties(plan.params, position_of)
    _check_prefetch(plan)
    _check_experts(plan)
    _check_shared(plan)


def _check_experts(plan: PlanFields) -> None:
    """Each expert cache serves one experts module of an offloaded layer, once, whose
    parameters the plan prefetches, with E rows each where they are fused (`ExpertGroup`)."""
    seen: set[tuple[int, str]] = set()
    offloaded = set(plan.offloaded_layers)
    by_ref = {(p.layer, p.name): p for p in plan.params} if plan.experts else {}
    for j, cache in enumerate(plan.experts):
        group = cache.group
        key = (group.layer, group.module)
        if key in seen or group.layer not in offloaded:
            raise PlanError(f"experts[{j}] ({group.layer}:{group.module}) is given twice or its layer is not "
                            "offloaded by prefetch", name=f"experts[{j}]", value=key)
        seen.add(key)
        for name in group.params:
            p = by_ref.get((group.layer, name))
            if not serves_cache(group, p):
                rows = f" with {group.num_experts} rows" if group.fused else ""
                raise PlanError(f"experts[{j}]: parameter {group.layer}:{name} is not prefetched{rows}",
                                name=f"experts[{j}].params", value=name)


def _check_shared(plan: PlanFields) -> None:
    """A buffer that is one for all its slots (`BufferPlan.shared`) is read only by
    parameters an expert cache serves: the copy queue, which writes a buffer per slot,
    never copies into it."""
    shared = {b.key: j for j, b in enumerate(plan.buffers) if b.shared}
    if not shared:
        return
    served = served_refs(plan.experts)
    for p in plan.params:
        if p.placement is not Placement.PREFETCH or (p.tied_to is not None and p.tied_to[0] == p.layer):
            continue
        j = shared.get(p.param.buffer_key)
        if j is not None and (p.layer, p.name) not in served:
            raise PlanError(f"buffers[{j}] is one buffer for all its slots, but parameter {p.layer}:{p.name}, "
                            "which no expert cache serves, is copied into it", name=f"buffers[{j}].shared",
                            value=(p.layer, p.name))


#: The placements each backend runs; an executor refuses, or silently ignores, others.
_PLACEMENTS_OF: dict[Backend, frozenset[Placement]] = {
    Backend.PREFETCH: frozenset({Placement.RESIDENT, Placement.PREFETCH}),
    Backend.UVA: frozenset({Placement.RESIDENT, Placement.UVA, Placement.ON_DEMAND}),
    Backend.NONE: frozenset({Placement.RESIDENT}),
}


def _check_offloaded_layers(offloaded_layers: tuple[int, ...], num_layers: int) -> None:
    """Schedule positions are layers of the model, each once, in execution order."""
    previous = -1
    for i, index in enumerate(offloaded_layers):
        if index >= num_layers:
            raise PlanError(f"offloaded_layers[{i}] = {index} is not a layer of the plan's {num_layers}",
                            name=f"offloaded_layers[{i}]", value=index)
        if index <= previous:
            raise PlanError(f"offloaded_layers[{i}] = {index} does not follow {previous}: offloaded layers "
                            "are listed once each, in increasing order", name=f"offloaded_layers[{i}]", value=index)
        previous = index


def _check_param_order(
    params: tuple[ParamPlan, ...], num_layers: int, allowed: frozenset[Placement]
) -> dict[tuple[int, str], int]:
    """Every parameter is in a layer of the plan, in layer order, once, placed as its
    backend runs; returns each (layer, name)'s position in `params`."""
    layers = [p.layer for p in params]
    position_of = {(p.layer, p.param.name): i for i, p in enumerate(params)}
    if (
        (not layers or (layers[-1] < num_layers and layers == sorted(layers)))
        and len(position_of) == len(params)
        and {p.placement for p in params} <= allowed
    ):
        return position_of
    # Something is wrong: find the first offender, for the message.
    seen: set[tuple[int, str]] = set()
    previous = 0
    for i, p in enumerate(params):
        if p.placement not in allowed:
            raise PlanError(f"params[{i}].placement = {p.placement.value}: parameter {p.layer}:{p.name} is "
                            f"placed {p.placement.value}, which a {_backend_of(allowed)} plan does not run",
                            name=f"params[{i}].placement", value=p.placement.value)
        if p.layer >= num_layers:
            raise PlanError(f"params[{i}].layer = {p.layer}: parameter {p.name!r} names layer {p.layer}, "
                            f"but the plan has {num_layers} layers", name=f"params[{i}].layer", value=p.layer)
        if p.layer < previous:
            raise PlanError(f"params[{i}].layer = {p.layer} follows layer {previous}: parameters are listed "
                            "in layer order", name=f"params[{i}].layer", value=p.layer)
        previous = p.layer
        ref = (p.layer, p.name)
        if ref in seen:
            raise PlanError(f"params[{i}]: parameter {p.layer}:{p.name} is listed twice",
                            name=f"params[{i}]", value=ref)
        seen.add(ref)
    raise PlanError("params are inconsistent", name="params", value=None)  # pragma: no cover  # unreachable


def _backend_of(allowed: frozenset[Placement]) -> str:
    return next(b.value for b, placements in _PLACEMENTS_OF.items() if placements == allowed)


def _check_ties(params: tuple[ParamPlan, ...], position_of: dict[tuple[int, str], int]) -> None:
    """Each tie points back at the first parameter of its storage, which holds the one
    host copy (or device tensor) the tied parameter will share."""
    for i, p in [(i, p) for i, p in enumerate(params) if p.tied_to is not None]:
        tie = p.tied_to
        if tie is None:  # pragma: no cover  # selected above; narrows the type
            continue
        where = f"params[{i}].tied_to = {tie}: parameter {p.layer}:{p.name}"
        at = position_of.get(tie)
        if at is None or at >= i:
            problem = "not a parameter of the plan" if at is None else "not an earlier parameter"
            raise PlanError(f"{where} is tied to {tie[0]}:{tie[1]}, {problem}", name=f"params[{i}].tied_to", value=tie)
        target = params[at]
        key = p.param.storage_key
        if target.tied_to is not None:
            problem = f"which is itself tied to {target.tied_to[0]}:{target.tied_to[1]}"
        elif key is None or target.param.storage_key != key:
            problem = f"whose storage key {target.param.storage_key!r} is not its own {key!r}"
        elif target.offloaded != p.offloaded:
            problem = f"which is placed {target.placement.value} while it is placed {p.placement.value}"
        else:
            continue
        raise PlanError(f"{where} is tied to {tie[0]}:{tie[1]}, {problem}", name=f"params[{i}].tied_to", value=tie)


def _check_prefetch(plan: PlanFields) -> None:
    """Every PREFETCH parameter uses its layer's slot of a buffer of its own key; every
    offloaded layer has such a parameter; every buffer and slot is used, once."""
    num_slots = plan.schedule.num_slots
    buffer_of_key: dict[BufferKey, tuple[int, BufferPlan]] = {}
    for j, b in enumerate(plan.buffers):
        if b.key in buffer_of_key:
            raise PlanError(f"buffers[{j}]: the buffer {b.key} is listed twice", name=f"buffers[{j}]", value=b.key)
        buffer_of_key[b.key] = (j, b)
        slots = b.slots
        if list(slots) != sorted(set(slots)) or (slots and slots[-1] >= num_slots):
            raise PlanError(f"buffers[{j}].slots = {slots}: slots are listed once each, in increasing order, "
                            f"within the schedule's 0..{num_slots - 1}", name=f"buffers[{j}].slots", value=slots)
    slot_of_layer = dict(zip(plan.offloaded_layers, plan.schedule.slots, strict=True))
    used: set[tuple[BufferKey, int]] = set()  # (key, slot) pairs some parameter reads
    prefetch_layers: set[int] = set()
    prefetch = Placement.PREFETCH
    for p in plan.params:
        if p.placement is not prefetch:
            continue
        layer = p.layer
        expected = slot_of_layer.get(layer)
        if expected is None:
            raise PlanError(f"parameter {layer}:{p.param.name} is PREFETCH but layer {layer} is not offloaded",
                            name=p.param.name, value=layer)
        if p.slot != expected:
            raise PlanError(f"parameter {layer}:{p.param.name} has slot {p.slot}, the schedule says {expected}",
                            name=p.param.name, value=p.slot)
        prefetch_layers.add(layer)
        tie = p.tied_to
        if tie is not None and tie[0] == layer:
            continue  # shares the buffer of the parameter it is tied to
        spec = p.param
        key = spec.buffer_key
        pair = (key, expected)
        if pair in used:
            continue
        found = buffer_of_key.get(key)
        if found is None or expected not in found[1].slots:
            raise PlanError(f"parameter {layer}:{spec.name} has no buffer slot {expected} for key {key}",
                            name=spec.name, value=expected)
        j, buffer = found
        if buffer.slot_bytes != spec.nbytes or buffer.itemsize != spec.itemsize:
            raise PlanError(f"buffers[{j}].slot_bytes = {buffer.slot_bytes} (itemsize {buffer.itemsize}): "
                            f"parameter {layer}:{spec.name} takes {spec.nbytes} bytes (itemsize {spec.itemsize})",
                            name=f"buffers[{j}].slot_bytes", value=buffer.slot_bytes)
        used.add(pair)
    if len(prefetch_layers) != len(plan.offloaded_layers):
        for i, index in enumerate(plan.offloaded_layers):
            if index not in prefetch_layers:
                raise PlanError(f"offloaded_layers[{i}] = {index}: layer {index} has no PREFETCH parameter",
                                name=f"offloaded_layers[{i}]", value=index)
    if len(used) == sum(len(b.slots) for b in plan.buffers):
        return  # every allocated (key, slot) is read: used is a subset of them, checked above
    for j, b in enumerate(plan.buffers):
        read = sorted(slot for key, slot in used if key == b.key)
        if not read:
            raise PlanError(f"buffers[{j}]: no PREFETCH parameter uses the buffer {b.key}",
                            name=f"buffers[{j}]", value=b.key)
        if len(read) != len(b.slots):
            raise PlanError(f"buffers[{j}].slots = {b.slots}: only slots {read} are used",
                            name=f"buffers[{j}].slots", value=b.slots)
