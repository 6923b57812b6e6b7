"""`offload demo`: a small transformer-style model run resident and offloaded, compared
bit for bit, with the plan, the device memory freed and step times. The backend is
prefetch (every 2nd layer) or uva (half the model's bytes).

On a machine without a GPU it runs on `CpuRuntime`: the mechanics (hooks, slots, the
schedule, copies, restore) are exercised for real, but no memory is saved, and the
result says so.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
import torch
from torch import nn

from offload.cli._shared import UserError, capture
from offload.create import create_offloader
from offload.errors import ConfigError, ExecutionError, OffloadError
from offload.logs import logger
from offload.model.describe import describe_layers
from offload.pure.check import LiveCheck
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot, Platform
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.plan.render import render_plan
from offload.pure.stats import OffloadStats, render_stats
from offload.pure.units import format_bytes

__all__ = ["DEMO_LIMITS", "DemoBlock", "DemoResult", "build_demo_model", "demo_memory_bytes", "run_demo"]

log = logger("offload.demo")

DeviceChoice = Literal["auto", "cuda", "cpu"]
BackendChoice = Literal["prefetch", "uva"]

#: (smallest, largest) of each size `run_demo` takes. The largest are far beyond a demo
#: (one block of width 65536 holds 51.5 Gi parameters) and keep every size torch is
#: asked for representable; whether the sizes fit this machine is checked separately.
DEMO_LIMITS: Mapping[str, tuple[int, int]] = {
    "layers": (1, 4096),
    "hidden": (64, 65536),
    "tokens": (1, 1 << 20),
    "steps": (1, 10_000),
}


class DemoBlock(nn.Module):
    """A pre-norm transformer block: multi-head self-attention and a GELU MLP.

    Args:
        hidden: model width; a multiple of 64 (heads of 64).
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = max(1, hidden // 64)
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, tokens, hidden) -> the same shape."""
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.heads, hidden // self.heads).transpose(1, 2)

        attended = nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, hidden))
        result: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x))))
        return result


def demo_memory_bytes(layers: int, hidden: int, tokens: int, steps: int, itemsize: int) -> tuple[int, int]:
    """What the demo holds at its peak, in bytes: (weights, activations).

    Weights: ``layers x (12 hidden**2 + 13 hidden)`` parameters (`DemoBlock`). Activations:
    the inputs and both runs' outputs (``3 x steps x tokens x hidden``) plus the
    intermediates of one block (about ``16 x tokens x hidden``).
    """
    weights = layers * (12 * hidden * hidden + 13 * hidden) * itemsize
    activations = (3 * steps + 16) * tokens * hidden * itemsize
    return weights, activations


def _check_sizes(env: EnvSnapshot, target: torch.device, itemsize: int, sizes: Mapping[str, int]) -> None:
    """Refuse, before building anything, sizes out of `DEMO_LIMITS` or larger than the
    memory this machine reports (the device's on CUDA, the host's available memory on
    the CPU, where it is known)."""
    for name, value in sizes.items():
        low, high = DEMO_LIMITS[name]
        if not low <= value <= high:
            shown = value if value.bit_length() < 200 else f"an integer of {value.bit_length()} bits"
            raise ConfigError(f"{name} must be from {low} to {high}, got {shown}", name=name, value=value)
    if sizes["hidden"] % 64:
        raise ConfigError(f"hidden must be a multiple of 64, got {sizes['hidden']}", name="hidden", value=sizes["hidden"])
    weights, activations = demo_memory_bytes(sizes["layers"], sizes["hidden"], sizes["tokens"], sizes["steps"],
                                             itemsize)
    # On the CPU the model, its reference copy and the host copies are all host memory;
    # on CUDA the model and its reference copy are on the device.
    if target.type == "cuda":
        need, have, where = 2 * weights + activations, env.platform.device_total_bytes or None, "device memory"
    else:
        need, have, where = 3 * weights + activations, env.platform.host_available_bytes, "available host memory"
    if have is not None and need > have:
        name = "hidden" if weights >= activations else "tokens"
        raise ConfigError(
            f"layers {sizes['layers']}, hidden {sizes['hidden']} and tokens {sizes['tokens']} need about "
            f"{format_bytes(need)} of {where} for the demo, more than the {format_bytes(have)} there is; "
            "use fewer layers, a smaller hidden or fewer tokens", name=name, value=sizes[name])


def build_demo_model(layers: int, hidden: int, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    """`layers` `DemoBlock`s with deterministic weights on `device`."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = nn.Sequential(*[DemoBlock(hidden) for _ in range(layers)])
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(device=device, dtype=dtype).eval()


