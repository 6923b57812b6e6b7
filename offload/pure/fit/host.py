"""A host budget inside `fit`'s search: what a candidate takes of host memory, and the disk
reads that hold the rest (`HostTier`, implemented by the disk tier's room,
`offload.pure.disk.search.TierSearch`, which this room does not import).

Without one, every offloaded weight is in host memory and `fit` looks at the device only.
With one, a candidate whose host copies exceed the budget is run with its last offloaded
layers on disk where the plan allows (prefetch), costed with those reads, or dropped when
no disk tier makes it fit (UVA, whose host copies are read in place, and layers the
schedule keeps loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import DiskReads, StepEstimate, Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.plan.plan import OffloadPlan
from offload.pure.plan.schedule import PrefetchSchedule

__all__ = ["HostPlacement", "HostTier"]


@attrs.frozen(kw_only=True)
class HostPlacement:
    """Where a prefetch candidate's offloaded weights live within a host budget.

    Attributes:
        host_bytes: host memory they take: the host tier and the staging ring, bytes.
        disk: the disk reads as the step simulation sees them; None: none on disk.
        disk_positions: the schedule positions on disk.
    """

    host_bytes: int
    disk: DiskReads | None = None
    disk_positions: tuple[int, ...] = ()


class HostTier(Protocol):
    """A host budget and the disk tier that meets it, as `fit` asks of them."""

    @property
    def host_budget_bytes(self) -> int:
        """Host memory the offloaded weights (and a disk tier's staging ring) may take, bytes."""
        ...

    def place(self, positions: Sequence[int], schedule: PrefetchSchedule, *, caches: bool = True,
              at_call: bool = False) -> HostPlacement | None:
        """A prefetch candidate offloading the layers `positions` (in schedule order) on
        `schedule`, placed within the budget; None when no disk tier makes it fit.
        `caches`: its MoE layers have expert caches (whose experts the staging ring does
        not hold), else are streamed whole; `at_call`: their misses are read from disk at
        the experts' call (a routing trace or top-k bounds cost them there:
        `DiskReads.expert_layers`), else with their layers (every expert, the worst case)."""
        ...

    def least_host_bytes(self, positions: Sequence[int], schedule: PrefetchSchedule, *, caches: bool = True) -> int:
        """The least host memory that candidate can take with any disk tier, bytes."""
        ...

    def estimate(self, plan: OffloadPlan, profile: DeviceProfile, workload: Workload, *,
                 routing: RoutingTrace | None = None) -> tuple[StepEstimate, int]:
        """The step of the plan `fit` chose, run with its disk tier (if the budget needs
        one), over `routing` where given, and the host bytes it then takes."""
        ...
