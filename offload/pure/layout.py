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
    for p in params:
        if p.placement is not Placement.PREFETCH or p.slot is None or not owns_buffer(p):
            continue
        key = p.param.buffer_key
        if key in slots:
            slots[key].add(p.slot)
        else:
            slots[key] = {p.slot}
            first[key] = p.param
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
