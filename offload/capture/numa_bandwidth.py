"""Host-to-device copy bandwidth from registered memory on a chosen NUMA node.

For the benchmarks (``benchmarks/bench_uva.py``, ``benchmarks/bench_prefetch.py``) and
for diagnosing a slow link: the same 1 GiB is registered on the GPU's node and on another
node, and the copies from each are timed, so the cost of a remote node shows as a ratio.
Where the pages really landed is read back from ``/proc/self/numa_maps``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import attrs
import torch

from offload.pure.decide.pinning import PinMethod
from offload.pure.env.numa import NumaTopology, parse_numa_maps

__all__ = ["NodeBandwidth", "measure_node_bandwidth", "numa_bandwidth_lines"]

NUMA_MAPS = Path("/proc/self/numa_maps")


@attrs.frozen(kw_only=True)
class NodeBandwidth:
    """One measurement.

    Attributes:
        node: the node asked for (None: no placement).
        bytes_per_second: host-to-device bytes per second, median of the copies.
        on_node: the fraction of the buffer's pages on `node` per numa_maps; None when
            that could not be read or no node was asked for.
        fallback: why the memory could not be placed, or None.
    """

    node: int | None
    bytes_per_second: float
    on_node: float | None
    fallback: str | None


def measure_node_bandwidth(node: int | None, *, nbytes: int = 1 << 30, repeat: int = 5) -> NodeBandwidth:
    """Time host-to-device copies of `nbytes` from memory registered on `node`.

    Raises:
        ExecutionError: CUDA is unavailable or an allocation failed.
    """
    from offload.runtime.cuda import CudaRuntime

    runtime = CudaRuntime(numa_node=node)
    like = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    host = runtime.host_empty(like, pin=PinMethod.REGISTER)
    try:
        host.fill_(1)
        on_node: float | None = None
        if node is not None and NUMA_MAPS.exists():
            entry = parse_numa_maps(NUMA_MAPS.read_text(), host.data_ptr())
            total = sum(pages for _, pages in entry.pages) if entry is not None else 0
            if entry is not None and total:
                on_node = dict(entry.pages).get(node, 0) / total
        dst = torch.empty(nbytes, dtype=torch.uint8, device=runtime.device)
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize(runtime.device)
        seconds = []
        for _ in range(repeat):
            start = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            torch.cuda.synchronize(runtime.device)
            seconds.append(time.perf_counter() - start)
        del dst
    finally:
        runtime.release_host(host)
    placer = runtime.numa_placer
    fallback = placer.fallback_reason if placer is not None else None
    if runtime.pin_fallbacks:
        fallback = "registering the buffer failed, so it is pageable"
    return NodeBandwidth(node=node, bytes_per_second=nbytes / statistics.median(seconds), on_node=on_node,
                         fallback=fallback)


def _line(label: str, result: NodeBandwidth, local: float | None = None) -> str:
    text = f"pinned host-to-device bandwidth from {label}: {result.bytes_per_second / 1e9:.1f} GB/s"
    if local:
        text += f" ({result.bytes_per_second / local:.2f} of local)"
    if result.fallback is not None:
        text += f" [not placed: {result.fallback}]"
    elif result.on_node is not None:
        text += f" [{result.on_node:.0%} of pages on node {result.node}]"
    return text


def numa_bandwidth_lines(topology: NumaTopology, *, nbytes: int = 1 << 30) -> list[str]:
    """Lines for a benchmark: the bandwidth from the GPU's node and, where the host has
    one, from a remote node; or why it was not measured.

    Args:
        topology: the host's nodes and the GPU's (``capture_env().platform.numa``).
        nbytes: bytes per copy.
    """
    if not torch.cuda.is_available():
        return ["NUMA host-to-device bandwidth: not measured (CUDA is not available)"]
    local_node = topology.gpu_node
    label = f"NUMA node {local_node} (the GPU's node)"
    if local_node is None:
        local_node = topology.nodes[0] if topology.nodes else None
        label = ("no NUMA placement (nodes unknown)" if local_node is None
                 else f"NUMA node {local_node} (the GPU's node is unknown)")
    local = measure_node_bandwidth(local_node, nbytes=nbytes)
    lines = [_line(label, local)]
    remote = [n for n in topology.nodes if n != local_node]
    if remote:
        far = measure_node_bandwidth(remote[0], nbytes=nbytes)
        kind = "remote" if topology.gpu_node is not None else "another node"
        lines.append(_line(f"NUMA node {remote[0]} ({kind})", far, local.bytes_per_second))
    else:
        lines.append("pinned host-to-device bandwidth from a remote NUMA node: not measured (no other node)")
    return lines
