"""UVA offloading on the hardware (GPU): zero-copy reads, host memory, setup speed.

One run prints three tables:

(a) Read bandwidth of a GEMM over a UVA weight. A 4096x16384 bf16 weight (128 MiB) is
    copied to registered host memory (``CudaRuntime.host_copy(pin=PinMethod.REGISTER)``) and read in
    place through ``CudaRuntime.device_view`` by ``x @ W`` for 1, 16 and 256 tokens. The
    effective bandwidth is the weight's bytes over the GEMM's time (CUDA events, mean of
    20 back-to-back GEMMs), as a ratio to the pinned host-to-device copy bandwidth measured
    in the same run (median of 5 copies of 1 GiB). Target: at least 0.9.
(b) Host bytes resident per offloaded byte. Four Llama-3-8B-shaped layers (q 4096x4096,
    k and v 1024x4096, o 4096x4096, gate and up 14336x4096, down 4096x14336; bf16,
    1.6 GiB) are copied from the device into page-locked host memory by each `PinMethod`
    (registered in place; one cudaHostAlloc of the exact size), and, beside them, into
    ``torch.empty_strided(..., pin_memory=True)`` (PyTorch's caching host allocator). For
    each, the growth of the machine's used memory (the drop of ``MemAvailable`` in
    /proc/meminfo) is divided by the bytes offloaded. MemAvailable is the headline because
    it sees every page taken for the process, including pinned pages the driver maps
    outside the process's RSS; the growth of this process's ``RssAnon + RssShmem``
    (/proc/self/status) is printed beside it as a cross-check (it cannot see the driver's
    pinned pages, so it reads near 0 for the caching allocator). Everything is freed
    between the two (the caching allocator's cache with ``torch._C._host_emptyCache()``).
    Target for each of ours: at most 1.01.
(c) Setup throughput: 6 GiB of bf16 weights (48 of 4096x16384) moved from the device to
    page-locked host memory by ``CudaRuntime.host_copy`` with each `PinMethod`, beside
    ``w.cpu().pin_memory()``, in GB/s. Target for each: at least 2x that baseline.

Run: ``python benchmarks/bench_uva.py`` (well under 3 minutes on an H200; needs about
7 GiB of device memory and at most about 8 GiB of host memory at a time). Without CUDA it
says so and exits 0. ``--strict`` exits 1 when a row misses its target.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from offload import capture_env
from offload.capture.numa_bandwidth import numa_bandwidth_lines
from offload.pure import PinMethod
from offload.runtime.cuda import CudaRuntime

HIDDEN, INNER = 4096, 16384
TOKENS = (1, 16, 256)
READ_TARGET = 0.9
RESIDENT_TARGET = 1.01
SETUP_TARGET = 2.0
COPY_BYTES = 1 << 30
SETUP_WEIGHTS = 48  # of HIDDEN x INNER bf16: 6 GiB
LLAMA_LAYER = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336))
LLAMA_LAYERS = 4


def pinned_copy_bandwidth() -> float:
    """Host-to-device bytes per second from pinned memory: median of 5 copies of 1 GiB."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    del src, dst
    release_cached_pinned()
    return COPY_BYTES / statistics.median(seconds)


def release_cached_pinned() -> None:
    """Give the caching host allocator's pinned blocks back to the operating system."""
    gc.collect()
    torch.cuda.synchronize()
    empty_cache = getattr(torch._C, "_host_emptyCache", None)  # private; present on CUDA builds
    if empty_cache is not None:
        empty_cache()


