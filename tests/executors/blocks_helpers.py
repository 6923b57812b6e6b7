"""A runtime that makes host blocks (`offload.protocols.HostBlocks`) over `FakeRuntime`,
and models whose layers are (or are not) one copy each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import nn

from offload.pure.decide.pinning import PinMethod
from offload.runtime.hostmem import pageable_block
from tests.executors.fakes import FakeEvent, FakeRuntime, InjectedFailure

__all__ = ["BlockRuntime", "OddMiddle", "TanhLinear", "linear_stack", "odd_middle_model"]


@final
class BlockRuntime:
    """`FakeRuntime` (which does the work and logs it) plus `host_block`: pageable blocks
    (`offload.runtime.hostmem.pageable_block`) played pinned when asked, as `FakeRuntime`
    plays its copies. Records every copy's destination and source byte ranges, and what
    happens to each block.

    Args:
        inner: the runtime that does everything else.
        fail_block_at: the `host_block` call (from 0) that raises `InjectedFailure`.
        fallback_at: the `host_block` call whose pinning "fails": its members stay pageable.
    """

    def __init__(self, inner: FakeRuntime | None = None, *, fail_block_at: int | None = None,
                 fallback_at: int | None = None) -> None:
        self.inner = inner if inner is not None else FakeRuntime()
        self._fail_block_at = fail_block_at
        self._fallback_at = fallback_at
        self.blocks_made = 0
        self.blocks_released = 0
        self.block_fallbacks = 0
        self._live: dict[int, set[int]] = {}  # block number -> data_ptrs of members not released
        self._block_of: dict[int, int] = {}  # member data_ptr -> block number
        self._pinned: set[int] = set()
        #: (destination data_ptr, source data_ptr, bytes) of every copy_after.
        self.copies: list[tuple[int, int, int]] = []

    # ---- HostBlocks ---------------------------------------------------------------------

    def host_block(self, likes: Sequence[torch.Tensor], *,
                   pin: PinMethod) -> tuple[torch.Tensor, list[torch.Tensor]]:
        number = self.blocks_made
        self.blocks_made += 1
        if number == self._fail_block_at:
            raise InjectedFailure(f"injected host_block failure #{number}")
        block = pageable_block([(tuple(t.shape), tuple(t.stride()), t.dtype) for t in likes])
        members = list(block.members)
        self._live[number] = {m.data_ptr() for m in members}
        for m in members:
            self._block_of[m.data_ptr()] = number
        if pin is not PinMethod.NONE:
            if number == self._fallback_at:
                self.block_fallbacks += 1
            else:
                self._pinned.update(m.data_ptr() for m in members)
        return block.tensor, members

    @property
    def live_blocks(self) -> int:
        """Blocks with a member not released yet."""
        return sum(1 for live in self._live.values() if live)

    # ---- Runtime ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def host_copy(self, tensor: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        return self.inner.host_copy(tensor, pin=pin)

    def host_empty(self, like: torch.Tensor, *, pin: PinMethod) -> torch.Tensor:
        return self.inner.host_empty(like, pin=pin)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return (host.numel() > 0 and host.data_ptr() in self._pinned) or self.inner.is_pinned(host)

    @property
    def pin_fallbacks(self) -> int:
        return self.inner.pin_fallbacks + self.block_fallbacks

    def release_host(self, host: torch.Tensor) -> None:
        number = self._block_of.pop(host.data_ptr(), None) if host.numel() else None
        if number is None:
            self.inner.release_host(host)
            return
        self._pinned.discard(host.data_ptr())
        live = self._live[number]
        live.discard(host.data_ptr())
        if not live:
            self.blocks_released += 1

    def device_view(self, host: torch.Tensor) -> torch.Tensor:
        return self.inner.device_view(host)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.inner.to_device(host)

    def device_empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.device_empty(shape, stride, dtype)

    def copy_to(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self.inner.copy_to(tensor, device)

    def record(self) -> FakeEvent:
        return self.inner.record()

    def copy_after(self, dst: torch.Tensor, src: torch.Tensor, after: object) -> FakeEvent:
        self.copies.append((dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()))
        return self.inner.copy_after(dst, src, after)

    def wait(self, event: object) -> None:
        self.inner.wait(event)

    def waited_seconds(self) -> float:
        return self.inner.waited_seconds()

    def copy_seconds(self) -> float:
        return self.inner.copy_seconds()

    def is_capturing(self) -> bool:
        return self.inner.is_capturing()

    def synchronize(self) -> None:
        self.inner.synchronize()


class TanhLinear(nn.Linear):
    """``Linear(64, 64)`` then tanh: a 16 KiB weight and a 256-byte bias, both dense
    multiples of 256 bytes (one block, one copy per layer)."""

    def __init__(self) -> None:
        super().__init__(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


class OddMiddle(nn.Module):
    """Two 64 x 64 weights with a 63-element (252-byte) vector between them: the weights
    share a block and merge into one copy, the vector is copied alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(64, 64) / 8)
        self.odd = nn.Parameter(torch.randn(63))
        self.second = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.first)
        h = torch.cat([h[..., :63] * self.odd, h[..., 63:]], dim=-1)
        return torch.tanh(h @ self.second)


def linear_stack(layers: int, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[TanhLinear() for _ in range(layers)]).requires_grad_(False)


def odd_middle_model(layers: int, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[OddMiddle() for _ in range(layers)]).requires_grad_(False)
