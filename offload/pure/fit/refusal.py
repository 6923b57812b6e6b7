"""`fit`'s refusals (`Refusal`): when no configuration fits the device budget, or when
configurations fit it but none fits the host budget too (`host_bounds`: the least host
budget that works with this device budget, and the least device budget that works with
this host budget, each with its configuration). A search run with the expert caches and
again without joins its two searches' bounds (`HostBounds.joined`)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from offload.errors import PlanError
from offload.pure.config import OffloadConfig
from offload.pure.fit.candidates import FitCandidate, cached_schedule, describe, none_candidate, uva_prefix
from offload.pure.fit.host import HostTier
from offload.pure.fit.table import LayerSet, Table, buffer_bytes, expand
from offload.pure.units import format_bytes

__all__ = ["HostBounds", "Refusal", "host_bounds"]

#: (bytes, a configuration that needs no more).
Least = tuple[int, OffloadConfig]


def _less(a: Least | None, b: Least | None) -> Least | None:
    return b if a is None or (b is not None and b[0] < a[0]) else a


@attrs.frozen(kw_only=True)
class HostBounds:
    """Within a device and a host budget: the least host memory of any configuration that
    fits the device budget (None: none fits it), and the fewest device bytes of any whose
    host memory can meet the host budget."""

    budget: int
    host_budget: int
    least_host: Least | None
    least_device: Least

    def joined(self, other: HostBounds) -> HostBounds:
        """The bounds over both searches' configurations."""
        return attrs.evolve(self, least_host=_less(self.least_host, other.least_host),
                            least_device=min(self.least_device, other.least_device, key=lambda least: least[0]))

    def refusal(self) -> Refusal:
        """The error naming both bounds (some configuration fits the device budget)."""
        budget, host_budget = self.budget, self.host_budget
        least_host = self.least_host or (host_budget, OffloadConfig(backend="none"))  # not reached: see above
        least_device = self.least_device
        return Refusal(
            f"no configuration fits both the device budget of {format_bytes(budget)} ({budget} bytes) and the host "
            f"budget of {format_bytes(host_budget)} ({host_budget} bytes): with this device budget the least host "
            f"budget is {format_bytes(least_host[0])} ({least_host[0]} bytes, {describe(least_host[1], joiner=' with ')})"
            f"; with this host budget the least device budget is {format_bytes(least_device[0])} ({least_device[0]} "
            f"bytes, {describe(least_device[1], joiner=' with ')})",
            name="host_budget_bytes", value=host_budget, bounds=self)


class Refusal(PlanError):
    """`fit` found no configuration within its budgets; with a host budget, the bounds of
    its search (`HostBounds`), which a search of other configurations may join."""

    def __init__(self, message: str, *, name: str, value: object, bounds: HostBounds | None = None) -> None:
        super().__init__(message, name=name, value=value)
        self.bounds = bounds


def host_bounds(table: Table, sets: Sequence[LayerSet], uva: FitCandidate | None, budget: int, max_step: int,
                host: HostTier) -> HostBounds:
    """The bounds of the search of `table`'s configurations (`HostBounds`): the least host
    budget that works with this device budget, and the least device budget that works with
    this host budget, each with a configuration that meets it."""
    host_budget = host.host_budget_bytes
    # With this device budget: the least host memory of any configuration that fits it.
    least_host: Least | None = (uva.host_bytes, uva.config) if uva is not None else None
    # With this host budget: the fewest device bytes of any configuration whose host memory
    # can meet it (backend none takes no host memory at all).
    none = none_candidate(table)
    least_device: Least = (none.device_bytes, none.config)
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
    return HostBounds(budget=budget, host_budget=host_budget, least_host=least_host, least_device=least_device)
