"""The `offload` command line: ``offload env``, ``offload plan``, ``offload demo`` and
``offload load``.

User errors (a junk environment variable, a bad flag value, a missing or corrupt
checkpoint, a number out of range) exit with status 2 and one line on stderr naming the
flag and the value, escaped to stay one line whatever the names contain; so do torch
failures in the demo and in `load`'s forward. Ctrl-C exits with status 130 and one line.
Nothing the user can cause prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

import attrs

from offload.errors import ConfigError, ExecutionError, OffloadError
from offload.pure.config import OffloadConfig
from offload.pure.decide.admission import host_room
from offload.pure.decide.pinning import decide_pinning
from offload.pure.decide.uva import decide_uva
from offload.pure.env.snapshot import ENV_VARIABLES, EnvSnapshot, Platform
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import (
    PROFILES,
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
from offload.pure.serialize import to_data
from offload.pure.spec.presets import PRESETS, preset_outside_bytes, preset_spec
from offload.pure.spec.safetensors import printable
from offload.pure.spec.values import ModelSpec
from offload.pure.stats import OffloadStats, render_stats
from offload.pure.units import format_bytes, gib_to_bytes

__all__ = ["DEFAULT_PREFETCH", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "LOAD_PREFETCH", "build_parser", "main", "one_line"]

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
#: The status of a command stopped by Ctrl-C (SIGINT), as shells report it: 128 + 2.
EXIT_INTERRUPTED = 130

#: The plan `offload plan` makes when no offload flag is given:
#: prefetch, group size 4, one offloaded layer per group, depth 2.
DEFAULT_PREFETCH = OffloadConfig(backend="prefetch", group_size=4, num_in_group=1, prefetch_step=2)
DEFAULT_SOURCE = "llama-70b"

#: The config `offload load` uses on a machine without CUDA when no offload flag is
#: given: prefetch, every 2nd layer offloaded, depth 2 (with CUDA it fits the device).
LOAD_PREFETCH = OffloadConfig(backend="prefetch", group_size=2, num_in_group=1, prefetch_step=2)
LOAD_DTYPES = ("float32", "bfloat16", "float16")


class _UserError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; we print one line that names the problem.
        raise _UserError(f"{self.prog}: {message} (see --help)")


def _shown(text: str) -> str:
    """`text` quoted for a one-line message, cut when long."""
    return repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        if text.strip().lstrip("+-").isdigit():  # past sys.get_int_max_str_digits()
            raise argparse.ArgumentTypeError(f"{_shown(text)} has too many digits") from None
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is negative")
    return value


def _tokens(text: str) -> int:
    value = _positive_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not at least 1")
    try:
        Workload(tokens_per_step=value)  # the estimate's own bound
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: {exc.message}") from None
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a finite number")
    return value


def _gib(text: str, *, allow_zero: bool = True) -> float:
    """A size in GiB: 0, or from 1 byte to 2**60 bytes once rounded to whole bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a number of GiB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a non-negative, finite number of GiB")
    try:
        gib_to_bytes(value, name="the value", allow_zero=allow_zero)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return value


def _positive_gib(text: str) -> float:
    """A size in GiB from 1 byte to 2**60 bytes; 0 is let through for the command to
    refuse naming its flag (``--device-gib must be greater than 0``)."""
    try:
        zero = float(text) == 0
    except ValueError:
        zero = False  # _gib says what is wrong with it
    return 0.0 if zero else _gib(text, allow_zero=False)


