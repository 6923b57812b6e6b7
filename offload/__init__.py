"""`offload`: move PyTorch weights to host memory and stream them back just in time.

The pipeline a user calls, in order: `capture_env` (the machine, once), `describe_layers`
(`describe_stacks` for several layer stacks) or `spec_from_checkpoint` (the model's shapes), `make_plan` (pure: every decision, an
`OffloadPlan` to read, test, diff and serialise; `render_plan` prints it; `fit` and
`estimate` choose and cost a configuration), `create_offloader` (the executor that carries
the plan out), then its lifecycle (`wrap_modules`, `post_init`, forwards, `restore`).

This package exports that pipeline, the values a user builds and reads, the errors and
the roles (`Offloader`, `Runtime`); everything else is imported from its room:
`offload.pure` (the core: its rooms `env`, `spec`, `decide`, `plan`, `fit`, `sharing`),
`offload.executors`, `offload.runtime`, `offload.sharing`, `offload.hf`, `offload.capture`
(see docs/architecture.md; names that left the top level are listed in CHANGELOG.md).
Importing it does not import torch: the shell functions that need torch load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from offload.errors import CheckpointError, ConfigError, EnvError, ExecutionError, OffloadError, PlanError
from offload.protocols import Offloader, Runtime
from offload.pure import (
    Backend,
    EnvFlags,
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamPlan,
    ParamSpec,
    PinDecision,
    Placement,
    Platform,
    PrefetchSchedule,
    UvaDecision,
    WarningCode,
    Workload,
    check_schedule,
    decide_host_admission,
    decide_pinning,
    decide_uva,
    estimate,
    fit,
    make_plan,
    parse_env,
    render_plan,
    schedule_prefetch,
)
from offload.pure.check import LiveCheck, render_check
from offload.pure.stats import OffloadStats, render_stats

if TYPE_CHECKING:
    from offload.capture import capture_env
    from offload.create import create_offloader
    from offload.model.checkpoint import spec_from_checkpoint
    from offload.model.describe import describe_layers, describe_stacks

# Shell names that import torch, loaded on first attribute access (PEP 562).
_LAZY = {
    "capture_env": "offload.capture",
    "describe_layers": "offload.model.describe",
    "describe_stacks": "offload.model.describe",
    "spec_from_checkpoint": "offload.model.checkpoint",
    "create_offloader": "offload.create",
}

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "CheckpointError",
    "ConfigError",
    "EnvError",
    "EnvFlags",
    "EnvSnapshot",
    "ExecutionError",
    "LayerSpec",
    "LiveCheck",
    "ModelSpec",
    "OffloadConfig",
    "OffloadError",
    "OffloadPlan",
    "OffloadStats",
    "Offloader",
    "ParamPlan",
    "ParamSpec",
    "PinDecision",
    "Placement",
    "PlanError",
    "Platform",
    "PrefetchSchedule",
    "Runtime",
    "UvaDecision",
    "WarningCode",
    "Workload",
    "capture_env",
    "check_schedule",
    "create_offloader",
    "decide_host_admission",
    "decide_pinning",
    "decide_uva",
    "describe_layers",
    "describe_stacks",
    "estimate",
    "fit",
    "make_plan",
    "parse_env",
    "render_check",
    "render_plan",
    "render_stats",
    "schedule_prefetch",
    "spec_from_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
