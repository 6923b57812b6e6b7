"""What a plan warns about, derived from the facts `make_plan` gathered."""

from __future__ import annotations

import attrs

from offload.pure.config import OffloadConfig
from offload.pure.decide.admission import ADVISORY_LIMITS, NOT_CHECKED, HostAdmission, HostFit, HostLimit, over_text
from offload.pure.decide.pinning import PinDecision
from offload.pure.decide.selection import Selection, filter_misses
from offload.pure.decide.uva import UvaDecision
from offload.pure.env.snapshot import ENV_VARIABLES, EnvSnapshot
from offload.pure.plan.plan import Backend, PlanWarning, WarningCode
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

__all__ = ["PlanFacts", "longest_cyclic_run", "plan_warnings"]


@attrs.frozen(kw_only=True)
class PlanFacts:
    """What the warnings are computed from (all already decided by `make_plan`)."""

    spec: ModelSpec
    config: OffloadConfig
    env: EnvSnapshot
    backend: Backend
    pin: PinDecision
    uva: UvaDecision
    selection: Selection
    offloaded_layers: tuple[int, ...]
    offloaded_bytes: int
    resident_bytes: int
    buffer_bytes: int
    admission: HostAdmission = NOT_CHECKED


def longest_cyclic_run(layers: tuple[int, ...], num_layers: int) -> int:
    """The longest run of consecutive layer indices in `layers`, wrapping from the last
    layer to the first (the next step starts right after this one ends)."""
    present = set(layers)
    if not present:
        return 0
    if len(present) >= num_layers:
        return num_layers
    best = 0
    for start in present:
        if (start - 1) % num_layers in present:
            continue  # not the start of a run
        length = 0
        while (start + length) % num_layers in present:
            length += 1
        best = max(best, length)
    return best


def _w(code: WarningCode, message: str) -> PlanWarning:
    return PlanWarning(code=code, message=message)


