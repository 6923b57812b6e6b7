"""`make_plan`: the model, the request and the environment in; the whole plan out."""

from __future__ import annotations

from offload.pure.config import OffloadConfig
from offload.pure.decisions import decide_pinning, decide_uva
from offload.pure.env import EnvSnapshot
from offload.pure.layout import prefetch_buffers
from offload.pure.plan import (
    Backend,
    BackendReason,
    OffloadPlan,
    ParamPlan,
    Placement,
)
from offload.pure.schedule import check_schedule, schedule_prefetch
from offload.pure.select import (
    Ref,
    Selection,
    group_nbytes,
    group_primary,
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

    groups = group_storages(spec)
    if backend is Backend.PREFETCH:
        selection = select_prefetch(groups, len(spec.layers), config, platform)
        placement = Placement.PREFETCH
    elif backend is Backend.UVA:
        selection = select_uva(groups, config, platform)
        placement = Placement.UVA if uva.enabled else Placement.ON_DEMAND
    else:
        selection = Selection(offloaded=(), split_ties=())
        placement = Placement.RESIDENT

    # Offloaded names per layer: the loop below looks names up without building a key per
    # parameter (a large model has tens of thousands, and make_plan has a time budget).
    offloaded: dict[int, set[str]] = {}
    for group in selection.offloaded:
        for index, param in group:
            names = offloaded.get(index)
            if names is None:
                offloaded[index] = {param.name}
            else:
                names.add(param.name)
    tied_to: dict[Ref, Ref] = {
        (index, param.name): group_primary(group)
        for group in groups
        if len(group) > 1
        for index, param in group[1:]
    }

    offloaded_layers = tuple(sorted(offloaded)) if backend is Backend.PREFETCH else ()
    schedule = schedule_prefetch(len(offloaded_layers), config.prefetch_step)
    check_schedule(schedule)
    slot_of_layer = {index: schedule.slots[i] for i, index in enumerate(offloaded_layers)}

    params: list[ParamPlan] = []
    prefetched: list[ParamPlan] = []
    resident_bytes = 0
    on_device: dict[str, bool] = {}  # device name -> on the compute device (few distinct names)
    no_names: set[str] = set()
    resident = Placement.RESIDENT
    for layer in spec.layers:
        index = layer.index
        slot = slot_of_layer.get(index)
        names = offloaded.get(index, no_names)
        for param in layer.params:
            tie = tied_to.get((index, param.name)) if param.storage_key is not None else None
            if param.name in names:
                entry = ParamPlan(layer=index, param=param, placement=placement, slot=slot, tied_to=tie)
                params.append(entry)
                if slot is not None:
                    prefetched.append(entry)
                continue
            params.append(ParamPlan(layer=index, param=param, placement=resident, tied_to=tie))
            here = on_device.get(param.device)
            if here is None:
                here = on_device[param.device] = is_on_compute_device(param.device, platform,
                                                                      keep_host=config.keep_host_params)
            if here and tie is None:  # a tied storage counts once, at its first member
                resident_bytes += param.nbytes

    buffers = prefetch_buffers(prefetched)
    offloaded_bytes = sum(group_nbytes(g) for g in selection.offloaded)  # each storage once
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
        compute_device="cuda" if platform.has_cuda else "cpu",
        num_layers=len(spec.layers),
    )

