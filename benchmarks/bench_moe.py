"""Mixture-of-experts decoding with the device expert cache: bytes per step, hit rates, overhead.

On the CPU (the default), for the seven small random MoE models of `tests.hf.moe_models`
(``--layers`` 6, every layer offloaded: ``OffloadConfig(group_size=1, prefetch_step=2)``,
nothing else set) at ``--batches`` 1, 4, 16 and 64: a greedy ``generate`` of an
``--prompt``-token prefill (8) and ``--steps`` decode steps (1), three times on fresh
copies of the model: resident, offloaded with the expert cache, and offloaded with
``expert_cache=False`` (whole-layer streaming). Per model and batch it prints:

- ``whole/need`` and ``cache/need``: bytes copied per decode step over the bytes the step
  needs, over the decode steps. *Copied*: the growth of ``stats().bytes_copied`` from the
  start of a decode step's forward to the start of the next forward (after the last,
  the end of ``generate``): the copies the schedule issues during the step, expert copies
  and speculative whole-layer prefetches included. The non-expert copies issued during a
  step are partly for the next step's first layers (copied ahead while this step runs),
  in place of this step's first layers, copied during the step before: the schedule
  copies each position once per step, so the amount is one step's; the run checks that
  the non-expert part of every window is exactly the plan's non-expert bytes of the
  positions that are not kept (whole-layer: every offloaded byte of those positions), and
  stops otherwise. *Needed*: those non-expert bytes, plus, for each MoE layer, the experts
  that got at least one token in that step (recorded with `record_routing`) x the
  expert's bytes.
- ``hits %``: the cache's hit rate over the decode steps (``stats().experts``), and
  ``belady %``: Belady's optimum for the same slots on the run's recorded trace (prefill
  and decode: the cache starts the decode step with what the prefill left), over the
  same steps.
- ``pred/meas``: the expert bytes `replay` predicts from the recorded trace over the
  executor's measured expert bytes (``ExpertCounts.bytes_copied``), over the whole run
  (prefill and decode); 1.000 means the estimate is the executor's (target within 2%).
- ``parity``: every logit of both offloaded runs ``torch.equal`` to the resident run's.
- ``ovh us``: the cache's host overhead per MoE layer per call in microseconds, the
  median over the decode steps' calls: the wall time of the experts module's patched
  forward less the time of the module's own forward inside it. It includes reading the
  routing from the inputs (``torch.unique``), `admit`, the copies of the misses (on the
  CPU runtime a synchronous ``memcpy`` of misses x B, small here), the hits' copies from
  their slots into their rows, the kept misses' copies into their slots and
  ``torch.compiler.disable``'s wrapper; not the module's compute. Beside it ``admit us``:
  `admit` alone, per call, replaying the run's trace (the best of 3 replays; the policy's
  share of the overhead). One torch thread.

Then a Zipf table: `zipf_trace` (s = 1, one token per step, ``--zipf-steps`` steps) for
E = 64 and 128, top-8, C = 8, 16, 32 slots: the default policy's hit rate against
Belady's optimum and against the best static cache in hindsight (the C experts routed
most often over the trace, each kept from its first routing on: on independent draws no
online policy beats a static cache of the C most popular experts in expectation).

With ``--gpu`` (CUDA only; without it the run says so and exits 0): an ``--gpu-layers``
(8) stack shaped like Qwen3-235B-A22B's MoE layers (128 experts, top-8, hidden 4096,
expert intermediate 1536, bf16; no attention: RMSNorm, a router ``Linear`` + softmax +
top-8, and a fused experts module written here with transformers 5's layout and call
convention and its eager loop over the routed experts, so that the machine needs no
transformers), every layer offloaded through the engine lifecycle (built on meta,
``wrap_modules``, weights written into the host copies, ``post_init``). The router's
logits get a bias of ``-s ln(rank)`` (``--gpu-zipf`` s, default 1; 0: unskewed) over a
random ranking of the experts, so that some experts are hotter than others, as in real
routing. For batch 1 and 64 it prints tokens/s (``--gpu-steps`` timed decode steps after
one untimed, synchronised around each) with the expert cache and with whole-layer
streaming, and the link bound: batch / (needed bytes per step / pinned host-to-device
bandwidth, measured in the run: median of 5 copies of 1 GiB). Both runs must give the
same outputs bit for bit. The plan holds 38.7 GB of pinned host memory (8 layers), one run
after the other, and 14.5 GB of device buffers with the cache (9.7 GB without).

Run: ``python -m benchmarks.bench_moe`` (about 20 s on the 2-core CPU machine), ``--gpu``
(not yet timed on a GPU; estimated at about a minute on an H200 for 8 layers, most of it
the two builds' pinned host memory). ``--strict`` exits 1 when a row misses a target
(cache/need at most 1.05, pred/meas within 2%, parity; with ``--gpu``, equal outputs).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from offload import OffloadConfig, capture_env, create_offloader, describe_layers, make_plan
from offload.executors.experts import record_routing
from offload.protocols import Offloader
from offload.pure.experts.replay import Replay, belady, replay, zipf_trace
from offload.pure.experts.values import ExpertCachePlan, RoutingTrace
from offload.pure.plan.plan import OffloadPlan
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.stats import OffloadStats
from offload.runtime.cpu import CpuRuntime

BATCHES = (1, 4, 16, 64)
TARGET = 1.05  # cache/need at most this
ESTIMATE = 0.02  # pred/meas within this of 1
ZIPF_EXPERTS = (64, 128)
ZIPF_SLOTS = (8, 16, 32)
ZIPF_TOP_K = 8
GIB = 1 << 30
GB = 1e9
HEADER = (f"{'model':<12} {'batch':>5} {'whole/need':>10} {'cache/need':>10} {'hits %':>7} {'belady %':>8} "
          f"{'pred/meas':>9} {'parity':>6} {'ovh us':>7} {'admit us':>8}")
ZIPF_HEADER = (f"{'E':>4} {'C':>3} {'policy %':>8} {'belady %':>8} {'static %':>8} {'policy/belady':>13} "
               f"{'policy/static':>13}")
GPU_HEADER = (f"{'mode':<12} {'batch':>5} {'tokens/s':>9} {'step ms':>8} {'copied GB':>9} {'needed GB':>9} "
              f"{'hits %':>7} {'copied/need':>11}")


# --- on the CPU: the seven small models -------------------------------------------------


@attrs.define
class ServeTimer:
    """The host time the expert cache adds to each call of an experts module: the patched
    forward's wall time less the module's own forward's (see the module docstring)."""

    on: bool = False
    inner_ns: int = 0
    samples_ns: list[int] = attrs.field(factory=list)

    def time_own_forward(self, module: nn.Module) -> None:
        """Before offloading: time the module's own forward (the cache wraps it later)."""
        forward = module.forward

        @functools.wraps(forward)  # keeps the signature: the experts are found by it
        def own(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return forward(*args, **kwargs)
            finally:
                self.inner_ns += time.perf_counter_ns() - start

        module.forward = own  # an instance attribute, as the cache patches it

    def time_patched_forward(self, module: nn.Module) -> None:
        """After offloading: time the cache's patched forward around the module's own."""
        serving = module.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.inner_ns = 0
            start = time.perf_counter_ns()
            out = serving(*args, **kwargs)
            if self.on:
                self.samples_ns.append(time.perf_counter_ns() - start - self.inner_ns)
            return out

        module.forward = timed


@attrs.frozen
class Run:
    """One offloaded ``generate``: its logits, plan, the stats at the start of each forward
    and at the end, the routing it recorded, and the cache's overhead samples (ns)."""

    logits: list[torch.Tensor]
    plan: OffloadPlan
    snaps: list[OffloadStats]
    trace: RoutingTrace
    overhead_ns: list[int]


def _experts_modules(model: Any) -> list[nn.Module]:
    layers = list(model.model.layers)
    return [layers[g.layer].get_submodule(g.module) for g in describe_layers(layers).experts]


def offloaded_run(name: str, layers: int, batch: int, *, cache: bool, prompt: int, steps: int,
                  impl: str | None) -> Run:
    """`name` offloaded every layer (the expert cache on or off), decoded as `_decode` does."""
    from offload.hf import offload_model
    from offload.pure.env.snapshot import EnvSnapshot
    from tests.hf.moe_models import build_moe, decode_logits

    model = build_moe(name, layers, experts_implementation=impl)
    timer = ServeTimer()
    modules = _experts_modules(model)
    if cache:
        for module in modules:
            timer.time_own_forward(module)
    config = OffloadConfig(group_size=1, prefetch_step=2, expert_cache=cache)
    # Recording starts before offloading: the cache's patched forward hides the module's
    # signature, by which record_routing finds the experts modules.
    with record_routing(list(model.model.layers)) as record:
        offloader = offload_model(model, config, env=EnvSnapshot(), runtime=CpuRuntime())
        if cache:
            for module in modules:
                timer.time_patched_forward(module)
        snaps: list[OffloadStats] = []

        def begin(module: nn.Module, args: tuple[Any, ...]) -> None:
            snaps.append(offloader.stats())
            timer.on = len(snaps) > 1  # the decode steps only

        hook = model.model.register_forward_pre_hook(begin)
        logits = decode_logits(model, batch, prompt=prompt, steps=steps)
        hook.remove()
        snaps.append(offloader.stats())
    return Run(logits=logits, plan=offloader.plan, snaps=snaps, trace=record.trace(), overhead_ns=timer.samples_ns)


def _copied_layers(plan: OffloadPlan) -> set[int]:
    """The offloaded layers at positions that are not kept (a kept one is copied once only)."""
    kept = plan.schedule.kept_positions
    return {layer for position, layer in enumerate(plan.offloaded_layers) if position not in kept}


def scheduled_bytes(plan: OffloadPlan) -> int:
    """Bytes the schedule copies per step (the expert caches' copies aside): every offloaded
    weight of a position that is not kept, less the expert caches' parameters."""
    cached = {(c.layer, name) for c in plan.experts for name in c.group.params}
    copied = _copied_layers(plan)
    return sum(p.nbytes for p in plan.offloaded_params if p.layer in copied and (p.layer, p.name) not in cached)


def non_expert_bytes(plan: OffloadPlan, groups: Sequence[ExpertGroup]) -> int:
    """The non-expert part of the bytes a step needs: the offloaded weights of positions
    that are not kept, less every experts module's parameters (cached or not)."""
    experts = {(g.layer, name) for g in groups for name in g.params}
    copied = _copied_layers(plan)
    return sum(p.nbytes for p in plan.offloaded_params if p.layer in copied and (p.layer, p.name) not in experts)


def routed_bytes(trace: RoutingTrace, step: int) -> int:
    """Bytes of the experts that got a token at `step`, over every experts module."""
    return sum(len(routed) * g.expert_bytes for g, routed in zip(trace.groups, trace.steps[step], strict=True))


def step_windows(run: Run, steps: int) -> list[tuple[int, int]]:
    """(bytes copied, expert bytes copied) of each decode step's window (the module docstring)."""
    out = []
    for k in range(1, steps + 1):
        before, after = run.snaps[k], run.snaps[k + 1]
        experts = sum(c.bytes_copied for c in after.experts) - sum(c.bytes_copied for c in before.experts)
        out.append((after.bytes_copied - before.bytes_copied, experts))
    return out


def belady_decode_hits(plans: tuple[ExpertCachePlan, ...], trace: RoutingTrace, steps: int) -> tuple[int, int]:
    """(hits, routed) of Belady's optimum over the decode steps (1 to `steps`) of `trace`,
    each cache replayed alone so that its misses per step are known."""
    hits = routed = 0
    for g, group in enumerate(trace.groups):
        alone = RoutingTrace(groups=(group,), steps=tuple((step[g],) for step in trace.steps))
        best = belady(plans, alone)
        for k in range(1, steps + 1):
            calls = len(trace.steps[k][g])
            routed += calls
            hits += calls - best.step_bytes[k] // group.expert_bytes
    return hits, routed


def _timed_ns(run: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - start


@attrs.frozen
class Row:
    """One model and batch, as printed."""

    model: str
    batch: int
    whole: float
    cache: float
    hits: float | None
    belady: float | None
    estimate: float | None
    parity: bool
    overhead_us: float | None
    admit_us: float

    @property
    def line(self) -> str:
        def fmt(value: float | None, width: int, digits: int) -> str:
            return f"{'n/a' if value is None else f'{value:.{digits}f}':>{width}}"

        return (f"{self.model:<12} {self.batch:>5} {fmt(self.whole, 10, 2)} {fmt(self.cache, 10, 2)} "
                f"{fmt(self.hits, 7, 1)} {fmt(self.belady, 8, 1)} {fmt(self.estimate, 9, 3)} "
                f"{str(self.parity).lower():>6} {fmt(self.overhead_us, 7, 1)} {fmt(self.admit_us, 8, 1)}")

    @property
    def missed(self) -> list[str]:
        """The targets this row misses, in words."""
        out = []
        if self.cache > TARGET:
            out.append(f"cache/need {self.cache:.2f} > {TARGET}")
        if self.estimate is None or abs(self.estimate - 1) > ESTIMATE:
            out.append(f"pred/meas {self.estimate} not within {ESTIMATE:.0%}")
        if not self.parity:
            out.append("outputs differ from the resident model's")
        return out


def measure_model(name: str, batch: int, args: argparse.Namespace) -> tuple[Row, list[str]]:
    """One row, and lines describing the model (for the first batch)."""
    from tests.hf.moe_models import build_moe, decode_logits, implementations, same_logits

    impl = args.experts_implementation if args.experts_implementation in implementations(name) else None
    resident = build_moe(name, args.layers, experts_implementation=impl)
    expected = decode_logits(resident, batch, prompt=args.prompt, steps=args.steps)
    runs = {cache: offloaded_run(name, args.layers, batch, cache=cache, prompt=args.prompt, steps=args.steps,
                                 impl=impl) for cache in (True, False)}
    cache, whole = runs[True], runs[False]
    if cache.trace.steps != whole.trace.steps:
        raise RuntimeError(f"{name} batch {batch}: the two offloaded runs routed differently")
    needed, copied = {}, {}
    for key, run in runs.items():
        scheduled = scheduled_bytes(run.plan)
        windows = step_windows(run, args.steps)
        for k, (got, experts) in enumerate(windows, start=1):
            if got - experts != scheduled:
                raise RuntimeError(f"{name} batch {batch} {'cache' if key else 'whole-layer'}: decode step {k} "
                                   f"copied {got - experts} bytes besides the experts, the schedule copies "
                                   f"{scheduled} per step: the window is not one step's copies")
        base = non_expert_bytes(run.plan, run.trace.groups)
        needed[key] = sum(base + routed_bytes(run.trace, k) for k in range(1, args.steps + 1))
        copied[key] = sum(got for got, _ in windows)
    first, last = cache.snaps[1], cache.snaps[-1]
    hits = sum(c.hits for c in last.experts) - sum(c.hits for c in first.experts)
    routed = hits + sum(c.misses for c in last.experts) - sum(c.misses for c in first.experts)
    predicted: Replay = replay(cache.plan.experts, cache.trace)
    measured = sum(c.bytes_copied for c in last.experts)
    best_hits, best_routed = belady_decode_hits(cache.plan.experts, cache.trace, args.steps)
    overhead = statistics.median(cache.overhead_ns) / 1e3 if cache.overhead_ns else None
    calls = len(cache.trace.steps) * len(cache.trace.groups)
    admit_ns = min(_timed_ns(lambda: replay(cache.plan.experts, cache.trace)) for _ in range(3))
    row = Row(model=name, batch=batch, whole=copied[False] / needed[False], cache=copied[True] / needed[True],
              hits=100 * hits / routed if routed else None,
              belady=100 * best_hits / best_routed if best_routed else None,
              estimate=predicted.total_bytes / measured if measured else None,
              parity=same_logits(cache.logits, expected) and same_logits(whole.logits, expected), overhead_us=overhead,
              admit_us=admit_ns / calls / 1e3)
    plan = cache.plan
    group = plan.experts[0].group
    kept = len(plan.schedule.kept_positions)
    lines = [f"{name}: {args.layers} layers ({len(plan.experts)} MoE), experts implementation "
             f"{getattr(resident.config, '_experts_implementation', None) or 'default'}; E {group.num_experts}, "
             f"B {group.expert_bytes} bytes, C {plan.experts[0].slots} slots; per step "
             f"{non_expert_bytes(plan, cache.trace.groups)} non-expert bytes, whole-layer streaming "
             f"{scheduled_bytes(whole.plan)} bytes; {kept} kept positions"]
    return row, lines


@attrs.frozen
class ZipfRow:
    experts: int
    slots: int
    policy: float
    belady: float
    static: float

    @property
    def line(self) -> str:
        return (f"{self.experts:>4} {self.slots:>3} {100 * self.policy:>8.1f} {100 * self.belady:>8.1f} "
                f"{100 * self.static:>8.1f} {self.policy / self.belady:>13.3f} {self.policy / self.static:>13.3f}")


def zipf_rows(steps: int, *, seed: int = 0) -> list[ZipfRow]:
    """The Zipf table: per E and C, the default policy, Belady and the static top-C cache.

    The static cache holds the C experts routed most often over the trace, each loaded at
    its first routing (a miss) and never evicted: it starts empty, as the others do (a
    cache preloaded with them would be spared C misses no online cache is spared).
    """
    rows = []
    for e in ZIPF_EXPERTS:
        group = ExpertGroup(layer=0, module="mlp.experts", num_experts=e, params=("mlp.experts.gate_up_proj",),
                            expert_bytes=1, routing=Routing.INDICES)
        trace = zipf_trace((group,), steps=steps, top_k=ZIPF_TOP_K, s=1.0, seed=seed)
        counts = [0] * e
        for step in trace.steps:
            for expert in step[0]:
                counts[expert] += 1
        routed = sum(counts)
        for c in ZIPF_SLOTS:
            plan = ExpertCachePlan(group=group, slots=c)
            hottest = sorted(range(e), key=lambda j: (-counts[j], j))[:c]
            static = sum(counts[j] - 1 for j in hottest if counts[j])
            rows.append(ZipfRow(experts=e, slots=c, policy=replay((plan,), trace).hit_rate,
                                belady=belady((plan,), trace).hit_rate, static=static / routed if routed else 1.0))
    return rows


def run_cpu(args: argparse.Namespace) -> int:
    from tests.hf.moe_models import MOE_ARCHITECTURES

    names = args.models or list(MOE_ARCHITECTURES)
    unknown = sorted(set(names) - set(MOE_ARCHITECTURES))
    if unknown:
        print(f"bench_moe: unknown models {unknown}; known: {sorted(MOE_ARCHITECTURES)}")
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    begun = time.perf_counter()
    rows: list[Row] = []
    try:
        print(f"bench_moe: CPU, 1 thread, torch {torch.__version__}; {len(names)} models of {args.layers} layers, "
              f"every layer offloaded (group_size 1, prefetch_step 2); batches {' '.join(map(str, args.batches))}; "
              f"{args.prompt}-token prefill, {args.steps} decode step{'s' if args.steps != 1 else ''}")
        for name in names:
            for index, batch in enumerate(args.batches):
                row, lines = measure_model(name, batch, args)
                if index == 0:
                    for line in lines:
                        print(line)
                rows.append(row)
        print()
        print(HEADER)
        for row in rows:
            print(row.line)
        print()
        zipf = zipf_rows(args.zipf_steps)
        print(f"Zipf s=1 traces, top-{ZIPF_TOP_K}, 1 token per step, {args.zipf_steps} steps: the default policy "
              "against Belady's optimum and the best static cache in hindsight (the C most routed experts, each "
              "kept from its first routing on); every cache starts empty")
        print(ZIPF_HEADER)
        for zrow in zipf:
            print(zrow.line)
        print()
        missed = [f"{row.model} batch {row.batch}: {'; '.join(row.missed)}" for row in rows if row.missed]
        ones = [row.whole for row in rows if row.batch == 1]
        if ones:
            print(f"whole-layer streaming at batch 1: {min(ones):.2f}x to {max(ones):.2f}x the bytes needed; the "
                  f"expert cache {min(r.cache for r in rows if r.batch == 1):.2f}x to "
                  f"{max(r.cache for r in rows if r.batch == 1):.2f}x")
        print(f"targets (cache/need at most {TARGET}, pred/meas within {ESTIMATE:.0%}, parity): "
              + (f"{len(missed)} of {len(rows)} rows missed: " + "; ".join(missed) if missed
                 else f"every one of {len(rows)} rows met them"))
        print(f"total {time.perf_counter() - begun:.1f} s")
    finally:
        torch.set_num_threads(threads)
    return 1 if args.strict and missed else 0


# --- on a GPU: a stack shaped like Qwen3-235B-A22B's MoE layers ---------------------------


@attrs.frozen
class StackShape:
    """The MoE stack of ``--gpu``: `layers` layers of `experts` experts, `top_k` per
    token, width `hidden`, expert intermediate `inter`, weights of `dtype`."""

    layers: int = 8
    experts: int = 128
    top_k: int = 8
    hidden: int = 4096
    inter: int = 1536
    dtype: torch.dtype = torch.bfloat16

    @property
    def expert_bytes(self) -> int:
        """B: one expert's gate, up and down projections."""
        return 3 * self.hidden * self.inter * torch.empty((), dtype=self.dtype).element_size()


QWEN3_235B = StackShape()


class FusedExperts(nn.Module):
    """Experts in transformers 5's fused layout and call convention (``Qwen3MoeExperts``):
    ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], ``forward(hidden_states,
    top_k_index, top_k_weights)`` looping eagerly over the routed experts."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit:
            expert = index[0]
            top_k_pos, token = torch.where(mask[expert])
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            current = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, (current * top_k_weights[token, top_k_pos, None]).to(out.dtype))
        return out


class MoeLayer(nn.Module):
    """RMSNorm, a router (softmax, top-k, renormalised) and the experts, with a residual."""

    def __init__(self, shape: StackShape) -> None:
        super().__init__()
        self.top_k = shape.top_k
        self.norm = nn.Parameter(torch.empty(shape.hidden))
        self.router = nn.Linear(shape.hidden, shape.experts, bias=True)
        self.experts = FusedExperts(shape.experts, shape.hidden, shape.inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        h = (flat.float() * torch.rsqrt(flat.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.norm
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out: torch.Tensor = x + self.experts(h, index, weights).reshape(x.shape)
        return out


def fill_weights(layers: Sequence[MoeLayer], shape: StackShape, device: torch.device, *, zipf: float,
                 seed: int = 0) -> None:
    """Write deterministic weights into `layers`' parameters (their host copies after
    ``wrap_modules``), drawn on `device` expert by expert so that no large temporary is made."""
    generator = torch.Generator(device).manual_seed(seed)
    order = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            layer.norm.copy_(torch.ones(shape.hidden, dtype=shape.dtype))
            router = torch.randn(shape.experts, shape.hidden, generator=generator, device=device)
            layer.router.weight.copy_((router / math.sqrt(shape.hidden)).to(shape.dtype))
            ranks = torch.randperm(shape.experts, generator=order).to(torch.float32)
            layer.router.bias.copy_((-zipf * torch.log(ranks + 1)).to(shape.dtype))
            for param in (layer.experts.gate_up_proj, layer.experts.down_proj):
                for expert in range(shape.experts):
                    row = torch.randn(param.shape[1:], generator=generator, device=device, dtype=torch.float32)
                    param[expert].copy_((row * 0.02).to(shape.dtype))


def meta_stack(shape: StackShape) -> nn.ModuleList:
    """The stack on meta: no memory taken."""
    with torch.device("meta"):
        layers = nn.ModuleList([MoeLayer(shape) for _ in range(shape.layers)])
    layers.to(shape.dtype).requires_grad_(False)
    return layers


def offload_stack(layers: nn.ModuleList, shape: StackShape, device: torch.device, *, cache: bool,
                  zipf: float) -> Offloader:
    """`layers` (on meta) offloaded every layer through the engine lifecycle: planned,
    wrapped, weights written into the host copies, ``post_init``.

    Raises:
        RuntimeError: offload does not find an experts module in every layer.
    """
    spec = describe_layers(list(layers))
    if len(spec.experts) != shape.layers:
        raise RuntimeError(f"offload found {len(spec.experts)} experts modules in {shape.layers} layers")
    plan = make_plan(spec, OffloadConfig(group_size=1, prefetch_step=2, expert_cache=cache), capture_env())
    offloader = create_offloader(plan)
    offloader.wrap_modules(list(layers))
    fill_weights([layer for layer in layers if isinstance(layer, MoeLayer)], shape, device, zipf=zipf)
    offloader.post_init()
    return offloader


def pinned_bandwidth(device: torch.device, nbytes: int = GIB) -> float:
    """Host-to-device bytes per second from pinned memory: median of 5 copies of `nbytes`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    del host, target
    return nbytes / statistics.median(seconds)


@attrs.frozen
class StackRow:
    """One mode and batch of the stack: tokens/s and per-step bytes (means over the timed steps)."""

    mode: str
    batch: int
    step_seconds: float
    copied: float
    needed: float
    hits: float | None
    first_output: torch.Tensor

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.step_seconds

    @property
    def line(self) -> str:
        hits = "n/a" if self.hits is None else f"{self.hits:.1f}"
        return (f"{self.mode:<12} {self.batch:>5} {self.tokens_per_second:>9.2f} {self.step_seconds * 1e3:>8.1f} "
                f"{self.copied / GB:>9.3f} {self.needed / GB:>9.3f} {hits:>7} {self.copied / self.needed:>11.3f}")


def measure_stack(shape: StackShape, device: torch.device, *, cache: bool, batches: Sequence[int], steps: int,
                  zipf: float) -> list[StackRow]:
    """Build and offload the stack, run one untimed and `steps` timed decode steps per
    batch, and let the stack go (its host memory is given back before the next build)."""
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    layers = meta_stack(shape)
    rows = []
    # Recording starts before offloading: the cache's patched forward hides the module's
    # signature, by which record_routing finds the experts modules.
    with record_routing(list(layers)) as record:
        offloader = offload_stack(layers, shape, device, cache=cache, zipf=zipf)
        try:
            base = non_expert_bytes(offloader.plan, record.groups)
            forwards = 0
            with torch.inference_mode():
                for batch in batches:
                    generator = torch.Generator(device).manual_seed(batch)
                    xs = [torch.randn(batch, 1, shape.hidden, generator=generator, device=device).to(shape.dtype)
                          for _ in range(steps + 1)]
                    times: list[float] = []
                    copied = needed = hits = routed = 0
                    first: torch.Tensor | None = None
                    for index, x in enumerate(xs):
                        before = offloader.stats()
                        sync()
                        start = time.perf_counter()
                        for layer in layers:
                            x = layer(x)
                        sync()
                        elapsed = time.perf_counter() - start
                        after = offloader.stats()
                        forwards += 1
                        if index == 0:
                            first = x.to("cpu", copy=True)
                            continue  # the untimed step
                        times.append(elapsed)
                        copied += after.bytes_copied - before.bytes_copied
                        needed += base + routed_bytes(record.trace(), forwards - 1)
                        hits += sum(c.hits for c in after.experts) - sum(c.hits for c in before.experts)
                        routed += sum(c.hits + c.misses for c in after.experts) - \
                            sum(c.hits + c.misses for c in before.experts)
                    assert first is not None
                    rows.append(StackRow(mode="expert cache" if cache else "whole-layer", batch=batch,
                                         step_seconds=statistics.median(times), copied=copied / steps,
                                         needed=needed / steps, hits=100 * hits / routed if routed else None,
                                         first_output=first))
        finally:
            del offloader
    del layers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _available_gb() -> float | None:
    """MemAvailable of /proc/meminfo, in GB; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None


def run_gpu(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("bench_moe --gpu: skipped: CUDA is not available on this machine")
        return 0
    device = torch.device("cuda")
    shape = attrs.evolve(QWEN3_235B, layers=args.gpu_layers)
    begun = time.perf_counter()
    bandwidth = pinned_bandwidth(device)
    print(f"bench_moe --gpu: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; {shape.layers} MoE "
          f"layers: E {shape.experts}, top-{shape.top_k}, hidden {shape.hidden}, expert intermediate {shape.inter}, "
          f"{str(shape.dtype).removeprefix('torch.')}: B {shape.expert_bytes / 2**20:.1f} MiB, "
          f"{shape.experts * shape.expert_bytes * shape.layers / GIB:.1f} GiB of experts; router bias -s ln(rank), "
          f"s = {args.gpu_zipf:g}; pinned host-to-device {bandwidth / GB:.1f} GB/s (median of 5 copies of 1 GiB); "
          f"host memory available {_available_gb() or float('nan'):.1f} GB")
    rows: list[StackRow] = []
    for cache in (True, False):
        started = time.perf_counter()
        measured = measure_stack(shape, device, cache=cache, batches=(1, 64), steps=args.gpu_steps,
                                 zipf=args.gpu_zipf)
        rows += measured
        print(f"{'expert cache' if cache else 'whole-layer'}: built and measured in "
              f"{time.perf_counter() - started:.1f} s; host memory available after {_available_gb() or 0:.1f} GB")
    print()
    print(GPU_HEADER)
    for row in rows:
        print(row.line)
    print()
    same = True
    for batch in (1, 64):
        ours = next(r for r in rows if r.batch == batch and r.mode == "expert cache")
        whole = next(r for r in rows if r.batch == batch and r.mode == "whole-layer")
        same &= torch.equal(ours.first_output, whole.first_output)
        bound = batch / (ours.needed / bandwidth)
        print(f"batch {batch}: expert cache {ours.tokens_per_second:.2f} tokens/s = "
              f"{ours.tokens_per_second / whole.tokens_per_second:.2f}x whole-layer streaming "
              f"({whole.tokens_per_second:.2f} tokens/s), {ours.tokens_per_second / bound:.2f}x the link bound "
              f"({bound:.2f} tokens/s: {ours.needed / GB:.3f} GB needed per step at {bandwidth / GB:.1f} GB/s; the "
              f"cache copies {ours.copied / GB:.3f} GB, hits {ours.hits or 0:.1f}%)")
    print(f"outputs of the expert cache and whole-layer streaming bit for bit equal: {str(same).lower()}")
    print(f"total {time.perf_counter() - begun:.1f} s")
    return 1 if args.strict and not same else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=None, help="models of tests.hf.moe_models (default: all 7)")
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="batch sizes (default 1 4 16 64)")
    parser.add_argument("--layers", type=int, default=6, help="layers per model (default 6)")
    parser.add_argument("--prompt", type=int, default=8, help="prefill tokens (default 8)")
    parser.add_argument("--steps", type=int, default=1, help="decode steps measured (default 1)")
    parser.add_argument("--experts-implementation", default=None, choices=("eager", "grouped_mm", "batched_mm"),
                        help="transformers' experts implementation where the model has it (default: its own)")
    parser.add_argument("--zipf-steps", type=int, default=2000, help="steps of each Zipf trace (default 2000)")
    parser.add_argument("--gpu", action="store_true", help="the Qwen3-235B-shaped stack on CUDA instead")
    parser.add_argument("--gpu-layers", type=int, default=QWEN3_235B.layers, help="layers of the stack (default 8)")
    parser.add_argument("--gpu-steps", type=int, default=3, help="timed decode steps per batch (default 3)")
    parser.add_argument("--gpu-zipf", type=float, default=1.0, help="router bias exponent s (default 1; 0: none)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a row misses a target")
    args = parser.parse_args(argv)
    if min(args.layers, args.prompt, args.steps, args.zipf_steps, args.gpu_layers, args.gpu_steps,
           *args.batches) < 1 or args.gpu_zipf < 0:
        parser.error("sizes, counts and batches must be at least 1, --gpu-zipf at least 0")
    return run_gpu(args) if args.gpu else run_cpu(args)


if __name__ == "__main__":
    sys.exit(main())
