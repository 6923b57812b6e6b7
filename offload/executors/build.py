"""`build_executor`: the executor that runs a plan's backend (no runtime chosen here: that
is `offload.create`'s job; sharing builds its executors with a host source of its own)."""

from __future__ import annotations

import os

from offload.errors import PlanError
from offload.executors.hoststore import HostSource
from offload.executors.noop import NoopOffloader
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.uva import UVAOffloader
from offload.protocols import Offloader, Runtime
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.plan.plan import Backend, OffloadPlan

__all__ = ["build_executor"]


def build_executor(plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None, *,
                   disk: DiskTierPlan | None = None, spill_dir: str | os.PathLike[str] | None = None) -> Offloader:
    """The executor for `plan`'s backend on `runtime`, its host copies from `host_source`
    first where one is given (`HostSource`); with `disk`, the plan's disk tier (prefetch
    only: `PrefetchOffloader`), spilling to `spill_dir`.

    Raises:
        PlanError: the plan is inconsistent with its backend (see each executor), or a
            disk tier comes with another backend.
        ExecutionError: `disk` spills and no `spill_dir` is given.
    """
    if disk is not None and plan.backend is not Backend.PREFETCH:
        raise PlanError(f"a disk tier streams through the prefetch backend; this plan's backend is "
                        f"{plan.backend.value}", name="backend", value=plan.backend.value)
    if plan.backend is Backend.PREFETCH:
        return PrefetchOffloader(plan, runtime, host_source, disk=disk, spill_dir=spill_dir)
    if plan.backend is Backend.UVA:
        return UVAOffloader(plan, runtime, host_source)
    return NoopOffloader(plan, runtime)
