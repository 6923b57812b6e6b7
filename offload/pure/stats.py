"""What an offloader reports about its work: `OffloadStats`, and `render_stats` to print it."""

from __future__ import annotations

import attrs

__all__ = ["ExpertCounts", "OffloadStats", "render_stats", "render_stats_line"]


@attrs.frozen(kw_only=True)
class ExpertCounts:
    """The counters of one device expert cache (Note [expert cache]).

    Attributes:
        layer: its layer's index.
        module: its experts module's path in the layer.
        hits: routed experts found in a device slot.
        misses: routed experts copied from host memory.
        evictions: residents a miss took the slot of.
        bytes_copied: bytes the misses copied from host memory: misses x the expert's bytes.
    """

    layer: int
    module: str
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_copied: int = 0

    @property
    def hit_rate(self) -> float | None:
        """hits / (hits + misses); None before any routed expert."""
        routed = self.hits + self.misses
        return self.hits / routed if routed else None


@attrs.frozen(kw_only=True)
class OffloadStats:
    """Counters of one offloader since `wrap_modules`.

    Attributes:
        params_offloaded: parameters currently held in host memory.
        params_dropped: planned parameters that post-processing deleted.
        host_bytes: host memory held for weights, in bytes.
        device_buffer_bytes: device memory held in static buffers (expert caches
            included), in bytes.
        copies_issued: host-to-device copies issued (one per parameter and prefetch).
        bytes_copied: bytes those copies moved.
        wait_seconds: time the compute stream waited for copies, in seconds; None when
            the runtime cannot measure it.
        pin_fallbacks: host copies the plan pins that stayed pageable because pinning
            them failed (the model works; such a model cannot be captured in a CUDA graph).
        realignments: prefetch: times the schedule was put right because offloaded layers
            ran out of order, were skipped or run twice, or a forward stopped part way (the
            weights stay correct; the layers until the next step copy on demand).
        steps: forward steps seen: runs of the first offloaded (prefetch) or first
            on-demand (uva) layer. CUDA graph replays run no Python and are not counted,
            nor are models whose weights are all read in place (UVA views: no hook runs).
        copy_seconds: device time the host-to-device copies took, measured on the copy
            stream, over the copies issued outside CUDA graph captures
            (`timed_bytes` of them); None when the runtime cannot measure it.
        timed_bytes: bytes of the copies `copy_seconds` covers.
        disk_layers: layers on the disk tier (0 without one); the fields below are 0 then.
        disk_bytes_read: bytes read from disk into the staging buffers.
        disk_read_seconds: wall time the disk reader had reads in flight.
        disk_wait_seconds: time the copies waited for reads to finish (the reads did not
            keep ahead of the copies).
        disk_misses: copies whose reads had not been started ahead (layers out of order,
            a realignment): read when the copy needed them.
        experts: each device expert cache's counters (`ExpertCounts`); their copies are
            counted in `copies_issued` and `bytes_copied` too.
    """

    params_offloaded: int = 0
    params_dropped: int = 0
    host_bytes: int = 0
    device_buffer_bytes: int = 0
    copies_issued: int = 0
    bytes_copied: int = 0
    wait_seconds: float | None = None
    pin_fallbacks: int = 0
    realignments: int = 0
    steps: int = 0
    copy_seconds: float | None = None
    timed_bytes: int = 0
    disk_layers: int = 0
    disk_bytes_read: int = 0
    disk_read_seconds: float = 0.0
    disk_wait_seconds: float = 0.0
    disk_misses: int = 0
    experts: tuple[ExpertCounts, ...] = ()

    @property
    def disk_gbps(self) -> float | None:
        """Achieved disk read rate, in GB/s; None when nothing was read."""
        if self.disk_read_seconds <= 0 or not self.disk_bytes_read:
            return None
        return self.disk_bytes_read / self.disk_read_seconds / 1e9

    @property
    def bytes_per_step(self) -> float | None:
        """Bytes copied per forward step; None before the first step."""
        return self.bytes_copied / self.steps if self.steps else None

    @property
    def wait_seconds_per_step(self) -> float | None:
        """Compute-stream wait per forward step; None before the first step or unmeasured."""
        return self.wait_seconds / self.steps if self.steps and self.wait_seconds is not None else None

    @property
    def copy_gbps(self) -> float | None:
        """Achieved host-to-device bandwidth of the timed copies, in GB/s (1e9 bytes per
        second); None when unmeasured or nothing was timed."""
        if self.copy_seconds is None or self.copy_seconds <= 0 or not self.timed_bytes:
            return None
        return self.timed_bytes / self.copy_seconds / 1e9


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3f} MiB"


