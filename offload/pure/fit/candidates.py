"""`fit`'s candidates: what each configuration costs, read off the `Table`, and their ranking.

Costs and ranking are as `offload.pure.fit.search` describes them; a candidate's step comes from
the same simulation `estimate` runs. `FitCandidate` is public as
``offload.pure.fit.search.FitCandidate``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs

from offload.pure.config import OffloadConfig
from offload.pure.fit.estimate import DiskReads, simulate_prefetch
from offload.pure.fit.host import HostTier
from offload.pure.fit.table import Expanded, LayerSet, Table, buffer_bytes, expand, kept_bytes
from offload.pure.plan.schedule import PrefetchSchedule, schedule_prefetch
from offload.pure.units import format_bytes

__all__ = [
    "BACKEND_ORDER",
    "FitCandidate",
    "best_depth",
    "cached_schedule",
    "close",
    "compare",
    "describe",
    "disk_seconds",
    "none_candidate",
    "prefetch_candidate",
    "same_outcome",
    "tie_key",
    "uva_candidates",
    "uva_prefix",
]

_TOL = 1e-9
#: Ties on time and bytes go to the simpler backend.
BACKEND_ORDER = {"none": 0, "prefetch": 1, "uva": 2}


@attrs.frozen(kw_only=True)
class FitCandidate:
    """One configuration the search evaluated, with what it costs. Bytes and seconds.

    Attributes:
        config: the configuration (backend explicit).
        step_seconds: predicted steady-state step time.
        limit_seconds: max(resident compute, offloaded bytes per step / pinned rate, a
            disk tier's reads per step); the bytes of layers loaded once (alone in their
            slot) are not per step.
        resident_bytes: weights that stay in device memory.
        buffer_bytes: static prefetch buffers in device memory.
        transient_bytes: the largest layer's on-demand copy (0 unless UVA falls back).
        outside_bytes: weights outside the layers (embeddings, head, final norm), always
            resident: the caller's figure.
        reserve_bytes: the caller's reserve.
        host_bytes: host memory for the host copies (with a disk tier: its host tier and
            staging ring).
        disk_positions: the schedule positions a host budget puts on disk (prefetch).
    """

    config: OffloadConfig
    step_seconds: float
    limit_seconds: float
    resident_bytes: int
    buffer_bytes: int
    transient_bytes: int
    outside_bytes: int
    reserve_bytes: int
    host_bytes: int
    disk_positions: tuple[int, ...] = ()

    @property
    def device_bytes(self) -> int:
        """resident + buffers + transient + outside + reserve: what must fit the budget."""
        return (self.resident_bytes + self.buffer_bytes + self.transient_bytes + self.outside_bytes
                + self.reserve_bytes)


def describe(config: OffloadConfig, *, joiner: str = ": ") -> str:
    """A one-line description of a configuration, with its expert caches' C where it sets
    one and its filter: ``prefetch: group_size 8, num_in_group 2, prefetch_step 1``
    (``joiner`` goes after the backend's name)."""
    if config.backend == "prefetch":
        text = (f"prefetch{joiner}group_size {config.group_size}, num_in_group {config.num_in_group}, "
                f"prefetch_step {config.prefetch_step}")
        if not config.expert_cache:
            text += ", expert_cache off"
        elif config.expert_slots is not None:
            text += f", expert_slots {config.expert_slots}"
    elif config.backend == "uva":
        text = f"uva{joiner}uva_max_bytes {config.uva_max_bytes} ({format_bytes(config.uva_max_bytes)})"
    else:
        text = f"backend {config.backend}"
    return text + (f", filter {', '.join(config.param_filter)}" if config.param_filter else "")


def _candidate(table: Table, config: OffloadConfig, *, busy: Sequence[float], offloaded_bytes: int,
               host: int, buffers: int = 0, transient: int = 0,
               copy: Sequence[float] = (), positions: Sequence[int] = (),
               schedule: PrefetchSchedule | None = None, disk: DiskReads | None = None,
               host_bytes: int | None = None, disk_positions: tuple[int, ...] = (),
               at_call: Mapping[int, tuple[float, float]] | None = None) -> FitCandidate:
    """A candidate's figures, computed as `estimate` computes them (`host`: the bytes its
    offloaded weights take off the device; `host_bytes`: what they take of host memory,
    when a disk tier holds some of them; `at_call`: `simulate_prefetch`'s)."""
    stalls = simulate_prefetch(busy, copy, positions, schedule, disk, at_call)[0] \
        if schedule is not None and positions else ()
    step = sum(b + s for b, s in zip(busy, stalls, strict=True)) if stalls else sum(busy)
    step += sum(read + link for read, link in at_call.values()) if at_call else 0.0
    reads = disk_seconds(disk) + (sum(read for read, _ in at_call.values()) if at_call else 0.0)
    limit = max(sum(table.compute), offloaded_bytes / table.profile.pinned_h2d_bytes_per_s, reads)
    return FitCandidate(config=config, step_seconds=step, limit_seconds=limit,
                        resident_bytes=table.resident_bytes - host, buffer_bytes=buffers,
                        transient_bytes=transient, outside_bytes=table.outside, reserve_bytes=table.reserve,
                        host_bytes=host if host_bytes is None else host_bytes, disk_positions=disk_positions)


def disk_seconds(disk: DiskReads | None) -> float:
    """Seconds of disk reads per step: every disk position's read but those alone in their
    staging buffer (read once and kept), as `estimate` counts them."""
    if disk is None:
        return 0.0
    next_of = dict(disk.next_of)
    return sum(seconds for i, seconds in enumerate(disk.seconds) if seconds and next_of.get(i, i) != i)


def none_candidate(table: Table) -> FitCandidate:
    """Backend none: every weight resident."""
    return _candidate(table, OffloadConfig(backend="none"), busy=table.compute, offloaded_bytes=0, host=0)


def uva_candidates(table: Table, budget: int) -> tuple[FitCandidate | None, FitCandidate | None]:
    """(the smallest UVA prefix that fits, the prefix that needs the fewest device bytes)."""
    fits: FitCandidate | None = None
    leanest: tuple[int, int] | None = None  # (device bytes, prefix length)
    per_layer = [0] * len(table.compute)
    host = largest = 0
    for m, (nbytes, reads) in enumerate(table.uva_groups, start=1):
        host += nbytes
        for layer, moved in reads:
            per_layer[layer] += moved
            largest = max(largest, per_layer[layer])
        transient = 0 if table.uva_enabled else largest
        device = table.resident_bytes - host + transient + table.fixed_bytes
        if host > 0 and (leanest is None or device < leanest[0]):
            leanest = (device, m)
        if host > 0 and device <= budget:
            fits = uva_prefix(table, m)
            break
    return fits, (uva_prefix(table, leanest[1]) if leanest is not None else None)


def uva_prefix(table: Table, m: int) -> FitCandidate:
    """UVA over the first `m` storages (in layer order) of the table's UVA groups."""
    per_layer = [0] * len(table.compute)
    for _, reads in table.uva_groups[:m]:
        for layer, moved in reads:
            per_layer[layer] += moved
    host = sum(nbytes for nbytes, _ in table.uva_groups[:m])
    rate = table.profile.zero_copy_bytes_per_s if table.uva_enabled else table.copy_rate
    busy = [c + b / rate for c, b in zip(table.compute, per_layer, strict=True)]
    config = OffloadConfig(backend="uva", uva_max_bytes=host, param_filter=table.segments)
    return _candidate(table, config, busy=busy, offloaded_bytes=sum(per_layer), host=host,
                      transient=0 if table.uva_enabled else max(per_layer))


def prefetch_candidate(table: Table, expanded: Expanded, depth: int, buffers: int,
                       host: HostTier | None = None) -> FitCandidate | None:
    """Prefetch of `expanded`'s layers at `depth`, with `buffers` static buffer bytes; with
    a host budget, its last layers on disk as `host` places them (None: no disk tier
    makes it fit the budget)."""
    ls = expanded.layer_set
    config = OffloadConfig(backend="prefetch", group_size=ls.group_size, num_in_group=ls.num_in_group,
                           prefetch_step=depth, param_filter=table.segments, expert_cache=table.expert_cache,
                           expert_slots=table.expert_slots)
    rate = table.copy_rate
    schedule = cached_schedule(len(expanded.positions), depth, expanded.cycles)
    at_call = bool(table.expert_wait)  # expert caches: their misses copied (and read) at their call
    placed = host.place(expanded.positions, schedule, caches=table.expert_cache, at_call=at_call) \
        if host is not None else None
    if host is not None and placed is None:
        return None
    # Layers alone in their slot are loaded once: not on the link per step, nor in the limit.
    per_step = sum(expanded.copy_bytes) - kept_bytes(expanded.copy_bytes, expanded.positions, depth, expanded.cycles)
    busy: Sequence[float] = table.compute
    calls: dict[int, tuple[float, float]] = {}  # (disk read, link) at each layer's experts' call
    if at_call:  # each offloaded layer waits at its experts' calls (over a trace, or the worst case)
        on = set(expanded.positions)
        # for its misses' reads from the files first, on the disk tier
        reads = placed.disk if placed is not None and placed.disk is not None else None
        read = {layer: table.expert_moved[layer] / reads.bytes_per_s for layer in reads.expert_layers} \
            if reads is not None else {}
        calls = {layer: (read.get(layer, 0.0), table.expert_moved[layer] / rate)
                 for layer in expanded.positions if table.expert_moved[layer]}
        busy = [c + (w if i in on else 0.0) for i, (c, w) in enumerate(zip(table.compute, table.expert_wait,
                                                                              strict=True))]
        per_step += sum(round(table.expert_moved[i]) for i in expanded.positions)
    return _candidate(table, config, busy=busy, offloaded_bytes=per_step,
                      host=ls.host_bytes, buffers=buffers,
                      copy=[expanded.copy_bytes[i] / rate for i in expanded.positions],
                      positions=expanded.positions, schedule=schedule,
                      disk=placed.disk if placed is not None else None,
                      host_bytes=placed.host_bytes if placed is not None else None,
                      disk_positions=placed.disk_positions if placed is not None else (), at_call=calls)


@functools.lru_cache(maxsize=4096)
def cached_schedule(num_offloaded: int, depth: int, cycles: tuple[int, ...] = ()) -> PrefetchSchedule:
    """`schedule_prefetch`, remembered: the search asks for the same few many times."""
    return schedule_prefetch(num_offloaded, depth, cycles)


def best_depth(table: Table, layer_set: LayerSet, budget: int, max_step: int,
               host: HostTier | None = None) -> tuple[FitCandidate | None, int, bool]:
    """The best depth for one layer set that fits the device budget (and the host budget,
    with `host`), how many depths were simulated, and whether any depth fit the device."""
    expanded = expand(table, layer_set)
    best: FitCandidate | None = None
    runs = 0
    fits_device = False
    # One kind of layer at every position: buffers grow with depth, so stop at the first misfit.
    monotone = len(expanded.kinds) == 1
    for depth in range(1, min(len(expanded.positions), max_step) + 1):
        buffers = buffer_bytes(expanded, depth)
        if table.resident_bytes - layer_set.host_bytes + buffers + table.fixed_bytes > budget:
            if monotone:
                break
            continue
        fits_device = True
        candidate = prefetch_candidate(table, expanded, depth, buffers, host)
        runs += 1
        if candidate is None:
            continue  # no disk tier meets the host budget at this depth
        if best is None or compare(candidate, best) < 0:
            best = candidate
        if candidate.step_seconds <= layer_set.bound_seconds or close(candidate.step_seconds, layer_set.bound_seconds):
            break  # no deeper prefetch is faster than the bound
    return best, runs, fits_device


def close(a: float, b: float) -> bool:
    """Equal within a relative 1e-9: step times that differ by less are a tie."""
    return abs(a - b) <= _TOL * max(abs(a), abs(b))


def tie_key(c: FitCandidate) -> tuple[int, int, int, int, int, int, int]:
    """What breaks a tie on step time, least first: host bytes, device bytes, backend, settings."""
    cfg = c.config
    return (c.host_bytes, c.device_bytes, BACKEND_ORDER[cfg.backend], cfg.group_size,
            cfg.num_in_group, cfg.prefetch_step, cfg.uva_max_bytes)


def compare(a: FitCandidate, b: FitCandidate) -> int:
    """Negative when `a` ranks before `b` (see `offload.pure.fit.search`), 0 when equal."""
    if not close(a.step_seconds, b.step_seconds):
        return -1 if a.step_seconds < b.step_seconds else 1
    ta, tb = tie_key(a), tie_key(b)
    return -1 if ta < tb else (1 if ta > tb else 0)


def same_outcome(a: FitCandidate, b: FitCandidate) -> bool:
    """The same step (within `close`), host bytes and device bytes."""
    return close(a.step_seconds, b.step_seconds) and (a.host_bytes, a.device_bytes) == (b.host_bytes, b.device_bytes)
