"""`build_executor`: the executor that runs a plan's backend (no runtime chosen here: that
is `offload.create`'s job; sharing builds its executors with a host source of its own)."""

from __future__ import annotations

from offload.executors.hoststore import HostSource
from offload.executors.noop import NoopOffloader
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.uva import UVAOffloader
from offload.protocols import Offloader, Runtime
from offload.pure.plan.plan import Backend, OffloadPlan

__all__ = ["build_executor"]


def build_executor(plan: OffloadPlan, runtime: Runtime, host_source: HostSource | None = None) -> Offloader:
    """The executor for `plan`'s backend on `runtime`, its host copies from `host_source`
    first where one is given (`HostSource`).

    Raises:
        PlanError: the plan is inconsistent with its backend (see each executor).
    """
    if plan.backend is Backend.PREFETCH:
        return PrefetchOffloader(plan, runtime, host_source)
    if plan.backend is Backend.UVA:
        return UVAOffloader(plan, runtime, host_source)
    return NoopOffloader(plan, runtime)
