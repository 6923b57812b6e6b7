"""Prefetch offloading against the hardware limit (GPU).

Model: 24 bf16 layers of 256 MiB each (Linear 4096 -> 16384, then 16384 -> 4096, no
bias), 6 GiB of weights. For 16, 4096 and 16384 tokens, and for offloading every layer,
every 2nd and every 4th (group_size 1, 2, 4; num_in_group 1; prefetch_step 2), it runs
the model eagerly, and for 16 tokens also as a replayed CUDA graph.

Per row it prints the measured steady-state step time (several back-to-back steps timed
together, divided by their number: with circular prefetch the first layers of the next
step load during the current one), the resident step time (every weight on the device,
same mode), the pinned host-to-device bandwidth measured here with a 1 GiB copy, the limit
max(resident, offloaded bytes per step / bandwidth), the ratio to it, and (eager rows) the
time per step the compute stream stood waiting for copies (``stats().wait_seconds``).
Target: every ratio at most 1.02.

Run: ``python benchmarks/bench_prefetch.py`` (about 1 to 2 minutes on an H200; needs
6 GiB of device memory and up to 7 GiB of pinned host memory). Without CUDA it says so
and exits 0. ``--strict`` exits 1 when a row misses the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from offload import OffloadConfig, capture_env, create_offloader, describe_layers, make_plan
from offload.capture.numa_bandwidth import numa_bandwidth_lines
from offload.executors import PrefetchOffloader
from offload.graphs import capture_forward

LAYERS = 24
HIDDEN = 4096
INNER = 16384
TOKENS = (16, 4096, 16384)
GRAPH_TOKENS = 16
EVERY = (1, 2, 4)  # group_size: offload every layer, every 2nd, every 4th
PREFETCH_STEP = 2
TARGET = 1.02
BANDWIDTH_BYTES = 1 << 30


class Layer(nn.Module):
    """Two linear layers, 4096 -> 16384 -> 4096, bf16, no bias: 256 MiB of weights."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, INNER, bias=False, device="cuda", dtype=torch.bfloat16)
        self.down = nn.Linear(INNER, HIDDEN, bias=False, device="cuda", dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.up(x))
        return out


def pinned_bandwidth() -> float:
    """Host-to-device bytes per second from pinned memory: median of 5 copies of 1 GiB."""
    src = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / statistics.median(seconds)


def step_time(run: Callable[[], object], *, warmup: int, steps: int) -> float:
    """Seconds per step: `steps` back-to-back runs after `warmup`, timed together."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def inputs() -> dict[int, torch.Tensor]:
    return {t: torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16) for t in TOKENS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=8, help="steps timed per row (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a row misses the target")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefetch: CUDA is not available; this benchmark needs a CUDA GPU. Nothing measured.")
        print(*numa_bandwidth_lines(capture_env(os.environ).platform.numa), sep="\n")
        return 0

    torch.manual_seed(0)
    model = nn.Sequential(*[Layer() for _ in range(LAYERS)]).requires_grad_(False)
    layers = list(model)
    env = capture_env(os.environ)
    bandwidth = pinned_bandwidth()
    xs = inputs()

    def timed(run: Callable[[], object]) -> float:
        return step_time(run, warmup=args.warmup, steps=args.steps)

    def forward_on(t: int) -> Callable[[], object]:
        return lambda: model(xs[t])

    resident = {t: timed(forward_on(t)) for t in TOKENS}
    graph_x = xs[GRAPH_TOKENS].clone()
    resident_graph, _ = capture_forward(model, graph_x, None)
    resident_replay = timed(resident_graph.replay)
    del resident_graph

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {LAYERS} bf16 layers of "
          f"{HIDDEN}x{INNER} + {INNER}x{HIDDEN} (256 MiB each), prefetch_step {PREFETCH_STEP}")
    print(f"pinned host-to-device bandwidth (1 GiB copy): {bandwidth / 1e9:.1f} GB/s")
    print(*numa_bandwidth_lines(env.platform.numa), sep="\n")  # registered, local vs remote node
    header = (f"{'mode':<6} {'tokens':>6} {'offload':>9} {'GiB/step':>8} {'step ms':>9} {'resident ms':>11} "
              f"{'GB/s':>6} {'limit ms':>9} {'ratio':>6} {'wait ms':>8}  target")
    print(header)
    misses = 0
    rows = 0
    for every in EVERY:
        config = OffloadConfig(group_size=every, num_in_group=1, prefetch_step=PREFETCH_STEP)
        plan = make_plan(describe_layers(layers), config, env)
        off = create_offloader(plan)
        assert isinstance(off, PrefetchOffloader)
        off.wrap_modules(layers)
        off.post_init()
        link = plan.offloaded_bytes / bandwidth
        label = "all" if every == 1 else f"1 in {every}"
        # (mode, tokens, step seconds, resident seconds, seconds per step the compute
        # stream waited for copies: stats().wait_seconds, not measured inside graphs)
        measured: list[tuple[str, int, float, float, float | None]] = []
        for t in TOKENS:
            waited = off.stats().wait_seconds
            step = timed(forward_on(t))
            waited = None if waited is None else (off.stats().wait_seconds or 0.0) - waited
            measured.append(("eager", t, step, resident[t],
                             None if waited is None else waited / (args.warmup + args.steps)))
        if plan.pin.pin:
            graph_x.copy_(xs[GRAPH_TOKENS])
            graph, _ = capture_forward(model, graph_x, off)
            measured.append(("graph", GRAPH_TOKENS, timed(graph.replay), resident_replay, None))
            del graph
        else:
            print(f"(graph row skipped for {label}: pinning is off, {plan.pin.explanation})")
        for mode, tokens, step, base, wait in measured:
            limit = max(base, link)
            ratio = step / limit
            ok = ratio <= TARGET
            rows += 1
            misses += not ok
            print(f"{mode:<6} {tokens:>6} {label:>9} {plan.offloaded_bytes / 2**30:>8.2f} {step * 1e3:>9.2f} "
                  f"{base * 1e3:>11.2f} {bandwidth / 1e9:>6.1f} {limit * 1e3:>9.2f} {ratio:>6.3f} "
                  f"{'-' if wait is None else f'{wait * 1e3:.2f}':>8}  "
                  f"{'ok' if ok else 'MISS'} (<= {TARGET})")
        off.restore()
        torch.cuda.synchronize()
    print(f"{rows - misses} of {rows} rows within {TARGET} of the limit")
    return 1 if args.strict and misses else 0


if __name__ == "__main__":
    sys.exit(main())
