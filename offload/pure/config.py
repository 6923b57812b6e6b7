"""The user's offloading request, validated at construction."""

from __future__ import annotations

from typing import Any, Literal, get_args

import attrs

from offload.errors import ConfigError
from offload.pure._checks import int_at_least, is_bool, one_of
from offload.pure.env.numa import NumaRequest, numa_request
from offload.pure.experts.values import RoutingProfile

__all__ = ["BackendName", "HostCheck", "LayerBlocks", "OffloadConfig", "segment_matches"]

BackendName = Literal["auto", "prefetch", "uva", "none"]
_BACKENDS: tuple[str, ...] = get_args(BackendName)

#: What the executors do with a plan whose host memory does not fit
#: (`OffloadPlan.host_admission`): refuse it before moving anything, warn and go on, or
#: not check at all.
HostCheck = Literal["refuse", "warn", "off"]
_HOST_CHECKS: tuple[str, ...] = get_args(HostCheck)

#: Whether the prefetch backend puts a layer's host copies in one block, so that the
#: layer is one copy (`offload.pure.plan.blocks`): where a copy is made anyway, also for
#: weights adopted in place (copied once at wrap time), or never.
LayerBlocks = Literal["auto", "always", "never"]
_LAYER_BLOCKS: tuple[str, ...] = get_args(LayerBlocks)


def _filter(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple):
        raise ConfigError(
            f"{attribute.name} must be a tuple of dotted name segments, got {value!r}",
            name=attribute.name,
            value=value,
        )
    for segment in value:
        if (
            not isinstance(segment, str)
            or segment.strip() != segment
            or any(part == "" or any(ch.isspace() for ch in part) for part in segment.split("."))
        ):
            raise ConfigError(
                f"{attribute.name} segment {segment!r} is not a dotted name "
                "(empty parts and spaces are not allowed)",
                name=attribute.name,
                value=segment,
            )


