"""The parts a plan is made of: the backend and why, placements, warnings, one entry per
parameter (`ParamPlan`) and per static buffer (`BufferPlan`). `OffloadPlan`
(`offload.pure.plan.plan`) holds them; the rules it is checked against
(`offload.pure.plan._rules`) and the buffer layout (`offload.pure.plan.layout`) read them.
"""

from __future__ import annotations

import enum

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, is_bool, is_str, tuple_of_ints
from offload.pure._slots import slot_setters
from offload.pure.spec.experts import ExpertGroup
from offload.pure.spec.values import ParamSpec

__all__ = [
    "OFFLOADED_PLACEMENTS",
    "Backend",
    "BackendReason",
    "BufferPlan",
    "ParamPlan",
    "Placement",
    "PlanWarning",
    "WarningCode",
    "serves_cache",
    "trusted_param_plan",
]


class Backend(enum.Enum):
    """The backend that runs the plan."""

    PREFETCH = "prefetch"
    UVA = "uva"
    NONE = "none"


class BackendReason(enum.Enum):
    """Why that backend."""

    EXPLICIT = "explicit"
    AUTO_GROUP_SIZE = "auto_group_size"
    AUTO_UVA_BUDGET = "auto_uva_budget"
    AUTO_NOTHING_CONFIGURED = "auto_nothing_configured"


class Placement(enum.Enum):
    """Where a parameter lives while the model runs."""

    RESIDENT = "resident"  # stays where it is (on the device, or on the host if it was there)
    PREFETCH = "prefetch"  # host copy, streamed into a static device buffer before its layer
    UVA = "uva"  # host copy, read in place by the device through a zero-copy view
    ON_DEMAND = "on_demand"  # host copy, moved to the device for each call of its layer


OFFLOADED_PLACEMENTS = frozenset({Placement.PREFETCH, Placement.UVA, Placement.ON_DEMAND})


class WarningCode(enum.Enum):
    """Kinds of plan warning."""

    FILTER_MATCHED_NOTHING = "filter_matched_nothing"
    MODEL_FITS_ON_DEVICE = "model_fits_on_device"
    PREFETCH_STALLS = "prefetch_stalls"
    PREFETCH_DEPTH_COVERS_ALL = "prefetch_depth_covers_all"
    INTEGRATED_GPU = "integrated_gpu"
    PREFETCH_UNPINNED = "prefetch_unpinned"
    HOST_MEMORY_SHORT = "host_memory_short"
    MEMLOCK_LIMIT = "memlock_limit"
    NO_ACCELERATOR = "no_accelerator"
    COHERENT_UNIFIED_MEMORY = "coherent_unified_memory"
    ON_DEMAND_SLOW = "on_demand_slow"
    BOTH_BACKENDS_CONFIGURED = "both_backends_configured"
    SETTINGS_UNUSED = "settings_unused"
    NOTHING_OFFLOADED = "nothing_offloaded"
    TIED_KEPT_RESIDENT = "tied_kept_resident"
    PLAN_REVISED = "plan_revised"
    HOST_PARAMS_KEPT = "host_params_kept"
    DEVICE_MEMORY_SHORT = "device_memory_short"
    DISK_BOUND = "disk_bound"


@attrs.frozen(kw_only=True)
class PlanWarning:
    """Something the user should know before running the plan.

    Attributes:
        code: the kind, for programs.
        message: the explanation, for people; it names the values involved.
    """

    code: WarningCode = attrs.field(validator=attrs.validators.instance_of(WarningCode))
    message: str = attrs.field(validator=is_str(PlanError))


