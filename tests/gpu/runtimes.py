"""`RecordingCudaRuntime`: a `CudaRuntime` that remembers every host copy it made (and
every host tensor it was asked to release); and
`measure_freed`, the device-memory measurement the GPU tests share."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar, final

import attrs
import torch

from offload.pure import PinMethod
from offload.runtime.cuda import CudaRuntime

__all__ = ["HostRecord", "RecordingCudaRuntime", "measure_freed"]

T = TypeVar("T")


@attrs.frozen
class HostRecord:
    """One host copy: the pin method asked for, whether the copy is pinned, its address and bytes."""

    pin: PinMethod
    pinned: bool
    ptr: int
    nbytes: int


@final
class RecordingCudaRuntime:
    """Delegates every effect to a real `CudaRuntime` and records each host copy, and
    the data pointer of each host tensor given to `release_host` (in `released`)."""

    def __init__(self) -> None:
        self._cuda = CudaRuntime()
        self.records: list[HostRecord] = []
        self.released: list[int] = []

    @property
    def host_copies(self) -> list[tuple[bool, bool]]:
        """(pinning asked for, pinned) of each host copy."""
        return [(r.pin is not PinMethod.NONE, r.pinned) for r in self.records]

    @property
    def hosts(self) -> list[tuple[int, int]]:
        """(data pointer, bytes) of each host copy."""
        return [(r.ptr, r.nbytes) for r in self.records]

    @property
    def device(self) -> torch.device:
        return self._cuda.device

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        host = self._cuda.host_copy(tensor, pin=pin)
        self.records.append(HostRecord(pin=pin, pinned=bool(host.is_pinned()), ptr=host.data_ptr(),
                                       nbytes=host.untyped_storage().nbytes()))
        return host

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        host = self._cuda.host_empty(like, pin=pin)
        self.records.append(HostRecord(pin=pin, pinned=bool(host.is_pinned()), ptr=host.data_ptr(),
                                       nbytes=host.untyped_storage().nbytes()))
        return host

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self._cuda.is_pinned(host)

    @property
    def pin_fallbacks(self) -> int:
        return self._cuda.pin_fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        self.released.append(host.data_ptr())
        self._cuda.release_host(host)

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        return self._cuda.device_view(host)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self._cuda.to_device(host)

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._cuda.device_empty(shape, stride, dtype)

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self._cuda.copy_to(tensor, device)

    def record(self) -> torch.cuda.Event:
        return self._cuda.record()

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: object) -> torch.cuda.Event:
        return self._cuda.copy_after(dst, src, after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return self._cuda.copy_chunks(dst, src)

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                          after: object) -> torch.cuda.Event:
        return self._cuda.copy_chunks_after(chunks, after)

    def wait(self, event: object) -> None:
        self._cuda.wait(event)

    def waited_seconds(self) -> float:
        return self._cuda.waited_seconds()

    def copy_seconds(self) -> float:
        return self._cuda.copy_seconds()

    def is_capturing(self) -> bool:
        return self._cuda.is_capturing()

    def synchronize(self) -> None:
        self._cuda.synchronize()


def measure_freed(action: Callable[[], T]) -> tuple[T, int, int]:
    """Run `action` and measure the device memory it freed.

    Returns:
        What `action` returned, the bytes allocated before it, and the bytes it freed.
    """
    gc.collect()  # earlier tests' models (kept in reference cycles by their hooks) go now ...
    gc.disable()  # ... and not in the middle of the measurement
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        result = action()
        torch.cuda.synchronize()
        return result, before, before - torch.cuda.memory_allocated()
    finally:
        gc.enable()
