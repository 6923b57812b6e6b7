"""What the planner predicts for a mixture-of-experts stack too big for the device.

The stack of ``bench_moe --gpu`` (shaped like Qwen3-235B-A22B's MoE layers: ``--layers`` 8
of 128 experts, top-8, hidden 4096, expert intermediate 1536, bf16), described on meta (no
memory taken), fitted by the pure planner to a ``--budget-gib`` device budget (24) on a
``--profile`` (``h100-pcie5``) at ``--batches`` 1 and 64 tokens per step, three ways:

- ``bound``: without a routing trace, the top-k bound (each module's top-k read off the
  layer, as `find_experts` reads it: at most min(E, T x top-k) misses per call);
- ``no top-k``: without a trace, the module's top-k left out (every expert may be routed,
  and miss, at each call);
- ``zipf``: over a Zipf (``--zipf`` s = 1) trace of ``--trace-steps`` (200) steps of that
  many tokens, top-8 (`zipf_trace`).

Per row: the predicted step in ms, the limit a step cannot beat (max(compute, bytes over
the link / pinned rate), ms) and their ratio, the chosen configuration, and over the trace
the predicted hit rate beside Belady's for the same slots. Nothing runs: these are the
planner's predictions, the numbers `offload plan --fit-gib` prints, not measurements.
"""

from __future__ import annotations

import argparse
import sys

import attrs

from benchmarks.bench_moe import QWEN3_235B, meta_stack
from offload import describe_layers
from offload.pure import EnvSnapshot
from offload.pure.experts.replay import zipf_trace
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import profile_by_name
from offload.pure.fit.search import FitResult, fit
from offload.pure.spec.values import ModelSpec

HEADER = f"{'batch':>5}  {'costed':<8}  {'step ms':>9}  {'limit ms':>9}  {'ratio':>6}  {'hits %':>6}  " \
         f"{'belady %':>8}  config"
WAYS = ("bound", "no top-k", "zipf")


def row(batch: int, way: str, result: FitResult) -> str:
    step = result.estimate
    config = result.chosen.config
    chosen = f"{config.backend} g{config.group_size} k{config.num_in_group} d{config.prefetch_step}" \
        if config.backend == "prefetch" else config.backend
    chosen += f", caches C {min(c.slots for c in result.plan.experts)}" if result.plan.experts else \
        ", experts streamed whole" if config.backend == "prefetch" else ""
    hits = f"{step.expert_hit_rate * 100:.1f}" if step.expert_hit_rate is not None else "-"
    best = f"{step.belady_hit_rate * 100:.1f}" if step.belady_hit_rate is not None else "-"
    return (f"{batch:>5}  {way:<8}  {step.step_seconds * 1e3:>9.1f}  {step.limit_seconds * 1e3:>9.1f}  "
            f"{step.step_seconds / step.limit_seconds:>6.2f}  {hits:>6}  {best:>8}  {chosen}")


def fits(spec: ModelSpec, profile_name: str, budget: int, batch: int, *, zipf: float,
         steps: int) -> dict[str, FitResult]:
    """The three fits of one batch (the module docstring)."""
    profile = profile_by_name(profile_name)
    workload = Workload(tokens_per_step=batch)
    unbounded = attrs.evolve(spec, experts=tuple(attrs.evolve(g, top_k=None) for g in spec.experts))
    trace = zipf_trace(spec.experts, steps=steps, top_k=QWEN3_235B.top_k, tokens=batch, s=zipf, seed=0)
    env = EnvSnapshot()
    return {
        "bound": fit(spec, env, profile, workload, budget),
        "no top-k": fit(unbounded, env, profile, workload, budget),
        "zipf": fit(spec, env, profile, workload, budget, routing=trace),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=QWEN3_235B.layers, help="layers of the stack (default 8)")
    parser.add_argument("--budget-gib", type=float, default=24.0, help="device budget in GiB (default 24)")
    parser.add_argument("--profile", default="h100-pcie5", help="device profile (default h100-pcie5)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64], help="tokens per step (default 1 64)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s of the trace (default 1)")
    parser.add_argument("--trace-steps", type=int, default=200, help="steps of the trace (default 200)")
    args = parser.parse_args(argv)
    if min(args.layers, args.trace_steps, *args.batches) < 1 or args.budget_gib <= 0 or args.zipf < 0:
        parser.error("layers, steps and batches must be at least 1, the budget above 0, --zipf at least 0")
    shape = attrs.evolve(QWEN3_235B, layers=args.layers)
    spec = describe_layers(list(meta_stack(shape)))
    budget = int(args.budget_gib * (1 << 30))
    print(f"{args.layers} layers of {shape.experts} experts (top-{shape.top_k}), {spec.nbytes / (1 << 30):.1f} GiB; "
          f"device budget {args.budget_gib:g} GiB; profile {args.profile}; trace: Zipf s = {args.zipf:g}, "
          f"{args.trace_steps} steps")
    print(HEADER)
    for batch in args.batches:
        for way, result in fits(spec, args.profile, budget, batch, zipf=args.zipf, steps=args.trace_steps).items():
            print(row(batch, way, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