@attrs.frozen(kw_only=True)
class DemoResult:
    """What the demo measured.

    Attributes:
        plan: the plan the offloaded run followed.
        device: the compute device used.
        mechanics_only: True without a GPU: the mechanics were verified, no memory saved.
        outputs_equal: every offloaded output equalled the resident one bit for bit.
        restored_equal: after restore, every parameter equalled the original bit for bit.
        steps: forward steps timed per mode.
        resident_step_s: mean resident step time, in seconds.
        offloaded_step_s: mean offloaded step time, in seconds.
        device_bytes_freed_measured: device memory released by offloading net of the
            static buffers, in bytes, as the allocator reports it; None on the CPU.
        stats: the offloader's counters after the offloaded steps.
        check: where the offloaded model's planned parameters were after those steps.
    """

    plan: OffloadPlan
    device: str
    mechanics_only: bool
    outputs_equal: bool
    restored_equal: bool
    steps: int
    resident_step_s: float
    offloaded_step_s: float
    device_bytes_freed_measured: int | None
    stats: OffloadStats
    check: LiveCheck


def _pick_device(choice: DeviceChoice) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ExecutionError("--device cuda was asked for but torch.cuda.is_available() is False",
                             name="device", value=choice)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(model: nn.Module, inputs: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], float]:
    """Outputs for `inputs` and the mean step time (total of back-to-back steps / count)."""
    with torch.inference_mode():
        model(inputs[0])  # warm-up: first-call overheads are not steady state
        _sync(device)
        start = time.perf_counter()
        outputs = [model(x) for x in inputs]
        _sync(device)
    return outputs, (time.perf_counter() - start) / len(inputs)


def run_demo(
    *,
    env: EnvSnapshot,
    device: DeviceChoice = "auto",
    layers: int = 8,
    hidden: int = 256,
    tokens: int = 64,
    config: OffloadConfig | None = None,
    backend: BackendChoice = "prefetch",
    steps: int = 5,
    progress: Callable[[str], None] = log.info,
) -> DemoResult:
    """Run the demo model resident and offloaded and compare.

    Args:
        env: the captured snapshot (its switches apply; on ``--device cpu`` the platform
            is replaced by one without an accelerator).
        device: "auto" (CUDA when available), "cuda" or "cpu".
        layers, hidden, tokens: model depth, width (a multiple of 64) and tokens per step.
        config: what to offload; by default, per `backend`.
        backend: the default config's backend: "prefetch" (every 2nd layer, depth 2) or
            "uva" (``uva_max_bytes`` half the model's bytes; on-demand copies where the
            plan turns UVA off, e.g. without a GPU).
        steps: timed forward steps per mode.
        progress: called with a line for each stage (the CLI prints them).

    Raises:
        ConfigError: a size is out of `DEMO_LIMITS`, or the sizes need more memory than
            the platform reports (checked before anything is built); names the size.
        ExecutionError: CUDA was asked for and is not available, or execution failed
            (a torch RuntimeError or MemoryError, such as running out of memory, is
            wrapped, naming the stage it failed in).
    """
    for name, value in (("layers", layers), ("hidden", hidden), ("tokens", tokens), ("steps", steps)):
        if value < (low := DEMO_LIMITS[name][0]):
            raise ConfigError(f"{name} must be at least {low}, got {value}", name=name, value=value)
    target = _pick_device(device)
    if target.type == "cpu" and env.platform.has_cuda:
        env = attrs.evolve(env, platform=Platform(torch_version=env.platform.torch_version,
                                                  host_total_bytes=env.platform.host_total_bytes,
                                                  host_available_bytes=env.platform.host_available_bytes))
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    _check_sizes(env, target, torch.empty((), dtype=dtype).element_size(),
                 {"layers": layers, "hidden": hidden, "tokens": tokens, "steps": steps})
    stage = ["starting"]

    def report(line: str) -> None:
        stage[0] = line
        progress(line)

    try:
        return _run(env=env, target=target, dtype=dtype, layers=layers, hidden=hidden, tokens=tokens,
                    config=config, backend=backend, steps=steps, progress=report)
    except OffloadError:
        raise
    except (RuntimeError, MemoryError) as exc:  # torch failing: out of memory, a kernel refusing
        lines = str(exc).strip().splitlines()
        raise ExecutionError(f"the demo failed while {stage[0]}: {type(exc).__name__}: {lines[0] if lines else ''}",
                             name="demo", value=stage[0]) from exc


