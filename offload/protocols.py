"""The narrow roles that tie `offload` together, as Protocols.

- `Offloader`: what every backend satisfies and what frameworks program against.
- `Runtime`: the effects an executor may use (host memory, device buffers, streams and
  events, copies, capture state). `CudaRuntime` is the real one; `CpuRuntime` runs the
  same executor code on a machine without a GPU; tests inject recording fakes. Executors
  never call ``torch.cuda`` themselves.
- `HostBlocks`: what a runtime offers, beside `Runtime`, to hold several host copies in
  one allocation (one copy per prefetched layer, `offload.pure.plan.blocks`). A runtime without
  it gets one host copy per storage and one memcpy per buffer.
- `RegisteredRanges`: what a runtime offers to cut copies where host memory that someone
  else registered (a segment shared between processes, `offload.sharing`) is registered
  in several pieces.
- `PreparedCopies`: what a runtime offers to work out once how a copy is cut (flat spans,
  registered pieces) and issue it many times without working it out again (the prefetch
  backend's every step). A runtime without it gets `Runtime.copy_after` each time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from offload.pure.check import LiveCheck
from offload.pure.decide.pinning import PinMethod
from offload.pure.plan.plan import OffloadPlan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from offload.pure.stats import OffloadStats

__all__ = ["Event", "HostBlocks", "HostWaits", "Offloader", "PreparedCopies", "RegisteredRanges", "Runtime"]


@runtime_checkable
class Offloader(Protocol):
    """Runs an `OffloadPlan` on live modules. It decides nothing the plan has not decided."""

    @property
    def plan(self) -> OffloadPlan:
        """The plan this offloader runs (revised if post-processing changed parameters)."""
        ...

    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Move the planned parameters to host storage, install hooks, return the layers."""
        ...

    def post_init(self) -> None:
        """After weights are final: re-sync host copies, allocate buffers, start prefetches."""
        ...

    def sync_prev_onload(self) -> None:
        """Before CUDA graph capture or replay: wait for copies issued earlier."""
        ...

    def join_after_forward(self) -> None:
        """Inside a capture, after the forward: join copies still outstanding."""
        ...

    def restore(self) -> None:
        """Put every weight back where it was, bit-identical; remove hooks; free host memory."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                     prefix: str = "", skip_read_only: bool = False) -> None:
        """New weights for the wrapped model, without restoring it: offloaded ones into
        their host copies, the rest in place (`offload.executors.reload`);
        `skip_read_only` leaves out host copies another process writes."""
        ...

    def check(self) -> LiveCheck:
        """Where every planned parameter of the wrapped model is now, against the plan
        (a difference is listed, never fixed)."""
        ...

    def stats(self) -> OffloadStats:
        """Counters: bytes copied, copies issued, and what else the backend measures."""
        ...


class Event(Protocol):
    """An opaque marker in a stream's queue, made by a `Runtime` and only used with it."""


