"""A recording fake `Runtime` for the executor tests (a fake, not a mock: it really runs).

`FakeRuntime` wraps `CpuRuntime`. It logs every effect the executor asks for, in order,
together with the reads that `ProbeBlock` layers report, so a test can check the order of
copies, events, waits and compute. Knobs:

- ``fail_host_copy_at=k``: the k-th `host_copy` (counted from 0) raises `InjectedFailure`;
  ``fail_device_empty_at=k`` likewise for `device_empty`, ``fail_device_view_at=k`` for
  `device_view`.
- ``defer=True``: copies are queued and done only when the compute side waits for them
  (or on `synchronize`), as late as a real copy stream may finish them. A layer that read
  its buffer without waiting would then read stale data, and parity would fail.
- ``capturing``: what `is_capturing` answers; toggle it to play a CUDA graph capture.
- `host_copy` accepts any `PinMethod` (it records the request) and copies without pinning,
  so plans made for a CUDA-like platform run here; `is_pinned` then answers True for that
  copy (the fake plays pinned memory), unless ``fail_pin_at=k`` made the k-th pinned copy
  fall back to pageable (counted in `pin_fallbacks`, as a real runtime would).
- `release_host`, `device_view`, `to_device` and `copy_to` are logged as `Release`,
  `View`, `ToDevice` and `CopyTo`; a view is the host tensor itself (the CPU reads host
  memory in place). ``fail_copy_to_at=k`` makes the k-th `copy_to` (counted from 0, see
  `copies_to`) raise `InjectedFailure`; it is a public attribute, so a test can aim it
  at a later call (a restore) once it knows how many calls came before.
- ``device="cuda:0"`` plays a CUDA compute device while every tensor stays on the CPU:
  `device` reports ``cuda:0``, and `copy_to` to that device, `device_empty` and
  `to_device` return CPU tensors counted as device memory; `copy_to` to the CPU is a
  host copy. A CPU parameter is then in host memory as the executors see it, so a plan
  made for a CUDA-like platform from the real (``cpu``) devices runs the GPU paths:
  `Move.TO_DEVICE` for resident weights, `Move.HOST_TO_PINNED` or `Move.ADOPT` for
  offloaded ones. By default (``device="cpu"``) the device is the CPU, as before.
- Device memory is accounted in both modes: every storage returned as device memory is
  followed by a weak reference to its StorageImpl (not the Python tensor: ``param.data =
  t`` keeps the storage while ``t`` dies), `device_live_bytes` is what is still alive, and
  `device_peak_bytes` the most that was, sampled after each device allocation.
"""

from __future__ import annotations

import itertools
from typing import TypeVar

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.errors import ExecutionError
from offload.pure.decide.pinning import PinMethod
from offload.runtime.cpu import CpuRuntime, host_empty_like

#: What `FakeRuntime.waited_seconds` counts per wait outside a capture, in seconds.
WAIT_SECONDS = 0.25

#: What `FakeRuntime.copy_seconds` counts per copied byte outside a capture, in seconds
#: (a made-up link of 1 GB/s).
COPY_SECONDS_PER_BYTE = 1e-9

__all__ = [
    "COPY_SECONDS_PER_BYTE",
    "WAIT_SECONDS",
    "Copy",
    "CopyTo",
    "Entry",
    "FakeEvent",
    "FakeRuntime",
    "HostCopy",
    "HostEmpty",
    "InjectedFailure",
    "Read",
    "Record",
    "Release",
    "Sync",
    "ToDevice",
    "View",
    "Wait",
]


class InjectedFailure(RuntimeError):
    """The failure `FakeRuntime` raises on purpose."""


@attrs.frozen
class FakeEvent:
    """An event of the fake runtime; ``number`` orders all events it made."""

    number: int
    capturing: bool


@attrs.frozen
class HostCopy:
    """`host_copy` was asked for a tensor of `shape`, with this `pin` argument."""

    pin: PinMethod
    shape: tuple[int, ...]


@attrs.frozen
class HostEmpty:
    """`host_empty` was asked for a tensor of `shape`, with this `pin` argument."""

    pin: PinMethod
    shape: tuple[int, ...]


@attrs.frozen
class Record:
    """`record`: an event on the compute stream after everything before it."""

    event: FakeEvent


@attrs.frozen
class Copy:
    """`copy_after`: ``dst`` (its data pointer) gets ``src`` on the copy stream after
    ``after`` (None: after whatever the copy stream did before); ``done`` follows it."""

    dst: int
    nbytes: int
    after: FakeEvent | None
    done: FakeEvent
    capturing: bool


@attrs.frozen
class Wait:
    """`wait`: the compute stream waits for ``event``."""

    event: FakeEvent
    capturing: bool


@attrs.frozen
class Sync:
    """`synchronize`: everything issued so far is done."""


@attrs.frozen
class Read:
    """A `ProbeBlock` computed with the parameter ``name`` whose data is at ``ptr``."""

    name: str
    ptr: int


