"""`offload demo`: a small transformer-style model run resident and offloaded, compared
bit for bit, with the plan, the device memory freed and step times. The backend is
prefetch (every 2nd layer) or uva (half the model's bytes).

On a machine without a GPU it runs on `CpuRuntime`: the mechanics (hooks, slots, the
schedule, copies, restore) are exercised for real, but no memory is saved, and the
result says so.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
import torch
from torch import nn

from offload.create import create_offloader
from offload.describe import describe_layers
from offload.errors import ConfigError, ExecutionError
from offload.pure.config import OffloadConfig
from offload.pure.env import EnvSnapshot, Platform
from offload.pure.plan import Backend, OffloadPlan
from offload.pure.planner import make_plan
from offload.stats import OffloadStats

__all__ = ["DemoBlock", "DemoResult", "build_demo_model", "run_demo"]

log = logging.getLogger(__name__)

DeviceChoice = Literal["auto", "cuda", "cpu"]
BackendChoice = Literal["prefetch", "uva"]


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
        ConfigError: a size is out of range.
        ExecutionError: CUDA was asked for and is not available, or execution failed.
    """
    for name, value, minimum in (("layers", layers, 1), ("hidden", hidden, 64), ("tokens", tokens, 1), ("steps", steps, 1)):
        if value < minimum:
            raise ConfigError(f"{name} must be at least {minimum}, got {value}", name=name, value=value)
    if hidden % 64:
        raise ConfigError(f"hidden must be a multiple of 64, got {hidden}", name="hidden", value=hidden)
    target = _pick_device(device)
    if target.type == "cpu" and env.platform.has_cuda:
        env = attrs.evolve(env, platform=Platform(torch_version=env.platform.torch_version))
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32

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
