"""`SharedHostSource`: host copies that lie in the host's shared segment, for one member.

It is the `HostSource` a member's `HostStore` asks before its runtime:

- the leader's `copy` writes the weight into its slot (page-locked first, as the plan
  says) and gives the slot's tensor; its `empty` gives the slot for a loader to fill;
- a follower's `copy` gives the slot's read-only tensor, once the leader has said it is
  written, after comparing a sample of the follower's own values with it; its `empty`
  gives nothing (the runtime's private memory, which the loader may write; `post_init`
  moves it to the slot and releases it).

`slot_moves` finds a follower's weights outside the segment that fit a written slot (and
those whose sample differs): what it compares before it moves anything.

Where a weight no longer fits its slot (post-processing gave it another shape, strides
or dtype) the source answers None and the store makes a private copy, as without sharing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import final

import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import find_parameter, torch_dtype
from offload.executors.hoststore import Ref
from offload.logs import logger
from offload.protocols import RegisteredRanges
from offload.pure.decide.pinning import PinMethod
from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.plan import SegmentLayout, Slot
from offload.runtime.hostmem import PIECE_BYTES, HostRegisterError
from offload.sharing.pinning import (
    HOST_REGISTER_DEFAULT,
    HOST_REGISTER_FOLLOWER,
    PinCalls,
    cuda_pin_calls,
    register_range,
    unregister_pieces,
)
from offload.sharing.segment import SegmentMapping

__all__ = ["SAMPLE_PER_DIM", "SharedHostSource", "same_sample", "slot_moves"]

log = logger("offload.sharing")

#: Elements compared per dimension when a follower checks its weight against the slot
#: (evenly spaced, first and last included): at most 4**ndim elements per weight.
SAMPLE_PER_DIM = 4


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """A few of `tensor`'s elements as bytes, on the host: the same positions for every
    tensor of one shape (gathered where the tensor is, without copying the rest)."""
    t = tensor.detach()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if t.dim() == 0:
        picked = t.reshape(1)
    else:
        index = []
        for size in t.shape:
            k = min(size, SAMPLE_PER_DIM)
            positions = [0] if k == 1 else [round(i * (size - 1) / (k - 1)) for i in range(k)]
            index.append(torch.tensor(positions, dtype=torch.long, device=t.device))
        picked = t[torch.meshgrid(*index, indexing="ij")]
    return picked.cpu().contiguous().view(torch.uint8)


def same_sample(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` (one shape and dtype) have the same bits at the sampled positions."""
    return torch.equal(_sample(a), _sample(b))


def _fits(slot: Slot, tensor: torch.Tensor) -> bool:
    return (tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype).removeprefix("torch.")) == (
        slot.shape, slot.stride, slot.dtype)


