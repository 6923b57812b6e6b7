"""The argument parser of every subcommand, and the flag types: each refuses a value that
means nothing in one line naming it (`UserError`, exit status 2)."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from offload.cli._shared import UserError, shown
from offload.cli.quantisation import QUANTIZATIONS
from offload.errors import ConfigError
from offload.pure.config import OffloadConfig
from offload.pure.disk.tier import ASSUMED_DISK_GBPS
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import (
    PROFILES,
)
from offload.pure.spec.presets import PRESETS
from offload.pure.units import gib_to_bytes

#: The plan `offload plan` makes when no offload flag is given:
#: prefetch, group size 4, one offloaded layer per group, depth 2.
DEFAULT_PREFETCH = OffloadConfig(backend="prefetch", group_size=4, num_in_group=1, prefetch_step=2)
DEFAULT_SOURCE = "llama-70b"


#: The config `offload load` uses on a machine without CUDA when no offload flag is
#: given: prefetch, every 2nd layer offloaded, depth 2 (with CUDA it fits the device).
LOAD_PREFETCH = OffloadConfig(backend="prefetch", group_size=2, num_in_group=1, prefetch_step=2)
LOAD_DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; we print one line that names the problem.
        raise UserError(f"{self.prog}: {message} (see --help)")


#: The disk read rate ``offload plan --host-gib`` assumes without ``--disk-gbps``, GB/s.
DEFAULT_DISK_GBPS = ASSUMED_DISK_GBPS


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        if text.strip().lstrip("+-").isdigit():  # past sys.get_int_max_str_digits()
            raise argparse.ArgumentTypeError(f"{shown(text)} has too many digits") from None
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is negative")
    return value


def tokens(text: str) -> int:
    value = positive_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not at least 1")
    try:
        Workload(tokens_per_step=value)  # the estimate's own bound
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {exc.message}") from None
    return value


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a finite number")
    return value


def gib(text: str, *, allow_zero: bool = True) -> float:
    """A size in GiB: 0, or from 1 byte to 2**60 bytes once rounded to whole bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number of GiB") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a non-negative, finite number of GiB")
    try:
        gib_to_bytes(value, name="the value", allow_zero=allow_zero)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return value


def positive_gib(text: str) -> float:
    """A size in GiB from 1 byte to 2**60 bytes; 0 is let through for the command to
    refuse naming its flag (``--device-gib must be greater than 0``)."""
    try:
        zero = float(text) == 0
    except ValueError:
        zero = False  # gib says what is wrong with it
    return 0.0 if zero else gib(text, allow_zero=False)


