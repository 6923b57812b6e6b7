"""A forward step with disk-tier layers against the planner's prediction for it.

A random Llama-shaped float32 checkpoint (``--hidden``, ``--layers``; 342 MB by default,
width 512 and 24 layers of 12.8 MB) is written under ``--dir`` and removed afterwards. In
one run:

1. ``plain``: the checkpoint's files read by the plain sequential ``O_DIRECT`` reader of
   `benchmarks.bench_disk` after eviction (the median of ``--repeat`` runs), before and
   again after the timed steps: the disk's rate, in GB/s, is the mean of the two (it
   drifts on a virtual disk).
2. The model is loaded with `offload_pretrained(..., host_budget_bytes=)`, every layer
   offloaded (prefetch depth 2), the host budget a third of the offloaded bytes, and
   ``disk_gbps`` the rate just measured.
3. One untimed forward of ``--tokens`` tokens, then ``--steps`` timed ones: the median step.
   Measured first in the same run: the step with no disk tier (every layer in host
   memory: its copies' rate), and the resident step (every weight resident).
4. The planner's prediction: `estimate_with_tier` on this machine as a profile (copies at
   the rate measured, compute from the resident step, the disk at the plain rate).

It prints the rate, the tier, the predicted and measured step, their ratio (target: within
15%, 0.85 to 1.15), and what `stats()` says of the reads (achieved GB/s, time the copies
waited for reads, reads not started ahead). Run: ``python benchmarks/bench_disk_step.py``
(about 30 s on the CPU machine); ``--quick`` is a small smoke run.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from benchmarks.bench_disk import PIECE, evict, filesystem_of, read_plain, timed
from offload import EnvSnapshot, OffloadConfig
from offload.hf import offload_pretrained
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.runtime.cpu import CpuRuntime

MIB = 1 << 20
GB = 1e9
TARGET = 0.15  # the step within this fraction of the prediction


def write_checkpoint(directory: Path, *, hidden: int, layers: int) -> int:
    """A random Llama-shaped float32 checkpoint in `directory`; its parameters' bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    nbytes: int = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{max(nbytes // 4 // 1_000_000, 1)}MB")
    return nbytes


def plain_gbps(paths: Sequence[Path], repeat: int) -> tuple[float, bool]:
    """The plain reader's median rate over `paths` (evicted before each run), and whether
    it read with ``O_DIRECT``."""
    region = mmap.mmap(-1, PIECE)
    buffer = memoryview(region)
    modes: list[bool] = []
    read_plain(paths, [buffer], direct=modes)  # untimed: faults the buffer in
    rates = []
    for _ in range(repeat):
        evict(paths)
        rates.append(timed(functools.partial(read_plain, paths, [buffer], direct=modes)))
    buffer.release()
    region.close()
    return statistics.median(rates), all(modes)


