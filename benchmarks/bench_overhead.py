"""Host (Python) overhead per offloaded layer per forward, beside resident and peers.

Stacks of tiny layers, so that the compute is small and what an offloader does in Python
per layer dominates: 32 and 128 ``nn.Linear(64, 64)`` (2 parameters each), and 32
Llama-shaped blocks of 9 parameters (q, k, v, o, gate, up, down without bias and two
RMSNorm weights; hidden 64). Input: batch 1, 4 tokens.

Contenders, each set up once per stack on its own copy of the model (``wrap_modules`` +
``post_init`` for ours) and restored at the end:

- ``resident``: the model as is (the baseline);
- ``copies-only``: the resident model plus, before each layer, a plain ``copy_`` of each
  of its weights into a buffer of its own (from pinned host memory on CUDA): the floor of
  moving the bytes one copy per parameter, which every offloader that copies them so
  pays (``prefetch-each``'s floor);
- ``copies-merged``: the same with all of a layer's weights in one host tensor, copied in
  one ``copy_`` into one buffer: the floor of the copies ``prefetch-d1`` / ``-d2`` make.
  The targets are checked against the total overhead; the overhead beyond the matching
  floor is what our Python adds, and is printed beside it;
- ``prefetch-d1`` / ``prefetch-d2``: the prefetch backend, every layer offloaded
  (group_size 1, num_in_group 1), prefetch_step 1 and 2, each layer one copy
  (``layer_blocks="always"``: on the CPU every weight is adopted in place, and "auto"
  would leave it so; on CUDA the weights come from the device, and "auto" already makes
  one copy per layer). The copies per step are checked and printed;
- ``prefetch-each``: prefetch_step 1 with ``layer_blocks="never"``: one copy per
  parameter, as before layers were copied in one go;
- ``prefetch-copy-off``: ``prefetch-d1`` on a runtime whose copies are switched off after
  the warm-up (`benchmarks.copies_off`): what our Python costs without the copy, as issue
  11's baseline was measured (12 us under inference_mode, 14 under no_grad, FACTS.md). A
  diagnostic: its outputs are wrong by design and not checked;
- ``on-demand``: the UVA backend with every parameter placed ``on_demand`` (what it
  plans without CUDA; on CUDA the run turns UVA off for this contender so that it does);
  the placements are checked and printed;
- when installed: diffusers' ``apply_group_offloading`` at leaf and block level
  (``diffusers-leaf``, ``diffusers-block``) and accelerate's ``cpu_offload``
  (``accelerate-cpu``); otherwise a "not installed" row.

Each (stack, grad mode) cell warms every contender up, then runs rounds: in each round
every contender runs one forward, timed alone with ``time.perf_counter_ns`` (CUDA
synchronised before and after), in an order rotated round by round, so drift hits all
alike. The garbage collector is off while timing. Per contender: median and minimum
forward time; overhead per layer = (contender - resident) / layers, as the median over
rounds of the contender's time less the resident time of the same round (paired, so
that a burst of load on a shared machine, which lasts longer than a round, hits both),
and from the minima of the cell. Grad modes: ``torch.inference_mode()`` and
``torch.no_grad()`` (the model is ``requires_grad_(False)`` in both). Outputs of our
contenders must equal the resident output bit for bit, and restore must give back the
resident weights: otherwise the run stops with an error saying what differed.

Targets, printed as "ratio to target" (no assertion): prefetch overhead at
most 12 us per 2-parameter layer and 30 us per 9-parameter block.

Run: ``python -m benchmarks.bench_overhead [--quick] [--device auto|cpu|cuda]``. On the
CPU it uses one thread. ``--quick`` runs only the 32-layer stacks, briefly.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import attrs
import torch
from torch import nn

from benchmarks.copies_off import CopiesOff
from offload import (
    EnvSnapshot,
    OffloadConfig,
    OffloadPlan,
    Placement,
    Platform,
    capture_env,
    create_offloader,
    describe_layers,
    make_plan,
)
from offload.create import default_runtime
from offload.protocols import Offloader
from offload.pure import LayerBlocks

HIDDEN = 64
INNER = 128
TOKENS = 4
TARGET_US = {2: 12.0, 9: 30.0}  # prefetch overhead target per layer, by parameters per layer
# The hot-path baseline (FACTS.md): 32 x Linear(64, 64), custom ops replaced by direct calls,
# copy switched off, per layer per forward.
BASELINE_US = {"inference_mode": 12.0, "no_grad": 14.0}
BASELINE_STACK = "linear32"
PEERS = ("diffusers-leaf", "diffusers-block", "accelerate-cpu")
OURS = ("prefetch-d1", "prefetch-d2", "prefetch-each", "on-demand")
GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight: one parameter."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out


class LlamaBlock(nn.Module):
    """A Llama-shaped decoder block, single head, 9 parameters."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        attended = nn.functional.scaled_dot_product_attention(self.q_proj(h), self.k_proj(h), self.v_proj(h),
                                                              is_causal=True)
        x = x + self.o_proj(attended)
        h = self.post_attention_layernorm(x)
        out: torch.Tensor = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return out


