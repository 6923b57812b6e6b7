"""`create_offloader`: the executor a plan asks for, with the runtime its platform needs."""

from __future__ import annotations

from offload.errors import PlanError
from offload.executors.noop import NoopOffloader
from offload.executors.prefetch import PrefetchOffloader
from offload.protocols import Offloader, Runtime
from offload.pure.plan import Backend, OffloadPlan
from offload.runtime.cpu import CpuRuntime

__all__ = ["create_offloader", "default_runtime"]


def default_runtime(plan: OffloadPlan) -> Runtime:
    """`CudaRuntime` for a plan made for a CUDA platform, `CpuRuntime` otherwise.

    Raises:
        ExecutionError: the plan is for CUDA and this process has no CUDA device.
    """
    if plan.compute_device == "cpu":
        return CpuRuntime()
    from offload.runtime.cuda import CudaRuntime

    return CudaRuntime()


def create_offloader(plan: OffloadPlan, runtime: Runtime | None = None) -> Offloader:
    """The offloader that runs `plan`.

    Args:
        plan: what to do (from `make_plan`).
        runtime: the effects to use; by default from the plan's platform (`default_runtime`).

    Returns:
        A `PrefetchOffloader` or `NoopOffloader`, typed as the `Offloader` protocol.

    Raises:
        PlanError: the plan's backend has no executor in this version (uva).
        ExecutionError: the default runtime cannot be created.
    """
    if plan.backend is Backend.UVA:
        raise PlanError(
            "the uva backend has no executor in this version yet; plan with backend "
            "prefetch (group_size > 0) or none",
            name="backend",
            value=plan.backend.value,
        )
    rt = runtime if runtime is not None else default_runtime(plan)
    if plan.backend is Backend.PREFETCH:
        return PrefetchOffloader(plan, rt)
    return NoopOffloader(plan, rt)