def _run(*, env: EnvSnapshot, target: torch.device, dtype: torch.dtype, layers: int, hidden: int, tokens: int,
         config: OffloadConfig | None, backend: BackendChoice, steps: int,
         progress: Callable[[str], None]) -> DemoResult:
    """`run_demo`'s work, after its checks."""
    progress(f"building {layers} blocks of width {hidden} ({dtype}) on {target}")
    model = build_demo_model(layers, hidden, device=target, dtype=dtype)
    if config is None and backend == "uva":
        model_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
        config = OffloadConfig(backend="uva", uva_max_bytes=model_bytes // 2)
    config = config or OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator(device="cpu").manual_seed(1)
    inputs = [torch.randn(1, tokens, hidden, generator=generator).to(target, dtype) for _ in range(steps)]

    progress("running resident")
    expected, resident_s = _time_steps(model, inputs, target)

    plan = make_plan(describe_layers(list(model)), config, env)
    offloader = create_offloader(plan)
    _sync(target)
    before = torch.cuda.memory_allocated(target) if target.type == "cuda" else 0
    progress(f"offloading {len(plan.offloaded_params)} parameters of "
             f"{len({p.layer for p in plan.offloaded_params})} layers ({plan.backend.value})")
    offloader.wrap_modules(list(model))
    offloader.post_init()
    _sync(target)
    freed = before - torch.cuda.memory_allocated(target) if target.type == "cuda" else None
    try:
        progress("running offloaded")
        got, offloaded_s = _time_steps(model, inputs, target)
        stats = offloader.stats()
        live = offloader.check()
    finally:
        offloader.restore()
    restored = dict(model.named_parameters())
    return DemoResult(
        plan=offloader.plan,
        device=str(target),
        mechanics_only=target.type == "cpu",
        outputs_equal=all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)),
        restored_equal=all(
            torch.equal(restored[name], value) and restored[name].stride() == value.stride()
            for name, value in original.items()
        ),
        steps=steps,
        resident_step_s=resident_s,
        offloaded_step_s=offloaded_s,
        device_bytes_freed_measured=freed,
        stats=stats,
        check=live,
    )


def _plan_line(plan: OffloadPlan) -> str:
    if plan.backend is Backend.UVA:
        placements = sorted({p.placement.value for p in plan.offloaded_params})
        return (f"{len(plan.offloaded_params)} parameters of {len({p.layer for p in plan.offloaded_params})} "
                f"of {plan.num_layers} layers offloaded ({', '.join(placements) or 'none'}), "
                f"{plan.offloaded_bytes} bytes offloaded")
    return (f"{len(plan.offloaded_layers)} of {plan.num_layers} layers offloaded, "
            f"{plan.schedule.num_slots} slots, {plan.offloaded_bytes} bytes offloaded")


def summarize(result: DemoResult) -> Mapping[str, str]:
    """The result as labelled lines for people."""
    plan = result.plan
    lines = {
        "device": result.device + (" (no GPU: mechanics verified, no memory saved)" if result.mechanics_only else ""),
        "parity": "outputs equal bit for bit" if result.outputs_equal else "OUTPUTS DIFFER",
        "restore": "every weight restored bit for bit" if result.restored_equal else "RESTORE DIFFERS",
        "plan": _plan_line(plan),
        "step time": f"resident {result.resident_step_s * 1e3:.3f} ms, offloaded "
                     f"{result.offloaded_step_s * 1e3:.3f} ms "
                     f"({result.offloaded_step_s / result.resident_step_s:.2f}x) over {result.steps} steps",
        "copies": f"{result.stats.copies_issued} copies, {result.stats.bytes_copied} bytes",
    }
    if result.device_bytes_freed_measured is not None:
        expected = plan.device_bytes_freed - plan.device_bytes_buffers
        ratio = result.device_bytes_freed_measured / expected if expected else math.nan
        lines["device memory"] = (f"{result.device_bytes_freed_measured} bytes freed (net of buffers), "
                                  f"plan says {expected} ({ratio:.4f})")
    return lines


def cmd_demo(args: argparse.Namespace) -> int:
    from offload.pure.check import render_check

    env = capture()
    try:
        result = run_demo(
            env=env, device=args.device, layers=args.layers, hidden=args.hidden, tokens=args.tokens,
            backend=args.backend, progress=lambda line: print(f"... {line}", flush=True),
        )
    except ConfigError as exc:
        if exc.name not in ("layers", "hidden", "tokens"):
            raise
        raise UserError(f"offload demo: --{exc.name}: {exc.message}") from None
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
