"""How long `make_plan` takes on a large spec (CPU; no GPU needed).

Spec: 1,000 layers of 20 parameters each (bf16, a mix of matrices and vectors). Prints
the best and median of several runs for each backend, against the target of 0.1 s.

Run: ``python benchmarks/bench_plan.py``
"""

from __future__ import annotations

import gc
import statistics
import time

from offload.pure import (
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    ParamSpec,
    Platform,
    contiguous_stride,
    make_plan,
)

TARGET_S = 0.1
LAYERS = 1000
PARAMS_PER_LAYER = 20


def big_spec() -> ModelSpec:
    """1,000 layers x 20 parameters; every 5th a vector, the rest 1024x1024 matrices."""

    def param(j: int) -> ParamSpec:
        shape = (1024,) if j % 5 == 0 else (1024, 1024)
        return ParamSpec(name=f"block.p{j}.weight", shape=shape, stride=contiguous_stride(shape),
                         dtype="bfloat16", itemsize=2, device="cuda:0")

    params = tuple(param(j) for j in range(PARAMS_PER_LAYER))
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=params) for i in range(LAYERS)))


def main() -> None:
    spec = big_spec()
    env = EnvSnapshot(platform=Platform(has_cuda=True, device_name="bench", device_total_bytes=80 << 30,
                                        can_map_host_memory=True))
    configs = {
        "prefetch g4/n1/s2": OffloadConfig(group_size=4, num_in_group=1, prefetch_step=2),
        "prefetch g1/n1/s3 (all)": OffloadConfig(group_size=1, num_in_group=1, prefetch_step=3),
        "uva 20 GiB": OffloadConfig(uva_max_bytes=20 << 30),
        "none": OffloadConfig(),
    }
    print(f"make_plan on {LAYERS} layers x {PARAMS_PER_LAYER} parameters (target < {TARGET_S} s)")
    print(f"{'config':<26} {'best s':>8} {'median s':>9} {'ratio to target':>16}")
    for label, config in configs.items():
        times = []
        for _ in range(7):
            # Start each run from a collected heap, so that one run's garbage is not
            # charged to the next; the collector stays on during the run (unlike timeit).
            gc.collect()
            start = time.perf_counter()
            make_plan(spec, config, env)
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"{label:<26} {best:8.4f} {statistics.median(times):9.4f} {best / TARGET_S:16.2f}")


if __name__ == "__main__":
    main()
