"""How long planning a large model takes: `describe_layers` and `make_plan` (CPU; no GPU
needed).

Model: 1,000 layers of 20 parameters each (bf16; every 5th a 1024 vector, the rest
1024x1024 matrices), each layer's parameters in 4 sub-modules of 5, built on the meta
device (no memory). Rows:

- ``describe_layers``: the layers to a `ModelSpec` (target 0.1 s). The row below it is
  the part torch takes, walking ``named_parameters()`` alone, for reference.
- ``make_plan``: that spec to a plan, for each backend (target 0.04 s).

Prints the best and median of several runs and the best as a ratio to the target.

Run: ``python -m benchmarks.bench_plan``
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from offload.describe import describe_layers
from offload.pure import EnvSnapshot, ModelSpec, OffloadConfig, Platform, make_plan

DESCRIBE_TARGET_S = 0.1
PLAN_TARGET_S = 0.04
LAYERS = 1000
PARAMS_PER_LAYER = 20
PARTS = 4  # sub-modules per layer, PARAMS_PER_LAYER / PARTS parameters each
RUNS = 9


def big_layers() -> list[nn.Module]:
    """1,000 layers x 20 meta-device parameters; every 5th a vector, the rest 1024x1024."""
    per_part = PARAMS_PER_LAYER // PARTS

    def layer() -> nn.Module:
        root = nn.Module()
        for part in range(PARTS):
            child = nn.Module()
            for k in range(per_part):
                j = part * per_part + k
                shape = (1024,) if j % 5 == 0 else (1024, 1024)
                child.register_parameter(f"p{j}", nn.Parameter(torch.empty(shape, dtype=torch.bfloat16,
                                                                            device="meta")))
            root.add_module(f"part{part}", child)
        return root

    return [layer() for _ in range(LAYERS)]


def big_spec() -> ModelSpec:
    """The `ModelSpec` of `big_layers`."""
    return describe_layers(big_layers())


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """(best, median) seconds of `RUNS` calls of `run`."""
    times = []
    for _ in range(RUNS):
        # Start each run from a collected heap, so that one run's garbage is not charged
        # to the next; the collector stays on during the run (unlike timeit).
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def row(label: str, best: float, median: float, target: float | None) -> str:
    ratio = f"{best / target:12.2f}" if target else f"{'-':>12}"
    limit = f"{target:9.3f}" if target else f"{'-':>9}"
    return f"{label:<34} {best:8.4f} {median:9.4f} {limit} {ratio}"


def main() -> None:
    layers = big_layers()
    spec = describe_layers(layers)
    env = EnvSnapshot(platform=Platform(has_cuda=True, device_name="bench", device_total_bytes=80 << 30,
                                        can_map_host_memory=True))
    configs = {
        "prefetch g4/n1/s2": OffloadConfig(group_size=4, num_in_group=1, prefetch_step=2),
        "prefetch g1/n1/s3 (all)": OffloadConfig(group_size=1, num_in_group=1, prefetch_step=3),
        "uva 20 GiB": OffloadConfig(uva_max_bytes=20 << 30),
        "none": OffloadConfig(),
    }
    print(f"planning {LAYERS} layers x {PARAMS_PER_LAYER} parameters, best and median of {RUNS} runs")
    print(f"{'step':<34} {'best s':>8} {'median s':>9} {'target s':>9} {'best/target':>12}")
    print(row("describe_layers", *timed(lambda: describe_layers(layers)), DESCRIBE_TARGET_S))
    walk = timed(lambda: [list(layer.named_parameters(remove_duplicate=False)) for layer in layers])
    print(row("  torch's named_parameters alone", *walk, None))
    for label, config in configs.items():
        print(row(f"make_plan {label}", *timed(functools.partial(make_plan, spec, config, env)), PLAN_TARGET_S))


if __name__ == "__main__":
    main()
