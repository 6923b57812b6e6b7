"""`offload`: move PyTorch weights to host memory and stream them back just in time.

Plan first (`make_plan`, pure, inspectable, serialisable), then execute. Importing this
package does not import torch: the pure core and the errors load eagerly, and the shell
functions that need torch (`capture_env`, `describe_layers`, `spec_from_checkpoint`,
`create_offloader`, the executors and runtimes) load on first use. Everything listed in `__all__` is the public surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from offload import errors, protocols
from offload.errors import CheckpointError, ConfigError, EnvError, ExecutionError, OffloadError, PlanError
from offload.pure import (
    COMPUTE_DEVICE,
    DTYPE_ITEMSIZE,
    ENV_VARIABLES,
    PLAN_FORMAT,
    PRESETS,
    PROFILES,
    Backend,
    BackendName,
    BackendReason,
    BufferPlan,
    CgroupMemory,
    DeviceProfile,
    EnvFlags,
    EnvSnapshot,
    FitCandidate,
    FitResult,
    HostAdmission,
    HostCheck,
    HostFit,
    HostLimit,
    HostNuma,
    LayerBlocks,
    LayerEstimate,
    LayerSpec,
    LimitCheck,
    ModelSpec,
    NumaReason,
    NumaTopology,
    OffloadConfig,
    OffloadPlan,
    ParamPlan,
    ParamSpec,
    PinDecision,
    PinMethod,
    PinReason,
    Placement,
    PlanWarning,
    Platform,
    PrefetchSchedule,
    StepEstimate,
    UvaDecision,
    UvaReason,
    WarningCode,
    Workload,
    check_schedule,
    contiguous_stride,
    decide_host_admission,
    decide_numa,
    decide_pinning,
    decide_uva,
    estimate,
    fit,
    make_plan,
    parse_env,
    planning_env,
    preset_spec,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
    render_estimate,
    render_fit,
    render_plan,
    resolve_backend,
    revise_plan,
    schedule_prefetch,
    segment_matches,
)
from offload.pure.check import LiveCheck, Location, ParamLocation, render_check
from offload.pure.stats import OffloadStats, render_stats, render_stats_line

if TYPE_CHECKING:
    from offload.capture import capture_env
    from offload.checkpoint import read_checkpoint, spec_from_checkpoint
    from offload.create import create_offloader
    from offload.describe import describe_layers
    from offload.executors.noop import NoopOffloader
    from offload.executors.prefetch import PrefetchOffloader
    from offload.executors.uva import UVAOffloader
    from offload.runtime.cpu import CpuRuntime
    from offload.runtime.cuda import CudaRuntime

# Shell names that import torch, loaded on first attribute access (PEP 562).
_LAZY = {
    "capture_env": "offload.capture",
    "describe_layers": "offload.describe",
    "spec_from_checkpoint": "offload.checkpoint",
    "read_checkpoint": "offload.checkpoint",
    "create_offloader": "offload.create",
    "CpuRuntime": "offload.runtime.cpu",
    "CudaRuntime": "offload.runtime.cuda",
    "NoopOffloader": "offload.executors.noop",
    "PrefetchOffloader": "offload.executors.prefetch",
    "UVAOffloader": "offload.executors.uva",
}

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendName",
    "BackendReason",
    "BufferPlan",
    "COMPUTE_DEVICE",
    "CgroupMemory",
    "CheckpointError",
    "ConfigError",
    "CpuRuntime",
    "CudaRuntime",
    "DTYPE_ITEMSIZE",
    "DeviceProfile",
    "ENV_VARIABLES",
    "EnvError",
    "EnvFlags",
    "EnvSnapshot",
    "ExecutionError",
    "FitCandidate",
    "FitResult",
    "HostAdmission",
    "HostCheck",
    "HostFit",
    "HostLimit",
    "HostNuma",
    "LayerBlocks",
    "LayerEstimate",
    "LayerSpec",
    "LimitCheck",
    "LiveCheck",
    "Location",
    "ModelSpec",
    "NoopOffloader",
    "NumaReason",
    "NumaTopology",
    "OffloadConfig",
    "OffloadError",
    "OffloadPlan",
    "OffloadStats",
    "PLAN_FORMAT",
    "PRESETS",
    "PROFILES",
    "ParamLocation",
    "ParamPlan",
    "ParamSpec",
    "PinDecision",
    "PinMethod",
    "PinReason",
    "Placement",
    "PlanError",
    "PlanWarning",
    "Platform",
    "PrefetchOffloader",
    "PrefetchSchedule",
    "StepEstimate",
    "UVAOffloader",
    "UvaDecision",
    "UvaReason",
    "WarningCode",
    "Workload",
    "capture_env",
    "check_schedule",
    "contiguous_stride",
    "create_offloader",
    "decide_host_admission",
    "decide_numa",
    "decide_pinning",
    "decide_uva",
    "describe_layers",
    "errors",
    "estimate",
    "fit",
    "make_plan",
    "parse_env",
    "planning_env",
    "preset_spec",
    "profile_by_name",
    "profile_for_device",
    "profile_from_numbers",
    "protocols",
    "read_checkpoint",
    "render_check",
    "render_estimate",
    "render_fit",
    "render_plan",
    "render_stats",
    "render_stats_line",
    "resolve_backend",
    "revise_plan",
    "schedule_prefetch",
    "segment_matches",
    "spec_from_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
