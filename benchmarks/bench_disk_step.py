"""A forward step with disk-tier layers against the disk's limit and the planner's prediction.

A random Llama-shaped float32 checkpoint (``--size`` 0.5, 2.7 or 6.0 GB, or ``--hidden``
and ``--layers``) is written under ``--dir`` and removed afterwards. Every layer is
offloaded (prefetch depth 2); a quarter of the offloaded bytes (``--host-fraction``) may
stay in host memory, and the last layers go to disk. Two models are loaded: every layer in
host memory (the *host-tier* model) and the disk tier's. Before them, the disk's rate as
``offload env --disk`` measures it (`offload.runtime.diskrate.measure_disk_rate`, a scratch
file). Then per ``--tokens`` count, ``--rounds`` rounds of, in one process:

1. the disk layers' bytes read by the plain reader (one thread, ``O_DIRECT``, 16 MiB
   ``preadv`` into one buffer: `benchmarks.bench_disk.read_plain_runs`) and by the tier's
   reader as the tier reads them (`read_like_the_tier`: `DiskReader`'s threads, a request
   per run of a layer, two staging buffers), in turn first, each after eviction;
2. ``--steps`` host-tier steps (its copies included: the CPU runtime runs them on the
   compute thread), and as many while a thread reads the disk layers' bytes as the tier
   reads them (what the reads and the compute take from each other on these cores: the
   steps' time, and the rate those reads reach);
3. ``--steps`` disk-tier steps back to back, after an untimed one (after a pause the ring
   has its first reads done: that step is short).

So the reads and the steps see the same disk: on this virtual disk the rate moves by 2x or
more within a minute. Each round waits (up to ``--quiet-wait`` s) for other processes to
leave the cores and the disk, and says what they used. Per round:

- the limit: max(host-tier step, disk bytes per step / the plain reader's rate), and
  ``step/limit`` (target: at most 1.15);
- the prediction: `estimate_with_tier` on this machine as a profile, the compute the
  host-tier step, copies at the rate the host-tier model measured, the disk at the tier
  reader's rate; ``step/predicted`` (target 0.85 to 1.15). Beside it, the prediction from
  the plain reader's rate, from ``offload env --disk``'s rate, with the compute as the
  host-tier step runs while the disk reads, from the reader's rate while the host-tier
  model runs, and from the rate the tier's reads reached during the steps (``stats()``:
  the simulation given the rate the step saw).

It prints each round, then the median ratio of the rounds and their range, and what
``stats()`` says of the reads during the timed steps. Run: ``python -m
benchmarks.bench_disk_step --size 0.5`` (1 to 3 minutes on the CPU machine, longer while
other processes keep it busy; 2.7 and 6.0 need 3 and 6 GB of disk, about 1.5x that of host
memory, and about 3 and 6 minutes); ``--quick`` is a small smoke run.
docs/disk.md ("A step against the prediction") has the measurements.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from benchmarks.bench_disk import (
    PIECE,
    filesystem_of,
    merged_runs,
    others,
    read_plain_runs,
    timed,
    usage,
    wait_for_quiet,
)
from offload import EnvSnapshot, OffloadConfig
from offload.hf import offload_pretrained
from offload.hf.offloader import ModelOffloader
from offload.pure.disk.estimate import estimate_with_tier
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.plan.plan import OffloadPlan
from offload.pure.stats import OffloadStats
from offload.runtime.cpu import CpuRuntime
from offload.runtime.diskio import DiskReader
from offload.runtime.diskrate import evict, layer_bytes, measure_disk_rate, read_like_the_tier, staging_buffers

MIB = 1 << 20
GB = 1e9
TARGET = 0.15  # the step within this fraction of the prediction, and at most 1 + this of the limit
#: ``--size``: (width, layers) of the Llama-shaped float32 checkpoints measured (GB as written).
SIZES = {"0.5": (640, 24), "2.7": (1536, 23), "6.0": (2048, 29)}

Run = tuple[str, int, int]


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
    del model
    return nbytes


def steps_of(model: Any, ids: torch.Tensor, count: int, *, untimed: int = 1) -> list[float]:
    """Seconds of `count` back-to-back forwards of `ids`, after `untimed` ones."""
    found = []
    with torch.inference_mode():
        for _ in range(untimed):
            model(input_ids=ids)
        for _ in range(count):
            start = time.perf_counter()
            model(input_ids=ids)
            found.append(time.perf_counter() - start)
    return found


def layer_runs(tier: DiskTierPlan) -> list[list[Run]]:
    """The disk layers' byte runs in their files, per layer in the order a pass reads them;
    empty when a disk parameter is spilled (not read from the checkpoint)."""
    if any(p.extent is None for p in tier.params):
        return []
    layer_of = dict(zip(tier.disk_positions, tier.disk_layers, strict=True))
    found = []
    for position in tier.read_order:
        extents = [p.extent for p in tier.params if p.layer == layer_of[position] and p.extent is not None]
        found.append(merged_runs([(e.path, e.offset, e.length) for e in extents]))
    return found


def settle(offloader: ModelOffloader) -> None:
    """Wait until the tier's reads in flight (the next pass's first, staged after a step)
    have landed, so that they do not share the disk with the reads timed next."""
    before = -1
    for _ in range(200):
        now = offloader.stats().disk_bytes_read
        if now == before:
            return
        before = now
        time.sleep(0.05)


def while_reading(reader: DiskReader, runs: list[list[Run]], buffers: list[torch.Tensor],
                  work: Callable[[], list[float]]) -> tuple[list[float], float]:
    """`work`'s result, run while another thread reads `runs` as the tier reads them, over
    and over (what a step's compute and its reads take from each other on these cores);
    and the rate those reads reached meanwhile, GB/s."""
    done = threading.Event()
    read = [0, 0.0]  # bytes, seconds

    def loop() -> None:
        while not done.is_set():
            start = time.perf_counter()
            read[0] += read_like_the_tier(reader, runs, buffers=buffers)
            read[1] += time.perf_counter() - start

    thread = threading.Thread(target=loop, name="bench-disk-step-reads")
    thread.start()
    try:
        found = work()
    finally:
        done.set()
        thread.join()
    return found, read[0] / read[1] / GB if read[1] else 0.0


@attrs.frozen(kw_only=True)
class Round:
    """One round: the two readers' rates (GB/s; `loaded`: the tier reader's while the
    host-tier model runs), the steps (seconds), and the cores and disk reads (GB/s) other
    processes used meanwhile."""

    plain: float
    reader: float
    loaded: float
    host_steps: tuple[float, ...]
    reading_steps: tuple[float, ...]
    steps: tuple[float, ...]
    others: tuple[float, float]

    @property
    def step(self) -> float:
        return statistics.median(self.steps)

    @property
    def host_step(self) -> float:
        return statistics.median(self.host_steps)

    @property
    def reading_step(self) -> float:
        return statistics.median(self.reading_steps)


@attrs.frozen(kw_only=True)
class Models:
    """The two offloaded models a run times: every layer in host memory, and with the disk tier."""

    host: Any
    disk: Any
    disk_offloader: ModelOffloader


def measure_rounds(models: Models, ids: torch.Tensor, runs: list[list[Run]],
                   args: argparse.Namespace) -> tuple[list[Round], OffloadStats]:
    """`args.rounds` rounds (see the module docstring); and the disk tier's stats of its
    timed steps (the counts they added, summed over the rounds)."""
    region = mmap.mmap(-1, PIECE)
    buffer = memoryview(region)
    flat = merged_runs([run for layer in runs for run in layer])
    paths = [Path(p) for p in sorted({path for path, _, _ in flat})]
    staging = [staging_buffers(layer_bytes(runs), 2) for _ in range(2)]  # the timed reads', the background's
    modes: list[bool] = []
    rounds: list[Round] = []
    waits: list[tuple[OffloadStats, OffloadStats]] = []
    offloader = models.disk_offloader
    try:
        with DiskReader() as reader, DiskReader() as background:
            read_like_the_tier(reader, runs[:1], buffers=staging[0])  # untimed: opens the files
            read_plain_runs(flat[:1], buffer, direct=modes)
            for index in range(args.rounds):
                settle(offloader)
                wait_for_quiet(args.quiet_wait)
                since = usage()
                rates: dict[str, float] = {}
                for side in (("plain", "reader") if index % 2 == 0 else ("reader", "plain")):
                    evict(paths)
                    if side == "plain":
                        rates[side] = timed(functools.partial(read_plain_runs, flat, buffer, direct=modes))
                    else:
                        rates[side] = timed(functools.partial(read_like_the_tier, reader, runs, buffers=staging[0]))
                host_steps = steps_of(models.host, ids, args.steps)
                reading, loaded = while_reading(background, runs, staging[1],
                                                functools.partial(steps_of, models.host, ids, args.steps))
                steps_of(models.disk, ids, 0)  # the step after the pause: its first reads were done
                before = offloader.stats()
                steps = steps_of(models.disk, ids, args.steps, untimed=0)
                waits.append((before, offloader.stats()))
                rounds.append(Round(plain=rates["plain"], reader=rates["reader"], loaded=loaded,
                                    host_steps=tuple(host_steps),
                                    reading_steps=tuple(reading), steps=tuple(steps), others=others(since)))
    finally:
        buffer.release()
        region.close()
    fields = ("steps", "disk_bytes_read", "disk_read_seconds", "disk_wait_seconds", "disk_misses")
    added = {f: sum(getattr(b, f) - getattr(a, f) for a, b in waits) for f in fields}
    return rounds, attrs.evolve(OffloadStats(), **added)


def predicted(plan: OffloadPlan, tier: DiskTierPlan, *, tokens: int, compute: float, copy_rate: float,
              disk_gbps: float) -> float:
    """`estimate_with_tier`'s step on this machine as a profile: the step's compute (split
    over the layers by parameters), copies at `copy_rate` (bytes/s), the disk at `disk_gbps`."""
    here = DeviceProfile(name="this-machine", device_name="cpu", pinned_h2d_bytes_per_s=copy_rate,
                         pageable_h2d_bytes_per_s=copy_rate, zero_copy_fraction=1.0, bf16_flops_per_s=1e12,
                         source="measured in this run")
    return estimate_with_tier(plan, attrs.evolve(tier, disk_gbps=disk_gbps), here,
                              Workload(tokens_per_step=tokens, resident_step_seconds=compute)).step_seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="a checkpoint of about this many GB (overrides --hidden and --layers)")
    parser.add_argument("--hidden", type=int, default=512, help="the model's width (default 512)")
    parser.add_argument("--layers", type=int, default=24, help="its layers (default 24)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64], help="tokens per step, one or more "
                        "counts (default 1 64)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each kind per round (default 2)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per token count (default 4)")
    parser.add_argument("--host-fraction", type=float, default=0.25, help="the host budget, as a fraction of the "
                        "offloaded bytes (default 0.25)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: "
                        "torch's own)")
    parser.add_argument("--env-mib", type=int, default=1024, help="the scratch file offload env --disk's "
                        "measurement reads before the steps, MiB (default 1024)")
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait, before each round, for "
                        "other processes to leave the cores and the disk (default 60)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: the "
                        "current directory)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: width 128, 8 layers, a host fraction "
                        "of 0.4, 1 round of 1 step of 8 tokens")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a ratio misses its target")
    args = parser.parse_args(argv)
    if args.size is not None:
        args.hidden, args.layers = SIZES[args.size]
    if args.quick:
        args.hidden, args.layers, args.steps, args.rounds, args.tokens, args.env_mib = 128, 8, 1, 1, [8], 32
        args.host_fraction, args.quiet_wait = 0.4, 0.0  # two staging buffers take a quarter of 8 layers
    if min(args.hidden, args.layers, args.steps, args.rounds, args.env_mib, *args.tokens) < 1 or \
            not 0 < args.host_fraction < 1 or (args.torch_threads is not None and args.torch_threads < 1):
        parser.error("sizes, counts, threads and tokens must be at least 1, --host-fraction between 0 and 1")
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
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
    print(f"bench_disk_step: a {nbytes / GB:.3f} GB Llama checkpoint (width {args.hidden}, {args.layers} layers, "
          f"float32) on {filesystem_of(directory)}; torch threads {torch.get_num_threads()}")
    env_rate = measure_disk_rate(directory, nbytes=args.env_mib * MIB)
    print(f"offload env --disk before the steps: {env_rate.gbps:.3f} GB/s (DiskReader, {env_rate.threads} threads, "
          f"{env_rate.request_bytes // MIB} MiB requests, {env_rate.mode}; runs "
          f"{' '.join(f'{r:.3f}' for r in env_rate.runs)})")
    config = OffloadConfig(backend="prefetch", group_size=1, prefetch_step=2)
    ids = {t: torch.randint(0, 8192, (1, t), generator=torch.Generator().manual_seed(t)) for t in args.tokens}
    # Every layer in host memory, and the disk tier: both loaded, their steps interleaved.
    host, host_offloader = offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(),
                                              host_budget_bytes=1 << 50)
    budget = int(host_offloader.plan.host_bytes * args.host_fraction)
    model, offloader = offload_pretrained(checkpoint, config, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, disk_gbps=env_rate.gbps, spill_dir=spill)
    tier = offloader.disk_tier
    runs = layer_runs(tier) if tier is not None else []
    if tier is None or not runs:
        print("no disk tier: the budget holds every offloaded layer" if tier is None else
              "the disk tier spills: its reads are not the checkpoint's runs")
        return 1
    print(f"tier: {len(tier.disk_positions)} of {len(offloader.plan.offloaded_layers)} layers on disk "
          f"({tier.disk_bytes / GB:.3f} GB per step), host budget {budget / MIB:.1f} MiB, read ahead "
          f"{tier.read_ahead}")
    models = Models(host=host, disk=model, disk_offloader=offloader)
    measured = {tokens: measure_rounds(models, ids[tokens], runs, args) for tokens in args.tokens}
    copies = host_offloader.stats()
    copy_rate = copies.timed_bytes / copies.copy_seconds if copies.copy_seconds else 10e9
    print(f"host-tier copies at {copy_rate / GB:.2f} GB/s")
    offloader.restore()
    del model, offloader, models
    host_offloader.restore()  # every weight resident
    resident = {t: statistics.median(steps_of(host, ids[t], args.steps)) for t in args.tokens}
    missed = False
    for tokens in args.tokens:
        ahead = functools.partial(predicted, host_offloader.plan, tier, tokens=tokens, copy_rate=copy_rate)
        missed |= report(tokens, measured[tokens], tier.disk_bytes, ahead, resident_step=resident[tokens],
                         env_gbps=env_rate.gbps)
    return 1 if args.strict and missed else 0


def _spread(values: Sequence[float]) -> str:
    """The median of `values` and their range, as printed."""
    return f"{statistics.median(values):.3f} (rounds {min(values):.3f}-{max(values):.3f})"


def report(tokens: int, measured: tuple[list[Round], OffloadStats], disk_bytes: int,
           ahead: Callable[..., float], *, resident_step: float, env_gbps: float) -> bool:
    """Print one token count's lines; whether a median ratio missed its target."""
    rounds, stats = measured
    t = f"tokens {tokens}:"

    def ms(values: Sequence[float]) -> str:
        return " ".join(f"{v * 1e3:.1f}" for v in values)

    for index, r in enumerate(rounds):
        print(f"{t} round {index + 1}: plain {r.plain:.3f} GB/s, reader {r.reader:.3f} GB/s; host-tier steps "
              f"{ms(r.host_steps)} ms, while the disk reads {ms(r.reading_steps)} ms (it reads at {r.loaded:.3f} "
              f"GB/s); steps {ms(r.steps)} ms; "
              f"other processes {r.others[0]:.2f} cores, {r.others[1]:.3f} GB/s of disk reads")
    median = statistics.median
    print(f"{t} step {median(r.step for r in rounds) * 1e3:.1f} ms, host-tier step "
          f"{median(r.host_step for r in rounds) * 1e3:.1f} ms, while the disk reads "
          f"{median(r.reading_step for r in rounds) * 1e3:.1f} ms, resident step {resident_step * 1e3:.1f} ms "
          f"(medians of {len(rounds)} rounds)")
    achieved = stats.disk_bytes_read / stats.disk_read_seconds / GB if stats.disk_read_seconds else 0.0
    print(f"{t} plain reader {median(r.plain for r in rounds):.3f} GB/s, tier's reader "
          f"{median(r.reader for r in rounds):.3f} GB/s, {median(r.loaded for r in rounds):.3f} GB/s while the "
          f"host-tier model runs, the tier during the steps {achieved:.3f} GB/s; "
          f"reader/plain: {_spread([r.reader / r.plain for r in rounds])}")
    limits = [r.step / max(r.host_step, disk_bytes / (r.plain * GB)) for r in rounds]
    print(f"{t} ratio step/limit: {_spread(limits)}; target at most {1 + TARGET:.2f}; the limit max(host-tier "
          f"step, {disk_bytes / GB:.3f} GB / the plain rate)")
    guesses = [r.step / ahead(compute=r.host_step, disk_gbps=r.reader) for r in rounds]
    print(f"{t} ratio step/predicted: {_spread(guesses)}; target {1 - TARGET:.2f} to {1 + TARGET:.2f}; "
          "estimate_with_tier from the host-tier step and the tier reader's rate")
    others_: list[tuple[str, list[float]]] = [
        ("the plain rate", [r.step / ahead(compute=r.host_step, disk_gbps=r.plain) for r in rounds]),
        (f"offload env --disk's {env_gbps:.3f} GB/s",
         [r.step / ahead(compute=r.host_step, disk_gbps=env_gbps) for r in rounds]),
        ("the host-tier step while the disk reads",
         [r.step / ahead(compute=r.reading_step, disk_gbps=r.reader) for r in rounds]),
        ("the reader's rate while the host-tier model runs",
         [r.step / ahead(compute=r.host_step, disk_gbps=r.loaded) for r in rounds])]
    if achieved:  # the rate the tier's reads reached during the steps (the structure, given the rate)
        others_.append((f"the tier's {achieved:.3f} GB/s during the steps",
                        [r.step / ahead(compute=r.host_step, disk_gbps=achieved) for r in rounds]))
    print(f"{t} step/predicted from " + "; ".join(f"{what}: {_spread(values)}" for what, values in others_))
    print(f"{t} copies waited {stats.disk_wait_seconds / max(stats.steps, 1) * 1e3:.1f} ms per step, "
          f"{stats.disk_misses} reads not started ahead")
    return median(limits) > 1 + TARGET or abs(median(guesses) - 1) > TARGET


if __name__ == "__main__":
    raise SystemExit(main())
