"""The narrow roles that tie `offload` together, as Protocols.

`Offloader` is what every backend satisfies and what frameworks program against. The
`Runtime` protocol (the effects an executor may use: streams, events, host memory,
copies) arrives with the first executor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from offload.pure.plan import OffloadPlan

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Offloader"]


@runtime_checkable
class Offloader(Protocol):
    """Runs an `OffloadPlan` on live modules. It decides nothing the plan has not decided."""

    @property
    def plan(self) -> OffloadPlan:
        """The plan this offloader runs (updated if post-processing changed shapes)."""
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

    def stats(self) -> Mapping[str, int | float]:
        """Counters: bytes copied, copies issued, and what else the backend measures."""
        ...
