"""`create_offloader`: the executor a plan asks for, with the runtime its platform needs."""

from __future__ import annotations

from offload.executors.noop import NoopOffloader
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.uva import UVAOffloader
from offload.protocols import Offloader, Runtime
from offload.pure.plan import Backend, OffloadPlan
from offload.runtime.cpu import CpuRuntime

__all__ = ["create_offloader", "default_runtime"]


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


def create_offloader(plan: OffloadPlan, runtime: Runtime | None = None) -> Offloader:
    """The offloader that runs `plan`.

    Args:
        plan: what to do (from `make_plan`).
        runtime: the effects to use; by default from the plan's platform (`default_runtime`).

    Returns:
        A `PrefetchOffloader`, `UVAOffloader` or `NoopOffloader`, typed as the
        `Offloader` protocol.

    Raises:
        PlanError: the plan is inconsistent with its backend (see each executor).
        ExecutionError: the default runtime cannot be created.
    """
    rt = runtime if runtime is not None else default_runtime(plan)
    if plan.backend is Backend.PREFETCH:
        return PrefetchOffloader(plan, rt)
    if plan.backend is Backend.UVA:
        return UVAOffloader(plan, rt)
    return NoopOffloader(plan, rt)