def plan_warnings(f: PlanFacts) -> tuple[PlanWarning, ...]:
    """Every warning that applies, in a fixed order."""
    out: list[PlanWarning] = []
    platform = f.env.platform
    config = f.config
    offloading = f.backend is not Backend.NONE
    anything = bool(f.selection.offloaded)

    if config.backend == "auto" and config.group_size > 0 and config.uva_max_bytes > 0:
        out.append(_w(
            WarningCode.BOTH_BACKENDS_CONFIGURED,
            f"both group_size ({config.group_size}) and uva_max_bytes ({config.uva_max_bytes}) "
            "are set; backend auto chose prefetch and ignores the UVA budget",
        ))
    else:
        unused = []
        prefetch_set = config.group_size > 0 or config.num_in_group != 1 or config.prefetch_step != 1
        if f.backend is not Backend.PREFETCH and prefetch_set:
            unused.append("group_size/num_in_group/prefetch_step")
        if f.backend is not Backend.UVA and config.uva_max_bytes > 0:
            unused.append("uva_max_bytes")
        if f.backend is Backend.NONE and config.param_filter:
            unused.append("param_filter")
        if unused:
            out.append(_w(
                WarningCode.SETTINGS_UNUSED,
                f"backend {f.backend.value} does not use {', '.join(unused)}",
            ))

    misses = filter_misses(f.spec, config.param_filter)
    if offloading and misses:
        out.append(_w(
            WarningCode.FILTER_MATCHED_NOTHING,
            f"param_filter segments matched no parameter name: {', '.join(misses)}",
        ))
    if offloading and not anything:
        out.append(_w(WarningCode.NOTHING_OFFLOADED, _nothing_reason(f)))
    if config.keep_host_params and platform.has_cuda:
        kept = [(layer.index, p) for layer in f.spec.layers for p in layer.params if p.device == "cpu"]
        if kept:
            first = ", ".join(f"{index}:{p.name}" for index, p in kept[:3])
            out.append(_w(
                WarningCode.HOST_PARAMS_KEPT,
                f"{len(kept)} parameters ({first}{', ...' if len(kept) > 3 else ''}) are in host memory and "
                "stay there, neither offloaded nor moved to the device (keep_host_params): the model's "
                "own code must expect them on the host",
            ))
    for group in f.selection.cross_layer_ties:
        names = ", ".join(f"{layer}:{p.name}" for layer, p in group)
        out.append(_w(
            WarningCode.TIED_KEPT_RESIDENT,
            f"tied parameters {names} share one storage across layers; the prefetch backend "
            "cannot point them at two layers' buffers, so they stay resident",
        ))
    for group in f.selection.split_ties:
        names = ", ".join(f"{layer}:{p.name}" for layer, p in group)
        out.append(_w(
            WarningCode.TIED_KEPT_RESIDENT,
            f"tied parameters {names} share one storage but only some of them can be "
            "offloaded; all of them stay resident",
        ))

    if offloading and anything and not platform.has_cuda:
        out.append(_w(
            WarningCode.NO_ACCELERATOR,
            "no accelerator: the compute device is the CPU, so offloaded weights stay in host "
            "memory where they are and are copied into static buffers (or per call) exactly as on a "
            "GPU, but nothing is saved",
        ))
    if offloading and anything and platform.has_cuda and platform.is_integrated:
        out.append(_w(
            WarningCode.INTEGRATED_GPU,
            f"{platform.device_name} is an integrated GPU sharing one memory pool with the host: "
            "offloading frees no physical memory",
        ))
    model_bytes = f.offloaded_bytes + f.resident_bytes
    if offloading and platform.has_cuda and 0 < model_bytes <= platform.device_total_bytes:
        out.append(_w(
            WarningCode.MODEL_FITS_ON_DEVICE,
            f"the model's {format_bytes(model_bytes)} of weights fit in the device's "
            f"{format_bytes(platform.device_total_bytes)}; offloading may not be needed",
        ))

    if f.backend is Backend.PREFETCH and anything:
        out.extend(_prefetch_warnings(f))
    if f.backend is Backend.UVA and anything and not f.uva.enabled:
        out.append(_w(
            WarningCode.ON_DEMAND_SLOW,
            f"UVA is off ({f.uva.explanation}); the UVA-planned parameters are copied to the "
            "device on every call of their layer instead: slow, and not capturable in CUDA graphs",
        ))

    admission = _admission_warnings(f)
    out.extend(admission)
    device_short = any(w.code is WarningCode.DEVICE_MEMORY_SHORT for w in admission)
    if anything and f.pin.pin and platform.is_coherent_unified_memory and not device_short:
        out.append(_w(
            WarningCode.COHERENT_UNIFIED_MEMORY,
            f"{platform.device_name} has hardware-coherent unified memory: pinned host memory "
            "competes with device memory; if loading runs out of memory set "
            f"{ENV_VARIABLES['disable_pin_memory'][0]}=1",
        ))
    return tuple(out)


# Each limit of the host admission check and the warning its excess gives; MemAvailable
# and the cgroup's headroom measure the same memory, so they share one warning.
_ADMISSION_CODES = {
    HostLimit.HOST_AVAILABLE: WarningCode.HOST_MEMORY_SHORT,
    HostLimit.CGROUP: WarningCode.HOST_MEMORY_SHORT,
    HostLimit.MEMLOCK: WarningCode.MEMLOCK_LIMIT,
    HostLimit.DEVICE: WarningCode.DEVICE_MEMORY_SHORT,
}

_ADMISSION_HINTS = {
    WarningCode.HOST_MEMORY_SHORT: "free host memory, raise the container's memory limit or offload less",
    WarningCode.MEMLOCK_LIMIT: f"raise the limit (ulimit -l) or set {ENV_VARIABLES['disable_pin_memory'][0]}=1",
    WarningCode.DEVICE_MEMORY_SHORT: f"set {ENV_VARIABLES['disable_pin_memory'][0]}=1 or offload less",
}


