"""``offload plan``: exactly what would be offloaded, where, and what it costs; with
``--fit-gib``, the fastest configuration that fits a device budget."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

import attrs

from offload.cli._shared import UserError, capture, shown
from offload.cli.parser import (
    DEFAULT_DISK_GBPS,
    DEFAULT_PREFETCH,
    DEFAULT_SOURCE,
    gib_bytes,
)
from offload.cli.plan_source import Source, has_weights, plan_source
from offload.errors import ConfigError, PlanError
from offload.pure.config import OffloadConfig
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.render import render_disk_tier, tier_warnings
from offload.pure.disk.search import fit_with_tier
from offload.pure.disk.tier import DiskTierPlan, plan_disk_tier
from offload.pure.env.snapshot import EnvSnapshot, Platform
from offload.pure.experts.profile import trace_from_json
from offload.pure.experts.values import RoutingTrace
from offload.pure.fit.estimate import StepEstimate, Workload, estimate
from offload.pure.fit.profiles import (
    DeviceProfile,
    planning_env,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
)
from offload.pure.fit.render import render_estimate, render_fit
from offload.pure.fit.search import fit
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import OffloadPlan
from offload.pure.plan.render import render_plan
from offload.pure.spec.presets import PRESETS
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from offload.model.checkpoint import CheckpointExtents


def _take_source(args: argparse.Namespace) -> None:
    """Set ``args.source``: SOURCE as given, else the last word after ``--filter`` when at
    least one segment precedes it and it is a preset or an existing path (``--filter SEG ...``
    takes every following word), else the default."""
    if args.source is not None:
        return
    words: list[str] = args.filter
    if len(words) >= 2 and (words[-1] in PRESETS or os.path.exists(words[-1])):
        args.source = words.pop()
    else:
        args.source = DEFAULT_SOURCE


def _config(args: argparse.Namespace) -> tuple[OffloadConfig, bool]:
    """The config the flags ask for, and whether it is the default."""
    chosen = {
        "backend": args.backend,
        "group_size": args.group_size,
        "num_in_group": args.num_in_group,
        "prefetch_step": args.prefetch_step,
        "uva_max_bytes": None if args.uva_gib is None else gib_bytes(args.uva_gib),
        "expert_slots": args.expert_slots,
    }
    given = {k: v for k, v in chosen.items() if v is not None}
    if not given:
        return attrs.evolve(DEFAULT_PREFETCH, param_filter=tuple(args.filter)), True
    return OffloadConfig(**given, param_filter=tuple(args.filter)), False


def _print_model(source: Source) -> None:
    spec = source.spec
    print(f"model:    {source.origin}: {len(spec.layers)} layers, {spec.num_params} parameters, "
          f"{format_bytes(spec.nbytes)}")
    for line in source.details:
        print(line)


def _planning_env(args: argparse.Namespace) -> EnvSnapshot:
    snapshot = capture()
    if args.device_gib is None:
        return snapshot
    if args.device_gib == 0:
        raise UserError("offload plan: --device-gib must be greater than 0")
    platform = Platform(
        has_cuda=True,
        device_name="planned CUDA device",
        device_total_bytes=gib_bytes(args.device_gib),
        can_map_host_memory=True,
        can_register_host_memory=True,
        host_pointer_for_registered_memory=True,
        torch_version=snapshot.platform.torch_version,
        probe_notes=("a hypothetical device (--device-gib): host memory is not checked",),
    )
    return attrs.evolve(snapshot, platform=platform)


def _profile(args: argparse.Namespace) -> DeviceProfile | None:
    """The profile the flags name or build, or None when they give none."""
    profile = profile_by_name(args.profile) if args.profile else None
    if args.link_gbps is not None or args.tflops is not None:
        if profile is None and (args.link_gbps is None or args.tflops is None):
            raise UserError("offload plan: without --profile, give both --link-gbps and --tflops")
        try:
            profile = profile_from_numbers(link_gbps=args.link_gbps, tflops=args.tflops, base=profile)
        except ConfigError as exc:
            flag = {"link_gbps": "--link-gbps", "tflops": "--tflops"}.get(exc.name or "")
            if flag is None:
                raise
            raise UserError(f"offload plan: {flag}: {exc.message}") from None
    return profile


def _routing(args: argparse.Namespace, profile: DeviceProfile | None) -> RoutingTrace | None:
    """The trace ``--routing-trace`` names, read (None without it)."""
    path: str | None = args.routing_trace
    if path is None:
        return None
    if profile is None:
        raise UserError("offload plan: --routing-trace is for the estimate; give --profile NAME, or --link-gbps "
                        "and --tflops")
    try:
        with open(path, "rb") as file:
            text = file.read()
    except OSError as exc:
        raise UserError(f"offload plan: --routing-trace: cannot read {shown(path)}: {exc.strerror or exc}") from None
    try:
        return trace_from_json(text)
    except PlanError as exc:
        raise UserError(f"offload plan: --routing-trace {shown(path)}: {exc.message}") from None


def cmd_fit(args: argparse.Namespace, profile: DeviceProfile | None) -> int:
    if profile is None:
        raise UserError("offload plan: --fit-gib needs --profile NAME, or --link-gbps and --tflops")
    routing = _routing(args, profile)
    chosen = [flag for flag, value in (("--backend", args.backend), ("--group-size", args.group_size),
                                       ("--num-in-group", args.num_in_group), ("--prefetch-step", args.prefetch_step),
                                       ("--uva-gib", args.uva_gib)) if value is not None]
    if chosen:
        raise UserError(f"offload plan: --fit-gib chooses the configuration itself; drop {', '.join(chosen)}")
    source = plan_source(args.source, counted="counted in the fit", quantization=args.quantization, dtype=args.dtype)
    spec = source.spec
    if args.fit_gib == 0:
        raise UserError("offload plan: --fit-gib must be greater than 0")
    budget = gib_bytes(args.fit_gib)
    env = _planning_env(args)
    if not env.platform.has_cuda:
        # Planning for the profile's device from a machine without one: the budget is the
        # device memory the model may use there.
        env = planning_env(env, attrs.evolve(profile, device_memory_bytes=budget))
    disk = _disk_request(args)
    workload = Workload(tokens_per_step=args.tokens)
    try:
        if disk is None:
            result = fit(spec, env, profile, workload, budget, outside_bytes=source.outside_bytes,
                         reserve_bytes=gib_bytes(args.reserve_gib), param_filter=tuple(args.filter),
                         expert_slots=args.expert_slots, routing=routing)
            tier = None
        else:
            # Both budgets: the fit searches the plans whose host copies, with a disk tier
            # where they need one, fit the host budget (offload.pure.disk.search).
            found = _extents(args)
            both = fit_with_tier(spec, env, profile, workload, budget, host_budget_bytes=disk[0], disk_gbps=disk[1],
                                 read_ahead=disk[2], outside_bytes=source.outside_bytes,
                                 reserve_bytes=gib_bytes(args.reserve_gib), param_filter=tuple(args.filter),
                                 expert_slots=args.expert_slots, routing=routing,
                                 layer_names=tuple(layer.name for layer in spec.layers) if found is not None else (),
                                 tensors=found.tensors if found is not None else None,
                                 extents=found.extents if found is not None else None,
                                 files=found.files if found is not None else ())
            result, tier = both.fit, both.tier
    except PlanError as exc:
        if len(spec.stack_ranges) < 2:
            raise
        stacks = "; ".join(line.removeprefix("stack:").strip() for line in source.details if line.startswith("stack:"))
        raise PlanError(f"{exc} (the model's stacks, all planned: {stacks})", name=exc.name, value=exc.value) from exc
    if args.json:
        if tier is None:
            print(result.to_json(indent=2))
        else:
            print(json.dumps({"fit": json.loads(result.to_json()), "disk": json.loads(tier.to_json())}, indent=2))
        return 0
    _print_model(source)
    print(f"profile:  {profile.name} ({profile.device_name})")
    if disk is not None and tier is None:
        print(f"host:     the host budget of {format_bytes(disk[0])} holds every offloaded weight: no disk tier")
    # With a disk tier the chosen plan runs with it: its host memory is the tier's, and its
    # warnings are those of a plan that reads from disk (result.estimate is with the tier).
    shown = result if tier is None else attrs.evolve(result, plan=_with_tier(result.plan, tier, result.estimate))
    print(render_fit(shown))
    if tier is not None:
        plan = result.plan
        print(render_disk_tier(tier, device_bytes=plan.device_bytes_resident + plan.device_bytes_buffers))
        print()  # the estimate's own heading follows; the disk tier above says what it reads, at what rate
        print(render_estimate(result.estimate))
    return 0


def _with_tier(plan: OffloadPlan, tier: DiskTierPlan, step: StepEstimate | None) -> OffloadPlan:
    """`plan` as it runs with `tier`, for printing: the host admission of the host tier and
    the staging ring (the disk layers take no host memory), and with its estimate `step`
    the warnings of a plan that reads from disk (`tier_warnings`)."""
    shown = attrs.evolve(plan, host_admission=tier.host_admission)
    return shown if step is None else attrs.evolve(shown, warnings=tier_warnings(plan, tier, step))


def _disk_request(args: argparse.Namespace) -> tuple[int, float, int] | None:
    """(host budget bytes, disk GB/s, read-ahead) that ``--host-gib`` asks for (None
    without it), its flags checked."""
    if args.host_gib is None:
        given = next((flag for flag, value in (("--disk-gbps", args.disk_gbps), ("--read-ahead", args.read_ahead))
                      if value is not None), None)
        if given is not None:
            raise UserError(f"offload plan: {given} needs --host-gib")
        return None
    if args.host_gib == 0:
        raise UserError("offload plan: --host-gib must be greater than 0")
    if args.disk_gbps is not None and args.disk_gbps <= 0:
        raise UserError("offload plan: --disk-gbps must be greater than 0")
    return (gib_bytes(args.host_gib), float(args.disk_gbps if args.disk_gbps is not None else DEFAULT_DISK_GBPS),
            args.read_ahead if args.read_ahead is not None else 2)


def _extents(args: argparse.Namespace) -> CheckpointExtents | None:
    """Where a checkpoint's tensors lie in its files (None for a preset or a config alone,
    which have no file to read from)."""
    if not has_weights(args.source):
        return None
    from offload.model.checkpoint import checkpoint_extents

    return checkpoint_extents(args.source)


def _disk_tier(args: argparse.Namespace, plan: OffloadPlan, spec: ModelSpec,
               env: EnvSnapshot | None = None) -> DiskTierPlan | None:
    """The disk tier ``--host-gib`` asks for (None without it): a checkpoint's parameters
    read from its files where they lie as the model holds them; a preset's all spilled."""
    disk = _disk_request(args)
    if disk is None:
        return None
    found = _extents(args)
    return plan_disk_tier(
        plan, host_budget_bytes=disk[0], disk_gbps=disk[1], read_ahead=disk[2],
        layer_names=tuple(layer.name for layer in spec.layers) if found is not None else (),
        tensors=found.tensors if found is not None else None, extents=found.extents if found is not None else None,
        files=found.files if found is not None else (), env=env)


