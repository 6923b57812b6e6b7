"""`fit`'s refusal when configurations fit the device budget but none fits the host budget
too (`host_refusal`): the least host budget that works with this device budget, and the
least device budget that works with this host budget, each with its configuration."""

from __future__ import annotations

from collections.abc import Sequence

from offload.errors import PlanError
from offload.pure.config import OffloadConfig
from offload.pure.fit.candidates import FitCandidate, cached_schedule, describe, none_candidate, uva_prefix
from offload.pure.fit.host import HostTier
from offload.pure.fit.table import LayerSet, Table, buffer_bytes, expand
from offload.pure.units import format_bytes

__all__ = ["host_refusal"]


def host_refusal(table: Table, sets: Sequence[LayerSet], uva: FitCandidate | None, budget: int, max_step: int,
                  host: HostTier) -> PlanError:
    """The error when configurations fit the device budget but none fits the host budget
    too: the least host budget that works with this device budget, and the least device
    budget that works with this host budget, each with a configuration that meets it."""
    host_budget = host.host_budget_bytes
    # With this device budget: the least host memory of any configuration that fits it.
    least_host: tuple[int, OffloadConfig] | None = (uva.host_bytes, uva.config) if uva is not None else None
    # With this host budget: the fewest device bytes of any configuration whose host memory
    # can meet it (backend none takes no host memory at all).
    none = none_candidate(table)
    least_device: tuple[int, OffloadConfig] = (none.device_bytes, none.config)
    if uva is not None:
        # The longest UVA prefix within the host budget takes the fewest device bytes.
        host_so_far, longest = 0, 0
        for m, (nbytes, _) in enumerate(table.uva_groups, start=1):
            host_so_far += nbytes
            if host_so_far > host_budget:
                break
            if host_so_far:
                longest = m  # a prefix of nothing but empty storages offloads nothing
        if longest:
            lean = uva_prefix(table, longest)
            if lean.device_bytes < least_device[0]:
                least_device = (lean.device_bytes, lean.config)
    for layer_set in sets:
        expanded = expand(table, layer_set)
        for depth in range(1, min(len(expanded.positions), max_step) + 1):
            device = table.resident_bytes - layer_set.host_bytes + buffer_bytes(expanded, depth) + table.fixed_bytes
            schedule = cached_schedule(len(expanded.positions), depth, expanded.cycles)
            least = host.least_host_bytes(expanded.positions, schedule, caches=table.expert_cache)
            config = OffloadConfig(backend="prefetch", group_size=layer_set.group_size,
                                   num_in_group=layer_set.num_in_group, prefetch_step=depth,
                                   param_filter=table.segments, expert_cache=table.expert_cache,
                                   expert_slots=table.expert_slots)
            if device <= budget and (least_host is None or least < least_host[0]):
                least_host = (least, config)
            if least <= host_budget and device < least_device[0]:
                least_device = (device, config)
    if least_host is None:  # not reached: called only when some configuration fits the device
        least_host = (host_budget, none.config)
    return PlanError(
        f"no configuration fits both the device budget of {format_bytes(budget)} ({budget} bytes) and the host "
        f"budget of {format_bytes(host_budget)} ({host_budget} bytes): with this device budget the least host "
        f"budget is {format_bytes(least_host[0])} ({least_host[0]} bytes, {describe(least_host[1], joiner=' with ')});"
        f" with this host budget the least device budget is {format_bytes(least_device[0])} ({least_device[0]} "
        f"bytes, {describe(least_device[1], joiner=' with ')})",
        name="host_budget_bytes", value=host_budget)