class Stack(nn.Module):
    """``layers`` (an ``nn.ModuleList``) run in order: the shape diffusers' block level expects."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@attrs.frozen
class StackSpec:
    name: str
    layers: int
    params_per_layer: int
    build: Callable[[], nn.Module]


def _stacks(quick: bool) -> list[StackSpec]:
    specs = [
        StackSpec("linear32", 32, 2, lambda: nn.Linear(HIDDEN, HIDDEN)),
        StackSpec("linear128", 128, 2, lambda: nn.Linear(HIDDEN, HIDDEN)),
        StackSpec("llama32", 32, 9, lambda: LlamaBlock(HIDDEN, INNER)),
    ]
    return [s for s in specs if not quick or s.layers == 32]


def build_stack(spec: StackSpec, device: torch.device) -> Stack:
    """The stack with deterministic weights, on `device`, ``requires_grad_(False)``."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = Stack([spec.build() for _ in range(spec.layers)])
    finally:
        torch.random.set_rng_state(state)
    return model.to(device).eval().requires_grad_(False)


@attrs.define
class Contender:
    """One way of running the stack: its model copy, and for ours the offloader."""

    name: str
    kind: str  # "resident", "floor", "ours", "diagnostic" or "peer"
    model: nn.Module | None  # None: not available (see `note`)
    offloader: Offloader | None = None
    copies_off: CopiesOff | None = None  # the diagnostic's runtime, switched off after the first warm-up
    note: str = ""
    times_ns: list[int] = attrs.field(factory=list)
    last_output: torch.Tensor | None = None


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _cpu_env(env: EnvSnapshot) -> EnvSnapshot:
    """`env` as on a machine without an accelerator (for ``--device cpu`` on a GPU machine)."""
    if not env.platform.has_cuda:
        return env
    return attrs.evolve(env, platform=Platform(torch_version=env.platform.torch_version,
                                               host_total_bytes=env.platform.host_total_bytes,
                                               host_available_bytes=env.platform.host_available_bytes))


def _ours(name: str, resident: Stack, config: OffloadConfig, env: EnvSnapshot, *,
          copies_off: bool = False) -> tuple[Contender, OffloadPlan]:
    model = copy.deepcopy(resident)
    layers = list(model.layers)
    plan = make_plan(describe_layers(layers), config, env)
    runtime = CopiesOff(default_runtime(plan)) if copies_off else None
    offloader = create_offloader(plan, runtime)
    offloader.wrap_modules(layers)
    offloader.post_init()
    return Contender(name, "diagnostic" if copies_off else "ours", model, offloader, copies_off=runtime), plan


def _placements(plan: OffloadPlan) -> dict[Placement, int]:
    counts: dict[Placement, int] = {}
    for p in plan.params:
        counts[p.placement] = counts.get(p.placement, 0) + 1
    return counts