@attrs.frozen(kw_only=True)
class ParamPlan:
    """The decision for one parameter.

    The parameter's own facts (name, shape, stride in elements, dtype, itemsize, bytes,
    device) are those of its `ParamSpec`, readable here as properties.

    Attributes:
        layer: index of its layer.
        param: the parameter as planned.
        placement: where it lives while the model runs.
        slot: for PREFETCH, the static buffer slot of its buffer key; None otherwise.
        tied_to: (layer, name) of the first parameter sharing its storage, which holds the
            one host copy; None when it is that first one or is not tied.
    """

    layer: int
    param: ParamSpec
    placement: Placement
    slot: int | None = None
    tied_to: tuple[int, str] | None = None

    def __attrs_post_init__(self) -> None:
        # One check for all fields instead of a validator per field: plans of large models
        # hold tens of thousands of these, and make_plan has a time budget.
        tie: object = self.tied_to
        slot: object = self.slot
        layer: object = self.layer
        if not (
            type(layer) is int
            and layer >= 0
            and type(self.param) is ParamSpec
            and type(self.placement) is Placement
            and (slot is None or (type(slot) is int and slot >= 0))
            and (tie is None or (type(tie) is tuple and len(tie) == 2
                                 and type(tie[0]) is int and type(tie[1]) is str))
        ):
            raise PlanError(
                "ParamPlan needs layer >= 0, a ParamSpec, a Placement, slot None or >= 0 and "
                f"tied_to None or (layer, name); got layer={self.layer!r}, "
                f"param={type(self.param).__name__}, placement={self.placement!r}, "
                f"slot={self.slot!r}, tied_to={tie!r}",
                name=getattr(self.param, "name", "param"),
                value=(self.layer, self.slot, tie),
            )
        if (self.placement is Placement.PREFETCH) != (self.slot is not None):
            raise PlanError(
                f"parameter {self.layer}:{self.name}: a slot is given exactly for PREFETCH "
                f"placements, got placement {self.placement.value} with slot {self.slot}",
                name=self.name,
                value=self.slot,
            )

    @property
    def name(self) -> str:
        """The name relative to the layer."""
        return self.param.name

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes, in elements."""
        return self.param.shape

    @property
    def stride(self) -> tuple[int, ...]:
        """Strides, in elements; host copies and device buffers keep them."""
        return self.param.stride

    @property
    def dtype(self) -> str:
        """The torch dtype name without ``torch.``."""
        return self.param.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.param.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes its elements span."""
        return self.param.nbytes

    @property
    def device(self) -> str:
        """Where it was when planned (see `ParamSpec.device`)."""
        return self.param.device

    @property
    def offloaded(self) -> bool:
        """True when the parameter leaves the compute device."""
        return self.placement in OFFLOADED_PLACEMENTS

    @property
    def buffer_key(self) -> tuple[str, tuple[int, ...], tuple[int, ...], str]:
        """The static buffer key: (name, shape, stride, dtype)."""
        return self.param.buffer_key


# The trusted builders create instances without their __init__ (see _slots).
_NEW = object.__new__
_SET_LAYER, _SET_PARAM, _SET_PLACEMENT, _SET_SLOT, _SET_TIED_TO = slot_setters(
    ParamPlan, ("layer", "param", "placement", "slot", "tied_to")
)


def trusted_param_plan(
    layer: int, param: ParamSpec, placement: Placement, slot: int | None, tied_to: tuple[int, str] | None
) -> ParamPlan:
    """A `ParamPlan` equal to ``ParamPlan(layer=layer, ...)``, built without checking it.

    For `make_plan`, which derives every field from a validated `ModelSpec` and its own
    schedule (a slot exactly for PREFETCH); see `trusted_offload_plan`. A plan read from
    JSON builds its entries through the class, which checks each.
    """
    p = _NEW(ParamPlan)
    _SET_LAYER(p, layer)
    _SET_PARAM(p, param)
    _SET_PLACEMENT(p, placement)
    _SET_SLOT(p, slot)
    _SET_TIED_TO(p, tied_to)
    return p


@attrs.frozen(kw_only=True)
class BufferPlan:
    """A static device buffer key and the slots allocated for it (prefetch only).

    Attributes:
        name, shape, stride, dtype: the key; parameters with the same name, shape, stride
            and dtype in different layers take turns in its slots.
        itemsize: bytes per element.
        slot_bytes: bytes of one slot.
        slots: the slot numbers allocated (those some offloaded layer uses).
        shared: one device buffer serves all of its slots: the rows of expert caches,
            which only each experts module's call writes, with the experts it routes
            (Note [expert cache]), and which the copy queue never writes. Set exactly for
            the keys whose every parameter an expert cache serves (`serves_cache`).
    """

    name: str = attrs.field(validator=is_str(PlanError))
    shape: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    stride: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    dtype: str = attrs.field(validator=is_str(PlanError))
    itemsize: int = attrs.field(validator=int_at_least(1, PlanError))
    slot_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    slots: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    shared: bool = attrs.field(default=False, validator=is_bool(PlanError))

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...], str]:
        """(name, shape, stride, dtype)."""
        return (self.name, self.shape, self.stride, self.dtype)

    @property
    def nbytes(self) -> int:
        """Device bytes of all its slots (of its one buffer where `shared`)."""
        return self.slot_bytes * (min(1, len(self.slots)) if self.shared else len(self.slots))


def serves_cache(group: ExpertGroup, p: ParamPlan | None) -> bool:
    """Whether `p`, the plan of one of `group`'s parameters, is one an expert cache serves:
    prefetched, untied, and with E rows where the experts are fused."""
    return (p is not None and p.placement is Placement.PREFETCH and p.tied_to is None
            and (not group.fused or bool(p.shape) and p.shape[0] == group.num_experts))
