"""One copy per prefetched layer: its host copies in one block, its slot in one arena.

A prefetched layer's parameters are copied into their static buffers one memcpy each. A
Llama-shaped layer has 9; each copy costs a ``cudaMemcpyAsync`` (or a ``copy_`` on the
CPU) and an event, host time that adds up at decode. When a layer's host copies lie back
to back in one host allocation, in the order its buffers lie back to back in one device
allocation, the whole layer is one copy.

This module lays both out, and finds the copies that can be merged; the executor follows
it. It changes no byte count: blocks and arenas hold exactly the bytes of their members,
with no padding, because only *aligned* members take part:

- a member is a dense tensor (its elements fill its span: contiguous, or a permutation
  such as a transpose) of a non-zero multiple of `ALIGN` bytes;
- so every member starts `ALIGN`-aligned within its block or arena, as a separate
  ``cudaMalloc`` would have placed it (256 bytes), and kernels that assume that
  alignment get it.

Everything else (odd sizes, strided views, adopted host tensors, ties across layers)
keeps its own host copy, its own buffer and its own memcpy, exactly as before.

Adopted tensors (`Move.ADOPT`: already in pageable host memory, the plan does not pin)
are their own host copies, and moving them into a block copies every weight once: only
with ``OffloadConfig(layer_blocks="always")`` (on a machine without an accelerator, where
every weight is adopted, that is what makes the CPU runtime run the copies a GPU runs).
``"never"`` makes no block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from offload.pure.decide.moves import Move
from offload.pure.experts.values import served_refs
from offload.pure.plan.layout import BufferKey, owns_buffer
from offload.pure.plan.plan import BufferPlan, OffloadPlan, Placement
from offload.pure.spec.values import ParamSpec

__all__ = [
    "ALIGN",
    "Arena",
    "HostBlock",
    "Span",
    "aligned",
    "copies_per_step",
    "host_blocks",
    "layer_copies",
    "merge_spans",
    "slot_arenas",
]

#: The alignment (and size granularity) of every member of a block or an arena, in bytes:
#: what ``cudaMalloc`` guarantees for a separate allocation.
ALIGN = 256

#: Moves that make a new host copy (and may so place it in a block). `Move.ADOPT` keeps
#: the user's tensor as the copy: it cannot be moved into a block without a copy.
_NEW_COPY = frozenset({Move.TO_HOST, Move.HOST_TO_PINNED, Move.NEW_ON_HOST})


def aligned(spec: ParamSpec) -> bool:
    """True when `spec` can be a member of a block or an arena: dense, and a non-zero
    multiple of `ALIGN` bytes."""
    return _aligned(spec.nbytes, spec.numel, spec.itemsize)


def _aligned(nbytes: int, numel: int, itemsize: int) -> bool:
    """`aligned` from a span's bytes, its element count and the element size."""
    return nbytes > 0 and nbytes % ALIGN == 0 and nbytes == numel * itemsize


@attrs.frozen
class HostBlock:
    """One host allocation holding several host copies of one layer, back to back.

    Attributes:
        layer: the layer.
        names: the members (parameter names relative to the layer), in address order.
        offsets: each member's byte offset in the block.
        nbytes: the block's size: the sum of its members' bytes.
    """

    layer: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    nbytes: int


@attrs.frozen
class Arena:
    """One device allocation holding the static buffers of one slot, back to back.

    Attributes:
        slot: the slot number.
        keys: the buffer keys it holds, in address order (`OffloadPlan.buffers` order).
        offsets: each key's byte offset in the arena.
        nbytes: the arena's size: the sum of its buffers' bytes.
    """

    slot: int
    keys: tuple[BufferKey, ...]
    offsets: tuple[int, ...]
    nbytes: int


