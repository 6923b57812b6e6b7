"""The values of a step estimate (`offload.pure.fit.estimate`): what a step is asked to do
(`Workload`), what each layer's share of it is predicted to be (`LayerEstimate`), the
whole step (`StepEstimate`), and a disk tier as the simulation sees it (`DiskReads`)."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from offload.errors import ConfigError
from offload.pure._checks import check_int_at_least, is_int, positive_number
from offload.pure.serialize import short_repr, to_data

__all__ = ["MAX_TOKENS_PER_STEP", "DiskReads", "LayerEstimate", "StepEstimate", "Workload"]


#: The most tokens one step may process: 2**40, beyond any batch, and small enough that
#: 2 x parameters x tokens stays a finite float for any model up to 2**60 bytes.
MAX_TOKENS_PER_STEP = 1 << 40


def _tokens(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_int_at_least(attribute.name, value, 1, ConfigError)
    if is_int(value) and value > MAX_TOKENS_PER_STEP:
        raise ConfigError(f"{attribute.name} must be an integer from 1 to {MAX_TOKENS_PER_STEP} (2**40), "
                          f"got {_short_int(value)}", name=attribute.name, value=value)


def _stack_tokens(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple):
        raise ConfigError(f"stack_tokens must be a tuple of token counts, got {short_repr(value)}",
                          name="stack_tokens", value=value)
    for i, tokens in enumerate(value):
        check_int_at_least(f"stack_tokens[{i}]", tokens, 1, ConfigError)
        if tokens > MAX_TOKENS_PER_STEP:
            raise ConfigError(f"stack_tokens[{i}] must be an integer from 1 to {MAX_TOKENS_PER_STEP} (2**40), "
                              f"got {_short_int(tokens)}", name=f"stack_tokens[{i}]", value=tokens)


def _short_int(value: int) -> str:
    """`value` in decimal, cut to its first 24 digits and a count when longer (``str`` of
    an int past 4300 digits raises)."""
    digits = int(value.bit_length() * math.log10(2)) + 1
    if digits > 4000:
        return f"an integer of about {digits} digits"
    text = str(value)
    return text if len(text) <= 24 else f"{text[:24]}... ({len(text)} digits)"


@attrs.frozen(kw_only=True)
class Workload:
    """What one step processes.

    Attributes:
        tokens_per_step: tokens in one forward pass (batch x sequence), from 1 to
            `MAX_TOKENS_PER_STEP` (2**40).
        resident_step_seconds: a measured step time with every weight resident, seconds;
            when given it replaces the profile's FLOP-based compute time.
        stack_tokens: tokens per step of each layer stack, in the order the stacks run,
            where they differ (Whisper's encoder runs over 1500 frames, its decoder over a
            few tokens); empty: `tokens_per_step` for every stack. A step runs each stack
            once. Not used with `resident_step_seconds`.
    """

    tokens_per_step: int = attrs.field(default=1, validator=_tokens)
    resident_step_seconds: float | None = attrs.field(
        default=None, validator=positive_number(ConfigError, optional=True)
    )
    stack_tokens: tuple[int, ...] = attrs.field(default=(), validator=_stack_tokens)

    def tokens_by_layer(self, stack_ranges: tuple[tuple[int, int], ...], num_layers: int) -> tuple[int, ...]:
        """Tokens per step of each of `num_layers` layers, whose stacks are `stack_ranges`.

        Raises:
            ConfigError: `stack_tokens` gives another number of stacks than the model has.
        """
        if not self.stack_tokens:
            return (self.tokens_per_step,) * num_layers
        ranges = stack_ranges or ((0, num_layers),)
        if len(self.stack_tokens) != len(ranges):
            raise ConfigError(f"stack_tokens gives {len(self.stack_tokens)} token counts; the model has "
                              f"{len(ranges)} layer {'stack' if len(ranges) == 1 else 'stacks'}",
                              name="stack_tokens", value=self.stack_tokens)
        out = [self.tokens_per_step] * num_layers
        for tokens, (first, stop) in zip(self.stack_tokens, ranges, strict=True):
            for layer in range(first, min(stop, num_layers)):
                out[layer] = tokens
        return tuple(out)


@attrs.frozen(kw_only=True)
class LayerEstimate:
    """One layer's share of a steady-state step. Times in seconds, sizes in bytes.

    Attributes:
        layer: the layer index.
        compute_seconds: the layer's time with its weights resident.
        copy_seconds: its prefetch copy's time on the link per step (overlaps earlier
            layers); 0 for a layer loaded once.
        stall_seconds: time it waited for that copy after the layer before it finished.
        uva_read_seconds: time reading UVA weights through zero-copy views.
        on_demand_seconds: time copying on-demand weights before it runs.
        copy_bytes: bytes prefetched for it per step; 0 for a layer loaded once.
        uva_bytes: bytes read through zero-copy views per step.
        on_demand_bytes: bytes copied on demand per step.
        loaded_once_bytes: bytes prefetched for it once, before the first step, and kept
            in its slot (it is the only owner of that slot: `PrefetchSchedule.kept_positions`);
            not moved per step. 0 for every other layer.
        disk_read_seconds: a disk-tier layer's read from disk per step (overlaps earlier
            layers; its wait, where the read is late, is in `stall_seconds`), and with a
            routing trace its expert caches' misses read from disk at their call; 0 for
            the others.
        expert_seconds: with a routing trace, its wait at its experts' calls for their
            copies (misses from host memory, and from disk on the disk tier; hits from
            their slots); 0 without one.
        expert_bytes: with a routing trace, bytes its expert caches copy from host memory
            per step (misses x B, the trace's mean, rounded); 0 without one (the experts
            are then in `copy_bytes`).
        expert_routed: with a routing trace, experts routed to its caches per step (mean).
        expert_hits: of those, served from a slot (mean).
    """

    layer: int
    compute_seconds: float
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0
    uva_read_seconds: float = 0.0
    on_demand_seconds: float = 0.0
    copy_bytes: int = 0
    uva_bytes: int = 0
    on_demand_bytes: int = 0
    loaded_once_bytes: int = 0
    disk_read_seconds: float = 0.0
    expert_seconds: float = 0.0
    expert_bytes: int = 0
    expert_routed: float = 0.0
    expert_hits: float = 0.0

    @property
    def seconds(self) -> float:
        """The layer's wall time in the step: compute + stall + UVA read + on demand + experts."""
        return (self.compute_seconds + self.stall_seconds + self.uva_read_seconds + self.on_demand_seconds
                + self.expert_seconds)


