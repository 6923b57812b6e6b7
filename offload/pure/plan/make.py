"""`make_plan`: the model, the request and the environment in; the whole plan out."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter

from offload.pure.config import OffloadConfig
from offload.pure.decide.admission import HostAdmission, assess_host_memory, host_demand
from offload.pure.decide.numa import decide_numa
from offload.pure.decide.pinning import decide_pinning
from offload.pure.decide.selection import (
    NOTHING_SELECTED,
    LayerChoice,
    Ref,
    devices_on_compute,
    group_primary,
    select_prefetch,
    select_uva,
    tied_storages,
)
from offload.pure.decide.uva import decide_uva
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.plan.experts import plan_expert_caches
from offload.pure.plan.layout import layer_buffers, shared_keys
from offload.pure.plan.plan import (
    Backend,
    BackendReason,
    OffloadPlan,
    ParamPlan,
    Placement,
    trusted_offload_plan,
    trusted_param_plan,
)
from offload.pure.plan.schedule import check_schedule, schedule_prefetch, stack_cycles
from offload.pure.plan.warn import PlanFacts, plan_warnings
from offload.pure.spec.values import ModelSpec, ParamSpec

__all__ = ["decide_host_admission", "make_plan", "resolve_backend"]

_NBYTES = attrgetter("nbytes")
_NOT_CHOSEN: LayerChoice = frozenset()


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

    The plan is built from `spec`, `config` and `env`, all validated when they were
    made, without running the checks of `OffloadPlan` again (`offload.pure.plan._rules`):
    a large model has tens of thousands of parameters and planning has a time budget
    (``benchmarks/bench_plan.py``). The tests hold every plan made here to those checks,
    and a plan read from JSON is always checked.

    Args:
        spec: the model's layers and parameters.
        config: what the user asks for.
        env: the user's switches and the platform.

    Returns:
        The plan, with one `ParamPlan` per parameter of `spec` in order.

    Raises:
        PlanError: only if the inputs are inconsistent in a way their own validation
            could not see; every plan made here passes `check_schedule`. Also when
            ``config.numa_node`` names a NUMA node the host does not have.
    """
    pin = decide_pinning(env)
    uva = decide_uva(env, pin)
    host_numa = decide_numa(env.platform.numa, config.numa_node,
                            compute_device="cuda" if env.platform.has_cuda else "cpu", pin=pin.method)
    backend, reason = resolve_backend(config)
    platform = env.platform

    ties = tied_storages(spec)
    on_device = devices_on_compute(spec, config, platform)
    if backend is Backend.PREFETCH:
        selection = select_prefetch(spec, ties, config, on_device)
        placement = Placement.PREFETCH
    elif backend is Backend.UVA:
        selection = select_uva(spec, ties, config, on_device)
        placement = Placement.UVA if uva.enabled else Placement.ON_DEMAND
    else:
        selection = NOTHING_SELECTED
        placement = Placement.RESIDENT
    chosen = selection.offloaded

    offloaded_layers = tuple(sorted(chosen)) if backend is Backend.PREFETCH else ()
    schedule = schedule_prefetch(len(offloaded_layers), config.prefetch_step,
                                 stack_cycles(offloaded_layers, spec.stack_ranges))
    check_schedule(schedule)
    slot_of_layer = {index: schedule.slots[i] for i, index in enumerate(offloaded_layers)}
    tied_to: dict[Ref, Ref] = {
        (index, param.name): group_primary(group) for group in ties for index, param in group[1:]
    }
    tied_layers = {index for group in ties for index, _ in group}
    all_on_device = all(on_device.values())

    params: list[ParamPlan] = []
    prefetched: list[tuple[tuple[ParamSpec, ...], int]] = []  # (specs with own buffers, slot) per layer
    resident_bytes = 0
    resident = Placement.RESIDENT
    for layer in spec.layers:
        index = layer.index
        specs = layer.params
        choice = chosen.get(index, _NOT_CHOSEN)
        slot = slot_of_layer.get(index)
        if index not in tied_layers and (choice is None or not choice):
            # The whole layer is placed alike (the common case): its entries in one map.
            if choice is None:
                params.extend(map(trusted_param_plan, repeat(index), specs, repeat(placement), repeat(slot),
                                  repeat(None)))
                if slot is not None:
                    prefetched.append((specs, slot))
            else:
                params.extend(map(trusted_param_plan, repeat(index), specs, repeat(resident), repeat(None),
                                  repeat(None)))
                resident_bytes += (sum(map(_NBYTES, specs)) if all_on_device
                                   else sum(p.nbytes for p in specs if on_device[p.device]))
            continue
        owners: list[ParamSpec] = []
        for param in specs:
            tie = tied_to.get((index, param.name)) if param.storage_key is not None else None
            if choice is None or param.name in choice:
                params.append(trusted_param_plan(index, param, placement, slot, tie))
                if tie is None or tie[0] != index:  # tied within the layer: reads the first one's buffer
                    owners.append(param)
            else:
                params.append(trusted_param_plan(index, param, resident, None, tie))
                if on_device[param.device] and tie is None:  # a tied storage counts once, at its first member
                    resident_bytes += param.nbytes
        if slot is not None and owners:
            prefetched.append((tuple(owners), slot))

    experts = plan_expert_caches(spec, config, params)
    buffers = layer_buffers(prefetched, shared_keys(params, experts))
    offloaded_bytes = selection.offloaded_bytes
    device_bytes_buffers = sum(b.nbytes for b in buffers) + sum(c.device_bytes for c in experts)
    compute_device = "cuda" if platform.has_cuda else "cpu"
    admission = assess_host_memory(host_demand(
        params, compute_device=compute_device, host_bytes=offloaded_bytes, buffer_bytes=device_bytes_buffers,
        resident_bytes=resident_bytes, pin=pin.pin, devices=on_device,
    ), env)
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
        admission=admission,
    )
    return trusted_offload_plan(
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
        host_numa=host_numa,
        host_admission=admission,
        stacks=spec.stacks,
        experts=experts,
    )


def decide_host_admission(plan: OffloadPlan, env: EnvSnapshot) -> HostAdmission:
    """The verdict for `plan` on `env`: what `make_plan` records, and a way to check a
    saved plan against the machine it is about to run on.

    Args:
        plan: the plan.
        env: a snapshot (the plan's own, or a fresh `capture_env`).
    """
    demand = host_demand(
        plan.params,
        compute_device=plan.compute_device,
        host_bytes=plan.host_bytes,
        buffer_bytes=plan.device_bytes_buffers,
        resident_bytes=plan.device_bytes_resident,
        pin=plan.pin.pin,
    )
    return assess_host_memory(demand, env)