def slot_arenas(buffers: Iterable[BufferPlan]) -> tuple[Arena, ...]:
    """The arenas of a prefetch plan's static buffers: for each slot, the aligned buffers
    (`aligned`) that have that slot, in the plan's buffer order (the order of first use,
    so a layer's buffers lie in its parameters' order); a shared buffer (the expert
    caches' rows, `BufferPlan.shared`) lies in none. A slot with fewer than two such
    buffers gets no arena (nothing to merge).

    Args:
        buffers: `OffloadPlan.buffers`.

    Returns:
        The arenas, by slot number.
    """
    keys: dict[int, list[tuple[BufferKey, int]]] = {}
    for b in buffers:
        if b.shared or not _aligned(b.slot_bytes, math.prod(b.shape), b.itemsize):
            continue  # (a shared buffer is one for all its slots, and never copied into by a layer's copies)
        key: BufferKey = (b.name, b.shape, b.stride, b.dtype)
        for slot in b.slots:
            keys.setdefault(slot, []).append((key, b.slot_bytes))
    arenas: list[Arena] = []
    for slot in sorted(keys):
        members = keys[slot]
        if len(members) < 2:
            continue
        offsets, total = _back_to_back(n for _, n in members)
        arenas.append(Arena(slot=slot, keys=tuple(k for k, _ in members), offsets=offsets, nbytes=total))
    return tuple(arenas)


def _back_to_back(sizes: Iterable[int]) -> tuple[tuple[int, ...], int]:
    offsets: list[int] = []
    total = 0
    for n in sizes:
        offsets.append(total)
        total += n
    return tuple(offsets), total


def host_blocks(plan: OffloadPlan, moves: Mapping[tuple[int, str], Move]) -> tuple[HostBlock, ...]:
    """The host blocks of a prefetch plan: per offloaded layer, the aligned parameters
    that own a host copy of their own (not tied to an earlier parameter) and own a buffer,
    and whose move makes a new copy (`moves`; an adopted tensor only with
    ``layer_blocks="always"``), in the plan's parameter order. A layer with fewer than
    two gets no block; none at all with ``layer_blocks="never"``.

    Args:
        plan: the plan (any backend; only PREFETCH parameters take part).
        moves: how each offloaded (layer, name) reaches host memory (`OffloadPlan.move_of`).

    Returns:
        The blocks, in layer order.
    """
    mode = plan.config.layer_blocks
    if mode == "never":
        return ()
    copying = _NEW_COPY | {Move.ADOPT} if mode == "always" else _NEW_COPY
    by_layer: dict[int, list[tuple[str, int]]] = {}
    for p in plan.params:
        if (p.placement is not Placement.PREFETCH or p.tied_to is not None or not owns_buffer(p)
                or not aligned(p.param) or moves.get((p.layer, p.name)) not in copying):
            continue
        by_layer.setdefault(p.layer, []).append((p.name, p.param.nbytes))
    blocks: list[HostBlock] = []
    for layer in sorted(by_layer):
        members = by_layer[layer]
        if len(members) < 2:
            continue
        offsets, total = _back_to_back(n for _, n in members)
        blocks.append(HostBlock(layer=layer, names=tuple(name for name, _ in members), offsets=offsets,
                                nbytes=total))
    return tuple(blocks)


@attrs.frozen
class Span:
    """One copy, as byte ranges: `nbytes` from offset `src_offset` of source allocation
    `src` to offset `dst_offset` of destination allocation `dst`. An allocation is any
    object, compared by identity; None: a tensor of its own (never merged)."""

    dst: object
    dst_offset: int
    src: object
    src_offset: int
    nbytes: int