def setup_contenders(resident: Stack, env: EnvSnapshot, device: torch.device) -> tuple[list[Contender], list[str]]:
    """Every contender for `resident`, set up once, and lines describing their plans."""
    contenders = [Contender("resident", "resident", resident), _copies_only(resident, device),
                  _copies_only(resident, device, merged=True)]
    notes: list[str] = []
    runs: tuple[tuple[str, int, LayerBlocks], ...] = (("prefetch-d1", 1, "always"), ("prefetch-d2", 2, "always"),
                                                      ("prefetch-each", 1, "never"))
    for name, depth, blocks in runs:
        contender, plan = _ours(name, resident, OffloadConfig(group_size=1, num_in_group=1, prefetch_step=depth,
                                                              layer_blocks=blocks), env)
        counts = _placements(plan)
        if counts.get(Placement.PREFETCH, 0) != len(plan.params):
            raise RuntimeError(f"{contender.name}: the plan does not prefetch every parameter: {counts}")
        contenders.append(contender)
    contender, _ = _ours("prefetch-copy-off", resident, OffloadConfig(group_size=1, num_in_group=1, prefetch_step=1,
                                                                      layer_blocks="always"), env, copies_off=True)
    contenders.append(contender)
    nbytes = sum(p.numel() * p.element_size() for p in resident.parameters())
    # Without CUDA the UVA backend places everything on_demand by itself; on CUDA, UVA is
    # turned off for this contender so that it does.
    demand_env = attrs.evolve(env, flags=attrs.evolve(env.flags, disable_uva=True)) if env.platform.has_cuda else env
    contender, plan = _ours("on-demand", resident, OffloadConfig(backend="uva", uva_max_bytes=nbytes), demand_env)
    counts = _placements(plan)
    on_demand = counts.get(Placement.ON_DEMAND, 0)
    notes.append(f"on-demand: plan backend {plan.backend.value}, {on_demand} of {len(plan.params)} parameters placed "
                 f"on_demand (uva {'on' if plan.uva.enabled else 'off'}: {plan.uva.explanation})")
    if on_demand != len(plan.params):
        raise RuntimeError(f"on-demand: the plan does not place every parameter on_demand: {counts}")
    contenders.append(contender)

    offload_device = torch.device("cpu")
    diffusers_hooks = _import("diffusers.hooks")
    for name, level in (("diffusers-leaf", "leaf_level"), ("diffusers-block", "block_level")):
        if diffusers_hooks is None:
            contenders.append(Contender(name, "peer", None, note="not installed"))
            continue

        def group_offload(model: nn.Module, level: str = level, hooks: ModuleType = diffusers_hooks) -> None:
            extra = {"num_blocks_per_group": 1} if level == "block_level" else {}
            model.to(offload_device)  # where a pipeline's weights are before group offloading
            hooks.apply_group_offloading(model, onload_device=device, offload_device=offload_device,
                                         offload_type=level, **extra)

        contenders.append(_peer(name, resident, group_offload))
    accelerate = _import("accelerate")
    if accelerate is None:
        contenders.append(Contender("accelerate-cpu", "peer", None, note="not installed"))
    else:
        contenders.append(_peer("accelerate-cpu", resident,
                                lambda model: accelerate.cpu_offload(model, execution_device=device)))
    return contenders, notes


def _host_bytes(tensors: Sequence[torch.Tensor], cuda: bool) -> torch.Tensor:
    """`tensors`' bytes back to back in one flat host tensor (pinned on CUDA)."""
    flat = torch.cat([t.detach().cpu().reshape(-1).view(torch.uint8) for t in tensors])
    return flat.pin_memory() if cuda else flat


def _copies_only(resident: Stack, device: torch.device, *, merged: bool = False) -> Contender:
    """The resident stack with each layer's weights copied, as plainly as Python can,
    before the layer runs (see the module docstring): each into a buffer of its own, or,
    `merged`, all of them in one copy from one host tensor into one buffer."""
    model = copy.deepcopy(resident)
    cuda = device.type == "cuda"
    for layer in model.layers:
        if merged:
            src = _host_bytes(list(layer.parameters()), cuda)
            pairs = [(torch.empty_like(src, device=device), src)]
        else:
            pairs = [(torch.empty_like(p), p.detach().cpu().pin_memory() if cuda else p.detach().clone())
                     for p in layer.parameters()]
        forward = layer.forward

        def copying(*args: object, forward: Callable[..., object] = forward,
                    pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs, **kwargs: object) -> object:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=cuda)
            return forward(*args, **kwargs)

        layer.forward = copying
    return Contender("copies-merged" if merged else "copies-only", "floor", model)


def _peer(name: str, resident: Stack, apply: Callable[[nn.Module], object]) -> Contender:
    """A peer's contender on a copy of `resident`; a peer that fails to set up gets a row saying so."""
    model = copy.deepcopy(resident)
    try:
        apply(model)
    except Exception as exc:  # a third-party version this was not written against
        return Contender(name, "peer", None, note=f"failed to set up: {type(exc).__name__}: {exc}".splitlines()[0])
    return Contender(name, "peer", model)