def _bytes(gib: float) -> int:
    """A `_gib` flag's value in bytes (already checked, so this cannot fail)."""
    return gib_to_bytes(gib)


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
    plan.add_argument("--device-gib", type=_positive_gib,
                      help="plan for a CUDA device of this many GiB instead of this machine")
    plan.add_argument("--params", action="store_true", help="one row per parameter")
    plan.add_argument("--json", action="store_true",
                      help="print the plan as JSON (OffloadPlan.from_json reads it); with --fit-gib, the fit result")
    plan.add_argument("--fit-gib", type=_positive_gib,
                      help="choose the fastest configuration whose device bytes fit this budget (needs a profile)")
    plan.add_argument("--reserve-gib", type=_gib, default=0.0,
                      help="with --fit-gib: device GiB kept for activations and caches (default 0)")
    plan.add_argument("--tokens", type=_tokens, default=1, help="tokens per step for the estimate (default 1)")
    plan.add_argument("--profile", choices=sorted(PROFILES), help="the target device's speeds, for the estimate")
    plan.add_argument("--link-gbps", type=_number, help="measured pinned host-to-device GB/s (overrides the profile's)")
    plan.add_argument("--tflops", type=_number, help="achieved dense bf16 TFLOP/s (overrides the profile's)")

    demo = sub.add_parser("demo", help="run a small model resident and offloaded and compare bit for bit")
    demo.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: auto (CUDA if available)")
    demo.add_argument("--layers", type=_positive_int, default=8, help="blocks (default 8)")
    demo.add_argument("--hidden", type=_positive_int, default=256, help="width, a multiple of 64 (default 256)")
    demo.add_argument("--tokens", type=_positive_int, default=64, help="tokens per step (default 64)")
    demo.add_argument("--backend", choices=["prefetch", "uva"], default="prefetch",
                      help="prefetch (every 2nd layer, the default) or uva (half the model's bytes)")

    load = sub.add_parser("load", help="load a local Hugging Face checkpoint offloaded, run one forward, restore")
    load.add_argument("directory", help="a checkpoint directory (config.json and .safetensors files)")
    load.add_argument("--backend", choices=["auto", "prefetch", "uva", "none"], help="default: auto")
    load.add_argument("--group-size", type=_positive_int, help="prefetch: layers per group")
    load.add_argument("--num-in-group", type=_positive_int, help="prefetch: offloaded layers per group")
    load.add_argument("--prefetch-step", type=_positive_int, help="prefetch: depth (layers ahead)")
    load.add_argument("--uva-gib", type=_gib, help="uva: GiB of parameters to offload")
    load.add_argument("--filter", action="append", default=[], metavar="SEG",
                      help="only offload parameters whose names contain this dotted segment (repeatable)")
    load.add_argument("--fit-gib", type=_positive_gib,
                      help="choose the fastest configuration whose device bytes fit this budget "
                      "(default with CUDA: the device's memory)")
    load.add_argument("--reserve-gib", type=_gib,
                      help="when fitting: device GiB kept for activations and caches (default 0)")
    load.add_argument("--profile", choices=sorted(PROFILES),
                      help="when fitting: the device's speeds (default: matched from its name)")
    load.add_argument("--dtype", choices=LOAD_DTYPES, help="the weights' dtype (default: the checkpoint's)")
    load.add_argument("--tokens", type=_tokens, default=8, help="random token ids for the forward pass (default 8)")
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

    return capture_env()


