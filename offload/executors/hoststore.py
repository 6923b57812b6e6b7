"""`HostStore`: the host copies an executor holds, one per storage, pinned as the plan says.

Shared by the executors so that pinning is requested in exactly one place, fallbacks are
counted the same way, and everything taken is given back on restore.

A `HostSource` may be injected (`offload.sharing` gives one whose copies lie in a segment
shared by the processes of one host): `put` and `place` ask it first, and take their copy
from the runtime only where it answers None; what it gave is given back to it.

Blocks (`reserve`, `offload.pure.plan.blocks`): several copies of one layer in one allocation,
back to back, where the runtime offers it (`offload.protocols.HostBlocks`) and no injected
source claims any of them (`HostSource.claims`). The block is allocated when its first
member is placed; each member is a copy as any other (its own storage, released on its own); the allocation goes when the
last member is released. New data for a member (`put`, `place` at post_init) is copied
into it in place when it has the member's shape, strides and dtype; otherwise the member
is released and the data gets a copy of its own (the block's memory stays, counted in
`nbytes`, until its last member goes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, final

import torch

from offload.errors import ExecutionError
from offload.logs import logger
from offload.protocols import HostBlocks, Runtime
from offload.pure.decide.moves import Move
from offload.pure.decide.pinning import PinMethod

__all__ = ["HostSource", "HostStore", "Ref"]

log = logger("offload.host")

#: (layer index, parameter name relative to the layer).
Ref = tuple[int, str]


class HostSource(Protocol):
    """Where host copies come from before the runtime is asked (e.g. a segment shared with
    the other processes of the host, `offload.sharing.source.SharedHostSource`). Each call
    answers None where it has no copy to give; the store then asks the runtime."""

    def copy(self, ref: Ref, tensor: torch.Tensor) -> torch.Tensor | None:
        """A host copy of `tensor` (shape, strides, dtype and values) for `ref`, or None.

        Raises:
            ExecutionError: it should give one and cannot (the message says why).
        """
        ...

    def empty(self, ref: Ref, like: torch.Tensor) -> torch.Tensor | None:
        """Host memory shaped like `like` (which may be on meta) for a loader to fill, or None."""
        ...

    def release(self, host: torch.Tensor) -> bool:
        """Take back `host` if it came from here (True); False leaves it to the runtime."""
        ...

    def writable(self, host: torch.Tensor) -> bool:
        """Whether this process may write `host` in place (`load_weights`): False for
        memory it maps read-only (a copy another process wrote and shares)."""
        ...

    def read_only_reason(self, host: torch.Tensor) -> str:
        """Why `host` (not `writable`) may not be written, and what to do instead, for
        the message that refuses a write."""
        ...

    def claims(self, ref: Ref) -> bool:
        """Whether `copy` and `empty` may answer for `ref`. The store makes host blocks
        only of copies no source claims (a block's members come from one allocation)."""
        ...

    def counted(self, host: torch.Tensor) -> bool:
        """Whether `host` (from here) takes this process's host memory: False for a copy
        that lies in a file and is only read from there (`HostStore.nbytes`)."""
        ...


@final
class _Block:
    """A reserved block: its members' refs and shapes (`likes`, on meta), and once
    allocated, its flat view and member tensors; which members were handed out and which
    released."""

    __slots__ = ("flat", "handed", "likes", "members", "offsets", "refs", "released")

    def __init__(self, refs: tuple[Ref, ...], likes: tuple[torch.Tensor, ...], offsets: tuple[int, ...]) -> None:
        self.refs = refs
        self.likes = likes
        self.offsets = offsets
        self.flat: torch.Tensor | None = None
        self.members: list[torch.Tensor] = []
        self.handed: set[int] = set()
        self.released: set[int] = set()

    @property
    def alive(self) -> bool:
        """Allocated, and some member is not released yet."""
        return self.flat is not None and len(self.released) < len(self.refs)


@final
class HostStore:
    """Host copies keyed by the (layer, name) that owns each storage.

    Args:
        runtime: makes and releases the copies.
        pin: the plan's pin method (``plan.pin.method``); passed to every
            `Runtime.host_copy` unchanged.
        source: asked first for every copy (`HostSource`); None: the runtime makes them all.
    """

    def __init__(self, runtime: Runtime, *, pin: PinMethod, source: HostSource | None = None) -> None:
        self._rt = runtime
        self._pin = pin
        self._source = source
        self._copies: dict[Ref, torch.Tensor] = {}
        self._unpinned: set[Ref] = set()  # owners whose pinned copy fell back to pageable
        # Replaced copies that something may still read (a zero-copy view another parameter
        # still points at): kept, and registered, until `release_retired` or `clear`.
        self._retired: list[torch.Tensor] = []
        self._blocks: list[_Block] = []
        self._planned: dict[Ref, tuple[_Block, int]] = {}  # reserved, not placed yet
        self._member: dict[int, tuple[_Block, int]] = {}  # data_ptr of a member handed out -> its block

    @property
    def blocks_possible(self) -> bool:
        """Whether `reserve` may make blocks: the runtime offers them (of copies no source
        claims: `HostSource.claims`)."""
        return isinstance(self._rt, HostBlocks)

    def reserve(self, blocks: Sequence[tuple[tuple[Ref, ...], tuple[torch.Tensor, ...], tuple[int, ...]]]) -> None:
        """Plan blocks: each is (refs, likes, byte offsets), the members of one block in
        address order, shaped like `likes` (meta tensors). Their copies, when `place`
        makes them, are members of the block. Does nothing unless `blocks_possible`."""
        if not self.blocks_possible:
            return
        source = self._source
        for refs, likes, offsets in blocks:
            if source is not None and any(source.claims(ref) for ref in refs):
                continue
            block = _Block(refs, likes, offsets)
            self._blocks.append(block)
            for index, ref in enumerate(refs):
                self._planned[ref] = (block, index)

    @property
    def has_blocks(self) -> bool:
        """Whether `reserve` planned any block."""
        return bool(self._blocks)

    def in_block(self, ref: Ref) -> bool:
        """Whether `ref`'s copy is a member of a block."""
        return self.block_of(ref) is not None

    def block_of(self, ref: Ref) -> tuple[torch.Tensor, int] | None:
        """(flat view of the block, byte offset) of `ref`'s copy, when it is a member of a block."""
        host = self._copies.get(ref)
        entry = self._member.get(host.data_ptr()) if host is not None and host.numel() else None
        if entry is None:
            return None
        block, index = entry
        return None if block.flat is None else (block.flat, block.offsets[index])

    def _refresh(self, ref: Ref, tensor: torch.Tensor) -> torch.Tensor | None:
        """When `ref`'s copy is a member of a block with `tensor`'s shape, strides and dtype:
        `tensor` copied into it in place (the block stays whole, and its layer one copy),
        and the member returned; else None. Never when `tensor` lies in a block itself (a
        weight moved to another parameter by post-processing, such as a swap: a copy in
        place could overwrite what another parameter is still to be given).

        Raises:
            ExecutionError: the copy failed (the member keeps what it held, partly overwritten).
        """
        host = self._copies.get(ref)
        if (host is None or not self.in_block(ref) or host is tensor or host.dtype != tensor.dtype
                or host.shape != tensor.shape or host.stride() != tensor.stride() or self.in_a_block(tensor)):
            return None
        try:
            host.copy_(tensor)
        except RuntimeError as exc:
            raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r}: copying new data into its host block failed: "
                                 f"{exc}", name=ref[1], value=ref[0]) from exc
        return host

    def in_a_block(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in one of the blocks (it may be a member, or data
        post-processing took from one)."""
        if tensor.device.type != "cpu" or not tensor.numel():
            return False
        ptr = tensor.data_ptr()
        return any(b.flat is not None and b.flat.data_ptr() <= ptr < b.flat.data_ptr() + b.flat.numel()
                   for b in self._blocks)

    def _from_block(self, ref: Ref) -> torch.Tensor | None:
        """`ref`'s reserved member (allocating its block first), or None when it has none."""
        entry = self._planned.pop(ref, None)
        if entry is None:
            return None
        block, index = entry
        if block.flat is None and isinstance(self._rt, HostBlocks):  # reserve made sure it is
            block.flat, block.members = self._rt.host_block(block.likes, pin=self._pin)
        member = block.members[index]
        block.handed.add(index)
        self._member[member.data_ptr()] = (block, index)
        return member

    def put(self, ref: Ref, tensor: torch.Tensor, *, defer_release: bool = False) -> torch.Tensor:
        """Copy `tensor` to host memory for `ref` (releasing a copy `ref` held before).

        Args:
            ref: the owner of the copy.
            tensor: the source, on any device.
            defer_release: keep the copy `ref` held before (and its registration) until
                `release_retired` or `clear`, instead of releasing it now: device views
                of it may still be read.

        Raises:
            ExecutionError: the runtime (or the source) could not make the copy.
        """
        refreshed = None if defer_release else self._refresh(ref, tensor)
        if refreshed is not None:
            return refreshed
        host = self._source.copy(ref, tensor) if self._source is not None else None
        if host is None:
            member = self._from_block(ref)
            if member is not None:
                try:
                    member.copy_(tensor)
                except RuntimeError as exc:
                    self._release(member)
                    raise ExecutionError(f"host copy of a {tuple(tensor.shape)} {tensor.dtype} tensor into its block "
                                         f"failed: {exc}", name="host_copy", value=tuple(tensor.shape)) from exc
                host = member
            else:
                host = self._rt.host_copy(tensor, pin=self._pin)
        return self._keep(ref, host, defer_release=defer_release)

    def place(self, ref: Ref, tensor: torch.Tensor, move: Move, *, defer_release: bool = False) -> torch.Tensor:
        """Give `ref` the host copy `move` says (`OffloadPlan.move_of`), from `tensor`.

        - `Move.ADOPT`: `tensor` (pageable host memory, and the plan does not pin) is the
          host copy itself: nothing is copied or allocated (unless the source gives a
          copy: a shared one, or `ref` is a reserved member of a block: it is copied in).
        - `Move.NEW_ON_HOST`: `tensor` is a meta placeholder: uninitialised exact-size host
          memory with its shape, strides and dtype, pinned as the plan says.
        - `Move.TO_HOST`, `Move.HOST_TO_PINNED`: a copy (`put`).

        Args:
            ref: the owner of the copy.
            tensor: the parameter's data.
            move: how it reaches host memory; a move of a resident parameter is refused.
            defer_release: as for `put`.

        Raises:
            ExecutionError: the runtime failed, or `move` does not put anything in host memory.
        """
        try:
            if move is Move.ADOPT:
                shared = self._source.copy(ref, tensor) if self._source is not None else None
                if shared is None and (ref in self._planned or self.in_block(ref)):  # a block member
                    return self.put(ref, tensor, defer_release=defer_release)
                return self._keep(ref, tensor if shared is None else shared, defer_release=defer_release)
            if move is Move.NEW_ON_HOST:
                host = self._source.empty(ref, tensor) if self._source is not None else None
                if host is None:
                    host = self._from_block(ref)
                if host is None:
                    host = self._rt.host_empty(tensor, pin=self._pin)
                return self._keep(ref, host, defer_release=defer_release)
            if move in (Move.TO_HOST, Move.HOST_TO_PINNED):
                return self.put(ref, tensor, defer_release=defer_release)
        except ExecutionError as exc:
            # The runtime's error says what failed; say for which parameter.
            raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r}: {exc}", name=exc.name, value=exc.value) from exc
        raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r}: move {move.value} puts nothing in host memory",
                             name=ref[1], value=move.value)

    def _keep(self, ref: Ref, host: torch.Tensor, *, defer_release: bool) -> torch.Tensor:
        """Hold `host` as `ref`'s copy (releasing or retiring what `ref` held before)."""
        # The new copy is held before the old one is given back: if giving it back fails,
        # nothing is lost track of (the old one is gone from the table either way).
        previous = self._copies.get(ref)
        self._copies[ref] = host
        self._unpinned.discard(ref)
        if self._pin is not PinMethod.NONE and host.numel() and not self._rt.is_pinned(host):
            self._unpinned.add(ref)
            log.info("layer %d parameter %r stays in pageable memory: pinning it failed", *ref)
        if previous is not None and previous is not host:
            if defer_release:
                self._retired.append(previous)
            else:
                self._release(previous)
        return host

    def _release(self, host: torch.Tensor) -> None:
        """Give `host` back to where it came from: the source, else the runtime."""
        entry = self._member.pop(host.data_ptr(), None) if host.numel() else None
        if entry is not None:
            block = entry[0]
            block.released.add(entry[1])
            if len(block.released) == len(block.refs):  # its last member: nothing here holds its memory
                block.flat, block.members = None, []
        if self._source is None or not self._source.release(host):
            self._rt.release_host(host)

    def get(self, ref: Ref) -> torch.Tensor | None:
        """The copy `ref` owns, or None."""
        return self._copies.get(ref)

    def writable(self, ref: Ref) -> bool:
        """Whether `ref`'s copy may be written in place (not read-only memory the source
        shares with other processes); True when `ref` owns none."""
        host = self._copies.get(ref)
        return host is None or self._source is None or self._source.writable(host)

    def read_only_reason(self, ref: Ref) -> str:
        """Why `ref`'s copy is not `writable` (the source says), for messages."""
        host = self._copies.get(ref)
        return "" if host is None or self._source is None else self._source.read_only_reason(host)

    def __contains__(self, ref: object) -> bool:
        return ref in self._copies

    def tensors(self) -> list[torch.Tensor]:
        """Every copy held (retired ones not included)."""
        return list(self._copies.values())

    def __iter__(self) -> Iterator[Ref]:
        return iter(self._copies)

    def drop(self, ref: Ref) -> None:
        """Release the copy `ref` owns, if any."""
        host = self._copies.pop(ref, None)
        self._unpinned.discard(ref)
        if host is not None:
            self._release(host)

    def release_retired(self) -> None:
        """Release the copies `put` replaced with ``defer_release=True``."""
        while self._retired:  # one at a time: a failure leaves the rest for `clear`
            self._release(self._retired.pop())

    def clear(self) -> None:
        """Release every copy, retired ones included, and the members of blocks that were
        never handed out."""
        for ref in list(self._copies):
            self.drop(ref)
        self.release_retired()
        while self._blocks:
            block = self._blocks.pop()
            for index, member in enumerate(block.members):
                if index not in block.handed:
                    block.handed.add(index)
                    block.released.add(index)
                    self._rt.release_host(member)
        self._planned.clear()

    @property
    def fallbacks(self) -> int:
        """Copies held that were asked to be pinned and are pageable."""
        return len(self._unpinned)

    @property
    def nbytes(self) -> int:
        """Host bytes held, each storage once (retired copies included); a block counts
        whole until its last member is released."""
        source = self._source
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*self._copies.values(), *self._retired)
                    if t.numel() and t.data_ptr() not in self._member and (source is None or source.counted(t))}
        return sum(storages.values()) + sum(b.flat.numel() for b in self._blocks if b.alive and b.flat is not None)
