"""Static buffer layout for prefetch plans: which buffer keys exist, which slots each
needs, and which are one buffer for all their slots (the rows of expert caches,
`BufferPlan.shared`). Shared by `make_plan` and `revise_plan`, so both lay buffers out the
same way."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from operator import attrgetter

from offload.pure.experts.values import ExpertCachePlan, served_refs
from offload.pure.plan.values import BufferPlan, ParamPlan, Placement
from offload.pure.spec.values import ParamSpec

__all__ = ["BufferKey", "layer_buffers", "owns_buffer", "prefetch_buffers", "shared_keys"]

#: (name, shape, stride, dtype) of a static buffer.
BufferKey = tuple[str, tuple[int, ...], tuple[int, ...], str]

_BUFFER_KEY = attrgetter("buffer_key")


def owns_buffer(p: ParamPlan) -> bool:
    """True when a PREFETCH parameter gets a buffer of its own: it is not tied to another
    parameter of the same layer (which it then reads its buffer from)."""
    return p.tied_to is None or p.tied_to[0] != p.layer


def shared_keys(params: Iterable[ParamPlan], caches: Iterable[ExpertCachePlan]) -> frozenset[BufferKey]:
    """The buffer keys that are one buffer for all their slots (`BufferPlan.shared`): those
    of the parameters `caches` serve, less any key another PREFETCH parameter owning a
    buffer also has (the copy queue writes that one per slot).

    Args:
        params: the plan's parameters.
        caches: its expert caches (`plan_expert_caches`).
    """
    served = served_refs(caches)
    if not served:
        return frozenset()
    mine: set[BufferKey] = set()
    others: set[BufferKey] = set()
    prefetch = Placement.PREFETCH
    for p in params:
        if p.placement is prefetch and owns_buffer(p):
            (mine if (p.layer, p.name) in served else others).add(p.param.buffer_key)
    return frozenset(mine - others)


def prefetch_buffers(params: Iterable[ParamPlan], shared: Collection[BufferKey] = ()) -> tuple[BufferPlan, ...]:
    """One buffer per (name, shape, stride, dtype) key, with the slots its layers use.

    Args:
        params: the plan's parameters (any placements; only PREFETCH ones count).
        shared: the keys that are one buffer for all their slots (`shared_keys`).

    Returns:
        Buffers in order of first use, each with its used slots sorted.
    """
    layers: list[tuple[tuple[ParamSpec, ...], int]] = []
    owners: list[ParamSpec] = []
    current: tuple[int, int] | None = None  # (layer, slot) of `owners`
    prefetch = Placement.PREFETCH
    for p in params:
        slot = p.slot
        if p.placement is not prefetch or slot is None or not owns_buffer(p):
            continue
        if current != (p.layer, slot):
            if current is not None:
                layers.append((tuple(owners), current[1]))
            current, owners = (p.layer, slot), []
        owners.append(p.param)
    if current is not None:
        layers.append((tuple(owners), current[1]))
    return layer_buffers(layers, shared)


def layer_buffers(layers: Iterable[tuple[tuple[ParamSpec, ...], int]],
                  shared: Collection[BufferKey] = ()) -> tuple[BufferPlan, ...]:
    """The buffers of prefetched layers, as `prefetch_buffers` lays them out.

    Args:
        layers: for each prefetched layer, in layer order, the parameters that own a
            buffer (`owns_buffer`) and the layer's slot.
        shared: the keys that are one buffer for all their slots (`shared_keys`).

    Returns:
        One buffer per key, in order of first use, each with its used slots sorted.
    """
    # The layers of a model mostly repeat one list of keys: a run of layers with the same
    # keys as the one before is one pattern, whose keys are hashed once, not per layer.
    patterns: list[tuple[tuple[BufferKey, ...], tuple[ParamSpec, ...], set[int]]] = []
    for specs, slot in layers:
        keys = tuple(map(_BUFFER_KEY, specs))
        if patterns and patterns[-1][0] == keys:
            patterns[-1][2].add(slot)
        else:
            patterns.append((keys, specs, {slot}))
    slots: dict[BufferKey, set[int]] = {}
    first: dict[BufferKey, ParamSpec] = {}
    for keys, specs, used in patterns:
        for key, spec in zip(keys, specs, strict=True):
            known = slots.get(key)
            if known is None:
                slots[key] = set(used)
                first[key] = spec
            else:
                known.update(used)
    return tuple(
        BufferPlan(
            name=spec.name,
            shape=spec.shape,
            stride=spec.stride,
            dtype=spec.dtype,
            itemsize=spec.itemsize,
            slot_bytes=spec.nbytes,
            slots=tuple(sorted(slots[key])),
            shared=key in shared,
        )
        for key, spec in first.items()
    )