def _config(args: argparse.Namespace) -> tuple[OffloadConfig, bool]:
    """The config the flags ask for, and whether it is the default."""
    chosen = {
        "backend": args.backend,
        "group_size": args.group_size,
        "num_in_group": args.num_in_group,
        "prefetch_step": args.prefetch_step,
        "uva_max_bytes": None if args.uva_gib is None else _bytes(args.uva_gib),
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
        device_total_bytes=_bytes(args.device_gib),
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
        try:
            profile = profile_from_numbers(link_gbps=args.link_gbps, tflops=args.tflops, base=profile)
        except ConfigError as exc:
            flag = {"link_gbps": "--link-gbps", "tflops": "--tflops"}.get(exc.name or "")
            if flag is None:
                raise
            raise _UserError(f"offload plan: {flag}: {exc.message}") from None
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
    if args.fit_gib == 0:
        raise _UserError("offload plan: --fit-gib must be greater than 0")
    budget = _bytes(args.fit_gib)
    env = _planning_env(args)
    if not env.platform.has_cuda:
        # Planning for the profile's device from a machine without one: the budget is the
        # device memory the model may use there.
        env = planning_env(env, attrs.evolve(profile, device_memory_bytes=budget))
    result = fit(
        spec, env, profile, Workload(tokens_per_step=args.tokens), budget,
        outside_bytes=source.outside_bytes, reserve_bytes=_bytes(args.reserve_gib),
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


def _cgroup_rows(platform: Platform) -> list[list[str]]:
    """`offload env`'s lines for the cgroup's memory limit and the host memory left."""
    cgroup = platform.cgroup_memory

    def shown(value: int | None, none: str) -> str:
        return none if value is None else f"{value} ({format_bytes(value)})"

    limit_none = "unlimited" if cgroup.state == "unlimited" else "unknown"
    version = f"v{cgroup.version}" if cgroup.version else "unknown"
    rows = [
        ["  cgroup_memory.state", f"{cgroup.state} (cgroup {version})"],
        ["  cgroup_memory.limit_bytes", shown(cgroup.limit_bytes, limit_none)],
        ["  cgroup_memory.current_bytes", shown(cgroup.current_bytes, "unknown")],
        ["  cgroup_memory.reclaimable_bytes", shown(cgroup.reclaimable_bytes, "unknown")],
        ["  cgroup_memory.headroom_bytes", shown(cgroup.headroom_bytes, limit_none)],
        ["  cgroup_memory.limit_path", cgroup.limit_path or "(none)"],
        ["  cgroup_memory.cgroup_path", cgroup.cgroup_path or "(unknown)"],
    ]
    room, source = host_room(platform)
    rows.append(["  host memory for new allocations", f"{shown(room, 'unknown')}: {source}"])
    return rows


def _host_memory_data(platform: Platform) -> dict[str, Any]:
    """`offload env --json`'s summary of the host memory a plan may take."""
    room, source = host_room(platform)
    return {
        "cgroup_state": platform.cgroup_memory.state,
        "cgroup_headroom_bytes": platform.cgroup_memory.headroom_bytes,
        "available_bytes": room,
        "available_source": source,
    }


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
            "host_memory": _host_memory_data(snapshot.platform),
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
        if field.name == "cgroup_memory":
            rows.extend(_cgroup_rows(snapshot.platform))
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
    from offload.pure.check import render_check

    env = _capture()
    try:
        result = run_demo(
            env=env, device=args.device, layers=args.layers, hidden=args.hidden, tokens=args.tokens,
            backend=args.backend, progress=lambda line: print(f"... {line}", flush=True),
        )
    except ConfigError as exc:
        if exc.name not in ("layers", "hidden", "tokens"):
            raise
        raise _UserError(f"offload demo: --{exc.name}: {exc.message}") from None
    print()
    print(render_plan(result.plan))
    print()
    for label, text in summarize(result).items():
        print(f"{label + ':':<15}{text}")
    print()
    print("offloader stats (offloaded steps):")
    print(render_stats(result.stats))
    print()
    print(render_check(result.check))
    if result.mechanics_only:
        print("no GPU here: the offloading mechanics ran for real on the CPU and were verified; "
              "nothing is faster or smaller on a CPU")
    return 0 if result.outputs_equal and result.restored_equal else 1


def _load_request(args: argparse.Namespace, has_cuda: bool) -> tuple[OffloadConfig | None, int | None, str]:
    """What `offload load` asks `offload_pretrained` for: a config, or a device budget to
    fit (None with CUDA: the device's memory), and one line saying which."""
    chosen = [flag for flag, value in (("--backend", args.backend), ("--group-size", args.group_size),
                                       ("--num-in-group", args.num_in_group), ("--prefetch-step", args.prefetch_step),
                                       ("--uva-gib", args.uva_gib)) if value is not None]
    fitting_flags = [flag for flag, value in (("--reserve-gib", args.reserve_gib), ("--profile", args.profile))
                     if value is not None]
    if args.fit_gib is not None:
        if args.filter:
            raise _UserError("offload load: --filter applies to a given configuration, not to --fit-gib")
        if chosen:
            raise _UserError(f"offload load: --fit-gib chooses the configuration itself; drop {', '.join(chosen)}")
        if args.fit_gib == 0:
            raise _UserError("offload load: --fit-gib must be greater than 0")
        return None, _bytes(args.fit_gib), f"fit to {format_bytes(_bytes(args.fit_gib))} of device memory"
    if chosen or not has_cuda:
        if fitting_flags:
            verb = "applies" if len(fitting_flags) == 1 else "apply"
            raise _UserError(f"offload load: {' and '.join(fitting_flags)} {verb} only when fitting; give --fit-gib"
                             + (f" instead of {', '.join(chosen)}" if chosen else ""))
        config = (OffloadConfig(backend=args.backend or "auto", group_size=args.group_size or 0,
                                num_in_group=args.num_in_group or 1, prefetch_step=args.prefetch_step or 1,
                                uva_max_bytes=0 if args.uva_gib is None else _bytes(args.uva_gib),
                                param_filter=tuple(args.filter))
                  if chosen else attrs.evolve(LOAD_PREFETCH, param_filter=tuple(args.filter)))
        return config, None, "as given" if chosen else (
            "default without CUDA (prefetch, group size 2, 1 offloaded layer per group, depth 2)")
    if args.filter:
        raise _UserError("offload load: --filter applies to a given configuration (--group-size ... or --uva-gib); "
                         "with CUDA and no configuration flag, the default fits the device")
    return None, None, "fit to the device's memory (default with CUDA)"


def _cmd_load(args: argparse.Namespace) -> int:
    import time

    env = _capture()
    config, budget, how = _load_request(args, env.platform.has_cuda)
    try:
        import torch
        import transformers.modeling_utils  # noqa: F401  (imported before the clock starts: 2 s, not loading)

        from offload.hf import offload_pretrained
    except ImportError as exc:  # transformers is the optional `hf` extra
        raise _UserError(f"offload load needs transformers: pip install 'offload[hf]' ({exc})") from None
    start = time.monotonic()
    with _ProgressScope(sys.stderr):
        try:
            model, offloader = offload_pretrained(
                args.directory, config, device_budget_bytes=budget, env=env,
                dtype=None if args.dtype is None else getattr(torch, args.dtype),
                reserve_bytes=_bytes(args.reserve_gib or 0.0),
                profile=profile_by_name(args.profile) if args.profile else None)
        except OffloadError:
            raise
        except (OSError, ValueError, RuntimeError) as exc:  # transformers refusing the directory's contents
            if args.verbose >= 2:
                raise
            lines = str(exc).strip().splitlines()
            raise _UserError(f"offload load: {printable(args.directory)}: loading failed: {type(exc).__name__}: "
                             f"{lines[0] if lines else ''} (-vv for the traceback)") from None
    seconds = time.monotonic() - start
    plan = offloader.plan
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model:    {type(model).__name__} from {printable(args.directory)}: {format_bytes(nbytes)}, loaded and offloaded "
          f"in {seconds:.2f} s ({nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    print(f"config:   {how}")
    print(f"plan:     {_plan_summary(plan, _outside_bytes(model))}")
    if not env.platform.has_cuda:
        print("device:   no accelerator (the compute device is the CPU): the mechanics run for real, nothing is saved")
    start = time.monotonic()
    try:
        ids = torch.randint(0, int(getattr(model.config, "vocab_size", 2)), (1, args.tokens),
                            device=torch.device(plan.compute_device))
        with torch.inference_mode():
            output = model(input_ids=ids)[0]
    except (OffloadError, RuntimeError, MemoryError) as exc:  # out of memory, a kernel refusing the input
        offloader.restore()  # give the weights back before saying why
        if isinstance(exc, OffloadError):
            raise
        lines = str(exc).strip().splitlines()
        raise ExecutionError(f"the forward of {args.tokens} tokens failed: {type(exc).__name__}: "
                             f"{lines[0] if lines else ''}", name="tokens", value=args.tokens) from exc
    print(f"forward:  {args.tokens} tokens in {time.monotonic() - start:.2f} s, output {tuple(output.shape)}, "
          f"{'finite' if bool(torch.isfinite(output).all()) else 'NOT FINITE'}")
    print(f"stats:    {_stats_summary(offloader.stats())}")
    return _restore_and_check(model, offloader)


class _ProgressScope:
    """While entered, the ``offload.load`` logger's INFO records go to a `ProgressLine`
    on `stream` (and nowhere else); on exit the line is finished and the logger restored."""

    def __init__(self, stream: TextIO) -> None:
        from offload.progress_line import ProgressLine

        self._handler = ProgressLine(stream)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._log = logging.getLogger("offload.load")
        self._saved = (self._log.level, self._log.propagate)

    def __enter__(self) -> None:
        self._log.addHandler(self._handler)
        self._log.setLevel(logging.INFO)
        self._log.propagate = False  # shown once, by the progress line

    def __exit__(self, *exc: object) -> None:
        self._handler.end()
        self._log.removeHandler(self._handler)
        self._log.setLevel(self._saved[0])
        self._log.propagate = self._saved[1]


def _outside_bytes(model: Any) -> int:
    """Bytes of the tensors outside the layer stack (resident on the device), each storage once."""
    from offload.describe import storage_key
    from offload.hf.layers import find_layers
    from offload.hf.model import outside_tensors

    seen: dict[object, int] = {}
    for _, tensor in outside_tensors(model, list(find_layers(model, None))):
        seen.setdefault(storage_key(tensor) or id(tensor), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def _plan_summary(plan: OffloadPlan, outside_bytes: int) -> str:
    """One line: backend, layers offloaded, device and host bytes."""
    layers = len({p.layer for p in plan.params if p.offloaded})
    return (f"{plan.backend.value}, {layers} of {plan.num_layers} layers offloaded; device "
            f"{format_bytes(plan.device_bytes_resident)} resident + {format_bytes(plan.device_bytes_buffers)} "
            f"buffers + {format_bytes(outside_bytes)} outside the layers; host {format_bytes(plan.host_bytes)}")


def _stats_summary(stats: OffloadStats) -> str:
    waited = "n/a" if stats.wait_seconds is None else f"{stats.wait_seconds:.3f} s"
    return (f"{stats.params_offloaded} parameters offloaded, host {format_bytes(stats.host_bytes)}, device buffers "
            f"{format_bytes(stats.device_buffer_bytes)}, {stats.copies_issued} copies of "
            f"{format_bytes(stats.bytes_copied)}, waited {waited}, {stats.pin_fallbacks} pin fallbacks")


def _restore_and_check(model: Any, offloader: Any) -> int:
    """Restore, and compare the weights of the first and last offloaded layers with their
    true values from the offloaded model's ``state_dict()`` (its host copies), bit for
    bit; every parameter must be off the meta device. Returns the exit status."""
    import torch

    from offload.hf.layers import find_layers

    layers = list(find_layers(model, None))
    hit = sorted({p.layer for p in offloader.plan.params if p.offloaded})
    chosen = list(dict.fromkeys(hit[:1] + hit[-1:]))

    def sample() -> dict[str, torch.Tensor]:
        return {f"layer {i} {name}": tensor.detach() for i in chosen for name, tensor in layers[i].state_dict().items()}

    before = {key: tensor.clone() for key, tensor in sample().items()}
    offloader.restore()
    after = sample()
    wrong = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    wrong += [key for key, want in before.items() if key not in after or not torch.equal(after[key].cpu(), want.cpu())]
    if wrong:
        print(f"restore:  FAILED: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''} not given back")
        return 1
    shown = " and ".join(f"{i}" for i in chosen) or "none"
    print(f"restore:  done; {len(before)} tensors of layers {shown} equal bit for bit to the offloaded model's "
          "state_dict (its host copies)")
    return 0


def one_line(text: str) -> str:
    """`text` with every character that is not printable (a newline, a carriage return,
    another control character) written as its escape, so that it is one line whatever the
    names in it contain."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _say(text: str) -> None:
    """Write `text` to stderr as one line."""
    print(one_line(text), file=sys.stderr)


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
        if args.command == "load":
            return _cmd_load(args)
        return _cmd_plan(args)
    except _UserError as exc:
        _say(str(exc))
        return EXIT_USER_ERROR
    except OffloadError as exc:
        _say(f"offload: error: {exc.message}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        # Ctrl-C: the `finally` blocks on the way out have run; a traceback adds nothing.
        _say("offload: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `offload plan | head`: the reader left; that is not an error of ours.
        sys.stderr.close()
        return 0