@final
class SharedHostSource:
    """One member's view of the host's shared segment, as a `HostSource`.

    Args:
        layout: the slots (the same on every member).
        leader: True for the member that writes the copy.
        rank, leader_rank: this member's and the leader's global ranks (for messages).
        pin: the plan's pin method: `PinMethod.REGISTER` registers each slot when it is
            first given out (read-only on followers), `PinMethod.NONE` never.
        device: the runtime's compute device (registration is for CUDA devices only).
        verify: followers compare a sample of their own values with the slot and refuse
            a weight that differs (turn off only when followers do not load weights).
        pin_calls: the CUDA calls (`cuda_pin_calls` of `device` when None, made on first use).
        piece_bytes: the largest range registered at once.
        ranges: told of each slot registered in more than one piece, so that copies from
            it are cut at the pieces' ends (the runtime, `RegisteredRanges`); None: they
            are not (logged).

    Raises:
        ExecutionError: `pin` is `PinMethod.ALLOC` (memory from cudaHostAlloc cannot be
            shared between processes).
    """

    def __init__(self, layout: SegmentLayout, *, leader: bool, rank: int, leader_rank: int, pin: PinMethod,
                 device: torch.device, verify: bool = True, pin_calls: PinCalls | None = None,
                 piece_bytes: int = PIECE_BYTES, ranges: RegisteredRanges | None = None) -> None:
        if pin is PinMethod.ALLOC:
            raise ExecutionError(
                "host copies cannot be shared when the plan pins with cudaHostAlloc (the device cannot register "
                "host memory in place): page-locked allocations are private to a process. Plan with pinning "
                "off (OFFLOAD_DISABLE_PIN_MEMORY=1) to share them, or do not share", name="pin", value=pin.value)
        self._layout = layout
        self._leader = leader
        self._rank = rank
        self._leader_rank = leader_rank
        self._register = pin is PinMethod.REGISTER and device.type == "cuda"
        self._device = device
        self._verify = verify
        self._calls = pin_calls
        self._piece_bytes = piece_bytes
        self._ranges = ranges
        self._noted: list[tuple[tuple[int, int], ...]] = []  # pieces told to `ranges`
        self._mapping: SegmentMapping | None = None
        self._views: dict[Ref, torch.Tensor] = {}  # slots given out and not given back
        self._at: dict[int, Ref] = {}  # data pointer of a view -> its slot
        self._pieces: dict[Ref, tuple[tuple[int, int], ...]] = {}  # registered slots
        self._pending: set[Ref] = set()  # leader: slots given to a loader, not written yet
        self._allowed: set[Ref] = set()  # follower: slots the leader has written
        self._read_only: bool | None = None  # follower: the device takes read-only registration (asked once)
        self._writing = False  # leader: writing new weights into the segment (`writing`)
        self.fallbacks = 0  # slots whose registration failed or was not possible (they stay pageable)

    @property
    def leader(self) -> bool:
        """True for the member that writes the copy."""
        return self._leader

    @property
    def verify(self) -> bool:
        """Followers compare a sample of their own values with each slot."""
        return self._verify

    @property
    def mapping(self) -> SegmentMapping | None:
        """The segment this member maps (None before `attach` and after `close`)."""
        return self._mapping

    def attach(self, mapping: SegmentMapping) -> None:
        """Use `mapping` (writable on the leader, read-only on followers)."""
        if mapping.writable != self._leader:
            raise ExecutionError(f"segment {mapping.name} is mapped {'read-write' if mapping.writable else 'read-only'}"
                                 f" but this member is {'the leader' if self._leader else 'a follower'}",
                                 name="segment", value=mapping.name)
        self._mapping = mapping

    def allow(self, refs: Iterable[Ref]) -> None:
        """Follower: the slots the leader has written (replacing what was allowed)."""
        self._allowed = set(refs)

    def written(self) -> list[Ref]:
        """Leader: the slots holding their weight now (given out, not released, and not
        waiting for a loader), in layout order."""
        return [s.ref for s in self._layout.slots if s.ref in self._views and s.ref not in self._pending]

    def unwritten(self) -> list[Ref]:
        """Leader: the other slots (what followers must not take), in layout order; usually
        none, so this is what the leader announces."""
        written = set(self.written())
        return [s.ref for s in self._layout.slots if s.ref not in written]

    def allow_except(self, refs: Iterable[Ref]) -> None:
        """Follower: every slot but `refs` is written (what the leader announced)."""
        skip = set(refs)
        self._allowed = {s.ref for s in self._layout.slots if s.ref not in skip}

    def loaded(self) -> None:
        """Leader: the loader has written the slots it was given (`post_init`)."""
        self._pending.clear()

    def owns(self, tensor: torch.Tensor) -> bool:
        """True when `tensor`'s data lies in the segment."""
        return self._mapping is not None and self._mapping.contains(tensor)

    def writable(self, host: torch.Tensor) -> bool:
        """Whether this process may write `host` in place (`HostSource.writable`): memory
        of its own, or the segment on the leader while it writes new weights for every
        member (`writing`). A follower maps the segment read-only; the leader must not
        write it while followers' copies may read it (`SharedOffloader.load_weights`
        makes them stop first)."""
        return not self.owns(host) or (self._leader and self._writing)

    def read_only_reason(self, host: torch.Tensor) -> str:
        """A follower's copy is the segment's (`HostSource.read_only_reason`)."""
        return ("it lives in a host copy shared read-only with other processes: call load_weights on the sharing "
                "offloader of every member (the leader writes it)")

    def claims(self, ref: tuple[int, str]) -> bool:
        """Every copy may come from the segment (`HostSource.claims`): no host blocks."""
        return True

    def counted(self, host: torch.Tensor) -> bool:
        """Every copy takes host memory (`HostSource.counted`)."""
        return True

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Leader: the segment may be written in place meanwhile (every follower has
        stopped reading it: `SharedOffloader.load_weights`)."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def slot_view(self, ref: Ref) -> torch.Tensor | None:
        """Follower: the slot's tensor for `ref` if the leader has written it, else None."""
        slot = self._layout.slot(ref)
        if slot is None or self._mapping is None or (not self._leader and ref not in self._allowed):
            return None
        return self._view(slot)

    # ---- HostSource -----------------------------------------------------------------

    def copy(self, ref: Ref, tensor: torch.Tensor) -> torch.Tensor | None:
        """The slot of `ref` holding `tensor`'s values (the leader writes them; a follower
        checks a sample), or None where `ref` has no slot, `tensor` does not fit it, or
        (followers) the leader has not written it.

        Raises:
            ExecutionError: a follower's `tensor` differs from what the leader wrote.
        """
        slot = self._layout.slot(ref)
        if slot is None or self._mapping is None:
            return None
        if not _fits(slot, tensor):
            log.info("layer %d parameter %r is now %s %s, its shared slot %s %s: it gets a private host copy",
                     ref[0], ref[1], tuple(tensor.shape), tensor.dtype, slot.shape, slot.dtype)
            return None
        if not self._leader and ref not in self._allowed:
            return None
        view = self._view(slot)
        if tensor.device.type == "cpu" and tensor.data_ptr() == view.data_ptr():
            return view  # already the slot (a parameter pointed at it)
        if self._leader:
            view.copy_(tensor)
            self._pending.discard(ref)
        elif self._verify and not same_sample(tensor, view):
            raise ExecutionError(
                f"rank {self._rank}'s weight layer {ref[0]} parameter {ref[1]!r} differs from the shared host copy "
                f"rank {self._leader_rank} wrote (a sample of its values): members of a sharing group must hold "
                "identical weights (tensor-parallel ranks hold different shards: never put them in one group)",
                name="share_with", value=self._rank)
        return view

    def empty(self, ref: Ref, like: torch.Tensor) -> torch.Tensor | None:
        """Leader: the slot of `ref` for a loader to fill. Followers: None (their loader
        writes private memory; `post_init` moves them to the slot)."""
        slot = self._layout.slot(ref)
        if not self._leader or slot is None or self._mapping is None or not _fits(slot, like):
            return None
        self._pending.add(ref)
        return self._view(slot)

    def release(self, host: torch.Tensor) -> bool:
        """True for a tensor over the segment (its slot is no longer given out; the
        memory stays until the last process unmaps it); False for anything else."""
        if not self.owns(host):
            return False
        ref = self._at.pop(host.data_ptr(), None)
        if ref is not None:
            self._views.pop(ref, None)
            self._pending.discard(ref)
        return True

    # ---- internals ------------------------------------------------------------------

    def _view(self, slot: Slot) -> torch.Tensor:
        view = self._views.get(slot.ref)
        if view is not None:
            return view
        if self._mapping is None:
            raise ExecutionError("the shared segment is not mapped", name="segment", value=slot.ref)
        view = self._mapping.view(slot.offset, slot.nbytes, slot.shape, slot.stride, torch_dtype(slot.dtype))
        if self._register and slot.ref not in self._pieces:
            self._pin(slot, view)
        self._views[slot.ref] = view
        self._at[view.data_ptr()] = slot.ref
        return view

    def _pin(self, slot: Slot, view: torch.Tensor) -> None:
        """Register the slot (read-only on followers); on failure, or on a follower whose
        device does not take read-only registrations, it stays pageable."""
        if self._calls is None:
            self._calls = cuda_pin_calls(self._device)
        if not self._leader and not self._takes_read_only(self._calls):
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning("rank %d: %s does not support read-only registration "
                            "(cudaDevAttrHostRegisterReadOnlySupported is 0): its mapping of the shared host copy "
                            "stays in pageable memory, which is slower and cannot be captured in CUDA graphs",
                            self._rank, self._device)
            return
        flags = HOST_REGISTER_DEFAULT if self._leader else HOST_REGISTER_FOLLOWER
        try:
            self._pieces[slot.ref] = register_range(self._calls, view.data_ptr(), slot.nbytes, flags,
                                                    self._piece_bytes)
        except HostRegisterError as exc:
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning("page-locking the shared host copy failed (%s); this and later failures stay in "
                            "pageable memory, which is slower and cannot be captured in CUDA graphs", exc)
            return
        pieces = self._pieces[slot.ref]
        if len(pieces) > 1:
            if self._ranges is not None:
                self._ranges.note_registered(pieces)
                self._noted.append(pieces)
            else:
                log.info("layer %d parameter %r is registered in %d pieces; its copies are not cut at their ends",
                         slot.ref[0], slot.ref[1], len(pieces))

    def _takes_read_only(self, calls: PinCalls) -> bool:
        """Whether the device takes read-only registrations: asked once; unknown counts as
        yes (the registration is tried, and a refusal is a fallback like any other)."""
        if self._read_only is None:
            answer = calls.read_only_supported()
            self._read_only = answer is None or answer != 0
            log.debug("rank %d: cudaDevAttrHostRegisterReadOnlySupported of %s is %s", self._rank, self._device,
                      "unknown" if answer is None else answer)
        return self._read_only

    def close(self) -> None:
        """Unregister every slot and stop holding the segment (tensors still over it keep
        it mapped, as pageable memory, until they die)."""
        calls = self._calls
        if self._ranges is not None:
            while self._noted:
                self._ranges.forget_registered(self._noted.pop())
        if calls is not None:
            for pieces in self._pieces.values():
                for status in unregister_pieces(calls, pieces):
                    log.warning("cudaHostUnregister of the shared host copy failed with cudaError %d", status)
        self._pieces.clear()
        self._views.clear()
        self._at.clear()
        self._pending.clear()
        self._allowed.clear()
        if self._mapping is not None:
            self._mapping.drop()
            self._mapping = None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape), tuple(a.stride()), a.dtype) == (tuple(b.shape), tuple(b.stride()), b.dtype)