def _admission_warnings(f: PlanFacts) -> list[PlanWarning]:
    """One warning per kind of limit the plan's host memory exceeds (`f.admission`), the
    most exceeded first; none with ``host_check="off"``. These are the plan's only
    warnings about host memory, so they always agree with the verdict."""
    admission = f.admission
    mode = f.config.host_check
    if mode == "off":
        return []
    if mode == "refuse":
        outcome = ("wrap_modules refuses this plan before moving anything (host_check='refuse'; "
                   "OffloadConfig(host_check='warn') runs it anyway)")
    else:
        outcome = "host_check='warn': it runs anyway, and the process may be killed"
    advisory = ("pinning may fail and fall back to pageable memory (counted in stats().pin_fallbacks); "
                "nothing is refused for it")
    binding = admission.verdict is HostFit.DOES_NOT_FIT
    failed = sorted((c for c in admission.failed if binding or c.limit in ADVISORY_LIMITS),
                    key=lambda c: c.margin_bytes or 0)
    out: list[PlanWarning] = []
    seen: set[WarningCode] = set()
    for check in failed:
        code = _ADMISSION_CODES[check.limit]
        if code in seen:
            continue
        seen.add(code)
        text = over_text(check, admission.pinned_bytes)
        what = advisory if check.limit in ADVISORY_LIMITS else outcome
        out.append(_w(code, f"{text}; {_ADMISSION_HINTS[code]}; {what}"))
    return out


def _prefetch_warnings(f: PlanFacts) -> list[PlanWarning]:
    out: list[PlanWarning] = []
    step = f.config.prefetch_step
    # Per stack: each is a cycle of its own (`offload.pure.plan.schedule`).
    ranges = f.spec.stack_ranges
    run = max((longest_cyclic_run(tuple(i - first for i in f.offloaded_layers if first <= i < stop), stop - first)
               for first, stop in ranges), default=0)
    if run > step:
        out.append(_w(
            WarningCode.PREFETCH_STALLS,
            f"{run} consecutive layers are offloaded but prefetch_step is {step}: copies for "
            "those layers cannot all overlap compute; unless the step is bound by the link "
            f"anyway, use prefetch_step >= {run} or offload fewer adjacent layers",
        ))
    if f.offloaded_layers and all(sum(1 for i in f.offloaded_layers if first <= i < stop) <= step
                                  for first, stop in ranges):
        out.append(_w(
            WarningCode.PREFETCH_DEPTH_COVERS_ALL,
            f"prefetch_step {step} gives a slot to every one of the {len(f.offloaded_layers)} "
            "offloaded layers: each is loaded once and keeps its slot, so nothing is copied per "
            f"step, but the static buffers ({format_bytes(f.buffer_bytes)}) take as much device "
            f"memory as offloading frees ({format_bytes(f.offloaded_bytes)})",
        ))
    if f.env.platform.has_cuda and not f.pin.pin:
        out.append(_w(
            WarningCode.PREFETCH_UNPINNED,
            f"pinning is off ({f.pin.explanation}): host-to-device copies from pageable memory "
            "are about 6x slower, and a model that copies weights cannot be captured in a CUDA graph",
        ))
    return out


def _nothing_reason(f: PlanFacts) -> str:
    config = f.config
    if f.backend is Backend.PREFETCH and config.group_size - config.num_in_group >= len(f.spec.layers):
        return (
            f"no parameter is offloaded: with group_size {config.group_size} and num_in_group "
            f"{config.num_in_group}, the first offloaded layer would be layer "
            f"{config.group_size - config.num_in_group}, but the model has {len(f.spec.layers)} layers"
        )
    if config.param_filter:
        return f"no parameter is offloaded: none on the compute device matches param_filter {config.param_filter}"
    if not f.spec.layers:
        return "no parameter is offloaded: the model has no layers"
    return "no parameter is offloaded: no parameter of the selected layers is on the compute device"
