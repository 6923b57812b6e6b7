"""Fault injection for the executor tests: `FaultyRuntime`, a `Runtime` that wraps
`FakeRuntime` and raises on the k-th call of one chosen method (a fake, not a mock: every
call really runs on the wrapped runtime unless it is the one chosen to fail).

Calls are counted per method since the last `FaultyRuntime.reset_counts`, so that a test
counts the calls one lifecycle phase makes in a dry run, and then, in a fresh run, arms
the fault for that phase only (`arm` after the previous phases, `disarm` after it).

The methods that can be failed (`FAULTABLE`) are the ones that do work. The pure queries
are never failed (see `NOT_FAULTED`): raising there would model no failure a real
runtime has (they read a field or a set the runtime keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import torch

from offload.errors import ExecutionError
from offload.protocols import Event
from offload.pure.decide.pinning import PinMethod
from tests.executors.fakes import FakeRuntime

__all__ = ["FAULTABLE", "KINDS_OF_ERROR", "NOT_FAULTED", "FaultyRuntime", "make_error"]

#: The `Runtime` methods a fault can be injected into: each allocates, copies, releases,
#: orders or waits, and a real runtime can fail there (out of memory, a CUDA error, Ctrl-C).
FAULTABLE = (
    "host_copy",
    "host_empty",
    "release_host",
    "device_view",
    "to_device",
    "device_empty",
    "copy_to",
    "record",
    "copy_chunks",
    "copy_after",
    "wait",
    "synchronize",
)

#: The queries that are never failed, and why.
NOT_FAULTED = {
    "device": "a property naming the compute device, fixed at construction",
    "is_pinned": "a lookup in the runtime's own set of page-locked pointers (CudaRuntime._locked)",
    "pin_fallbacks": "a counter",
    "waited_seconds": "a sum over measured waits, read only by stats()",
    "is_capturing": "a query of the stream's capture status; a raise there models no effect that failed",
}

#: The kinds of error injected: ours, a foreign RuntimeError (a CUDA error), a
#: MemoryError (host out of memory) and a KeyboardInterrupt (Ctrl-C).
KINDS_OF_ERROR = ("execution", "runtime", "memory", "interrupt")


def make_error(kind: str, method: str, k: int) -> BaseException:
    """A fresh exception of `kind` (one of `KINDS_OF_ERROR`) saying where it was injected."""
    what = f"injected {kind} fault in {method} call #{k}"
    if kind == "execution":
        return ExecutionError(what, name=method, value=k)
    if kind == "runtime":
        return RuntimeError(what)
    if kind == "memory":
        return MemoryError(what)
    if kind == "interrupt":
        return KeyboardInterrupt(what)
    raise ValueError(f"no such kind of error: {kind!r}")


@final
class FaultyRuntime:
    """A `Runtime` over `FakeRuntime` that raises on the k-th call of one method once armed.

    Args:
        inner: the runtime that does the work (and keeps its own log and accounting).
    """

    def __init__(self, inner: FakeRuntime) -> None:
        self.inner = inner
        self.counts: dict[str, int] = dict.fromkeys(FAULTABLE, 0)
        self._armed: tuple[str, int, Callable[[], BaseException]] | None = None
        #: The exception raised, once the armed fault has fired.
        self.fired: BaseException | None = None
        #: Data pointers of page-locked host copies whose `release_host` was failed and
        #: not retried since: a leak the test cannot blame on the executor.
        self.unreleased: set[int] = set()

    def reset_counts(self) -> None:
        """Start counting calls afresh (at the beginning of a phase)."""
        self.counts = dict.fromkeys(FAULTABLE, 0)

    def arm(self, method: str, k: int, error: Callable[[], BaseException]) -> None:
        """Make the k-th call (from 0, counted since `reset_counts`) of `method` raise `error()`."""
        if method not in FAULTABLE:
            raise ValueError(f"{method!r} cannot be failed; choose one of {FAULTABLE}")
        self._armed = (method, k, error)
        self.fired = None

    def disarm(self) -> None:
        """No call fails any more."""
        self._armed = None

    def _count(self, method: str) -> None:
        index = self.counts[method]
        self.counts[method] = index + 1
        armed = self._armed
        if armed is not None and armed[0] == method and armed[1] == index:
            self._armed = None  # one shot: a retry or a cleanup path calls it again for real
            self.fired = armed[2]()
            raise self.fired

    # ---- the Runtime protocol ---------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The wrapped runtime's compute device."""
        return self.inner.device

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """Counted, may fail; else the wrapped `host_copy`."""
        self._count("host_copy")
        return self.inner.host_copy(tensor, pin=pin)

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """Counted, may fail; else the wrapped `host_empty`."""
        self._count("host_empty")
        return self.inner.host_empty(like, pin=pin)

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Never fails (a query)."""
        return self.inner.is_pinned(host)

    @property
    def pin_fallbacks(self) -> int:
        """Never fails (a counter)."""
        return self.inner.pin_fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        """Counted, may fail; else the wrapped `release_host`."""
        pinned = self.inner.is_pinned(host)
        try:
            self._count("release_host")
        except BaseException:
            if pinned:
                self.unreleased.add(host.data_ptr())
            raise
        self.unreleased.discard(host.data_ptr())
        self.inner.release_host(host)

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        """Counted, may fail; else the wrapped `device_view`."""
        self._count("device_view")
        return self.inner.device_view(host)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Counted, may fail; else the wrapped `to_device`."""
        self._count("to_device")
        return self.inner.to_device(host)

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Counted, may fail; else the wrapped `device_empty`."""
        self._count("device_empty")
        return self.inner.device_empty(shape, stride, dtype)

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Counted, may fail; else the wrapped `copy_to`."""
        self._count("copy_to")
        return self.inner.copy_to(tensor, device)

    def record(self) -> Event:
        """Counted, may fail; else the wrapped `record`."""
        self._count("record")
        return self.inner.record()

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event:
        """Counted, may fail; else the wrapped `copy_after`."""
        self._count("copy_after")
        return self.inner.copy_after(dst, src, after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Counted, may fail (post_init prepares each copy); else the wrapped `copy_chunks`."""
        self._count("copy_chunks")
        return self.inner.copy_chunks(dst, src)

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: Event | None) -> Event:
        """The prepared copy: counted and failed as ``copy_after`` (the same fault, a copy
        that fails); else the wrapped `copy_chunks_after`."""
        self._count("copy_after")
        return self.inner.copy_chunks_after(chunks, after)

    def wait(self, event: Event) -> None:
        """Counted, may fail; else the wrapped `wait`."""
        self._count("wait")
        self.inner.wait(event)

    def waited_seconds(self) -> float | None:
        """Never fails (read by stats())."""
        return self.inner.waited_seconds()

    def copy_seconds(self) -> float | None:
        """Never fails (read by stats())."""
        return self.inner.copy_seconds()

    def is_capturing(self) -> bool:
        """Never fails (a query)."""
        return self.inner.is_capturing()

    def synchronize(self) -> None:
        """Counted, may fail; else the wrapped `synchronize`."""
        self._count("synchronize")
        self.inner.synchronize()