def restore_and_check(contenders: Sequence[Contender], resident: nn.Module) -> None:
    """Restore our contenders; their weights must equal the resident ones bit for bit."""
    expected = dict(resident.named_parameters())
    for c in contenders:
        if c.offloader is None or c.model is None:
            continue
        c.offloader.restore()
        got = dict(c.model.named_parameters())
        if got.keys() != expected.keys():
            raise RuntimeError(f"{c.name}: after restore the parameters are {sorted(got)}, expected {sorted(expected)}")
        for name, want in expected.items():
            have = got[name]
            if have.device != want.device or have.dtype != want.dtype or not torch.equal(have, want):
                raise RuntimeError(f"{c.name}: after restore, {name} differs from the resident weight "
                                   f"({have.device}/{have.dtype} vs {want.device}/{want.dtype})")


def _check_output(c: Contender, output: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    """Ours must match bit for bit (else raise); a peer that does not gets a note on its row;
    the diagnostic is not checked (its copies are switched off)."""
    if c.kind == "diagnostic" or torch.equal(output, expected):
        return
    diff = (output.float() - expected.float().to(output.device)).abs().max().item()
    if c.kind == "ours":
        raise RuntimeError(f"{c.name}: {where}, the output differs from the resident output "
                           f"(max abs difference {diff:g}); a benchmark of a wrong result is worthless")
    c.note = f"output differs from resident, max abs difference {diff:g}"


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def measure(contenders: Sequence[Contender], x: torch.Tensor, device: torch.device, *, warmup: int,
            min_rounds: int, max_rounds: int, seconds: float) -> int:
    """Warm up, then time rounds until `seconds` pass (at least `min_rounds`, at most
    `max_rounds`); returns the number of rounds. Called inside the grad mode."""
    resident = contenders[0].model
    assert resident is not None
    expected = resident(x)
    for c in contenders:
        c.times_ns.clear()
        if c.model is None:
            continue
        try:
            for _ in range(warmup):
                out = c.model(x)
        except Exception as exc:
            if c.kind != "peer":
                raise
            c.model, c.note = None, f"failed in forward: {type(exc).__name__}: {exc}".splitlines()[0]
            continue
        _check_output(c, out, expected, "after warm-up")
        if c.copies_off is not None:
            c.copies_off.switch_off()  # every slot has held real weights by now
    live = [c for c in contenders if c.model is not None]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    rounds = 0
    deadline = time.perf_counter() + seconds
    with _gc_off():
        while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() < deadline):
            shift = rounds % len(live)
            for c in live[shift:] + live[:shift]:
                model = c.model
                assert model is not None
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter_ns()
                out = model(x)
                if cuda:
                    torch.cuda.synchronize(device)
                c.times_ns.append(time.perf_counter_ns() - start)
                c.last_output = out
            rounds += 1
    for c in live:
        assert c.last_output is not None
        _check_output(c, c.last_output, expected, "in the last timed round")
    return rounds


def _us(ns: float) -> float:
    return ns / 1e3


def _fmt(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'n/a' if value is None or not math.isfinite(value) else f'{value:.{digits}f}':>{width}}"


HEADER = (f"{'stack':<10} {'grad mode':<14} {'contender':<16} {'median us':>10} {'ovh/layer med':>13} "
          f"{'ovh/layer min':>13} {'d1/peer':>8} {'d2/peer':>8}")


def copies_per_step(contenders: Sequence[Contender], x: torch.Tensor) -> list[str]:
    """For each prefetch contender: the copies one more forward of `x` issues (from its
    stats, before and after), beside its offloaded layers."""
    lines = []
    for c in contenders:
        if c.offloader is None or c.model is None or c.kind != "ours" or not c.name.startswith("prefetch"):
            continue
        before = c.offloader.stats().copies_issued
        with torch.inference_mode():
            c.model(x)
        copies = c.offloader.stats().copies_issued - before
        lines.append(f"{c.name}: {copies} copies per forward for {len(c.offloader.plan.offloaded_layers)} "
                     f"offloaded layers (layer_blocks={c.offloader.plan.config.layer_blocks!r})")
    return lines


