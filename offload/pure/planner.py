"""`make_plan`: the model, the request and the environment in; the whole plan out."""

from __future__ import annotations

from offload.pure.config import OffloadConfig
from offload.pure.decisions import decide_pinning, decide_uva
from offload.pure.env import EnvSnapshot
from offload.pure.plan import (
    Backend,
    BackendReason,
    BufferPlan,
    OffloadPlan,
    ParamPlan,
    Placement,
    PlanWarning,
)
from offload.pure.schedule import check_schedule, schedule_prefetch
from offload.pure.select import (
    Ref,
    Selection,
    group_storages,
    is_on_compute_device,
    select_prefetch,
    select_uva,
)
from offload.pure.spec import ModelSpec
from offload.pure.warn import PlanFacts, plan_warnings

__all__ = ["make_plan", "resolve_backend"]


def resolve_backend(config: OffloadConfig) -> tuple[Backend, BackendReason]:
    """The backend a config asks for: explicit, or chosen by ``auto``.

    Auto picks prefetch when `group_size` > 0, else UVA when `uva_max_bytes` > 0, else none.
    """
    if config.backend != "auto":
        return Backend(config.backend), BackendReason.EXPLICIT
    if config.group_size > 0:
        return Backend.PREFETCH, BackendReason.AUTO_GROUP_SIZE
    if config.uva_max_bytes > 0:
        return Backend.UVA, BackendReason.AUTO_UVA_BUDGET
    return Backend.NONE, BackendReason.AUTO_NOTHING_CONFIGURED


def make_plan(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> OffloadPlan:
    """Decide everything about offloading `spec` under `config` on `env`.

    Pure and deterministic: equal inputs give equal plans.

    Args:
        spec: the model's layers and parameters.
        config: what the user asks for.
        env: the user's switches and the platform.

    Returns:
        The plan, with one `ParamPlan` per parameter of `spec` in order.

    Raises:
        PlanError: only if the inputs are inconsistent in a way their own validation
            could not see; every plan made here passes `check_schedule`.
    """
    pin = decide_pinning(env)
    uva = decide_uva(env, pin)
    backend, reason = resolve_backend(config)
    platform = env.platform

    if backend is Backend.PREFETCH:
        selection = select_prefetch(spec, config, platform)
        placement = Placement.PREFETCH
    elif backend is Backend.UVA:
        selection = select_uva(spec, config, platform)
        placement = Placement.UVA if uva.enabled else Placement.ON_DEMAND
    else:
        selection = Selection(offloaded=(), split_ties=())
        placement = Placement.RESIDENT

    offloaded: dict[Ref, Ref | None] = {}  # each offloaded (layer, name) -> primary if tied
    for group in selection.offloaded:
        for i, (index, param) in enumerate(group.members):
            offloaded[(index, param.name)] = group.primary if i else None
    tied_to: dict[Ref, Ref] = {
        (index, param.name): group.primary
        for group in group_storages(spec)
        for index, param in group.members[1:]
    }

    offloaded_layers = tuple(sorted({index for index, _ in offloaded})) if backend is Backend.PREFETCH else ()
    schedule = schedule_prefetch(len(offloaded_layers), config.prefetch_step)
    check_schedule(schedule)
    slot_of_layer = {index: schedule.slots[i] for i, index in enumerate(offloaded_layers)}

    params: list[ParamPlan] = []
    for layer in spec.layers:
        for param in layer.params:
            ref = (layer.index, param.name)
            where = placement if ref in offloaded else Placement.RESIDENT
            params.append(
                ParamPlan(
                    layer=layer.index,
                    name=param.name,
                    shape=param.shape,
                    stride=param.stride,
                    dtype=param.dtype,
                    itemsize=param.itemsize,
                    nbytes=param.nbytes,
                    device=param.device,
                    placement=where,
                    slot=slot_of_layer[layer.index] if where is Placement.PREFETCH else None,
                    tied_to=tied_to.get(ref),
                )
            )

    buffers = _buffers(params)
    offloaded_bytes = sum(g.nbytes for g in selection.offloaded)
    resident_bytes = sum(
        g.nbytes
        for g in group_storages(spec)
        if g.primary not in offloaded and is_on_compute_device(g.members[0][1].device, platform)
    )
    device_bytes_buffers = sum(b.nbytes for b in buffers)
    facts = PlanFacts(
        spec=spec,
        config=config,
        env=env,
        backend=backend,
        pin=pin,
        uva=uva,
        selection=selection,
        offloaded_layers=offloaded_layers,
        offloaded_bytes=offloaded_bytes,
        resident_bytes=resident_bytes,
        buffer_bytes=device_bytes_buffers,
    )
    return OffloadPlan(
        config=config,
        backend=backend,
        backend_reason=reason,
        pin=pin,
        uva=uva,
        params=tuple(params),
        offloaded_layers=offloaded_layers,
        buffers=buffers,
        schedule=schedule,
        offloaded_bytes=offloaded_bytes,
        device_bytes_freed=offloaded_bytes if platform.has_cuda else 0,
        device_bytes_buffers=device_bytes_buffers,
        device_bytes_resident=resident_bytes,
        host_bytes=offloaded_bytes,
        warnings=plan_warnings(facts),
        env_fingerprint=env.fingerprint(),
    )


def _buffers(params: list[ParamPlan]) -> tuple[BufferPlan, ...]:
    """One buffer per (name, shape, stride, dtype) key, with the slots its layers use.

    A parameter tied to another one in the same layer reads that one's buffer and needs
    none of its own; a tie across layers gets a buffer per layer (the layers are resident
    at different times) but one host copy.
    """
    slots: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], set[int]] = {}
    first: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], ParamPlan] = {}
    for p in params:
        if p.placement is not Placement.PREFETCH or p.slot is None:
            continue
        if p.tied_to is not None and p.tied_to[0] == p.layer:
            continue
        slots.setdefault(p.buffer_key, set()).add(p.slot)
        first.setdefault(p.buffer_key, p)
    return tuple(
        BufferPlan(
            name=p.name,
            shape=p.shape,
            stride=p.stride,
            dtype=p.dtype,
            itemsize=p.itemsize,
            slot_bytes=p.nbytes,
            slots=tuple(sorted(slots[key])),
        )
        for key, p in first.items()
    )