def steps_of(model: Any, ids: torch.Tensor, count: int) -> list[float]:
    """Seconds of `count` forwards of `ids`, after an untimed one."""
    found = []
    with torch.inference_mode():
        model(input_ids=ids)
        for _ in range(count):
            start = time.perf_counter()
            model(input_ids=ids)
            found.append(time.perf_counter() - start)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, default=512, help="the model's width (default 512)")
    parser.add_argument("--layers", type=int, default=24, help="its layers (default 24)")
    parser.add_argument("--steps", type=int, default=5, help="timed forward steps (default 5)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per step (default 8)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the plain reader (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: the "
                        "current directory)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: width 128, 8 layers, 2 steps")
    parser.add_argument("--strict", action="store_true", help="exit 1 if the step misses the target")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.steps, args.repeat = 128, 8, 2, 1
    base = args.dir if args.dir is not None else Path.cwd()
    directory = Path(tempfile.mkdtemp(prefix="bench-disk-step-", dir=base))
    try:
        return run(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, directory: Path) -> int:
    checkpoint, spill = directory / "model", directory / "spill"
    spill.mkdir()
    nbytes = write_checkpoint(checkpoint, hidden=args.hidden, layers=args.layers)
    paths = sorted(checkpoint.glob("*.safetensors"))
    rate, direct = plain_gbps(paths, args.repeat)
    print(f"bench_disk_step: a {nbytes / GB:.3f} GB Llama checkpoint (width {args.hidden}, {args.layers} layers) "
          f"on {filesystem_of(directory)}")
    print(f"plain reader before the steps: {rate:.3f} GB/s ({'O_DIRECT' if direct else 'buffered'}, median of "
          f"{args.repeat})")
    config = OffloadConfig(backend="prefetch", group_size=1, prefetch_step=2)
    ids = torch.randint(0, 8192, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    probe_budget = 1 << 50  # no disk tier: the plan's offloaded bytes, and a step with every layer in host memory
    resident, probe = offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(),
                                         host_budget_bytes=probe_budget, disk_gbps=rate)
    floor = statistics.median(steps_of(resident, ids, args.steps))
    copies = probe.stats()
    copy_rate = copies.timed_bytes / copies.copy_seconds if copies.copy_seconds else 10e9
    budget = probe.plan.host_bytes // 3
    probe.restore()
    resident_step = statistics.median(steps_of(resident, ids, args.steps))  # every weight resident, no copies
    del probe, resident
    evict(paths)
    model, offloader = offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, disk_gbps=rate, spill_dir=spill)
    tier = offloader.disk_tier
    if tier is None:
        print("no disk tier: the budget holds every offloaded layer")
        return 1
    print(f"tier: {len(tier.disk_positions)} of {len(offloader.plan.offloaded_layers)} layers on disk "
          f"({tier.disk_bytes / GB:.3f} GB), host budget {budget / MIB:.1f} MiB, read ahead {tier.read_ahead}")
    steps = steps_of(model, ids, args.steps)
    stats = offloader.stats()
    after, _ = plain_gbps(paths, args.repeat)  # the disk's rate drifts: measured on both sides of the steps
    rate = statistics.median([rate, after])
    tier = attrs.evolve(tier, disk_gbps=rate)
    offloader.restore()
    step = statistics.median(steps)
    # This machine as a profile: copies at the rate the run without a disk tier measured,
    # compute from the resident step (`Workload.resident_step_seconds`).
    here = DeviceProfile(name="this-machine", device_name="cpu", pinned_h2d_bytes_per_s=copy_rate,
                         pageable_h2d_bytes_per_s=copy_rate, zero_copy_fraction=1.0, bf16_flops_per_s=1e12,
                         source="measured in this run")
    predicted = estimate_with_tier(offloader.plan, tier, here, Workload(tokens_per_step=args.tokens,
                                                                      resident_step_seconds=resident_step)).step_seconds
    ratio = step / predicted
    print(f"plain reader after the steps: {after:.3f} GB/s; the prediction takes their mean, {rate:.3f} GB/s")
    print(f"resident step {resident_step * 1e3:.1f} ms; step without the disk tier (every layer in host memory) "
          f"{floor * 1e3:.1f} ms; copies at {copy_rate / GB:.2f} GB/s")
    print(f"predicted step (estimate_with_tier: the disk tier read at {rate:.3f} GB/s, copies and compute as "
          f"measured): {predicted * 1e3:.1f} ms; the disk tier's reads alone {tier.read_seconds * 1e3:.1f} ms")
    print(f"measured step: {step * 1e3:.1f} ms (median of {args.steps}: "
          f"{' '.join(f'{s * 1e3:.1f}' for s in steps)})")
    print(f"ratio step/predicted: {ratio:.3f} (target {1 - TARGET:.2f} to {1 + TARGET:.2f})")
    achieved = stats.disk_gbps
    print(f"reads: {'n/a' if achieved is None else f'{achieved:.3f} GB/s'}, copies waited "
          f"{stats.disk_wait_seconds / max(stats.steps, 1) * 1e3:.1f} ms per step, {stats.disk_misses} not started "
          "ahead")
    return 1 if args.strict and abs(ratio - 1) > TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())