def merge_spans(spans: Sequence[Span]) -> list[list[int]]:
    """Group copies that are one contiguous copy: same destination and source
    allocations, each starting in both where the one before it ends.

    Only exact adjacency merges, so a merged copy writes no byte that none of its members
    writes (a gap in the destination could belong to another buffer).

    Args:
        spans: the copies of one layer.

    Returns:
        Groups of indices into `spans`, each in address order; every index exactly once.
        Groups come in the order of their first member in `spans`; a span of its own
        (None allocation, or nothing adjacent) is a group of one.
    """
    order = sorted((i for i, s in enumerate(spans) if s.dst is not None and s.src is not None),
                   key=lambda i: (id(spans[i].dst), id(spans[i].src), spans[i].dst_offset))
    group_of = list(range(len(spans)))  # index -> the index that starts its group
    previous: Span | None = None
    for k, i in enumerate(order):
        s = spans[i]
        if (previous is not None and s.dst is previous.dst and s.src is previous.src
                and s.dst_offset == previous.dst_offset + previous.nbytes
                and s.src_offset == previous.src_offset + previous.nbytes):
            group_of[i] = group_of[order[k - 1]]
        previous = s
    members: dict[int, list[int]] = {}
    for i in order:
        members.setdefault(group_of[i], []).append(i)
    first = {head: min(group) for head, group in members.items()}
    groups: list[list[int]] = []
    for i in range(len(spans)):
        head = group_of[i]
        if head not in members:
            groups.append([i])  # a tensor of its own
        elif first[head] == i:
            groups.append(members[head])
    return groups


def layer_copies(plan: OffloadPlan, moves: Mapping[tuple[int, str], Move] | None = None) -> tuple[int, ...]:
    """How many copies each offloaded layer of a prefetch plan is each time it is loaded
    (in `offloaded_layers` order), laid out as the prefetch executor lays it out: one per
    buffer a layer owns, less those merged into one (`merge_spans`) because they lie back
    to back both in the layer's host block and in its slot's arena, and none for the
    parameters an expert cache serves (copied at their module's call, expert by expert).
    A layer alone in its slot is loaded once only (`copies_per_step`).

    Args:
        plan: a prefetch plan (any other backend: ()).
        moves: how each offloaded weight reaches host memory; None: from the devices it was
            planned on (`OffloadPlan.move_of`), so what the plan predicts before it runs.

    Returns:
        Copies per offloaded layer, for a runtime that makes blocks (`HostBlocks`); without
        one, each layer is one copy per buffer it owns.
    """
    if not plan.offloaded_layers or not plan.buffers:
        return ()
    if moves is None:
        moves = {(p.layer, p.name): plan.move_of(p) for p in plan.params if p.offloaded}
    blocks = {b.layer: b for b in host_blocks(plan, moves)}
    arenas = {a.slot: a for a in slot_arenas(plan.buffers)} if blocks else {}
    owned: dict[int, list[Span]] = {layer: [] for layer in plan.offloaded_layers}
    served = served_refs(plan.experts)
    for p in plan.params:
        if (p.placement is not Placement.PREFETCH or p.slot is None or not owns_buffer(p) or p.layer not in owned
                or (p.layer, p.name) in served):
            continue  # (an expert cache's parameters are copied expert by expert, at their module's call)
        arena, block = arenas.get(p.slot), blocks.get(p.layer)
        key = p.param.buffer_key
        in_arena = arena is not None and key in arena.keys
        in_block = block is not None and p.tied_to is None and p.name in block.names
        if arena is not None and block is not None and in_arena and in_block:
            span = Span(dst=arena, dst_offset=arena.offsets[arena.keys.index(key)], src=block,
                        src_offset=block.offsets[block.names.index(p.name)], nbytes=p.param.nbytes)
        else:
            span = Span(dst=None, dst_offset=0, src=None, src_offset=0, nbytes=p.param.nbytes)
        owned[p.layer].append(span)
    return tuple(len(merge_spans(owned[layer])) for layer in plan.offloaded_layers)


def copies_per_step(plan: OffloadPlan, moves: Mapping[tuple[int, str], Move] | None = None) -> tuple[int, ...]:
    """How many copies each offloaded layer of a prefetch plan makes per steady-state
    step (in `offloaded_layers` order): its `layer_copies`, or 0 for a layer alone in its
    slot (`PrefetchSchedule.kept_positions`), which is loaded once when the offloader
    starts and keeps its slot.

    Args:
        plan: a prefetch plan (any other backend: ()).
        moves: as for `layer_copies`.

    Returns:
        Copies per offloaded layer and step; their sum is what a step copies.
    """
    kept = plan.schedule.kept_positions
    return tuple(0 if i in kept else n for i, n in enumerate(layer_copies(plan, moves)))
