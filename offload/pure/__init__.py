"""The functional core of `offload`: values and pure functions, no torch, no I/O.

Nothing in this package imports torch, reads the process environment, files, clocks or devices, or
logs. Inputs and outputs are immutable values; the same inputs always give the same plan.

The map (each room imports only the rooms above it):

- `env`: the user's switches and the platform (`EnvSnapshot`), and parsers of what the shell read.
- `spec`: what a model is (`ModelSpec`), presets, safetensors headers.
- `decide`: one module per decision: pinning, UVA, selection, moves, NUMA, host admission.
- `plan`: the plan (`OffloadPlan`), its parts and rules, the schedule, buffers, `make_plan`,
  revision, warnings, rendering.
- `fit`: device profiles, the step estimate, the fit search.
- `sharing`: who shares host copies with whom, the job's host memory.
- `disk`: the disk tier: which offloaded layers live on disk, read from where, and the
  staging ring.
- beside them: `config` (`OffloadConfig`), `check` (what `check()` finds), `stats`
  (`OffloadStats`), and the shared helpers `_checks`, `_slots`, `serialize`, `units`.

This package re-exports the values and functions a user builds plans with; the rest is
imported from its room (``offload.pure.plan.schedule``, ...).
"""

from offload.pure.config import BackendName, HostCheck, LayerBlocks, OffloadConfig, segment_matches
from offload.pure.decide.admission import HostAdmission, HostFit, HostLimit, LimitCheck
from offload.pure.decide.numa import HostNuma, NumaReason, decide_numa
from offload.pure.decide.pinning import PinDecision, PinMethod, PinReason, decide_pinning
from offload.pure.decide.uva import UvaDecision, UvaReason, decide_uva
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.env.numa import NumaTopology
from offload.pure.env.snapshot import ENV_VARIABLES, EnvFlags, EnvSnapshot, Platform, parse_env
from offload.pure.fit.estimate import LayerEstimate, StepEstimate, Workload, estimate
from offload.pure.fit.profiles import (
    PROFILES,
    DeviceProfile,
    planning_env,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
)
from offload.pure.fit.render import render_estimate, render_fit
from offload.pure.fit.search import FitCandidate, FitResult, fit
from offload.pure.plan.make import decide_host_admission, make_plan, resolve_backend
from offload.pure.plan.plan import (
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
from offload.pure.plan.render import render_plan
from offload.pure.plan.revise import revise_plan
from offload.pure.plan.schedule import PrefetchSchedule, check_schedule, schedule_prefetch
from offload.pure.spec.presets import PRESETS, preset_spec
from offload.pure.spec.values import COMPUTE_DEVICE, DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride

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