def cmd_plan(args: argparse.Namespace) -> int:
    _take_source(args)
    profile = _profile(args)
    if args.fit_gib is not None:
        return cmd_fit(args, profile)
    config, is_default = _config(args)
    source = plan_source(args.source, counted="not in the plan's totals, which cover the layers",
                         quantization=args.quantization, dtype=args.dtype)
    spec = source.spec
    env = _planning_env(args)
    matched = ""
    if profile is None and env.platform.has_cuda:
        profile = profile_for_device(env.platform.device_name)
        matched = " (matched this device)" if profile is not None else ""
    if profile is not None:
        env = planning_env(env, profile)
    routing = _routing(args, profile)
    plan = make_plan(spec, config, env)
    tier = _disk_tier(args, plan, spec, env)
    if args.json:
        if tier is None:
            print(plan.to_json(indent=2))
        else:
            print(json.dumps({"plan": json.loads(plan.to_json()), "disk": json.loads(tier.to_json())}, indent=2))
        return 0
    platform = env.platform
    device = (
        f"{platform.device_name}, {format_bytes(platform.device_total_bytes)}"
        if platform.has_cuda
        else "no accelerator (the compute device is the CPU)"
    )
    _print_model(source)
    print(f"device:   {device}")
    if profile is not None:
        print(f"profile:  {profile.name} ({profile.device_name}){matched}")
    if is_default:
        print(
            "config:   default (prefetch, group size 4, 1 offloaded layer per group, depth 2); "
            "choose with --group-size/--num-in-group/--prefetch-step, --uva-gib or --backend"
        )
    workload = Workload(tokens_per_step=args.tokens)
    step = None
    if profile is not None:
        step = estimate(plan, profile, workload, routing=routing) if tier is None else \
            estimate_with_tier(plan, tier, profile, workload, routing=routing)
    # With a disk tier the plan runs with it: its host memory is the tier's, its warnings
    # those of a plan that reads from disk.
    print(render_plan(plan if tier is None else _with_tier(plan, tier, step), per_param=args.params))
    if tier is not None:
        print(render_disk_tier(tier, device_bytes=plan.device_bytes_resident + plan.device_bytes_buffers))
    if step is not None:
        print()  # the estimate's own heading names the profile and the tokens per step
        print(render_estimate(step))
    return 0
