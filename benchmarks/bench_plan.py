"""How long planning a large model takes: `describe_layers` and `make_plan` (CPU; no GPU
needed).

Models: 1,000 layers of 20 parameters each (bf16; every 5th a 1024 vector, the rest
1024x1024 matrices), built on the meta device (no memory), in two shapes:

- flat: each layer's parameters in 4 sub-modules of 5 (5,000 modules);
- nested: each parameter in a sub-module of its own, as a transformer block holds them
  (an ``nn.LayerNorm`` for each vector, an ``nn.Linear`` for each matrix, neither with a
  bias: 20 sub-modules a layer, 21,000 modules). The same parameters as the flat model,
  so the two rows differ only in the modules walked.

Rows:

- ``describe_layers``: the layers to a `ModelSpec` (target 0.1 s), for each shape. The
  row below each is the part torch takes, walking ``named_parameters()`` alone, for
  reference.
- ``make_plan``: the flat model's spec to a plan, for each backend (target 0.04 s).

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

from offload.model.describe import describe_layers
from offload.pure import EnvSnapshot, ModelSpec, OffloadConfig, Platform, make_plan

DESCRIBE_TARGET_S = 0.1
PLAN_TARGET_S = 0.04
LAYERS = 1000
PARAMS_PER_LAYER = 20
PARTS = 4  # sub-modules per layer, PARAMS_PER_LAYER / PARTS parameters each
RUNS = 9


def _shape(j: int) -> tuple[int, ...]:
    """The shape of parameter `j` of a layer: every 5th a vector, the rest 1024x1024."""
    return (1024,) if j % 5 == 0 else (1024, 1024)


def big_layers(count: int = LAYERS) -> list[nn.Module]:
    """`count` flat layers x 20 meta-device parameters, in 4 sub-modules of 5."""
    per_part = PARAMS_PER_LAYER // PARTS

    def layer() -> nn.Module:
        root = nn.Module()
        for part in range(PARTS):
            child = nn.Module()
            for k in range(per_part):
                j = part * per_part + k
                child.register_parameter(f"p{j}", nn.Parameter(torch.empty(_shape(j), dtype=torch.bfloat16,
                                                                            device="meta")))
            root.add_module(f"part{part}", child)
        return root

    return [layer() for _ in range(count)]


def nested_layers(count: int = LAYERS) -> list[nn.Module]:
    """`count` nested layers: the parameters of `big_layers`, each in a meta-device
    sub-module of its own (``norm{j}``, an ``nn.LayerNorm``, for a vector; ``proj{j}``,
    an ``nn.Linear``, for a matrix; neither with a bias)."""

    def layer() -> nn.Module:
        root = nn.Module()
        for j in range(PARAMS_PER_LAYER):
            if len(_shape(j)) == 1:
                root.add_module(f"norm{j}", nn.LayerNorm(1024, bias=False, dtype=torch.bfloat16, device="meta"))
            else:
                root.add_module(f"proj{j}", nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16, device="meta"))
        return root

    return [layer() for _ in range(count)]


def walk_parameters(layers: list[nn.Module]) -> list[list[tuple[str, nn.Parameter]]]:
    """What torch takes: each layer's ``named_parameters(remove_duplicate=False)``, listed."""
    return [list(layer.named_parameters(remove_duplicate=False)) for layer in layers]


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
    nested = nested_layers()
    spec = describe_layers(layers)
    env = EnvSnapshot(platform=Platform(has_cuda=True, device_name="bench", device_total_bytes=80 << 30,
                                        can_map_host_memory=True))
    configs = {
        "prefetch g4/n1/s2": OffloadConfig(group_size=4, num_in_group=1, prefetch_step=2),
        "prefetch g1/n1/s3 (all)": OffloadConfig(group_size=1, num_in_group=1, prefetch_step=3),
        "uva 20 GiB": OffloadConfig(uva_max_bytes=20 << 30),
        "none": OffloadConfig(),
    }
    modules = {label: sum(1 for layer in model for _ in layer.modules())
               for label, model in (("flat", layers), ("nested", nested))}
    print(f"planning {LAYERS} layers x {PARAMS_PER_LAYER} parameters (flat: {modules['flat']:,} modules, "
          f"nested: {modules['nested']:,}), best and median of {RUNS} runs")
    print(f"{'step':<34} {'best s':>8} {'median s':>9} {'target s':>9} {'best/target':>12}")
    for label, model in (("flat", layers), ("nested", nested)):
        print(row(f"describe_layers {label}", *timed(functools.partial(describe_layers, model)), DESCRIBE_TARGET_S))
        print(row("  torch's named_parameters alone", *timed(functools.partial(walk_parameters, model)), None))
    for label, config in configs.items():
        print(row(f"make_plan {label}", *timed(functools.partial(make_plan, spec, config, env)), PLAN_TARGET_S))


if __name__ == "__main__":
    main()
