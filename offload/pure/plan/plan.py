"""The plan: every offloading decision, resolved, immutable and serialisable.

`make_plan` (in `offload.pure.plan.make`) builds it; executors only read it. A plan
round-trips through JSON without loss (`to_json` / `from_json`) and is checked on
construction (`offload.pure.plan._rules`), so a plan read back from a file is held to
the same rules as a fresh one. (`make_plan` itself builds its plans with the trusted
builders at the end of this module, for speed; the tests hold its plans to those rules.)
"""

from __future__ import annotations

import json

import attrs

from offload.errors import OffloadError, PlanError
from offload.pure._checks import int_at_least, is_str, one_of, tuple_of, tuple_of_ints
from offload.pure._slots import slot_setters
from offload.pure.config import OffloadConfig
from offload.pure.decide.admission import NOT_CHECKED, HostAdmission
from offload.pure.decide.moves import Move, decide_move, where_kind
from offload.pure.decide.numa import HostNuma
from offload.pure.decide.pinning import PinDecision
from offload.pure.decide.uva import UvaDecision
from offload.pure.experts.values import ExpertCachePlan
from offload.pure.plan._rules import check_plan
from offload.pure.plan.schedule import PrefetchSchedule
from offload.pure.plan.values import (
    OFFLOADED_PLACEMENTS,
    Backend,
    BackendReason,
    BufferPlan,
    ParamPlan,
    Placement,
    PlanWarning,
    WarningCode,
    trusted_param_plan,
)
from offload.pure.serialize import from_data, parse_json, short_repr, to_data
from offload.pure.spec.values import runs

__all__ = [
    "OFFLOADED_PLACEMENTS",
    "PLAN_FORMAT",
    "Backend",
    "BackendReason",
    "BufferPlan",
    "OffloadPlan",
    "ParamPlan",
    "Placement",
    "PlanWarning",
    "WarningCode",
    "trusted_offload_plan",
    "trusted_param_plan",
]

#: The ``format`` tag of a serialised plan; bumped when the layout changes.
PLAN_FORMAT = "offload-plan/1"


