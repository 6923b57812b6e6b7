"""Host memory per host with and without sharing host copies, and the seconds sharing costs.

N rank processes on this machine (torch.distributed over gloo, a FileStore), each
building the same seeded stack of ``nn.Linear(hidden, hidden)`` layers on the CPU and
offloading every weight with the UVA backend (on demand without CUDA: no device buffers,
so the host memory measured is the host copies'). Run twice: ``private`` (each rank its
own host copies, as without ``share_with``) and ``shared``
(``create_offloader(plan, share_with=...)``).

Measured per rank, from ``/proc/self/smaps_rollup`` and ``/proc/self/smaps``:

- ``host Pss``: the process's Pss after post_init and one forward, less its Pss before
  it built the model (glibc's free memory trimmed first, ``malloc_trim``). Summed over
  the ranks it is the host memory the offloaded model takes on this host: N copies
  privately, one copy when shared (Pss divides each shared page among its mappers);
- ``segment Pss``: the Pss of the shared segment's mapping alone, summed over the ranks;
- ``publish s``: the leader's wrap_modules from start to the copy written and announced
  (creating, waiting for every follower to map it, writing every weight);
- ``map s``: the slowest follower's opening and mapping of the segment; ``follower
  wrap s``: its whole wrap_modules, waiting for the leader included.

Outputs are checked bit for bit against a resident copy in every rank, and restore must
give back the weights. Printed as a table, with the ratio of host bytes per host to one
copy's bytes.

Run: ``python -m benchmarks.bench_shared [--quick] [--ranks N] [--mib M]``; ``--quick``
runs 2 ranks with 16 MiB each (a few seconds once torch is imported).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import FileStore

from offload import EnvSnapshot, OffloadConfig, create_offloader, describe_layers, make_plan
from offload.pure.units import format_bytes
from offload.sharing import SharedOffloader, ShareWith

__all__ = ["HEADER", "main"]

HEADER = ("mode     ranks  offloaded/rank  host Pss/host  x one copy  segment Pss  publish s  map s     "
          "follower wrap s  post_init s")

#: Seconds one rank waits for another (generous: the ranks share this machine's cores).
TIMEOUT_S = 120.0
#: Seconds the whole run of one mode may take before its ranks are killed.
DEADLINE_S = 600.0


def _pss() -> int:
    """This process's Pss in bytes (smaps_rollup), after glibc gave back what it can."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _stack(layers: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).requires_grad_(False)


