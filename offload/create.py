"""`create_offloader`: the executor a plan asks for, with the runtime its platform needs."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from offload.errors import PlanError
from offload.executors.build import build_executor
from offload.protocols import Offloader, Runtime
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.plan.plan import OffloadPlan
from offload.runtime.cpu import CpuRuntime

if TYPE_CHECKING:
    import torch.distributed as dist

    from offload.sharing.coordinate import ShareWith

__all__ = ["build_executor", "create_offloader", "default_runtime"]


def default_runtime(plan: OffloadPlan) -> Runtime:
    """`CudaRuntime` for a plan made for a CUDA platform (placing host copies on the
    plan's NUMA node, `OffloadPlan.host_numa`), `CpuRuntime` otherwise.

    Raises:
        ExecutionError: the plan is for CUDA and this process has no CUDA device.
    """
    if plan.compute_device == "cpu":
        return CpuRuntime()
    from offload.runtime.cuda import CudaRuntime

    return CudaRuntime(numa_node=plan.host_numa.node)


def create_offloader(plan: OffloadPlan, runtime: Runtime | None = None, *,
                     share_with: dist.ProcessGroup | ShareWith | None = None, disk: DiskTierPlan | None = None,
                     spill_dir: str | os.PathLike[str] | None = None) -> Offloader:
    """The offloader that runs `plan`.

    Args:
        plan: what to do (from `make_plan`).
        runtime: the effects to use; by default from the plan's platform (`default_runtime`).
        share_with: a torch.distributed group (or `offload.sharing.ShareWith`) whose
            members hold identical weights: its members on each host share one host copy
            (`offload.sharing`). Every member must call this; it gathers from all of them.
        disk: the plan's disk tier (`offload.pure.disk.plan_disk_tier`): its layers are
            read from disk ahead of their copies instead of held in host memory
            (prefetch plans; not with `share_with`).
        spill_dir: with `disk`: where weights not read from the checkpoint as they lie
            are written once (needed when the tier spills any).

    Returns:
        A `PrefetchOffloader`, `UVAOffloader` or `NoopOffloader`, typed as the
        `Offloader` protocol; with `share_with`, a `SharedOffloader` running one.

    Raises:
        PlanError: the plan is inconsistent with its backend (see each executor), or
            `disk` is not its tier or comes with `share_with`.
        ExecutionError: the default runtime cannot be created; with `share_with`, as
            `offload.sharing.share_offloader` (e.g. members' weights differ).
    """
    if disk is not None and share_with is not None:
        raise PlanError("a disk tier cannot be shared (share_with): plan without one, or do not share",
                        name="disk", value=True)
    rt = runtime if runtime is not None else default_runtime(plan)
    if share_with is not None:
        from offload.sharing.join import share_offloader

        return share_offloader(plan, rt, share_with)
    return build_executor(plan, rt, disk=disk, spill_dir=spill_dir)