def gib_bytes(gib: float) -> int:
    """A `gib` flag's value in bytes (already checked, so this cannot fail)."""
    return gib_to_bytes(gib)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = Parser(prog="offload", description="Plan and inspect PyTorch weight offloading.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    env = sub.add_parser("env", help="what this machine can do, and the pin/UVA decisions with reasons")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.add_argument("--disk", metavar="DIR", help="also time the disk tier's reader on a scratch file in DIR (the "
                     "rate for offload plan --host-gib --disk-gbps; the file is removed after)")
    env.add_argument("--disk-mib", type=positive_int, help="with --disk: the scratch file's MiB (default 1024)")

    plan = sub.add_parser("plan", help="exactly what would be offloaded, where, and what it costs")
    plan.add_argument(
        "source",
        nargs="?",
        default=None,
        help=f"a preset ({', '.join(sorted(PRESETS))}), a directory of .safetensors files or their index, "
        f"or a directory holding only config.json (planned before downloading; default {DEFAULT_SOURCE})",
    )
    plan.add_argument("--backend", choices=["auto", "prefetch", "uva", "none"], help="default: auto")
    plan.add_argument("--group-size", type=positive_int, help="prefetch: layers per group")
    plan.add_argument("--num-in-group", type=positive_int, help="prefetch: offloaded layers per group")
    plan.add_argument("--prefetch-step", type=positive_int, help="prefetch: depth (layers ahead)")
    plan.add_argument("--uva-gib", type=gib, help="uva: GiB of parameters to offload")
    plan.add_argument("--filter", nargs="+", action="extend", default=[], metavar="SEG",
                      help="only offload parameters whose names contain one of these dotted segments "
                      "(repeatable; a last word after a segment that is a preset or an existing path is SOURCE)")
    plan.add_argument("--device-gib", type=positive_gib,
                      help="plan for a CUDA device of this many GiB instead of this machine")
    plan.add_argument("--params", action="store_true", help="one row per parameter")
    plan.add_argument("--json", action="store_true",
                      help="print the plan as JSON (OffloadPlan.from_json reads it); with --fit-gib, the fit result")
    plan.add_argument("--fit-gib", type=positive_gib,
                      help="choose the fastest configuration whose device bytes fit this budget (needs a profile)")
    plan.add_argument("--reserve-gib", type=gib, default=0.0,
                      help="with --fit-gib: device GiB kept for activations and caches (default 0)")
    plan.add_argument("--tokens", type=tokens, default=1, help="tokens per step for the estimate (default 1)")
    plan.add_argument("--routing-trace", metavar="FILE",
                      help="a routing trace (trace_to_json of record_routing's trace): the estimate counts the "
                      "expert caches' misses and hits over it instead of every expert every step")
    plan.add_argument("--expert-slots", type=positive_int,
                      help="C, device slots of each expert cache (default E / 8, at least 1)")
    plan.add_argument("--profile", choices=sorted(PROFILES), help="the target device's speeds, for the estimate")
    plan.add_argument("--link-gbps", type=number, help="measured pinned host-to-device GB/s (overrides the profile's)")
    plan.add_argument("--tflops", type=number, help="achieved dense bf16 TFLOP/s (overrides the profile's)")
    plan.add_argument("--host-gib", type=positive_gib,
                      help="prefetch: host GiB the offloaded weights may take; the last offloaded layers that do "
                      "not fit go to disk (shown as a third tier)")
    plan.add_argument("--disk-gbps", type=number, help=f"with --host-gib: the disk's read GB/s for the estimate "
                      f"(default {DEFAULT_DISK_GBPS:g}, assumed)")
    plan.add_argument("--read-ahead", type=positive_int,
                      help="with --host-gib: host staging buffers disk reads fill ahead (default 2)")
    plan.add_argument("--quantization", choices=QUANTIZATIONS,
                      help="plan the weights as a load-time quantisation leaves them: int8 is torchao's int8 "
                      "weight-only of every nn.Linear weight but the output head; none plans them as saved "
                      "(default: a config alone's quantization_config)")
    plan.add_argument("--dtype", choices=LOAD_DTYPES,
                      help="with a directory holding only config.json: the weights' dtype "
                      "(default: the config's dtype or torch_dtype)")

    demo = sub.add_parser("demo", help="run a small model resident and offloaded and compare bit for bit")
    demo.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: auto (CUDA if available)")
    demo.add_argument("--layers", type=positive_int, default=8, help="blocks (default 8)")
    demo.add_argument("--hidden", type=positive_int, default=256, help="width, a multiple of 64 (default 256)")
    demo.add_argument("--tokens", type=positive_int, default=64, help="tokens per step (default 64)")
    demo.add_argument("--backend", choices=["prefetch", "uva"], default="prefetch",
                      help="prefetch (every 2nd layer, the default) or uva (half the model's bytes)")

    load = sub.add_parser("load", help="load a local Hugging Face checkpoint offloaded, run one forward, restore")
    load.add_argument("directory", help="a checkpoint directory (config.json and .safetensors files)")
    load.add_argument("--backend", choices=["auto", "prefetch", "uva", "none"], help="default: auto")
    load.add_argument("--group-size", type=positive_int, help="prefetch: layers per group")
    load.add_argument("--num-in-group", type=positive_int, help="prefetch: offloaded layers per group")
    load.add_argument("--prefetch-step", type=positive_int, help="prefetch: depth (layers ahead)")
    load.add_argument("--uva-gib", type=gib, help="uva: GiB of parameters to offload")
    load.add_argument("--filter", action="append", default=[], metavar="SEG",
                      help="only offload parameters whose names contain this dotted segment (repeatable)")
    load.add_argument("--fit-gib", type=positive_gib,
                      help="choose the fastest configuration whose device bytes fit this budget "
                      "(default with CUDA: the device's memory)")
    load.add_argument("--reserve-gib", type=gib,
                      help="when fitting: device GiB kept for activations and caches (default 0)")
    load.add_argument("--profile", choices=sorted(PROFILES),
                      help="when fitting: the device's speeds (default: matched from its name)")
    load.add_argument("--expert-slots", type=positive_int,
                      help="C, device slots of each expert cache of a mixture-of-experts model (default E / 8)")
    load.add_argument("--dtype", choices=LOAD_DTYPES, help="the weights' dtype (default: the checkpoint's)")
    load.add_argument("--class", dest="model_class", metavar="NAME",
                      help="the model class to build, a transformers or diffusers class name "
                      "(default: the one config.json names)")
    load.add_argument("--tokens", type=tokens, default=8, help="random token ids for the forward pass (default 8)")
    load.add_argument("--host-gib", type=positive_gib,
                      help="host GiB the offloaded weights may take: the last offloaded layers that do not fit "
                      "are read from the checkpoint on disk, streamed (prefetch; the weights are read by name)")
    load.add_argument("--spill-dir", metavar="DIR",
                      help="with --host-gib: where weights that cannot be read from the checkpoint as they lie go")
    return parser
