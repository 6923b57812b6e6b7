"""The functional core of `offload`: values and pure functions, no torch, no I/O.

Nothing in this package imports torch, reads ``os.environ``, files, clocks or devices, or
logs. Inputs and outputs are immutable values; the same inputs always give the same plan.
"""

from offload.pure.config import BackendName, OffloadConfig, segment_matches
from offload.pure.decisions import (
    PinDecision,
    PinReason,
    UvaDecision,
    UvaReason,
    decide_pinning,
    decide_uva,
)
from offload.pure.env import ENV_VARIABLES, EnvFlags, EnvSnapshot, Platform, parse_env
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
from offload.pure.planner import make_plan, resolve_backend
from offload.pure.presets import PRESETS, preset_spec
from offload.pure.render import render_plan
from offload.pure.schedule import PrefetchSchedule, check_schedule, schedule_prefetch
from offload.pure.spec import COMPUTE_DEVICE, DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

__all__ = [
    "Backend",
    "BackendName",
    "BackendReason",
    "BufferPlan",
    "COMPUTE_DEVICE",
    "DTYPE_ITEMSIZE",
    "ENV_VARIABLES",
    "EnvFlags",
    "EnvSnapshot",
    "LayerSpec",
    "ModelSpec",
    "OffloadConfig",
    "OffloadPlan",
    "PLAN_FORMAT",
    "PRESETS",
    "ParamPlan",
    "ParamSpec",
    "PinDecision",
    "PinReason",
    "Placement",
    "PlanWarning",
    "Platform",
    "PrefetchSchedule",
    "UvaDecision",
    "UvaReason",
    "WarningCode",
    "check_schedule",
    "contiguous_stride",
    "decide_pinning",
    "decide_uva",
    "make_plan",
    "parse_env",
    "preset_spec",
    "render_plan",
    "resolve_backend",
    "schedule_prefetch",
    "segment_matches",
]