def slot_moves(plan: OffloadPlan, layers: Sequence[nn.Module], layout: SegmentLayout,
               source: SharedHostSource) -> tuple[list[tuple[list[nn.Parameter], torch.Tensor]], list[Ref]]:
    """A follower's offloaded weights that could point at the leader's copy, and those
    that differ from it.

    Args:
        plan: the plan of `layers` (its offloaded parameters, ties included).
        layers: the follower's layers.
        layout: the segment's slots.
        source: the follower's source, attached, with the slots the leader wrote allowed.

    Returns:
        (each owner's parameters, ties kept, with its slot's tensor, for every owner whose
        data is outside the segment and fits a written slot; the owners among them whose
        sample differs from the slot, where `source` verifies), both in plan order.
        Weights on meta, or that changed shape, stay private and are in neither.
    """
    owners: dict[Ref, list[nn.Parameter]] = {}
    for p in plan.offloaded_params:
        param = find_parameter(layers[p.layer], p.name) if p.layer < len(layers) else None
        if param is None:
            continue  # layers that do not match the plan: the executor refuses them
        members = owners.setdefault(p.tied_to or (p.layer, p.name), [])
        if all(param is not seen for seen in members):
            members.append(param)
    moves: list[tuple[list[nn.Parameter], torch.Tensor]] = []
    differ: list[Ref] = []
    for owner, params in owners.items():
        data = params[0].data
        if source.owns(data) or data.device.type == "meta" or layout.slot(owner) is None:
            continue
        view = source.slot_view(owner)
        if view is None or not _same_layout(data, view):
            continue  # not written by the leader, or changed shape: stays private
        if source.verify and not same_sample(data, view):
            differ.append(owner)
        moves.append((params, view))
    return moves, differ
