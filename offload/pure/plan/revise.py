"""`revise_plan`: the plan after weight post-processing replaced or deleted parameters.

After loading, post-processing (quantisation repacking, fusing) may give an offloaded
parameter new data of another shape or dtype, or delete it. The executor reports what
each offloaded parameter is now; this pure function works out what that means for the
plan (placements unchanged, buffers and schedule re-laid for the actual tensors, byte
totals recomputed) and records it in a warning, so the executor still decides nothing
and `offloader.plan` keeps telling the truth.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs

from offload.pure.experts.values import ExpertCachePlan
from offload.pure.plan.layout import prefetch_buffers, shared_keys
from offload.pure.plan.plan import OffloadPlan, ParamPlan, Placement, PlanWarning, WarningCode
from offload.pure.plan.schedule import schedule_prefetch
from offload.pure.plan.values import serves_cache
from offload.pure.spec.values import ParamSpec

__all__ = ["demote_to_on_demand", "revise_plan"]

Ref = tuple[int, str]


def _describe_change(ref: Ref, old: ParamSpec, new: ParamSpec | None) -> str | None:
    where = f"{ref[0]}:{ref[1]}"
    if new is None:
        return f"{where} deleted"
    before = (old.shape, old.stride, old.dtype)
    after = (new.shape, new.stride, new.dtype)
    if before == after:
        return None
    return f"{where} {old.dtype}{list(old.shape)} -> {new.dtype}{list(new.shape)}"


def revise_plan(plan: OffloadPlan, actual: Mapping[Ref, ParamSpec | None]) -> OffloadPlan:
    """Revise `plan` for what the offloaded parameters are after post-processing.

    Args:
        plan: the plan the model was wrapped with.
        actual: for offloaded (layer, name) pairs, the parameter as it is now, or None if
            it was deleted; pairs left out are unchanged. ``storage_key`` must say which
            of them still share storage: a tie whose members no longer share a key is
            broken, and each member is then stored on its own.

    Returns:
        `plan` itself when nothing changed; otherwise a plan without the deleted
        parameters, with the new shapes, strides and dtypes, buffers, schedule, slots and
        byte totals laid out again, and a PLAN_REVISED warning listing the changes.
    """
    changes: list[str] = []
    keys: dict[Ref, str | None] = {}
    for p in plan.offloaded_params:
        ref = (p.layer, p.name)
        if ref not in actual:
            keys[ref] = p.param.storage_key
            continue
        new = actual[ref]
        change = _describe_change(ref, p.param, new)
        if change is not None:
            changes.append(change)
        keys[ref] = None if new is None else new.storage_key
    for p in plan.offloaded_params:
        ref = (p.layer, p.name)
        if p.tied_to is not None and ref in keys and keys[ref] is not None:
            if p.tied_to not in keys or keys[p.tied_to] != keys[ref]:
                changes.append(f"{ref[0]}:{ref[1]} no longer shares storage with {p.tied_to[0]}:{p.tied_to[1]}")
    if not changes:
        return plan

    kept: list[ParamPlan] = []
    for p in plan.params:
        ref = (p.layer, p.name)
        if not p.offloaded or ref not in actual:
            kept.append(p)
            continue
        new = actual[ref]
        if new is None:
            continue
        tie = p.tied_to
        if tie is not None and (tie not in keys or keys[tie] is None or keys[tie] != keys[ref]):
            tie = None
        spec = attrs.evolve(new, name=p.name, device=p.param.device)
        kept.append(attrs.evolve(p, param=spec, tied_to=tie))

    offloaded_layers = plan.offloaded_layers
    schedule = plan.schedule
    if schedule.num_positions:
        cycle_of_layer = dict(zip(plan.offloaded_layers, schedule.cycle_of, strict=True))
        offloaded_layers = tuple(sorted({p.layer for p in kept if p.placement is Placement.PREFETCH}))
        # The cycles as they were (one per stack), less the layers that left the plan.
        counts = [sum(1 for layer in offloaded_layers if cycle_of_layer[layer] == c)
                  for c in range(len(schedule.cycle_ranges))]
        cycles = tuple(count for count in counts if count)
        schedule = schedule_prefetch(len(offloaded_layers), plan.config.prefetch_step,
                                     cycles if len(cycles) > 1 else ())
        slot_of_layer = dict(zip(offloaded_layers, schedule.slots, strict=True))
        kept = [
            attrs.evolve(p, slot=slot_of_layer[p.layer]) if p.placement is Placement.PREFETCH else p
            for p in kept
        ]
    experts = _caches_kept(plan, kept)
    buffers = prefetch_buffers(kept, shared_keys(kept, experts))
    offloaded_bytes = sum(p.nbytes for p in kept if p.offloaded and p.tied_to is None)
    warning = PlanWarning(
        code=WarningCode.PLAN_REVISED,
        message="post-processing changed offloaded parameters: " + "; ".join(changes),
    )
    return attrs.evolve(
        plan,
        params=tuple(kept),
        offloaded_layers=offloaded_layers,
        schedule=schedule,
        buffers=buffers,
        offloaded_bytes=offloaded_bytes,
        device_bytes_freed=offloaded_bytes if plan.compute_device != "cpu" else 0,
        device_bytes_buffers=sum(b.nbytes for b in buffers) + sum(c.device_bytes for c in experts),
        host_bytes=offloaded_bytes,
        experts=experts,
        warnings=(*plan.warnings, warning),
    )


def demote_to_on_demand(plan: OffloadPlan, refs: Collection[Ref], reason: str) -> OffloadPlan:
    """`plan` with the UVA parameters in `refs` placed ON_DEMAND instead, and a
    PLAN_REVISED warning saying why (e.g. pinning their host copies failed, and a
    zero-copy view needs pinned memory). `plan` itself when none of `refs` is UVA.
    """
    chosen = set(refs)
    demoted = [
        attrs.evolve(p, placement=Placement.ON_DEMAND)
        if p.placement is Placement.UVA and (p.layer, p.name) in chosen
        else p
        for p in plan.params
    ]
    changed = [f"{p.layer}:{p.name}" for p, q in zip(plan.params, demoted, strict=True) if p is not q]
    if not changed:
        return plan
    warning = PlanWarning(
        code=WarningCode.PLAN_REVISED,
        message=f"{reason}: {', '.join(changed)} copied to the device on demand instead of read in place",
    )
    return attrs.evolve(plan, params=tuple(demoted), warnings=(*plan.warnings, warning))


def _caches_kept(plan: OffloadPlan, kept: Sequence[ParamPlan]) -> tuple[ExpertCachePlan, ...]:
    """The expert caches whose parameters are all still prefetched as planned, E rows each
    where fused (a replaced or deleted expert weight leaves its module streamed whole)."""
    if not plan.experts:
        return ()
    by_ref = {(p.layer, p.name): p for p in kept}
    out = []
    for cache in plan.experts:
        group = cache.group
        if all(serves_cache(group, by_ref.get((group.layer, name))) for name in group.params):
            out.append(cache)
    return tuple(out)