@attrs.frozen
class Release:
    """`release_host` for a host tensor of `shape` (pinned or not)."""

    shape: tuple[int, ...]
    pinned: bool


@attrs.frozen
class View:
    """`device_view` of a host tensor of `shape` (pinned or not)."""

    shape: tuple[int, ...]
    pinned: bool


@attrs.frozen
class ToDevice:
    """`to_device` (an on-demand copy) of a host tensor of `shape` (pinned or not)."""

    shape: tuple[int, ...]
    pinned: bool


@attrs.frozen
class CopyTo:
    """`copy_to` of a tensor of `shape` (pinned or not) to the compute device
    (``to_device``) or to the host."""

    shape: tuple[int, ...]
    pinned: bool
    to_device: bool


Entry = HostCopy | HostEmpty | Record | Copy | Wait | Sync | Read | Release | View | ToDevice | CopyTo
E = TypeVar("E", HostCopy, HostEmpty, Record, Copy, Wait, Sync, Read, Release, View, ToDevice, CopyTo)


class FakeRuntime:  # not final: tests play other GPUs on it (a copy stream that lags)
    """A `Runtime` on the CPU that logs every effect (see the module docstring)."""

    def __init__(
        self,
        *,
        fail_host_copy_at: int | None = None,
        fail_device_empty_at: int | None = None,
        fail_pin_at: int | None = None,
        fail_device_view_at: int | None = None,
        fail_copy_to_at: int | None = None,
        defer: bool = False,
        device: str = "cpu",
    ) -> None:
        self._device = torch.device(device)
        if self._device.type not in ("cpu", "cuda"):
            raise ValueError(f"FakeRuntime plays the CPU or a CUDA device, not {device!r}")
        self.fail_copy_to_at = fail_copy_to_at
        self.copies_to = 0
        self._device_storages: list[tuple[StorageWeakRef, int]] = []
        self.device_peak_bytes = 0
        self._fail_pin_at = fail_pin_at
        self._pin_requests = 0
        self._pinned: set[int] = set()  # data_ptrs of copies playing pinned memory
        self._fallbacks = 0
        self._cpu = CpuRuntime()
        self._numbers = itertools.count()
        self._fail_at = fail_host_copy_at
        self._fail_empty_at = fail_device_empty_at
        self.device_empties = 0
        self._fail_view_at = fail_device_view_at
        self.device_views = 0
        self._defer = defer
        self._queue: list[tuple[FakeEvent, torch.Tensor, torch.Tensor]] = []
        self.log: list[Entry] = []
        self.capturing = False
        self.host_copies = 0

    @property
    def device(self) -> torch.device:
        """The CPU, or the CUDA device it plays (``device=``)."""
        return self._device

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`'s storage as device memory (once), and sample the peak."""
        storage = tensor.untyped_storage()
        self._device_storages.append((StorageWeakRef(storage), storage.nbytes()))  # type: ignore[no-untyped-call]  # unannotated in torch
        self.device_peak_bytes = max(self.device_peak_bytes, self.device_live_bytes)
        return tensor

    @property
    def device_live_bytes(self) -> int:
        """Bytes of the storages returned as device memory that are still alive."""
        self._device_storages = [(ref, n) for ref, n in self._device_storages
                                 if not ref.expired()]  # type: ignore[no-untyped-call]  # unannotated in torch
        return sum(n for _, n in self._device_storages)

    def on_device(self, tensor: torch.Tensor) -> bool:
        """True when `tensor`'s storage is a live allocation this runtime made as device memory."""
        ref = StorageWeakRef(tensor.untyped_storage())  # type: ignore[no-untyped-call]  # unannotated in torch
        return any(ref == live for live, _ in self._device_storages if not live.expired())  # type: ignore[no-untyped-call]  # unannotated in torch

    def _event(self) -> FakeEvent:
        return FakeEvent(next(self._numbers), self.capturing)

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """Record the request; fail if told to; copy (never pinned: there is no CUDA)."""
        index = self.host_copies
        self.host_copies += 1
        self.log.append(HostCopy(pin=pin, shape=tuple(tensor.shape)))
        if index == self._fail_at:
            raise InjectedFailure(f"injected host_copy failure #{index}")
        return self._play_pinned(self._cpu.host_copy(tensor, pin=PinMethod.NONE), pin)

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """Record the request; allocate (never pinned, but played pinned as `host_copy`)."""
        self.log.append(HostEmpty(pin=pin, shape=tuple(like.shape)))
        return self._play_pinned(self._cpu.host_empty(like, pin=PinMethod.NONE), pin)

    def _play_pinned(self, host: torch.Tensor, pin: PinMethod) -> torch.Tensor:
        if pin is not PinMethod.NONE:
            request = self._pin_requests
            self._pin_requests += 1
            if request == self._fail_pin_at:
                self._fallbacks += 1
            elif host.numel():
                self._pinned.add(host.data_ptr())
        return host

    def is_pinned(self, host: torch.Tensor) -> bool:
        """True for copies asked to be pinned that did not fall back."""
        return host.numel() > 0 and host.data_ptr() in self._pinned

    @property
    def pin_fallbacks(self) -> int:
        """Pinned copies that fell back to pageable (``fail_pin_at``)."""
        return self._fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        """Log the release and forget the pinned flag."""
        self.log.append(Release(shape=tuple(host.shape), pinned=self.is_pinned(host)))
        self._pinned.discard(host.data_ptr())

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        """Log the view; fail if told to; the CPU reads host memory in place (the view is `host`)."""
        index = self.device_views
        self.device_views += 1
        self.log.append(View(shape=tuple(host.shape), pinned=self.is_pinned(host)))
        if index == self._fail_view_at:
            raise InjectedFailure(f"injected device_view failure #{index}")
        return self._cpu.device_view(host)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Log the on-demand copy; copy as `CpuRuntime` does (counted as device memory)."""
        self.log.append(ToDevice(shape=tuple(host.shape), pinned=self.is_pinned(host)))
        return self._on_device(self._cpu.to_device(host))

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """As `CpuRuntime` (counted as device memory); fail if told to."""
        index = self.device_empties
        self.device_empties += 1
        if index == self._fail_empty_at:
            raise InjectedFailure(f"injected device_empty failure #{index}")
        return self._on_device(self._cpu.device_empty(shape, stride, dtype))

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Log it; fail if told to; a CPU copy keeping the strides, counted as device
        memory when `device` is the played CUDA device.

        Raises:
            ExecutionError: `device` is neither the CPU nor this runtime's device.
        """
        index = self.copies_to
        self.copies_to += 1
        to_device = device.type != "cpu"
        self.log.append(CopyTo(shape=tuple(tensor.shape), pinned=self.is_pinned(tensor), to_device=to_device))
        if index == self.fail_copy_to_at:
            raise InjectedFailure(f"injected copy_to failure #{index}")
        if not to_device:
            return self._cpu.copy_to(tensor, device)
        if device != self._device:
            raise ExecutionError(f"the fake runtime plays {self._device}, it cannot copy to {device}",
                                 name="device", value=str(device))
        out = host_empty_like(tensor)
        out.copy_(tensor)
        return self._on_device(out)

    def record(self) -> FakeEvent:
        """Log an event on the compute stream."""
        event = self._event()
        self.log.append(Record(event))
        return event

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: object) -> FakeEvent:
        """Log the copy; do it now, or queue it when deferring."""
        return self.copy_chunks_after(self.copy_chunks(dst, src), after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """`PreparedCopies`: the fake copies each pair whole, so the one pair."""
        return ((dst, src),)

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: object) -> FakeEvent:
        """`copy_after` of the pair `copy_chunks` gave: logged, done now or queued."""
        ((dst, src),) = chunks
        if after is not None and not isinstance(after, FakeEvent):
            raise TypeError(f"not an event of this runtime: {after!r}")
        done = self._event()
        self.log.append(Copy(dst=dst.data_ptr(), nbytes=src.untyped_storage().nbytes(), after=after,
                             done=done, capturing=self.capturing))
        if self._defer:
            self._queue.append((done, dst, src))
        else:
            dst.copy_(src)
        return done

    def wait(self, event: object) -> None:
        """Log the wait; when deferring, finish every queued copy up to `event` (the copy
        stream runs in order)."""
        if not isinstance(event, FakeEvent):
            raise TypeError(f"not an event of this runtime: {event!r}")
        self.log.append(Wait(event, self.capturing))
        if any(done == event for done, _, _ in self._queue):
            while self._queue:
                done, dst, src = self._queue.pop(0)
                dst.copy_(src)
                if done == event:
                    break

    def waited_seconds(self) -> float:
        """`WAIT_SECONDS` for each wait logged outside a capture (a made-up duration, so
        tests can see the executor report what its runtime measured)."""
        return WAIT_SECONDS * sum(1 for e in self.log if isinstance(e, Wait) and not e.capturing)

    def copy_seconds(self) -> float:
        """`COPY_SECONDS_PER_BYTE` for each byte of the copies logged outside a capture."""
        return COPY_SECONDS_PER_BYTE * sum(e.nbytes for e in self.log if isinstance(e, Copy) and not e.capturing)

    def is_capturing(self) -> bool:
        """What the test set `capturing` to."""
        return self.capturing

    def synchronize(self) -> None:
        """Log it and finish every queued copy."""
        self.log.append(Sync())
        for _, dst, src in self._queue:
            dst.copy_(src)
        self._queue.clear()

    def read(self, name: str, ptr: int) -> None:
        """The `ProbeBlock` callback: log a compute read."""
        self.log.append(Read(name, ptr))

    def entries(self, kind: type[E]) -> list[E]:
        """The logged entries of one kind, in order."""
        return [entry for entry in self.log if isinstance(entry, kind)]
