"""`CudaRuntime`: the executor's effects on a CUDA device.

Copies run on one side stream. Each copy first waits for an event recorded on the
compute stream (so no buffer is overwritten while a kernel still reads it) and records a
done event that the compute stream waits on before the layer that reads the buffer.
"""

from __future__ import annotations

from typing import final

import torch

from offload.errors import ExecutionError
from offload.runtime.cpu import host_empty_like

__all__ = ["CudaRuntime"]


@final
class CudaRuntime:
    """Runs executors on ``cuda:index`` with one side stream for host-to-device copies.

    Args:
        index: the CUDA device index; the current device when None.

    Raises:
        ExecutionError: CUDA is not available.
    """

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ExecutionError("CudaRuntime needs a CUDA device; torch.cuda.is_available() is False",
                                 name="device", value="cuda")
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self._copy_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]  # unannotated in torch

    @property
    def device(self) -> torch.device:
        """The CUDA device."""
        return self._device

    def host_copy(self, tensor: torch.Tensor, *, pin: bool) -> torch.Tensor:
        """An exact-size host tensor with the same shape, strides and values.

        Raises:
            ExecutionError: the allocation, pinning or copy failed; the CUDA error is the cause.
        """
        try:
            host = host_empty_like(tensor, pin=pin)
            host.copy_(tensor)
        except RuntimeError as exc:
            raise ExecutionError(
                f"host copy ({'pinned' if pin else 'pageable'}) of a {tuple(tensor.shape)} "
                f"{tensor.dtype} tensor failed: {exc}",
                name="host_copy",
                value=tuple(tensor.shape),
            ) from exc
        return host

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
        """Queue the copy on the side stream after `after`; return its done event."""
        stream = self._copy_stream
        if after is not None:
            if not isinstance(after, torch.cuda.Event):
                raise ExecutionError(f"not an event of this runtime: {after!r}", name="after", value=after)
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # as above
        done.record(stream)
        return done

    def wait(self, event: object) -> None:
        """The compute stream waits for `event`."""
        if not isinstance(event, torch.cuda.Event):
            raise ExecutionError(f"not an event of this runtime: {event!r}", name="event", value=event)
        torch.cuda.current_stream(self._device).wait_event(event)

    def is_capturing(self) -> bool:
        """True while the current stream is capturing a CUDA graph."""
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Block until the device is idle."""
        torch.cuda.synchronize(self._device)
