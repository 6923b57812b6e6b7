"""The static device buffers of a prefetch offloader and how its copies into them are cut:
the slot arenas, the copies merged where an arena and a host block are both contiguous,
and each copy prepared once by the runtime (`PreparedCopies`). Called at `post_init`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from offload.errors import ExecutionError
from offload.executors.common import Ref, torch_dtype
from offload.executors.hoststore import HostStore
from offload.protocols import Event, PreparedCopies, Runtime
from offload.pure.plan.blocks import Span, merge_spans, slot_arenas
from offload.pure.plan.plan import OffloadPlan
from offload.runtime.arena import CAN_CARVE, carve

__all__ = ["Buffers", "Chunks", "allocate_arenas", "copy_after", "merge_copies", "prepare_copies"]

Chunks = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # one copy: its (destination, source) memcpys
#: Buffer key (`BufferPlan.key`) -> slot -> its device buffer.
Buffers = dict[tuple[str, tuple[int, ...], tuple[int, ...], str], dict[int, torch.Tensor]]


def allocate_arenas(plan: OffloadPlan, host: HostStore, rt: Runtime,
                    buffers: Buffers) -> dict[int, tuple[torch.Tensor, int]]:
    """Where the host store made blocks (`offload.pure.plan.blocks`): each slot's aligned
    buffers back to back in one device allocation (an arena), each over a storage of
    its own (`offload.runtime.arena.carve`: views of one tensor would alias under
    torch.compile). Returns, by data pointer of each such buffer, (its arena's flat
    view, its byte offset); the buffers carved go into `buffers`."""
    placed: dict[int, tuple[torch.Tensor, int]] = {}
    if not host.has_blocks or not CAN_CARVE:
        return placed
    by_key = {b.key: b for b in plan.buffers}
    for arena in slot_arenas(plan.buffers):
        flat = rt.device_empty((arena.nbytes,), (1,), torch.uint8)
        for key, offset in zip(arena.keys, arena.offsets, strict=True):
            b = by_key[key]
            buffer = carve(flat, offset, b.shape, b.stride, torch_dtype(b.dtype))
            buffers.setdefault(key, {})[arena.slot] = buffer
            placed[buffer.data_ptr()] = (flat, offset)
    return placed


def merge_copies(copies: list[tuple[torch.Tensor, torch.Tensor, Ref]], arenas: dict[int, tuple[torch.Tensor, int]],
                 host: HostStore) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A position's copies, those that are contiguous in both an arena and a host block
    merged into one (`merge_spans`)."""
    spans = []
    for buffer, data, owner in copies:
        dst = arenas.get(buffer.data_ptr())
        src = host.block_of(owner)
        nbytes = data.untyped_storage().nbytes()
        if dst is None or src is None:
            spans.append(Span(dst=None, dst_offset=0, src=None, src_offset=0, nbytes=nbytes))
        else:
            spans.append(Span(dst=dst[0], dst_offset=dst[1], src=src[0], src_offset=src[1], nbytes=nbytes))
    merged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in merge_spans(spans):
        if len(group) == 1:
            merged.append(copies[group[0]][:2])
            continue
        first, last = spans[group[0]], spans[group[-1]]
        dst_flat, src_flat = arenas[copies[group[0]][0].data_ptr()][0], first.src
        size = last.dst_offset + last.nbytes - first.dst_offset
        if not isinstance(src_flat, torch.Tensor):
            raise ExecutionError("a host block has no flat view", name="block", value=group)
        merged.append((dst_flat[first.dst_offset:first.dst_offset + size],
                       src_flat[first.src_offset:first.src_offset + size]))
    return merged


def prepare_copies(rt: Runtime, copies: list[list[tuple[torch.Tensor, torch.Tensor]]]
                   ) -> tuple[Callable[[Chunks, Event | None], Event], list[list[Chunks]]]:
    """Each position's copies as `_issue` hands them to the copy function returned with
    them: cut once by a runtime with `PreparedCopies`, else each its (buffer, host) pair for
    `copy_after`."""
    if isinstance(rt, PreparedCopies):
        return rt.copy_chunks_after, [[rt.copy_chunks(buffer, host) for buffer, host in layer] for layer in copies]
    return functools.partial(copy_after, rt), [[((buffer, host),) for buffer, host in layer] for layer in copies]


def copy_after(rt: Runtime, chunks: Chunks, after: Event | None) -> Event:
    """`Runtime.copy_after` of the one (buffer, host) pair in `chunks` (a runtime
    without `PreparedCopies`)."""
    ((buffer, host),) = chunks
    return rt.copy_after(buffer, host, after)
