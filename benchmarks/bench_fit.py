"""How long `fit` takes on the built-in models and device profiles (CPU; no GPU needed).

For every model preset, plus a 126-layer model with Llama 3.1 405B's shapes, and every
device profile, `fit` searches for the fastest configuration in a budget of 30% and 60%
of the model's bytes, at 1 and at 4096 tokens per step. Each line prints the best of a
few runs against the target of 1 s, what was chosen, and its predicted step against the
limit (max(resident compute, offloaded bytes / pinned rate)).

Run: ``python benchmarks/bench_fit.py``
"""

from __future__ import annotations

import statistics
import time

from offload.errors import PlanError
from offload.pure import EnvSnapshot, ModelSpec, preset_spec
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import PROFILES
from offload.pure.fit.render import describe_config
from offload.pure.fit.search import fit
from offload.pure.spec.presets import llama_spec
from offload.pure.units import format_bytes

TARGET_S = 1.0
REPEATS = 3
FRACTIONS = (0.3, 0.6)
TOKENS = (1, 4096)


def models() -> dict[str, ModelSpec]:
    """The presets and a 126-layer model (Llama 3.1 405B: hidden 16384, intermediate 53248,
    128 heads, 8 KV heads)."""
    specs = {name: preset_spec(name) for name in ("llama-8b", "llama-70b", "mixtral-8x7b")}
    specs["llama-405b (126 layers)"] = llama_spec(layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8)
    return specs


def main() -> None:
    env = EnvSnapshot()  # this machine, without CUDA: fit plans for each profile's device
    print(f"fit: best of {REPEATS} runs, target < {TARGET_S} s; budget as a fraction of the model's bytes")
    header = f"{'model':<24} {'profile':<11} {'budget':>10} {'tokens':>6} {'best s':>7} {'median s':>8}  " \
             f"{'step/limit':>10}  chosen"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for model_name, spec in models().items():
        for profile in PROFILES.values():
            for fraction in FRACTIONS:
                budget = int(spec.nbytes * fraction)
                for tokens in TOKENS:
                    times = []
                    outcome = ""
                    for _ in range(REPEATS):
                        start = time.perf_counter()
                        try:
                            result = fit(spec, env, profile, Workload(tokens_per_step=tokens), budget)
                            outcome = f"{result.estimate.ratio_to_limit:10.3f}  {describe_config(result.chosen.config)}"
                        except PlanError as error:
                            outcome = f"{'-':>10}  does not fit: {error.message[:60]}"
                        times.append(time.perf_counter() - start)
                    worst = max(worst, min(times))
                    print(f"{model_name:<24} {profile.name:<11} {format_bytes(budget):>10} {tokens:>6} "
                          f"{min(times):7.3f} {statistics.median(times):8.3f}  {outcome}")
    print(f"slowest best run: {worst:.3f} s ({worst / TARGET_S:.2f} of the target)")


if __name__ == "__main__":
    main()