def gpu_seconds(run: Callable[[], object], *, warmup: int = 3, repeat: int = 20) -> float:
    """Mean seconds of `run` on the GPU over `repeat` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        run()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated in torch
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # as above
    start.record()
    for _ in range(repeat):
        run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / repeat


def read_bandwidth_rows(runtime: CudaRuntime, copy_bw: float) -> list[tuple[str, float, float]]:
    """(label, measured value, target) rows of table (a)."""
    weight = torch.randn(HIDDEN, INNER, device="cuda", dtype=torch.bfloat16)
    host = runtime.host_copy(weight, pin=PinMethod.REGISTER)
    if not runtime.is_pinned(host):
        print("(a) skipped: registering host memory failed, so there is nothing to view")
        return []
    view = runtime.device_view(host)
    nbytes = weight.numel() * weight.element_size()
    print(f"(a) GEMM x @ W, W {HIDDEN}x{INNER} bf16 ({nbytes / 2**20:.0f} MiB) read in place from host memory")
    print(f"    {'tokens':>6} {'UVA ms':>8} {'resident ms':>11} {'GB/s':>7} {'/ copy':>7}  target")
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        uva_s = gpu_seconds(lambda: x @ view)  # noqa: B023 (called before x changes)
        resident_s = gpu_seconds(lambda: x @ weight)  # noqa: B023
        bandwidth = nbytes / uva_s
        ratio = bandwidth / copy_bw
        rows.append((f"read {tokens} tokens", ratio, READ_TARGET))
        print(f"    {tokens:>6} {uva_s * 1e3:>8.3f} {resident_s * 1e3:>11.3f} {bandwidth / 1e9:>7.1f} {ratio:>7.3f}  "
              f"{'ok' if ratio >= READ_TARGET else 'MISS'} (>= {READ_TARGET})")
    torch.cuda.synchronize()  # no kernel reads the view any more
    runtime.release_host(host)
    return rows


def meminfo_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def process_rss() -> int:
    """RssAnon + RssShmem of this process from /proc/self/status, in bytes."""
    total = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024
    return total


def resident_per_byte(weights: list[torch.Tensor], copy_out: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float]:
    """(MemAvailable drop, RSS growth) per offloaded byte while the copies of `weights` live."""
    offloaded = sum(w.numel() * w.element_size() for w in weights)
    gc.collect()
    time.sleep(0.5)
    available, rss = meminfo_available(), process_rss()
    copies = [copy_out(w) for w in weights]
    torch.cuda.synchronize()
    used, grown = available - meminfo_available(), process_rss() - rss
    del copies
    return used / offloaded, grown / offloaded


METHODS = (PinMethod.REGISTER, PinMethod.ALLOC)


def host_memory_rows(runtime: CudaRuntime) -> list[tuple[str, float, float]]:
    """Rows of table (b)."""
    weights = [torch.randn(shape, device="cuda", dtype=torch.bfloat16)
               for _ in range(LLAMA_LAYERS) for shape in LLAMA_LAYER]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    print(f"(b) host bytes resident per offloaded byte, {LLAMA_LAYERS} Llama-3-8B-shaped layers "
          f"({nbytes / 2**30:.2f} GiB of bf16)")
    print(f"    {'method':<44} {'MemAvailable':>12} {'RSS':>6}  target")
    rows = []
    for method in METHODS:
        held: list[torch.Tensor] = []

        def ours(w: torch.Tensor, method: PinMethod = method, held: list[torch.Tensor] = held) -> torch.Tensor:
            host = runtime.host_copy(w, pin=method)
            held.append(host)
            return host

        used, rss = resident_per_byte(weights, ours)
        fallbacks = sum(not runtime.is_pinned(h) for h in held)
        for host in held:
            runtime.release_host(host)
        held.clear()
        release_cached_pinned()
        runtime.synchronize()  # frees allocations whose tensors died
        label = f"CudaRuntime.host_copy(pin={method.value})"
        print(f"    {label:<44} {used:>12.4f} {rss:>6.3f}  "
              f"{'ok' if used <= RESIDENT_TARGET else 'MISS'} (<= {RESIDENT_TARGET})"
              + (f"; {fallbacks} copies fell back to pageable" if fallbacks else ""))
        rows.append((f"host bytes per byte ({method.value})", used, RESIDENT_TARGET))

    def caching(w: torch.Tensor) -> torch.Tensor:
        host = torch.empty_strided(tuple(w.shape), tuple(w.stride()), dtype=w.dtype, pin_memory=True)
        return host.copy_(w)

    theirs_used, theirs_rss = resident_per_byte(weights, caching)
    release_cached_pinned()
    print(f"    {'torch.empty_strided(pin_memory=True) + copy_':<44} {theirs_used:>12.4f} {theirs_rss:>6.3f}  "
          "(for comparison)")
    return rows


def setup_rows(runtime: CudaRuntime) -> list[tuple[str, float, float]]:
    """Rows of table (c)."""
    weights = [torch.randn(HIDDEN, INNER, device="cuda", dtype=torch.bfloat16) for _ in range(SETUP_WEIGHTS)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    torch.cuda.synchronize()

    start = time.perf_counter()
    baseline_hosts = [w.cpu().pin_memory() for w in weights]
    torch.cuda.synchronize()
    baseline = nbytes / (time.perf_counter() - start)
    del baseline_hosts
    release_cached_pinned()

    print(f"(c) setup: {nbytes / 2**30:.0f} GiB of bf16 weights from the device to page-locked host memory")
    print(f"    {'w.cpu().pin_memory()':<40} {baseline / 1e9:>6.2f} GB/s  (baseline)")
    rows = []
    for method in METHODS:
        start = time.perf_counter()
        hosts = [runtime.host_copy(w, pin=method) for w in weights]
        torch.cuda.synchronize()
        ours = nbytes / (time.perf_counter() - start)
        fallbacks = sum(not runtime.is_pinned(h) for h in hosts)
        for host in hosts:
            runtime.release_host(host)
        del hosts
        gc.collect()
        runtime.synchronize()  # frees allocations whose tensors died
        ratio = ours / baseline
        label = f"CudaRuntime.host_copy(pin={method.value})"
        print(f"    {label:<40} {ours / 1e9:>6.2f} GB/s  ratio {ratio:.2f}  "
              f"{'ok' if ratio >= SETUP_TARGET else 'MISS'} (>= {SETUP_TARGET})"
              + (f" ({fallbacks} fell back to pageable)" if fallbacks else ""))
        rows.append((f"setup ratio ({method.value})", ratio, SETUP_TARGET))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strict", action="store_true", help="exit 1 if a row misses its target")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_uva: CUDA is not available; this benchmark needs a CUDA GPU. Nothing measured.")
        print(*numa_bandwidth_lines(capture_env({}).platform.numa), sep="\n")
        return 0
    runtime = CudaRuntime()
    copy_bw = pinned_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"pinned host-to-device copy bandwidth (1 GiB): {copy_bw / 1e9:.1f} GB/s")
    print(*numa_bandwidth_lines(capture_env({}).platform.numa), sep="\n")  # registered, local vs remote node
    rows = read_bandwidth_rows(runtime, copy_bw)
    torch.cuda.empty_cache()
    rows += host_memory_rows(runtime)
    torch.cuda.empty_cache()
    rows += setup_rows(runtime)
    # Targets: read and setup ratios are floors, host bytes per byte is a ceiling.
    misses = [label for label, value, target in rows
              if (value > target if label.startswith("host") else value < target)]
    print(f"{len(rows) - len(misses)} of {len(rows)} rows meet their target"
          + (f"; missed: {', '.join(misses)}" if misses else ""))
    return 1 if args.strict and misses else 0


if __name__ == "__main__":
    sys.exit(main())