@attrs.frozen(kw_only=True)
class OffloadPlan:
    """Everything that will happen, decided. Executors only read it.

    Attributes:
        config: the request the plan answers.
        backend: the backend that runs it.
        backend_reason: why that backend.
        pin: the pin decision every backend obeys.
        uva: the UVA decision.
        params: one entry per parameter, in layer order then ``named_parameters()`` order.
        offloaded_layers: prefetch: the layer index of each schedule position, in order.
        buffers: prefetch: the static device buffers, one per key.
        schedule: prefetch: slots and copy order over `offloaded_layers` (empty otherwise).
        offloaded_bytes: bytes that leave the compute device's weights (each storage once).
        device_bytes_freed: device memory released, in bytes (0 without an accelerator,
            where the compute device is the CPU).
        device_bytes_buffers: device memory the static buffers take, in bytes (expert
            caches included).
        device_bytes_resident: bytes of weights that stay on the compute device.
        host_bytes: host memory the host copies take, in bytes (exact size).
        warnings: what the user should know.
        env_fingerprint: `EnvSnapshot.fingerprint()` of the snapshot the plan was made for.
        compute_device: "cuda" when the plan's platform has CUDA, else "cpu" (the compute
            device without an accelerator); executors pick their default runtime by it.
        num_layers: how many layers the model has (executors check they get that many).
        host_numa: the NUMA node pinned host copies are placed on, and why
            (`offload.pure.decide.numa.decide_numa`); a plan read from JSON written before it
            existed says "not recorded" and places nothing.
        host_admission: whether the host memory the plan takes fits what the machine
            allows, with the numbers and the limit that binds
            (`offload.pure.decide.admission.assess_host_memory`); the executors refuse a plan
            that does not fit unless ``config.host_check`` says otherwise. A plan read
            from JSON written before it existed says "not checked" (unknown).
        stacks: layers per stack, as `ModelSpec.stacks` (the stacks' layers one after the
            other, in the order they run), for per-stack workloads (`Workload.stack_tokens`);
            empty: one stack of every layer (and in a plan read from JSON written before it
            existed).
        experts: prefetch: the device expert cache of each offloaded mixture-of-experts
            layer (`offload.pure.experts.values.ExpertCachePlan`): its experts are copied
            expert by expert as the routing asks (Note [expert cache] in
            `offload.executors.experts`), not with the layer's other copies; their device
            bytes are part of `device_bytes_buffers`. Empty: no MoE layer, or
            ``config.expert_cache`` off (and in a plan read from JSON written before it
            existed).
    """

    config: OffloadConfig = attrs.field(validator=attrs.validators.instance_of(OffloadConfig))
    backend: Backend = attrs.field(validator=attrs.validators.instance_of(Backend))
    backend_reason: BackendReason = attrs.field(validator=attrs.validators.instance_of(BackendReason))
    pin: PinDecision = attrs.field(validator=attrs.validators.instance_of(PinDecision))
    uva: UvaDecision = attrs.field(validator=attrs.validators.instance_of(UvaDecision))
    params: tuple[ParamPlan, ...] = attrs.field(validator=tuple_of(ParamPlan, PlanError))
    offloaded_layers: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    buffers: tuple[BufferPlan, ...] = attrs.field(validator=tuple_of(BufferPlan, PlanError))
    schedule: PrefetchSchedule = attrs.field(validator=attrs.validators.instance_of(PrefetchSchedule))
    offloaded_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    device_bytes_freed: int = attrs.field(validator=int_at_least(0, PlanError))
    device_bytes_buffers: int = attrs.field(validator=int_at_least(0, PlanError))
    device_bytes_resident: int = attrs.field(validator=int_at_least(0, PlanError))
    host_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    warnings: tuple[PlanWarning, ...] = attrs.field(validator=tuple_of(PlanWarning, PlanError))
    env_fingerprint: str = attrs.field(validator=is_str(PlanError))
    compute_device: str = attrs.field(validator=one_of(("cuda", "cpu"), PlanError))
    num_layers: int = attrs.field(validator=int_at_least(0, PlanError))
    host_numa: HostNuma = attrs.field(factory=HostNuma, validator=attrs.validators.instance_of(HostNuma))
    host_admission: HostAdmission = attrs.field(default=NOT_CHECKED,
                                                validator=attrs.validators.instance_of(HostAdmission))
    stacks: tuple[int, ...] = attrs.field(default=(), validator=tuple_of_ints(1, PlanError))
    experts: tuple[ExpertCachePlan, ...] = attrs.field(default=(), validator=tuple_of(ExpertCachePlan, PlanError))

    def __attrs_post_init__(self) -> None:
        check_plan(self)
        if self.stacks and sum(self.stacks) != self.num_layers:
            raise PlanError(f"stacks {self.stacks} hold {sum(self.stacks)} layers, the plan has {self.num_layers}",
                            name="stacks", value=self.stacks)

    @property
    def stack_ranges(self) -> tuple[tuple[int, int], ...]:
        """Each stack's layers as ``(first, stop)`` (`ModelSpec.stack_ranges`)."""
        return runs(self.stacks, self.num_layers)

    @property
    def offloaded_params(self) -> tuple[ParamPlan, ...]:
        """The parameters that leave the compute device."""
        return tuple(p for p in self.params if p.offloaded)

    @property
    def device_bytes_saved(self) -> int:
        """Net device memory saved, in bytes: freed minus static buffers (never negative)."""
        return max(0, self.device_bytes_freed - self.device_bytes_buffers)

    def move_of(self, p: ParamPlan, device: str | None = None, compute: str | None = None) -> Move:
        """How `p` reaches its place: `offload.pure.decide.moves.decide_move` with this plan's pin
        method and config. Executors ask this for every parameter.

        Args:
            p: one of the plan's parameters.
            device: where its data is (``cpu``, ``cuda:0``, ``meta``); the device it was
                planned on when None.
            compute: the compute device the plan runs on (the runtime's, ``cuda:0`` or
                ``cpu``); the plan's `compute_device` when None.
        """
        compute = self.compute_device if compute is None else compute
        return decide_move(
            where_kind(p.param.device if device is None else device, compute),
            offloaded=p.offloaded,
            pin=self.pin.method,
            keep_host=self.config.keep_host_params,
            compute_is_host=compute == "cpu",
        )

    def planned_moves(self) -> tuple[tuple[Move, int, int], ...]:
        """What carrying out the plan moves, from the devices the parameters were planned
        on: (move, parameters, bytes with each storage once), in `Move` order, moves that
        happen to no parameter left out."""
        count: dict[Move, int] = {}
        nbytes: dict[Move, int] = {}
        for p in self.params:
            move = self.move_of(p)
            count[move] = count.get(move, 0) + 1
            if p.tied_to is None:
                nbytes[move] = nbytes.get(move, 0) + p.nbytes
        return tuple((m, count[m], nbytes.get(m, 0)) for m in Move if m in count)

    def warning_codes(self) -> frozenset[WarningCode]:
        """The codes of all warnings, for quick membership tests."""
        return frozenset(w.code for w in self.warnings)

    def to_json(self, *, indent: int | None = None) -> str:
        """Serialise without loss; `OffloadPlan.from_json` reads it back equal."""
        return json.dumps({"format": PLAN_FORMAT, "plan": to_data(self)}, indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> OffloadPlan:
        """Read a plan written by `to_json`.

        The text is untrusted: it may have been edited by hand or be something else
        entirely. Whatever it holds, the only error is a `PlanError`.

        Raises:
            PlanError: the text is not JSON (or nests too deep, or holds an over-long
                integer, NaN, Infinity or a key twice: see `parse_json`), not a plan of
                this format, or the plan breaks a rule (the same checks as a freshly made
                plan, including every layer, slot, buffer and tie an executor indexes by).
        """
        document = parse_json(text)
        if not isinstance(document, dict) or document.get("format") != PLAN_FORMAT:
            found = document.get("format") if isinstance(document, dict) else type(document).__name__
            raise PlanError(f"not an {PLAN_FORMAT} document (format is {short_repr(found)})",
                            name="format", value=found)
        try:
            return from_data(cls, document.get("plan"))
        except PlanError:
            raise
        except OffloadError as exc:  # e.g. a ConfigError from the embedded config
            raise PlanError(f"the plan breaks a rule: {exc}", name=exc.name, value=exc.value) from exc


# The trusted builder creates a plan without its __init__ (see _slots).
_NEW = object.__new__

# In field order, as the values below: `slot_setters` refuses any other list.
_PLAN_SETTERS = slot_setters(OffloadPlan, (
    "config", "backend", "backend_reason", "pin", "uva", "params", "offloaded_layers", "buffers", "schedule",
    "offloaded_bytes", "device_bytes_freed", "device_bytes_buffers", "device_bytes_resident", "host_bytes",
    "warnings", "env_fingerprint", "compute_device", "num_layers", "host_numa", "host_admission", "stacks",
    "experts",
))


def trusted_offload_plan(
    *,
    config: OffloadConfig,
    backend: Backend,
    backend_reason: BackendReason,
    pin: PinDecision,
    uva: UvaDecision,
    params: tuple[ParamPlan, ...],
    offloaded_layers: tuple[int, ...],
    buffers: tuple[BufferPlan, ...],
    schedule: PrefetchSchedule,
    offloaded_bytes: int,
    device_bytes_freed: int,
    device_bytes_buffers: int,
    device_bytes_resident: int,
    host_bytes: int,
    warnings: tuple[PlanWarning, ...],
    env_fingerprint: str,
    compute_device: str,
    num_layers: int,
    host_numa: HostNuma,
    host_admission: HostAdmission = NOT_CHECKED,
    stacks: tuple[int, ...] = (),
    experts: tuple[ExpertCachePlan, ...] = (),
) -> OffloadPlan:
    """An `OffloadPlan` equal to ``OffloadPlan(config=config, ...)``, built without the
    checks its constructor runs (field validators and `offload.pure.plan._rules`).

    For `make_plan` only, whose plans the tests hold to every one of those checks (a plan
    is O(parameters) to check, and planning a large model has a time budget). A plan read
    from JSON, or built by hand, goes through the class and is checked.
    """
    values = (config, backend, backend_reason, pin, uva, params, offloaded_layers, buffers, schedule,
              offloaded_bytes, device_bytes_freed, device_bytes_buffers, device_bytes_resident, host_bytes,
              warnings, env_fingerprint, compute_device, num_layers, host_numa, host_admission, stacks, experts)
    plan = _NEW(OffloadPlan)
    for set_field, value in zip(_PLAN_SETTERS, values, strict=True):
        set_field(plan, value)
    return plan
