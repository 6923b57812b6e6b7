"""Static buffer layout for prefetch plans: which buffer keys exist and which slots each
needs. Shared by `make_plan` and `revise_plan`, so both lay buffers out the same way."""

from __future__ import annotations

from collections.abc import Iterable

from offload.pure.plan import BufferPlan, ParamPlan, Placement
from offload.pure.spec import ParamSpec

__all__ = ["BufferKey", "owns_buffer", "prefetch_buffers"]

#: (name, shape, stride, dtype) of a static buffer.
BufferKey = tuple[str, tuple[int, ...], tuple[int, ...], str]


def owns_buffer(p: ParamPlan) -> bool:
    """True when a PREFETCH parameter gets a buffer of its own: it is not tied to another
    parameter of the same layer (which it then reads its buffer from)."""
    return p.tied_to is None or p.tied_to[0] != p.layer


def prefetch_buffers(params: Iterable[ParamPlan]) -> tuple[BufferPlan, ...]:
    """One buffer per (name, shape, stride, dtype) key, with the slots its layers use.

    Args:
        params: the plan's parameters (any placements; only PREFETCH ones count).

    Returns:
        Buffers in order of first use, each with its used slots sorted.
    """
    slots: dict[BufferKey, set[int]] = {}
    first: dict[BufferKey, ParamSpec] = {}
    prefetch = Placement.PREFETCH
    for p in params:
        slot = p.slot
        if p.placement is not prefetch or slot is None:
            continue
        tie = p.tied_to
        if tie is not None and tie[0] == p.layer:  # reads the buffer of what it is tied to
            continue
        spec = p.param
        key = spec.buffer_key
        used = slots.get(key)
        if used is None:
            slots[key] = {slot}
            first[key] = spec
        else:
            used.add(slot)
    return tuple(
        BufferPlan(
            name=spec.name,
            shape=spec.shape,
            stride=spec.stride,
            dtype=spec.dtype,
            itemsize=spec.itemsize,
            slot_bytes=spec.nbytes,
            slots=tuple(sorted(slots[key])),
        )
        for key, spec in first.items()
    )