@attrs.frozen(kw_only=True)
class StepEstimate:
    """A predicted steady-state step, itemised per layer.

    Attributes:
        profile: the profile's name.
        tokens_per_step: tokens per step.
        compute_from: "flops" (the profile's throughput) or "measured" (a resident step time).
        copy_bytes_per_s: the rate of prefetch and on-demand copies (pinned or pageable).
        pinned_bytes_per_s: the pinned rate, which the limit uses.
        uva_bytes_per_s: the zero-copy read rate.
        layers: one entry per layer, in order.
        passes: passes simulated to reach the steady state.
        period: passes after which the steady state repeats (its figures are averaged).
        stack_tokens: the workload's tokens per step of each stack (empty: `tokens_per_step`).
        routing_steps: the steps of the routing trace the expert caches were replayed
            over (0: no trace; the experts are then counted in their layers' copies).
        belady_hit_rate: with a trace, the hit rate of Belady's optimum for the same
            slots over it (`offload.pure.experts.replay.belady`), beside `expert_hit_rate`.
    """

    profile: str
    tokens_per_step: int
    compute_from: str
    copy_bytes_per_s: float
    pinned_bytes_per_s: float
    uva_bytes_per_s: float
    layers: tuple[LayerEstimate, ...]
    passes: int = 1
    period: int = 1
    stack_tokens: tuple[int, ...] = ()
    routing_steps: int = 0
    belady_hit_rate: float | None = None

    @property
    def expert_seconds(self) -> float:
        """Time the layers wait at their experts' calls for the copies, seconds (0 without
        a routing trace)."""
        return sum(layer.expert_seconds for layer in self.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes the expert caches copy from host memory per step (0 without a trace)."""
        return sum(layer.expert_bytes for layer in self.layers)

    @property
    def expert_hit_rate(self) -> float | None:
        """Hits over routed experts per step, from 0 to 1, with a trace (1.0 where none was
        routed); None without one."""
        if not self.routing_steps:
            return None
        routed = sum(layer.expert_routed for layer in self.layers)
        return sum(layer.expert_hits for layer in self.layers) / routed if routed else 1.0

    @property
    def step_seconds(self) -> float:
        """Predicted step time, seconds: the sum of the layers' wall times."""
        return sum(layer.seconds for layer in self.layers)

    @property
    def compute_seconds(self) -> float:
        """Resident compute of the whole step, seconds."""
        return sum(layer.compute_seconds for layer in self.layers)

    @property
    def stall_seconds(self) -> float:
        """Time spent waiting for prefetch copies, seconds."""
        return sum(layer.stall_seconds for layer in self.layers)

    @property
    def copy_seconds(self) -> float:
        """Time the link spends on prefetch copies per step, seconds."""
        return sum(layer.copy_seconds for layer in self.layers)

    @property
    def uva_read_seconds(self) -> float:
        """Time spent reading through zero-copy views, seconds."""
        return sum(layer.uva_read_seconds for layer in self.layers)

    @property
    def on_demand_seconds(self) -> float:
        """Time spent copying on demand, seconds."""
        return sum(layer.on_demand_seconds for layer in self.layers)

    @property
    def disk_read_seconds(self) -> float:
        """Time the disk spends reading disk-tier layers per step, seconds (0 without a
        disk tier): no step is faster."""
        return sum(layer.disk_read_seconds for layer in self.layers)

    @property
    def loaded_once_bytes(self) -> int:
        """Bytes of the layers loaded once and kept in their own slots (not per step)."""
        return sum(layer.loaded_once_bytes for layer in self.layers)

    @property
    def offloaded_bytes_per_step(self) -> int:
        """Bytes that cross the host link per step (prefetch + UVA + on demand + the expert
        caches' misses); the layers loaded once are not among them."""
        return sum(layer.copy_bytes + layer.uva_bytes + layer.on_demand_bytes + layer.expert_bytes
                   for layer in self.layers)

    @property
    def link_seconds(self) -> float:
        """Offloaded bytes per step / pinned rate, seconds: the link's share of the limit."""
        return self.offloaded_bytes_per_step / self.pinned_bytes_per_s

    @property
    def limit_seconds(self) -> float:
        """max(resident compute, offloaded bytes / pinned rate, a disk tier's reads per
        step): no plan beats it."""
        return max(self.compute_seconds, self.link_seconds, self.disk_read_seconds)

    @property
    def ratio_to_limit(self) -> float:
        """Predicted step / limit (1.0 is the best possible; 1.0 for an empty model)."""
        return self.step_seconds / self.limit_seconds if self.limit_seconds > 0 else 1.0

    def to_json(self, *, indent: int | None = None) -> str:
        """The estimate as JSON (every field; derived totals are not included)."""
        return json.dumps(to_data(self), indent=indent)


@attrs.frozen(kw_only=True)
class DiskReads:
    """A disk tier as the step simulation sees it (`offload.pure.disk.estimate`).

    Attributes:
        seconds: per offloaded position, the seconds its read takes (0: not on disk).
        next_of: per disk position, the next occupant of its staging buffer, read once
            the copy out of it has landed (itself: alone in its buffer, read once).
        first: the disk positions read before the first pass, in order.
        expert_layers: the layers whose expert caches read their misses from disk at the
            experts' call (`DiskParam.in_place`), with a routing trace; their experts are
            then not in `seconds`.
        bytes_per_s: the disk's read rate, for those reads.
    """

    seconds: tuple[float, ...]
    next_of: tuple[tuple[int, int], ...]
    first: tuple[int, ...]
    expert_layers: tuple[int, ...] = ()
    bytes_per_s: float = 0.0
