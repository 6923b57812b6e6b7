"""`CpuRuntime`: the executor's effects on a machine without a GPU.

The "device" is the CPU, copies run synchronously when issued, and events are counters.
It exists so that CI runs the very same executor code a GPU runs: hooks, slots, the
schedule, parity and restore. It saves no memory, and nothing here pretends otherwise.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import final

import torch

from offload.errors import ExecutionError
from offload.pure.decide.pinning import PinMethod
from offload.runtime.copies import span_chunks
from offload.runtime.hostmem import pageable_block

__all__ = ["CpuEvent", "CpuRuntime"]


@final
class CpuEvent:
    """A point in the CPU runtime's single, synchronous order of work (a plain slotted
    class: one is made per copy, on the forward path)."""

    __slots__ = ("sequence",)

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence

    def __repr__(self) -> str:
        return f"CpuEvent({self.sequence})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuEvent) and other.sequence == self.sequence

    def __hash__(self) -> int:
        return hash(self.sequence)


def host_empty_like(tensor: torch.Tensor, *, pin: bool = False) -> torch.Tensor:
    """An exact-size, uninitialised host tensor with `tensor`'s shape, strides and dtype."""
    return torch.empty_strided(
        tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu", pin_memory=pin
    )


def _refuse_pin(pin: PinMethod) -> None:
    if pin is not PinMethod.NONE:
        raise ExecutionError(
            "the CPU runtime cannot pin host memory; this plan was made for a CUDA "
            "platform (run it with CudaRuntime, or plan for this machine)",
            name="pin",
            value=pin.value,
        )


@final
class CpuRuntime:
    """Runs executors on the CPU: synchronous copies, trivial streams and events."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._copy_ns = 0

    @property
    def device(self) -> torch.device:
        """The CPU."""
        return torch.device("cpu")

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """A separate host tensor with the same shape, strides and values.

        Raises:
            ExecutionError: `pin` is not `PinMethod.NONE` (pinning needs CUDA; a plan
                made for a machine without an accelerator never asks for it), or the copy
                failed.
        """
        _refuse_pin(pin)
        try:
            host = host_empty_like(tensor)
            host.copy_(tensor)
        except RuntimeError as exc:
            raise ExecutionError(f"host copy of a {tuple(tensor.shape)} {tensor.dtype} tensor failed: {exc}",
                                 name="host_copy", value=tuple(tensor.shape)) from exc
        return host

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        """An uninitialised host tensor with `like`'s shape, strides and dtype.

        Raises:
            ExecutionError: `pin` is not `PinMethod.NONE` (as `host_copy`), or the
                allocation failed.
        """
        _refuse_pin(pin)
        try:
            return host_empty_like(like)
        except RuntimeError as exc:
            raise ExecutionError(f"host allocation of a {tuple(like.shape)} {like.dtype} tensor failed: {exc}",
                                 name="host_empty", value=tuple(like.shape)) from exc

    def host_block(self, likes: Sequence[torch.Tensor], *,
                   pin: PinMethod) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Uninitialised host tensors shaped like `likes`, back to back in one anonymous
        mapping (`offload.protocols.HostBlocks`); the mapping goes with its last tensor.

        Raises:
            ExecutionError: `pin` is not `PinMethod.NONE` (as `host_copy`), or the mapping
                failed.
        """
        _refuse_pin(pin)
        try:
            block = pageable_block([(tuple(t.shape), tuple(t.stride()), t.dtype) for t in likes])
        except (OSError, RuntimeError) as exc:
            raise ExecutionError(f"host block of {len(likes)} tensors failed: {exc}",
                                 name="host_block", value=len(likes)) from exc
        return block.tensor, list(block.members)

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Never: nothing is pinned without CUDA."""
        return False

    @property
    def pin_fallbacks(self) -> int:
        """Always 0: the CPU runtime refuses to pin rather than falling back."""
        return 0

    def release_host(self, host: torch.Tensor) -> None:
        """Nothing to give back: host copies are ordinary tensors."""

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        """The CPU reads host memory in place: the view is `host` itself."""
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A separate copy, as a device copy would be, keeping the strides."""
        out = host_empty_like(host)
        for d, s in span_chunks(out, host):
            d.copy_(s)
        return out

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor with exactly these strides."""
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of `tensor` on `device` (the CPU here), keeping its strides."""
        if device.type != "cpu":
            raise ExecutionError(f"the CPU runtime cannot copy to {device}", name="device", value=str(device))
        out = host_empty_like(tensor)
        out.copy_(tensor)
        return out

    def record(self) -> CpuEvent:
        """Everything issued so far has already happened."""
        return CpuEvent(next(self._counter))

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: object) -> CpuEvent:
        """Copy now (the span's bytes, as `CudaRuntime` copies them): on the CPU every
        earlier event has already happened. Timed (see `copy_seconds`)."""
        return self.copy_chunks_after(self.copy_chunks(dst, src), after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """How `copy_after` copies `src` into `dst` (`span_chunks`: one pair; flat byte
        views where `src` is not dense), for `copy_chunks_after` (`PreparedCopies`)."""
        return tuple(span_chunks(dst, src))

    def copy_chunks_after(self, chunks: tuple[tuple[torch.Tensor, torch.Tensor], ...], after: object) -> CpuEvent:
        """Copy `chunks` (from `copy_chunks`) now, timed, as `copy_after` does."""
        start = time.perf_counter_ns()
        for d, s in chunks:
            d.copy_(s)
        self._copy_ns += time.perf_counter_ns() - start
        return CpuEvent(next(self._counter))

    def wait(self, event: object) -> None:
        """Nothing to wait for: copies finished when they were issued."""

    def block_on(self, event: object) -> None:
        """Nothing to wait for: copies finished when they were issued (`HostWaits`)."""

    def waited_seconds(self) -> None:
        """Not measured: copies run synchronously when issued, so there is no wait to time."""
        return None

    def copy_seconds(self) -> float:
        """Wall time `copy_after`'s copies took (they run on the calling thread)."""
        return self._copy_ns / 1e9

    def is_capturing(self) -> bool:
        """Never: CUDA graphs need CUDA."""
        return False

    def synchronize(self) -> None:
        """Nothing is ever in flight."""
