"""`CudaRuntime`: the executor's effects on a CUDA device.

Copies run on one side stream. Each copy first waits for an event recorded on the
compute stream (so no buffer is overwritten while a kernel still reads it) and records a
done event that the compute stream waits on before the layer that reads the buffer.
Host-to-device copies move the source's byte span, one memcpy per registered piece
(`offload.runtime.copies`), so strides with gaps never stage through pageable memory.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, final

import torch

from offload.errors import ExecutionError
from offload.logs import logger
from offload.pure.decide.pinning import PinMethod
from offload.runtime.copies import span_chunks
from offload.runtime.cpu import host_empty_like
from offload.runtime.cudart import copy_stream, host_calls, relax_capture_mode
from offload.runtime.hostmem import (
    PIECE_BYTES,
    HostAllocation,
    HostRegisterError,
    Layout,
    alloc_host_block,
    alloc_host_tensor,
    drain_retired,
    pageable_block,
    register_host_block,
    register_host_tensor,
    retired_count,
)
from offload.runtime.numa import HostPlacer

__all__ = ["CudaRuntime", "zero_copy_view"]

#: Bracketed waits kept before the finished ones are added up (bounds the list).
_FOLD_AT = 256

log = logger("offload.host")

# __cuda_array_interface__ type strings by item size: an integer type of the same width,
# reinterpreted as the real dtype afterwards (bfloat16 and float8 have no type string).
_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8", 16: "<c16"}


class _HostArray:
    """Presents page-locked host memory to torch as CUDA memory (unified addressing makes
    the host pointer valid on the device); holds the host tensor so the memory outlives
    the view."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        itemsize = host.element_size()
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape),
            "strides": tuple(step * itemsize for step in host.stride()),
            "typestr": _TYPESTR[itemsize],
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def zero_copy_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` that reads page-locked `host` in place, same shape, strides
    and dtype. Keep `host` alive as long as the view (the view holds it)."""
    raw = torch.as_tensor(_HostArray(host), device=device)
    return raw if raw.dtype == host.dtype else raw.view(host.dtype)


@final
class _Block:
    """A host block this runtime handed out (`CudaRuntime.host_block`): its memory (None
    when pageable) and the members not yet released."""

    __slots__ = ("allocation", "live", "nbytes", "start")

    def __init__(self, allocation: HostAllocation | None, flat: torch.Tensor, members: Sequence[torch.Tensor]) -> None:
        self.allocation = allocation
        self.start = flat.data_ptr()
        self.nbytes = flat.numel()
        self.live = {m.data_ptr() for m in members}


@final
class CudaRuntime:
    """Runs executors on ``cuda:index`` with one side stream for host-to-device copies.

    Args:
        index: the CUDA device index; the current device when None.
        piece_bytes: the largest range registered in one cudaHostRegister call (tests
            make it small to exercise host copies in several pieces).
        numa_node: the NUMA node registered host copies are placed on before their first
            touch (the plan's ``host_numa.node``); None leaves them to the kernel's default.

    Raises:
        ExecutionError: CUDA is not available.
    """

    def __init__(self, index: int | None = None, *, piece_bytes: int = PIECE_BYTES,
                 numa_node: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ExecutionError("CudaRuntime needs a CUDA device; torch.cuda.is_available() is False",
                                 name="device", value="cuda")
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._copy_stream = copy_stream(self._device)
        self._locked: dict[int, HostAllocation] = {}  # host data_ptr -> its page-locked memory
        self._member_of: dict[int, _Block] = {}  # data_ptr of a live member of a block -> the block
        # Ranges registered in pieces that are not one tensor of `_locked`: page-locked
        # blocks, and ranges registered elsewhere (`note_registered`). Sorted start
        # addresses, and start -> (end, pieces).
        self._range_starts: list[int] = []
        self._threads = threading.local()  # per thread: the device `block_on` set current
        self._locked_ranges: set[int] = set()  # starts of the ranges `_pinned_empty_like` added
        self._ranges: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}
        self._fallbacks = 0
        self._piece_bytes = piece_bytes
        self._placer = HostPlacer(numa_node) if numa_node is not None else None
        self._calls = host_calls(self._device)
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # bracketed waits not yet added up
        self._waited_ms = 0.0
        self._copies_timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # copies not yet added up
        self._copied_ms = 0.0

    @property
    def device(self) -> torch.device:
        """The CUDA device."""
        return self._device

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """An exact-size host tensor with the same shape, strides and values.

        Pinned copies are page-locked as `pin` says: mapped pages registered in place
        (`register_host_tensor`), or one page-locked allocation of the exact size
        (`alloc_host_tensor`); never PyTorch's power-of-two pinned allocator. If that
        fails, the tensor stays pageable: logged once, counted in `pin_fallbacks`.

        Raises:
            ExecutionError: the allocation or copy failed; the CUDA error is the cause.
        """
        try:
            host = host_empty_like(tensor) if pin is PinMethod.NONE else self._pinned_empty_like(tensor, pin)
            host.copy_(tensor)
        except RuntimeError as exc:
            raise ExecutionError(
                f"host copy ({pin.value}) of a {tuple(tensor.shape)} {tensor.dtype} tensor failed: {exc}",
                name="host_copy",
                value=tuple(tensor.shape),
            ) from exc
        return host

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """An uninitialised exact-size host tensor shaped like `like` (which may be on
        meta), page-locked as `pin` says, falling back to pageable as `host_copy` does.

        Raises:
            ExecutionError: the allocation failed.
        """
        try:
            return host_empty_like(like) if pin is PinMethod.NONE else self._pinned_empty_like(like, pin)
        except RuntimeError as exc:
            raise ExecutionError(
                f"host allocation ({pin.value}) of a {tuple(like.shape)} {like.dtype} tensor failed: {exc}",
                name="host_empty",
                value=tuple(like.shape),
            ) from exc

    def host_block(self, likes: Sequence[torch.Tensor], *,
                   pin: PinMethod) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Uninitialised host tensors shaped like `likes`, back to back in one allocation of
        exactly their bytes (`offload.protocols.HostBlocks`), page-locked as `pin` says:
        registered in place or one page-locked allocation, as `host_copy`; if that fails,
        all of them stay pageable (logged once, each counted in `pin_fallbacks`).

        Raises:
            ExecutionError: the allocation failed.
        """
        layouts: list[Layout] = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in likes]
        try:
            locked = None if pin is PinMethod.NONE else self._pinned_block(layouts, pin)
            allocation = locked if locked is not None else pageable_block(layouts)
        except (RuntimeError, OSError) as exc:
            raise ExecutionError(f"host block ({pin.value}) of {len(likes)} tensors failed: {exc}",
                                 name="host_block", value=len(likes)) from exc
        block = _Block(locked, allocation.tensor, allocation.members)
        if locked is not None:
            for ptr in block.live:
                self._member_of[ptr] = block
            self._add_range(block.start, block.start + block.nbytes, locked.pieces)
        return allocation.tensor, list(allocation.members)

    def _pinned_block(self, layouts: Sequence[Layout], method: PinMethod) -> HostAllocation | None:
        """The page-locked block, or None after a fallback (`_page_locked`)."""
        return self._page_locked(method, len(layouts), functools.partial(register_host_block, layouts),
                                 functools.partial(alloc_host_block, layouts))

    def _page_locked(self, method: PinMethod, count: int, register: Callable[..., HostAllocation],
                     alloc: Callable[..., HostAllocation]) -> HostAllocation | None:
        """`register` (`PinMethod.REGISTER`) or `alloc` (`PinMethod.ALLOC`) called with this
        runtime's CUDA calls; None when that fails: `count` host copies fall back to pageable
        memory (counted; the first fallback is logged)."""
        self._drain()
        calls = self._calls
        try:
            if method is PinMethod.REGISTER:
                return register(register=calls.register, unregister=calls.unregister, piece_bytes=self._piece_bytes,
                                place=self._placer.place if self._placer is not None else None)
            return alloc(alloc=calls.alloc, free=calls.free)
        except (HostRegisterError, OSError) as exc:
            first = self._fallbacks == 0
            self._fallbacks += count
            if first:
                log.warning("pinning host memory (%s) failed (%s); this and later failures fall back to "
                            "pageable memory, which is slower and cannot be captured in CUDA graphs",
                            method.value, exc)
            return None

    def _add_range(self, start: int, end: int, pieces: tuple[tuple[int, int], ...]) -> None:
        if start not in self._ranges:
            bisect.insort(self._range_starts, start)
        self._ranges[start] = (end, pieces)

    def _drop_range(self, start: int) -> None:
        if self._ranges.pop(start, None) is not None:
            self._range_starts.remove(start)

    def _pieces_in(self, host: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """The pieces of the registered range `host` starts in (a block, or one registered
        elsewhere), or () when it starts in none."""
        ptr = host.data_ptr()
        at = bisect.bisect_right(self._range_starts, ptr) - 1
        if at < 0:
            return ()
        end, pieces = self._ranges[self._range_starts[at]]
        return pieces if ptr < end else ()

    def note_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        """Host memory registered outside this runtime in `pieces` (`RegisteredRanges`: a
        shared segment's slot): copies from it are cut at the pieces' ends, as from a copy
        of this runtime's own."""
        if pieces:
            start, (last, length) = pieces[0][0], pieces[-1]
            self._add_range(start, last + length, tuple(pieces))

    def forget_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        """The range `note_registered` was told of is unregistered."""
        if pieces:
            self._drop_range(pieces[0][0])

    def _drain(self) -> None:
        """Give back host memory whose tensors died unreleased (never inside a capture)."""
        if retired_count() and not torch.cuda.is_current_stream_capturing():
            for status in drain_retired():
                log.warning("giving back retired page-locked host memory failed with cudaError %d", status)

    def _pinned_empty_like(self, tensor: torch.Tensor, method: PinMethod) -> torch.Tensor:
        if tensor.numel() == 0:
            return host_empty_like(tensor)  # no memory to lock
        layout = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        locked = self._page_locked(method, 1, functools.partial(register_host_tensor, *layout),
                                   functools.partial(alloc_host_tensor, *layout))
        if locked is None:
            return host_empty_like(tensor)
        start = locked.tensor.data_ptr()
        self._locked[start] = locked
        if len(locked.pieces) > 1:  # views into it at an offset (a staging buffer's) are cut at its pieces too
            self._add_range(start, start + locked.tensor.untyped_storage().nbytes(), locked.pieces)
            self._locked_ranges.add(start)
        return locked.tensor

    def is_pinned(self, host: torch.Tensor) -> bool:
        """True when `host` is page-locked by this runtime (or otherwise)."""
        ptr = host.data_ptr()
        return ptr in self._locked or ptr in self._member_of or bool(host.is_pinned())

    @property
    def numa_placer(self) -> HostPlacer | None:
        """What places registered host copies on the plan's NUMA node (with its counts and
        the reason of a fallback), or None when no node was given."""
        return self._placer

    @property
    def pin_fallbacks(self) -> int:
        """How many pinned host copies fell back to pageable memory."""
        return self._fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        """Give back `host`'s page-locked memory: registered pages are unregistered now
        (they stay readable); an allocation is freed once no tensor uses it. A member of a
        block gives the block back with the last of its members."""
        locked = self._locked.pop(host.data_ptr(), None)
        if locked is not None and host.data_ptr() in self._locked_ranges:  # only the range it added
            self._locked_ranges.discard(host.data_ptr())
            self._drop_range(host.data_ptr())
        block = self._member_of.pop(host.data_ptr(), None)
        if block is not None:
            block.live.discard(host.data_ptr())
            if not block.live and block.allocation is not None:  # the last member: the block goes
                locked = block.allocation
                self._drop_range(block.start)
        if locked is not None:
            for status in locked.release():
                log.warning("cudaHostUnregister failed with cudaError %d", status)
        self._drain()

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        """A zero-copy device view of registered `host` (``__cuda_array_interface__``).

        Raises:
            ExecutionError: `host` is not page-locked, or torch refused the pointer.
        """
        if host.numel() == 0:
            return torch.empty_strided(tuple(host.shape), tuple(host.stride()), dtype=host.dtype, device=self._device)
        if not self.is_pinned(host):
            raise ExecutionError("a zero-copy view needs page-locked host memory; this tensor is pageable",
                                 name="device_view", value=tuple(host.shape))
        if importlib.util.find_spec("numpy") is None:
            # torch builds a tensor from __cuda_array_interface__ only with numpy present.
            raise ExecutionError("zero-copy (UVA) views need numpy installed (torch parses the array "
                                 "interface with it); pip install numpy, or set OFFLOAD_DISABLE_UVA=1",
                                 name="numpy", value=None)
        try:
            return zero_copy_view(host, self._device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ExecutionError(f"zero-copy view of a {tuple(host.shape)} {host.dtype} host tensor failed: {exc}",
                                 name="device_view", value=tuple(host.shape)) from exc

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of `host` on the device, queued on the current stream, keeping strides."""
        out = torch.empty_strided(tuple(host.shape), tuple(host.stride()), dtype=host.dtype, device=self._device)
        pinned = self.is_pinned(host)
        for d, s in self._chunks(out, host):
            d.copy_(s, non_blocking=pinned)
        return out

    def _chunks(self, dst: torch.Tensor, host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`span_chunks` with the pieces `host` is registered in (one memcpy per piece)."""
        locked = self._locked.get(host.data_ptr())
        if locked is not None:
            pieces = locked.pieces
        else:  # a member of a block, a slice of one, or memory registered elsewhere
            pieces = self._pieces_in(host) if self._range_starts else ()
        # One registered piece has no boundary inside the tensor to cut at.
        return span_chunks(dst, host, pieces if len(pieces) > 1 else ())

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on the device with exactly these strides."""
        try:
            return torch.empty_strided(shape, stride, dtype=dtype, device=self._device)
        except RuntimeError as exc:
            raise ExecutionError(f"device buffer {shape} {dtype} could not be allocated: {exc}",
                                 name="device_empty", value=shape) from exc

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A synchronous copy of `tensor` onto `device`, keeping its strides."""
        out = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=device)
        out.copy_(tensor)
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return out

    def record(self) -> torch.cuda.Event:
        """An event on the current (compute) stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
        event.record(torch.cuda.current_stream(self._device))
        return event

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: object) -> torch.cuda.Event:
        """Queue the copy on the side stream after `after`; return its done event.

        Outside a capture the copy is bracketed by two timing events on the copy stream
        (the done event is the second), added up by `copy_seconds`."""
        return self.copy_chunks_after(self.copy_chunks(dst, src), after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """How `copy_after` copies `src` into `dst`: one memcpy per registered piece its
        span crosses (`PreparedCopies`; valid while `src`'s registration is)."""
        return tuple(self._chunks(dst, src))

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                          after: object) -> torch.cuda.Event:
        """Queue `chunks` (from `copy_chunks`) on the side stream after `after`, timed as
        `copy_after` is; return the done event."""
        stream = self._copy_stream
        if after is not None:
            if not isinstance(after, torch.cuda.Event):
                raise ExecutionError(f"not an event of this runtime: {after!r}", name="after", value=after)
            stream.wait_event(after)
        timed = not torch.cuda.is_current_stream_capturing()
        start = torch.cuda.Event(enable_timing=True) if timed else None  # type: ignore[no-untyped-call]  # as above
        if start is not None:
            start.record(stream)
        with torch.cuda.stream(stream):
            for d, s in chunks:
                d.copy_(s, non_blocking=True)
        done = torch.cuda.Event(enable_timing=timed)  # type: ignore[no-untyped-call]  # as above
        done.record(stream)
        if start is not None:
            self._copies_timed.append((start, done))
            if len(self._copies_timed) >= _FOLD_AT:
                self._fold()
        return done

    def wait(self, event: object) -> None:
        """The compute stream waits for `event`. Outside a capture the wait is bracketed by
        two timing events: the time between them on the device is the time the stream
        stood still (see `waited_seconds`)."""
        if not isinstance(event, torch.cuda.Event):
            raise ExecutionError(f"not an event of this runtime: {event!r}", name="event", value=event)
        stream = torch.cuda.current_stream(self._device)
        if torch.cuda.is_current_stream_capturing():
            stream.wait_event(event)
            return
        before = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
        after = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._timed.append((before, after))
        if len(self._timed) >= _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Add up the bracketed waits and copies that are done, oldest first; keep the rest.

        Not while the current stream captures a CUDA graph: ``cudaEventQuery`` is not
        permitted during a (global-mode) capture and would invalidate it, so the waits
        stay unfolded until the next call outside the capture."""
        if torch.cuda.is_current_stream_capturing():
            return
        while self._timed and self._timed[0][1].query():  # type: ignore[no-untyped-call]  # unannotated in torch
            before, after = self._timed.pop(0)
            self._waited_ms += before.elapsed_time(after)
        while self._copies_timed and self._copies_timed[0][1].query():  # type: ignore[no-untyped-call]  # as above
            start, done = self._copies_timed.pop(0)
            self._copied_ms += start.elapsed_time(done)

    def block_on(self, event: object) -> None:
        """Block the calling thread until `event` is done (`HostWaits`), polling it with
        short sleeps: the copies' events are not blocking-sync events, and a synchronize
        on them may spin a core per waiting thread. The thread's current device is set
        to this runtime's first (a thread that has never set it would make a context on
        device 0), and its capture mode relaxed (an event query in global mode would
        invalidate a CUDA graph another thread is capturing). For the disk reader's
        threads, not the thread that runs the model."""
        if not isinstance(event, torch.cuda.Event):
            raise ExecutionError(f"not an event of this runtime: {event!r}", name="event", value=event)
        if getattr(self._threads, "device", None) != self._device:
            torch.cuda.set_device(self._device)
            relax_capture_mode()  # its event queries must not break another thread's capture
            self._threads.device = self._device
        pause = 50e-6
        while not event.query():  # type: ignore[no-untyped-call]  # unannotated in torch
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def waited_seconds(self) -> float:
        """Seconds the compute stream stood still in `wait` (outside captures), over the
        waits the device has finished; never blocks, and queries nothing during a CUDA
        graph capture (it then reports what was added up before it)."""
        self._fold()
        return self._waited_ms / 1e3

    def copy_seconds(self) -> float:
        """Device seconds the copy stream spent in `copy_after`'s copies (outside
        captures), over the copies the device has finished; never blocks."""
        self._fold()
        return self._copied_ms / 1e3

    def is_capturing(self) -> bool:
        """True while the current stream is capturing a CUDA graph."""
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Block until the device is idle (and unregister memory retired meanwhile)."""
        torch.cuda.synchronize(self._device)
        self._drain()
