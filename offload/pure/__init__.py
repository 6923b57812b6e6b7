"""The functional core of `offload`: values and pure functions, no torch, no I/O.

Nothing in this package imports torch, reads the process environment, files, clocks or devices, or
logs. Inputs and outputs are immutable values; the same inputs always give the same plan.
"""

from offload.pure.admission import HostAdmission, HostFit, HostLimit, LimitCheck
from offload.pure.cgroup import CgroupMemory
from offload.pure.config import BackendName, HostCheck, LayerBlocks, OffloadConfig, segment_matches
from offload.pure.decisions import (
    PinDecision,
    PinMethod,
    PinReason,
    UvaDecision,
    UvaReason,
    decide_pinning,
    decide_uva,
)
from offload.pure.env import ENV_VARIABLES, EnvFlags, EnvSnapshot, Platform, parse_env
from offload.pure.estimate import LayerEstimate, StepEstimate, Workload, estimate
from offload.pure.fit import FitCandidate, FitResult, fit
from offload.pure.fit_render import render_estimate, render_fit
from offload.pure.numa import HostNuma, NumaReason, NumaTopology, decide_numa
from offload.pure.plan import (
    PLAN_FORMAT,
    Backend,
    BackendReason,
    BufferPlan,
    OffloadPlan,
    ParamPlan,
    Placement,
    PlanWarning,
    WarningCode,
)
from offload.pure.planner import decide_host_admission, make_plan, resolve_backend
from offload.pure.presets import PRESETS, preset_spec
from offload.pure.profiles import (
    PROFILES,
    DeviceProfile,
    planning_env,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
)
from offload.pure.render import render_plan
from offload.pure.revise import revise_plan
from offload.pure.schedule import PrefetchSchedule, check_schedule, schedule_prefetch
from offload.pure.spec import COMPUTE_DEVICE, DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = [
    "Backend",
    "BackendName",
    "BackendReason",
    "BufferPlan",
    "COMPUTE_DEVICE",
    "CgroupMemory",
    "DTYPE_ITEMSIZE",
    "DeviceProfile",
    "ENV_VARIABLES",
    "EnvFlags",
    "EnvSnapshot",
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
    "ModelSpec",
    "NumaReason",
    "NumaTopology",
    "OffloadConfig",
    "OffloadPlan",
    "PLAN_FORMAT",
    "PRESETS",
    "PROFILES",
    "ParamPlan",
    "ParamSpec",
    "PinDecision",
    "PinMethod",
    "PinReason",
    "Placement",
    "PlanWarning",
    "Platform",
    "PrefetchSchedule",
    "StepEstimate",
    "UvaDecision",
    "UvaReason",
    "WarningCode",
    "Workload",
    "check_schedule",
    "contiguous_stride",
    "decide_host_admission",
    "decide_numa",
    "decide_pinning",
    "decide_uva",
    "estimate",
    "fit",
    "make_plan",
    "parse_env",
    "planning_env",
    "preset_spec",
    "profile_by_name",
    "profile_for_device",
    "profile_from_numbers",
    "render_estimate",
    "render_fit",
    "render_plan",
    "resolve_backend",
    "revise_plan",
    "schedule_prefetch",
    "segment_matches",
]