@runtime_checkable
class Runtime(Protocol):
    """The effects an executor may use. Implementations decide nothing either: whether to
    pin is an argument, taken from the plan."""

    @property
    def device(self) -> torch.device:
        """The compute device (``cuda:0``, or ``cpu`` without an accelerator)."""
        ...

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """An exact-size host tensor with `tensor`'s shape, strides, dtype and values.

        Args:
            tensor: the source, on any device.
            pin: how to page-lock the host memory: the plan's ``PinDecision.method``. If
                pinning fails for this tensor it is left pageable (see `is_pinned`), logged
                and counted in `pin_fallbacks`; with `PinMethod.NONE` nothing is ever
                pinned, registered or allocated page-locked.

        Raises:
            ExecutionError: the allocation or copy failed.
        """
        ...

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """An uninitialised exact-size host tensor with `like`'s shape, strides and dtype,
        page-locked as `pin` says (falling back as `host_copy` does). `like` may be a meta
        tensor: only its metadata is read. For weights a loader fills in place.

        Raises:
            ExecutionError: the allocation failed.
        """
        ...

    def is_pinned(self, host: torch.Tensor) -> bool:
        """True when `host` (from `host_copy`) is page-locked."""
        ...

    @property
    def pin_fallbacks(self) -> int:
        """How many `host_copy` calls asked to pin and got pageable memory instead."""
        ...

    def release_host(self, host: torch.Tensor) -> None:
        """Give back what `host_copy` took for `host` (unregister page-locked memory)."""
        ...

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        """A zero-copy view of page-locked `host` that kernels on the compute device read
        in place (same shape, strides, dtype); `host` must outlive it.

        Raises:
            ExecutionError: `host` is not page-locked, or the device cannot map it.
        """
        ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of `host` on the compute device, queued on the compute stream (on-demand
        loading), keeping its strides."""
        ...

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on the compute device with exactly these strides."""
        ...

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A synchronous copy of `tensor` onto `device`, keeping its strides (restore)."""
        ...

    def record(self) -> Event:
        """An event on the compute stream after everything queued on it so far."""
        ...

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event:
        """Queue ``dst.copy_(src)`` on the copy stream once `after` has happened.

        Returns:
            An event that happens when the copy is done.
        """
        ...

    def wait(self, event: Event) -> None:
        """Make the compute stream wait for `event` (it does not block the host)."""
        ...

    def waited_seconds(self) -> float | None:
        """Seconds the compute stream has stood still in `wait` so far, as far as measured
        (waits still in flight are counted once they are done); None where the runtime
        cannot measure it. Waits inside a CUDA graph capture are not measured."""
        ...

    def copy_seconds(self) -> float | None:
        """Device time the copies of `copy_after` took so far, as far as measured (copies
        still in flight are counted once they are done); None where the runtime cannot
        measure it. Copies issued inside a CUDA graph capture are not measured."""
        ...

    def is_capturing(self) -> bool:
        """True while the compute stream is being captured into a CUDA graph."""
        ...

    def synchronize(self) -> None:
        """Block the host until every stream of this runtime is idle."""
        ...


@runtime_checkable
class HostBlocks(Protocol):
    """Several host copies in one allocation (see the module docstring)."""

    def host_block(self, likes: Sequence[torch.Tensor], *, pin: PinMethod) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Uninitialised exact-size host tensors with each of `likes`' shape, strides and
        dtype (`likes` may be on meta), back to back in one allocation in that order,
        page-locked as `pin` says (falling back, all of them, as `Runtime.host_copy` does).

        Each tensor has a storage of its own. `Runtime.is_pinned` answers for each, and
        `Runtime.release_host` takes each; the allocation is given back when the last is.

        Returns:
            A flat ``uint8`` view of the whole allocation (for copies of several members
            at once; `Runtime.copy_after` accepts its slices as sources), and the tensors.

        Raises:
            ExecutionError: the allocation failed.
        """
        ...


@runtime_checkable
class RegisteredRanges(Protocol):
    """Host memory registered outside the runtime, in several pieces (see the module
    docstring): copies from it are cut where each piece ends, as the runtime cuts its own."""

    def note_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        """(address, bytes) of the pieces of one registered range, in address order, back
        to back: copies whose source lies in it are cut at their ends from now on."""
        ...

    def forget_registered(self, pieces: Sequence[tuple[int, int]]) -> None:
        """The range `note_registered` was told of is unregistered: forget it."""
        ...


@runtime_checkable
class HostWaits(Protocol):
    """A runtime that can block a host thread (not a stream) until an event is done: the
    disk tier's readers wait so for the device copy out of a staging buffer before they
    refill it (`offload.executors.staging`). Without it they wait for the whole device
    (`Runtime.synchronize`)."""

    def block_on(self, event: Event) -> None:
        """Block the calling thread (any thread) until `event` is done.

        Raises:
            ExecutionError: `event` is not this runtime's.
        """
        ...


@runtime_checkable
class PreparedCopies(Protocol):
    """Copies worked out once and issued many times (see the module docstring): how a copy
    is cut depends only on where its two tensors' memory lies, which stays put while an
    offloader runs, so the prefetch backend asks once, at post_init, and hands the answer
    back on every step."""

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The (destination, source) pairs, each one memcpy, that `Runtime.copy_after`
        copies `src` into `dst` with; valid while both tensors' memory is."""
        ...

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: Event | None) -> Event:
        """`Runtime.copy_after` of the copy `chunks` came from (`copy_chunks`): queued on
        the copy stream once `after` has happened, timed alike.

        Returns:
            An event that happens when every pair is copied.
        """
        ...