def report(spec: StackSpec, mode: str, contenders: Sequence[Contender]) -> tuple[list[str], dict[str, float]]:
    """Table rows for one cell, and the median-based overhead per layer of each live contender."""
    base = contenders[0]
    base_min = min(base.times_ns)
    overhead: dict[str, float] = {}
    mins: dict[str, float] = {}
    medians: dict[str, float] = {}
    for c in contenders:
        if c.model is None:
            continue
        medians[c.name] = statistics.median(c.times_ns)
        # Paired: each round's time less the resident time of the same round (they ran
        # next to each other), so that a burst of load on the machine hits both.
        paired = [t - r for t, r in zip(c.times_ns, base.times_ns, strict=True)]
        overhead[c.name] = _us(statistics.median(paired)) / spec.layers
        mins[c.name] = _us(min(c.times_ns) - base_min) / spec.layers
    rows = []
    for c in contenders:
        lead = f"{spec.name:<10} {mode:<14} {c.name:<16}"
        if c.model is None:
            rows.append(f"{lead} {c.note}")
            continue
        ratios: list[float | None] = [None, None]
        if c.kind == "peer" and overhead[c.name] > 0:
            ratios = [overhead[f"prefetch-d{d}"] / overhead[c.name] for d in (1, 2)]
        row = (f"{lead} {_fmt(_us(medians[c.name]), 10, 1)} {_fmt(overhead[c.name], 13)} {_fmt(mins[c.name], 13)} "
               f"{_fmt(ratios[0], 8)} {_fmt(ratios[1], 8)}")
        rows.append(row + (f"  ({c.note})" if c.note else ""))
    return rows, overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="only the 32-layer stacks, briefly (well under a minute)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="compute device (default: CUDA when available)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timing budget per stack and grad mode (default 20, --quick 1.5)")
    parser.add_argument("--max-rounds", type=int, default=None, help="rounds at most per cell (default 5000, --quick 500)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_overhead: --device cuda was asked for but CUDA is not available")
        return 2
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    seconds = args.seconds if args.seconds is not None else (1.5 if args.quick else 20.0)
    max_rounds = args.max_rounds if args.max_rounds is not None else (500 if args.quick else 5000)
    warmup, min_rounds = (3, 15) if args.quick else (10, 50)

    env = capture_env(os.environ)
    if device.type == "cpu":
        env = _cpu_env(env)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    begun = time.perf_counter()
    try:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
        print(f"bench_overhead: {where}, torch {torch.__version__}; input batch 1 x {TOKENS} tokens x {HIDDEN}; "
              f"{'quick' if args.quick else 'full'} run, {seconds:g} s per cell")
        for name in ("diffusers", "accelerate"):
            module = _import(name)
            print(f"{name}: {getattr(module, '__version__', '?') if module is not None else 'not installed'}")
        rows: list[str] = []
        targets: list[str] = []
        for spec in _stacks(args.quick):
            resident = build_stack(spec, device)
            x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)
            contenders, notes = setup_contenders(resident, env, device)
            for line in notes:
                print(f"{spec.name}: {line}")
            for mode, grad_mode in GRAD_MODES.items():
                start = time.perf_counter()
                with grad_mode():
                    rounds = measure(contenders, x, device, warmup=warmup, min_rounds=min_rounds,
                                     max_rounds=max_rounds, seconds=seconds)
                print(f"{spec.name} {mode}: {rounds} rounds in {time.perf_counter() - start:.1f} s")
                cell_rows, overhead = report(spec, mode, contenders)
                rows += cell_rows
                target = TARGET_US[spec.params_per_layer]
                floor, each = overhead["copies-merged"], overhead["copies-only"]
                targets.append(f"{spec.name} {mode}: prefetch overhead per layer / target {target:g} us "
                               f"({spec.params_per_layer} parameters per layer): ratio to target "
                               + ", ".join(f"d{d} {overhead[f'prefetch-d{d}'] / target:.2f}" for d in (1, 2))
                               + f"; the copies alone cost {floor:.2f} us per layer in one copy (copies-merged), "
                               "beyond them "
                               + ", ".join(f"d{d} {overhead[f'prefetch-d{d}'] - floor:.2f} us" for d in (1, 2))
                               + f"; {each:.2f} us in one copy per parameter (copies-only), beyond them "
                               f"prefetch-each {overhead['prefetch-each'] - each:.2f} us; with the copy switched off "
                               f"d1 {overhead['prefetch-copy-off']:.2f} us"
                               + (f" (the hot-path baseline: {BASELINE_US[mode]:g} us)" if spec.name == BASELINE_STACK
                                  else ""))
            for line in copies_per_step(contenders, x):
                print(f"{spec.name}: {line}")
            restore_and_check(contenders, resident)
            print(f"{spec.name}: outputs of prefetch-d1, prefetch-d2, prefetch-each and on-demand equal the resident "
                  "output bit for bit; restore gave back the resident weights")
        print()
        print(HEADER)
        for row in rows:
            print(row)
        print()
        for line in targets:
            print(line)
        print(f"total {time.perf_counter() - begun:.1f} s")
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