def _ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1e3:.3f} ms"


def render_stats(stats: OffloadStats, *, link_gbps: float | None = None) -> str:
    """`stats` as a small table, one figure per line, per-step figures beside the totals.

    Args:
        stats: what `Offloader.stats()` returned.
        link_gbps: the host-to-device link's bandwidth in GB/s (e.g. the plan's profile),
            to print the achieved bandwidth as a ratio to it; None to leave it out.
    """
    per_step = stats.bytes_per_step
    wait_step = stats.wait_seconds_per_step
    gbps = stats.copy_gbps
    if gbps is None:
        bandwidth = "not measured"
    else:
        bandwidth = f"{gbps:.2f} GB/s"
        if link_gbps is not None and link_gbps > 0:
            bandwidth += f" ({gbps / link_gbps:.2f}x the link's {link_gbps:g} GB/s)"
    rows = [
        ("steps", f"{stats.steps}"),
        ("parameters offloaded", f"{stats.params_offloaded} ({stats.params_dropped} dropped by post-processing)"),
        ("host memory held", _gib(stats.host_bytes)),
        ("device buffers", _gib(stats.device_buffer_bytes)),
        ("copies", f"{stats.copies_issued} ({_gib(stats.bytes_copied)})"),
        ("copied per step", "n/a (no step yet)" if per_step is None else _gib(per_step)),
        ("compute waited", _ms(stats.wait_seconds)
         + ("" if wait_step is None else f" ({wait_step * 1e3:.3f} ms per step)")),
        ("copy time", _ms(stats.copy_seconds)),
        ("copy bandwidth", bandwidth),
        ("pin fallbacks", f"{stats.pin_fallbacks}"),
        ("realignments", f"{stats.realignments}"),
    ]
    if stats.disk_layers:
        disk_gbps = stats.disk_gbps
        rows += [
            ("disk layers", f"{stats.disk_layers}"),
            ("disk read", f"{_gib(stats.disk_bytes_read)} in {_ms(stats.disk_read_seconds)}"
             + ("" if disk_gbps is None else f" ({disk_gbps:.2f} GB/s)")),
            ("copies waited for disk", _ms(stats.disk_wait_seconds)
             + (f" ({stats.disk_misses} reads not started ahead)" if stats.disk_misses else "")),
        ]
    if stats.experts:
        hits = sum(c.hits for c in stats.experts)
        misses = sum(c.misses for c in stats.experts)
        rows += [
            ("expert caches", f"{len(stats.experts)}"),
            ("expert hits", f"{hits} of {hits + misses}" + (f" ({hits / (hits + misses):.1%})" if hits + misses else "")),
            ("expert evictions", f"{sum(c.evictions for c in stats.experts)}"),
            ("experts copied", _gib(sum(c.bytes_copied for c in stats.experts))),
        ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def render_stats_line(stats: OffloadStats) -> str:
    """`stats` as one log line: the step count and the per-step figures."""
    per_step = stats.bytes_per_step
    wait_step = stats.wait_seconds_per_step
    gbps = stats.copy_gbps
    parts = [
        f"step {stats.steps}",
        "n/a copied per step" if per_step is None else f"{_gib(per_step)} copied per step",
        "wait not measured" if wait_step is None else f"{wait_step * 1e3:.3f} ms waited per step",
        "copy bandwidth not measured" if gbps is None else f"copies at {gbps:.2f} GB/s",
        f"{stats.realignments} realignments",
    ]
    if stats.disk_layers:
        disk_gbps = stats.disk_gbps
        parts.append("disk not read yet" if disk_gbps is None else f"disk read at {disk_gbps:.2f} GB/s, "
                     f"{stats.disk_wait_seconds * 1e3:.3f} ms waited")
    if stats.experts:
        hits = sum(c.hits for c in stats.experts)
        routed = hits + sum(c.misses for c in stats.experts)
        parts.append(f"expert hits {hits / routed:.1%}" if routed else "no expert routed yet")
    return "offload: " + ", ".join(parts)
