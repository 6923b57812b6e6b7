"""The `offload` command line: ``offload env``, ``offload plan`` and ``offload demo``.

User errors (a junk environment variable, a bad flag value, a missing or corrupt
checkpoint) exit with status 2 and one line on stderr naming what was wrong; nothing the
user can cause prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import attrs

from offload.errors import OffloadError
from offload.pure.config import OffloadConfig
from offload.pure.decisions import decide_pinning, decide_uva
from offload.pure.env import ENV_VARIABLES, EnvSnapshot, Platform
from offload.pure.estimate import Workload, estimate
from offload.pure.fit import fit
from offload.pure.fit_render import render_estimate, render_fit
from offload.pure.planner import make_plan
from offload.pure.presets import PRESETS, preset_outside_bytes, preset_spec
from offload.pure.profiles import (
    PROFILES,
    DeviceProfile,
    planning_env,
    profile_by_name,
    profile_for_device,
    profile_from_numbers,
)
from offload.pure.render import render_plan
from offload.pure.serialize import to_data
from offload.pure.spec import ModelSpec
from offload.pure.units import GIB, format_bytes

__all__ = ["DEFAULT_PREFETCH", "build_parser", "main"]

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2

#: The plan `offload plan` makes when no offload flag is given:
#: prefetch, group size 4, one offloaded layer per group, depth 2.
DEFAULT_PREFETCH = OffloadConfig(backend="prefetch", group_size=4, num_in_group=1, prefetch_step=2)
DEFAULT_SOURCE = "llama-70b"


class _UserError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; we print one line that names the problem.
        raise _UserError(f"{self.prog}: {message} (see --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _tokens(text: str) -> int:
    value = _positive_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not at least 1")
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative, finite number of GiB")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = _Parser(prog="offload", description="Plan and inspect PyTorch weight offloading.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    env = sub.add_parser("env", help="what this machine can do, and the pin/UVA decisions with reasons")
    env.add_argument("--json", action="store_true", help="machine-readable output")

    plan = sub.add_parser("plan", help="exactly what would be offloaded, where, and what it costs")
    plan.add_argument(
        "source",
        nargs="?",
        default=None,
        help=f"a preset ({', '.join(sorted(PRESETS))}), a directory of .safetensors files or their index "
        f"(default {DEFAULT_SOURCE})",
    )
    plan.add_argument("--backend", choices=["auto", "prefetch", "uva", "none"], help="default: auto")
    plan.add_argument("--group-size", type=_positive_int, help="prefetch: layers per group")
    plan.add_argument("--num-in-group", type=_positive_int, help="prefetch: offloaded layers per group")
    plan.add_argument("--prefetch-step", type=_positive_int, help="prefetch: depth (layers ahead)")
    plan.add_argument("--uva-gib", type=_gib, help="uva: GiB of parameters to offload")
    plan.add_argument("--filter", nargs="+", action="extend", default=[], metavar="SEG",
                      help="only offload parameters whose names contain one of these dotted segments "
                      "(repeatable; a last word after a segment that is a preset or an existing path is SOURCE)")
    plan.add_argument("--device-gib", type=_gib,
                      help="plan for a CUDA device of this many GiB instead of this machine")
    plan.add_argument("--params", action="store_true", help="one row per parameter")
    plan.add_argument("--json", action="store_true",
                      help="print the plan as JSON (OffloadPlan.from_json reads it); with --fit-gib, the fit result")
    plan.add_argument("--fit-gib", type=_gib,
                      help="choose the fastest configuration whose device bytes fit this budget (needs a profile)")
    plan.add_argument("--reserve-gib", type=_gib, default=0.0,
                      help="with --fit-gib: device GiB kept for activations and caches (default 0)")
    plan.add_argument("--tokens", type=_tokens, default=1, help="tokens per step for the estimate (default 1)")
    plan.add_argument("--profile", choices=sorted(PROFILES), help="the target device's speeds, for the estimate")
    plan.add_argument("--link-gbps", type=_gib, help="measured pinned host-to-device GB/s (overrides the profile's)")
    plan.add_argument("--tflops", type=_gib, help="achieved dense bf16 TFLOP/s (overrides the profile's)")

    demo = sub.add_parser("demo", help="run a small model resident and offloaded and compare bit for bit")
    demo.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: auto (CUDA if available)")
    demo.add_argument("--layers", type=_positive_int, default=8, help="blocks (default 8)")
    demo.add_argument("--hidden", type=_positive_int, default=256, help="width, a multiple of 64 (default 256)")
    demo.add_argument("--tokens", type=_positive_int, default=64, help="tokens per step (default 64)")
    demo.add_argument("--backend", choices=["prefetch", "uva"], default="prefetch",
                      help="prefetch (every 2nd layer, the default) or uva (half the model's bytes)")
    return parser


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


def _capture() -> EnvSnapshot:
    from offload.capture import capture_env  # imports torch: only when a command needs it

    return capture_env(os.environ)


def _config(args: argparse.Namespace) -> tuple[OffloadConfig, bool]:
    """The config the flags ask for, and whether it is the default."""
    chosen = {
        "backend": args.backend,
        "group_size": args.group_size,
        "num_in_group": args.num_in_group,
        "prefetch_step": args.prefetch_step,
        "uva_max_bytes": None if args.uva_gib is None else round(args.uva_gib * GIB),
    }
    given = {k: v for k, v in chosen.items() if v is not None}
    if not given:
        return attrs.evolve(DEFAULT_PREFETCH, param_filter=tuple(args.filter)), True
    return OffloadConfig(**given, param_filter=tuple(args.filter)), False


@attrs.frozen(kw_only=True)
class _Source:
    """What SOURCE gives: the layers, where they came from, and what lies outside them."""

    spec: ModelSpec
    origin: str  # one line: "preset llama-8b (...)" or "checkpoint DIR"
    outside_bytes: int  # weights outside the layers, resident on the device
    details: tuple[str, ...]  # lines to print under the model line: stacks, outside


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _source(name: str, *, counted: str) -> _Source:
    """The spec for SOURCE, a description of it, and its outside bytes; `counted` ends the
    line about those bytes (whether the output below counts them)."""
    if os.path.exists(name):
        from offload.checkpoint import read_checkpoint
        from offload.pure.safetensors import printable

        result = read_checkpoint(name)
        details = [
            f"stack:    {printable(stack.name)}: {_count(stack.num_layers, 'layer')} (plan layers "
            f"{stack.first_layer}-{stack.first_layer + stack.num_layers - 1}), {format_bytes(stack.nbytes)}"
            for stack in result.stacks
        ]
        if result.outside_layers:
            details.append(f"outside:  {_count(len(result.outside_layers), 'tensor')} outside the layers, "
                           f"{format_bytes(result.outside_bytes)}, resident on the device; {counted}")
        return _Source(spec=result.spec, origin=f"checkpoint {printable(name)}", outside_bytes=result.outside_bytes,
                       details=tuple(details))
    if name in PRESETS:
        outside = preset_outside_bytes(name)
        return _Source(spec=preset_spec(name), origin=f"preset {name} (decoder layers, bf16, shapes only)",
                       outside_bytes=outside,
                       details=(f"outside:  embeddings, output head and final norm, {format_bytes(outside)}, "
                                f"resident on the device; {counted}",))
    raise _UserError(
        f"offload plan: {name!r} is neither an existing path nor a preset ({', '.join(sorted(PRESETS))})"
    )


def _print_model(source: _Source) -> None:
    spec = source.spec
    print(f"model:    {source.origin}: {len(spec.layers)} layers, {spec.num_params} parameters, "
          f"{format_bytes(spec.nbytes)}")
    for line in source.details:
        print(line)


def _planning_env(args: argparse.Namespace) -> EnvSnapshot:
    snapshot = _capture()
    if args.device_gib is None:
        return snapshot
    if args.device_gib == 0:
        raise _UserError("offload plan: --device-gib must be greater than 0")
    platform = Platform(
        has_cuda=True,
        device_name="planned CUDA device",
        device_total_bytes=round(args.device_gib * GIB),
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
            raise _UserError("offload plan: without --profile, give both --link-gbps and --tflops")
        profile = profile_from_numbers(link_gbps=args.link_gbps, tflops=args.tflops, base=profile)
    return profile


def _cmd_fit(args: argparse.Namespace, profile: DeviceProfile | None) -> int:
    if profile is None:
        raise _UserError("offload plan: --fit-gib needs --profile NAME, or --link-gbps and --tflops")
    chosen = [flag for flag, value in (("--backend", args.backend), ("--group-size", args.group_size),
                                       ("--num-in-group", args.num_in_group), ("--prefetch-step", args.prefetch_step),
                                       ("--uva-gib", args.uva_gib)) if value is not None]
    if chosen:
        raise _UserError(f"offload plan: --fit-gib chooses the configuration itself; drop {', '.join(chosen)}")
    source = _source(args.source, counted="counted in the fit")
    spec = source.spec
    budget = round(args.fit_gib * GIB)
    env = _planning_env(args)
    if not env.platform.has_cuda:
        # Planning for the profile's device from a machine without one: the budget is the
        # device memory the model may use there.
        env = planning_env(env, attrs.evolve(profile, device_memory_bytes=budget))
    result = fit(
        spec, env, profile, Workload(tokens_per_step=args.tokens), budget,
        outside_bytes=source.outside_bytes, reserve_bytes=round(args.reserve_gib * GIB),
        param_filter=tuple(args.filter),
    )
    if args.json:
        print(result.to_json(indent=2))
        return 0
    _print_model(source)
    print(f"profile:  {profile.name} ({profile.device_name})")
    print(render_fit(result))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    _take_source(args)
    profile = _profile(args)
    if args.fit_gib is not None:
        return _cmd_fit(args, profile)
    config, is_default = _config(args)
    source = _source(args.source, counted="not in the plan's totals, which cover the layers")
    spec = source.spec
    env = _planning_env(args)
    matched = ""
    if profile is None and env.platform.has_cuda:
        profile = profile_for_device(env.platform.device_name)
        matched = " (matched this device)" if profile is not None else ""
    if profile is not None:
        env = planning_env(env, profile)
    plan = make_plan(spec, config, env)
    if args.json:
        print(plan.to_json(indent=2))
        return 0
    platform = env.platform
    device = (
        f"{platform.device_name}, {format_bytes(platform.device_total_bytes)}"
        if platform.has_cuda
        else "no accelerator (the compute device is the CPU)"
    )
    _print_model(source)
    print(f"device:   {device}")
    if is_default:
        print(
            "config:   default (prefetch, group size 4, 1 offloaded layer per group, depth 2); "
            "choose with --group-size/--num-in-group/--prefetch-step, --uva-gib or --backend"
        )
    print(render_plan(plan, per_param=args.params))
    if profile is not None:
        print()
        print(f"estimate on {profile.name}{matched} at {args.tokens} tokens per step:")
        print(render_estimate(estimate(plan, profile, Workload(tokens_per_step=args.tokens))))
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    snapshot = _capture()
    pin = decide_pinning(snapshot)
    uva = decide_uva(snapshot, pin)
    if args.json:
        document = {
            "snapshot": to_data(snapshot),
            "fingerprint": snapshot.fingerprint(),
            "pin": to_data(pin),
            "uva": to_data(uva),
            "coherent_unified_memory": snapshot.platform.is_coherent_unified_memory,
        }
        print(json.dumps(document, indent=2))
        return 0
    flags = snapshot.flags
    print("switches:")
    for flag, names in ENV_VARIABLES.items():
        print(f"  {flag} = {getattr(flags, flag)}  (from {' or '.join(names)})")
    print("platform:")
    rows = []
    for field in attrs.fields(Platform):
        if field.name == "probe_notes":
            continue
        value = getattr(snapshot.platform, field.name)
        if value is None:
            shown = "unlimited" if field.name == "memlock_limit_bytes" else "unknown"
        elif field.name.endswith("_bytes"):
            shown = f"{value} ({format_bytes(value)})"
        else:
            shown = str(value) or "(none)"
        rows.append([f"  {field.name}", shown])
    rows.append(["  coherent unified memory", str(snapshot.platform.is_coherent_unified_memory)])
    width = max(len(label) for label, _ in rows)
    for label, shown in rows:
        print(f"{label:<{width}}  {shown}")
    for note in snapshot.platform.probe_notes:
        print(f"  note: {note}")
    print("decisions:")
    print(f"  pinning: {f'on ({pin.method_text})' if pin.pin else 'off'} [{pin.reason.value}] {pin.explanation}")
    print(f"  uva:     {'on' if uva.enabled else 'off'} [{uva.reason.value}] {uva.explanation}")
    print(f"snapshot fingerprint: {snapshot.fingerprint()}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from offload.demo import run_demo, summarize

    env = _capture()
    result = run_demo(
        env=env, device=args.device, layers=args.layers, hidden=args.hidden, tokens=args.tokens,
        backend=args.backend, progress=lambda line: print(f"... {line}", flush=True),
    )
    print()
    print(render_plan(result.plan))
    print()
    for label, text in summarize(result).items():
        print(f"{label + ':':<15}{text}")
    if result.mechanics_only:
        print("no GPU here: the offloading mechanics ran for real on the CPU and were verified; "
              "nothing is faster or smaller on a CPU")
    return 0 if result.outputs_equal and result.restored_equal else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
            format="%(levelname)s %(name)s: %(message)s",
        )
        if args.command == "env":
            return _cmd_env(args)
        if args.command == "demo":
            return _cmd_demo(args)
        return _cmd_plan(args)
    except _UserError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USER_ERROR
    except OffloadError as exc:
        print(f"offload: error: {exc.message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:
        # `offload plan | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0
