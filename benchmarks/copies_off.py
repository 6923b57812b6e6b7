"""A runtime whose copies can be switched off, for `bench_overhead`'s ``prefetch-copy-off``
row: what our Python costs per layer without the copy itself, the measurement the hot-path
baseline (FACTS.md, "custom ops replaced by direct calls, copy switched off") was made
with.

`CopiesOff` passes every call to the runtime it wraps (host blocks and prepared copies
included, so the executor takes the path it takes on that runtime), until `switch_off`:
from then on a copy is only an event on the compute stream. Copies run until then, so
every slot holds real weights (a layer reads another layer's, not uninitialised memory,
which could hold NaNs or denormals and slow the arithmetic down). Outputs after
`switch_off` are wrong by design: the benchmark does not check them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch

from offload.errors import ExecutionError
from offload.protocols import Event, HostBlocks, PreparedCopies, Runtime
from offload.pure.decide.pinning import PinMethod

__all__ = ["CopiesOff"]

Chunks = tuple[tuple[torch.Tensor, torch.Tensor], ...]


@final
class CopiesOff:
    """`inner`, with copies that `switch_off` turns into plain events.

    Raises:
        ExecutionError: `inner` offers no host blocks or no prepared copies (the path the
            benchmark's ``layer_blocks="always"`` contenders take would differ).
    """

    def __init__(self, inner: Runtime) -> None:
        if not isinstance(inner, HostBlocks) or not isinstance(inner, PreparedCopies):
            raise ExecutionError(f"{type(inner).__name__} offers no host blocks or no prepared copies",
                                 name="runtime", value=type(inner).__name__)
        self._inner = inner
        self._blocks: HostBlocks = inner
        self._prepared: PreparedCopies = inner
        self.copying = True

    def switch_off(self) -> None:
        """From now on, copies are not made."""
        self.copying = False

    @property
    def device(self) -> torch.device:
        return self._inner.device

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        return self._inner.host_copy(tensor, pin=pin)

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        return self._inner.host_empty(like, pin=pin)

    def host_block(self, likes: Sequence[torch.Tensor], *, pin: PinMethod) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._blocks.host_block(likes, pin=pin)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return self._inner.is_pinned(host)

    @property
    def pin_fallbacks(self) -> int:
        return self._inner.pin_fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        self._inner.release_host(host)

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        return self._inner.device_view(host)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self._inner.to_device(host)

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._inner.device_empty(shape, stride, dtype)

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self._inner.copy_to(tensor, device)

    def record(self) -> Event:
        return self._inner.record()

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None) -> Event:
        return self.copy_chunks_after(self.copy_chunks(dst, src), after)

    def copy_chunks(self, dst: torch.Tensor, src: torch.Tensor) -> Chunks:
        return self._prepared.copy_chunks(dst, src)

    def copy_chunks_after(self, chunks: Chunks, after: Event | None) -> Event:
        if self.copying:
            return self._prepared.copy_chunks_after(chunks, after)
        return self._inner.record()

    def wait(self, event: Event) -> None:
        self._inner.wait(event)

    def waited_seconds(self) -> float | None:
        return self._inner.waited_seconds()

    def copy_seconds(self) -> float | None:
        return self._inner.copy_seconds()

    def is_capturing(self) -> bool:
        return self._inner.is_capturing()

    def synchronize(self) -> None:
        self._inner.synchronize()