def _rank(rank: int, world: int, folder: str, mode: str, layers: int, hidden: int) -> None:
    out = Path(folder)
    result: dict[str, Any]
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=FileStore(str(out / "store"), world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        result = _run(rank, mode, layers, hidden)
        result["ok"] = True
    except BaseException as exc:  # the parent prints it
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def _run(rank: int, mode: str, layers: int, hidden: int) -> dict[str, Any]:
    from offload.capture.smaps import segment_memory

    before = _pss()
    model = _stack(layers, hidden)
    resident = _stack(layers, hidden)
    plan = make_plan(describe_layers(list(model)), OffloadConfig(backend="uva", uva_max_bytes=1 << 50), EnvSnapshot())
    share = ShareWith(timeout_s=TIMEOUT_S) if mode == "shared" else None
    off = create_offloader(plan, share_with=share)
    start = time.monotonic()
    off.wrap_modules(list(model))
    wrap_s = time.monotonic() - start
    start = time.monotonic()
    off.post_init()
    post_init_s = time.monotonic() - start
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        equal = bool(torch.equal(model(x), resident(x)))
    del resident  # the reference is not the offloader's memory
    dist.barrier()  # everyone has run: each maps and has touched every page
    host_pss = _pss() - before
    segment = off.segment if isinstance(off, SharedOffloader) else None
    seg_pss = segment_memory(segment.name).pss_bytes if segment is not None else 0
    times = off.times if isinstance(off, SharedOffloader) else None
    role = off.sharing.role if isinstance(off, SharedOffloader) else "private"
    dist.barrier()  # nobody restores before everyone measured
    off.restore()
    restored = bool(torch.equal(model(x), _stack(layers, hidden)(x)))
    return {"role": role, "equal": equal, "restored": restored, "host_pss": host_pss, "segment_pss": seg_pss,
            "offloaded": plan.host_bytes, "wrap_s": wrap_s, "post_init_s": post_init_s,
            "publish_s": times.publish_s if times is not None else 0.0,
            "map_s": times.map_s if times is not None else 0.0}


def _launch(world: int, mode: str, layers: int, hidden: int) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as folder:
        procs = [context.Process(target=_rank, args=(r, world, folder, mode, layers, hidden), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + DEADLINE_S
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for rank in range(world):
            path = Path(folder) / f"result-{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"})
    return results


def _row(mode: str, results: list[dict[str, Any]]) -> tuple[str, float]:
    world = len(results)
    offloaded = results[0]["offloaded"]
    host = sum(r["host_pss"] for r in results)
    ratio = host / offloaded
    followers = [r for r in results if r["role"] == "follower"]
    leader = next((r for r in results if r["role"] == "leader"), None)
    seg = sum(r["segment_pss"] for r in results)
    publish = f"{leader['publish_s']:.3f}" if leader is not None else "-"
    mapped = f"{max(r['map_s'] for r in followers):.5f}" if followers else "-"
    follower_wrap = f"{max(r['wrap_s'] for r in followers):.3f}" if followers else "-"
    post_init = max(r["post_init_s"] for r in results)
    row = (f"{mode:<8} {world:>5}  {format_bytes(offloaded):>14}  {format_bytes(host):>13}  {ratio:>10.2f}  "
           f"{format_bytes(seg) if seg else '-':>11}  {publish:>9}  {mapped:>8}  {follower_wrap:>15}  {post_init:>11.3f}")
    return row, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 ranks, 16 MiB each (a few seconds)")
    parser.add_argument("--ranks", type=int, default=None, help="rank processes (default 4, --quick 2)")
    parser.add_argument("--mib", type=int, default=None, help="offloaded MiB per rank (default 256, --quick 16)")
    args = parser.parse_args(argv)
    world = args.ranks if args.ranks is not None else (2 if args.quick else 4)
    mib = args.mib if args.mib is not None else (16 if args.quick else 256)
    if world < 2 or mib < 1:
        print("bench_shared: --ranks must be at least 2 and --mib at least 1")
        return 2
    hidden = 1024  # 4 MiB per float32 weight
    layers = max(1, mib // 4)
    begun = time.perf_counter()
    print(f"bench_shared: {world} ranks on this machine, {layers} x Linear({hidden}, {hidden}) float32 per rank "
          f"({format_bytes(layers * hidden * hidden * 4)} offloaded each, UVA backend on demand), torch "
          f"{torch.__version__}")
    rows: list[str] = []
    ratios: dict[str, float] = {}
    for mode in ("private", "shared"):
        results = _launch(world, mode, layers, hidden)
        failed = [f"rank {rank}: {r['error']}" for rank, r in enumerate(results) if not r["ok"]]
        if failed:
            print(f"bench_shared: the {mode} run failed: " + "; ".join(failed))
            return 1
        if not all(r["equal"] and r["restored"] for r in results):
            print(f"bench_shared: the {mode} run's outputs or restored weights differ from the resident model")
            return 1
        row, ratios[mode] = _row(mode, results)
        rows.append(row)
    print()
    print(HEADER)
    for row in rows:
        print(row)
    print()
    print(f"host memory per host: {ratios['private']:.2f} x one copy without sharing, {ratios['shared']:.2f} x with "
          f"(ideal: {world} and 1); outputs equal the resident model bit for bit in every rank, and restore gave "
          "the weights back")
    print(f"total {time.perf_counter() - begun:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