def segment_matches(segment: str, name: str) -> bool:
    """True when the dotted `segment` occurs in `name` as whole dot-separated parts.

    ``experts.w2_weight`` matches ``mlp.experts.w2_weight`` but not
    ``mlp.experts.w2_weight_scale`` nor ``mlp.shared_experts.w2_weight``.
    """
    parts = name.split(".")
    wanted = segment.split(".")
    width = len(wanted)
    return any(parts[i : i + width] == wanted for i in range(len(parts) - width + 1))


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """What the user asks for.

    Attributes:
        backend: "prefetch", "uva", "none", or "auto": prefetch when `group_size` > 0,
            else uva when `uva_max_bytes` > 0, else none.
        group_size: prefetch: layers per group (0 = prefetch not configured).
        num_in_group: prefetch: how many of each group's last layers are offloaded.
        prefetch_step: prefetch: how many offloaded layers ahead copies are issued; also
            the number of static buffer slots per parameter key.
        uva_max_bytes: uva: offload parameters in layer order until this many bytes are
            offloaded (the last one may cross it); 0 = uva not configured.
        param_filter: dotted name segments; when non-empty only parameters whose names
            contain one of them (whole parts) are offloaded.
        keep_host_params: on a platform with an accelerator, parameters that are in host
            memory when the plan is made (or run) stay there, resident and unmoved,
            instead of being offloaded or moved to the device (the default). For models
            a user splits between host and device on purpose; such parameters must be
            used by code that expects them on the host.
        numa_node: the NUMA node for pinned host copies: "auto" (the GPU's node on a
            multi-node host), a node number (which must be one of the host's: checked by
            `make_plan`), or None (no placement).
        host_check: when the host memory the plan takes does not fit what the machine
            allows (MemAvailable, the cgroup's memory limit, the locked-memory limit; see
            `offload.pure.decide.admission`): "refuse" (the default) makes ``wrap_modules`` raise
            before it moves anything, "warn" logs a warning and offloads anyway, "off"
            checks nothing (the verdict is still recorded in the plan).
        layer_blocks: prefetch: whether each layer's host copies lie back to back in one
            host allocation, and its static buffers in one device allocation, so that the
            layer is one copy instead of one per parameter (`offload.pure.plan.blocks`; only
            dense weights of a multiple of 256 bytes take part). "auto" (the default):
            where the weights are copied into host memory anyway (from the device, into
            pinned memory, or loaded into it); weights adopted in place (pageable host
            memory, not pinned) keep their own tensors. "always": adopted weights too,
            copied once at wrap time (each original released as soon as its parameter
            points at the block; the allocator may keep the freed memory). "never": one
            host copy per storage and one copy per parameter. Needs a runtime that makes
            blocks (`offload.protocols.HostBlocks`: `CudaRuntime`, `CpuRuntime`).
        expert_cache: prefetch: the experts of each offloaded mixture-of-experts layer
            (`ModelSpec.experts`) are copied expert by expert as the routing asks, with a
            device cache of `expert_slots` experts per layer (`offload.pure.experts`);
            False: its experts are streamed with the rest of the layer, whole.
        expert_slots: the device slots (C, in experts) of each expert cache: 1 to the
            layer's expert count; None: chosen by the plan
            (`offload.pure.experts.size.default_slots`, or from a device budget by `fit`).
        routing_profile: how often each expert was routed (`RoutingProfile`, recorded by
            `offload.executors.experts.record_routing` or read from JSON): each cache
            holds its hottest experts in its slots for good (up to half of them), and the
            plan refuses a profile of another model; None: no expert held.

    Raises:
        ConfigError: at construction, for a bad value or combination, naming it.
    """

    backend: BackendName = attrs.field(default="auto", validator=one_of(_BACKENDS, ConfigError))
    group_size: int = attrs.field(default=0, validator=int_at_least(0, ConfigError))
    num_in_group: int = attrs.field(default=1, validator=int_at_least(1, ConfigError))
    prefetch_step: int = attrs.field(default=1, validator=int_at_least(1, ConfigError))
    uva_max_bytes: int = attrs.field(default=0, validator=int_at_least(0, ConfigError))
    param_filter: tuple[str, ...] = attrs.field(default=(), validator=_filter)
    keep_host_params: bool = attrs.field(default=False, validator=is_bool(ConfigError))
    numa_node: NumaRequest = attrs.field(default="auto", validator=numa_request(ConfigError))
    host_check: HostCheck = attrs.field(default="refuse", validator=one_of(_HOST_CHECKS, ConfigError))
    layer_blocks: LayerBlocks = attrs.field(default="auto", validator=one_of(_LAYER_BLOCKS, ConfigError))
    expert_cache: bool = attrs.field(default=True, validator=is_bool(ConfigError))
    expert_slots: int | None = attrs.field(default=None, validator=int_at_least(1, ConfigError, optional=True))
    routing_profile: RoutingProfile | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(RoutingProfile)))

    def __attrs_post_init__(self) -> None:
        if self.group_size > 0 and self.num_in_group > self.group_size:
            raise ConfigError(
                f"num_in_group ({self.num_in_group}) is larger than group_size ({self.group_size}); "
                "a group cannot offload more layers than it has",
                name="num_in_group",
                value=self.num_in_group,
            )
        if self.backend == "prefetch" and self.group_size == 0:
            raise ConfigError(
                "backend 'prefetch' needs group_size > 0 (which layers to offload)",
                name="group_size",
                value=self.group_size,
            )
        if self.backend == "uva" and self.uva_max_bytes == 0:
            raise ConfigError(
                "backend 'uva' needs uva_max_bytes > 0 (how many bytes to offload)",
                name="uva_max_bytes",
                value=self.uva_max_bytes,
            )
        if len(set(self.param_filter)) != len(self.param_filter):
            raise ConfigError(
                f"param_filter repeats a segment: {self.param_filter!r}",
                name="param_filter",
                value=self.param_filter,
            )
