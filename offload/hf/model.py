"""`offload_model`: plan, wrap and prepare a whole model in one call; `ModelOffloader`
runs the executor of its layer stacks (every one, by default: `find_stacks`) and keeps
everything outside them on the compute device.

Everything outside the planned layer parameters (embeddings, the output head, the final
norm, every buffer such as rotary tables) is resident: it is moved to the compute device
one tensor at a time when the model is wrapped, and given back where it was by
`restore`. Nothing here needs `transformers`; any `nn.Module` with a layer stack works.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from offload.errors import ConfigError, ExecutionError, PlanError
from offload.hf.disk import DiskRequest, disk_request, plan_model_disk
from offload.hf.layers import find_stacks
from offload.hf.offloader import ModelOffloader, Slot, outside_bytes, outside_tensors
from offload.logs import logger
from offload.model.checkpoint import checkpoint_extents
from offload.model.describe import describe_stacks, storage_key
from offload.model.wrappers import inner_tensors, is_wrapper
from offload.protocols import Runtime
from offload.pure.config import OffloadConfig
from offload.pure.disk.search import TierSearch, tier_search
from offload.pure.disk.tier import ASSUMED_DISK_GBPS
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.values import RoutingProfile, RoutingTrace
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import PROFILES, DeviceProfile, planning_env, profile_for_device
from offload.pure.fit.search import fit
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import OffloadPlan
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

__all__ = ["CPU_TIER_CONFIG", "DEFAULT_PROFILE", "BudgetExperts", "ModelOffloader", "offload_model", "offload_stacks",
           "outside_tensors", "plan_model"]

log = logger("offload.plan")

#: The profile `fit` uses when none is given and the device's name matches none.
DEFAULT_PROFILE = "h200-pcie5"

#: The configuration a host budget alone plans on a machine without an accelerator: every
#: layer offloaded through one slot, so that the disk tier takes every layer the budget does
#: not hold (resident weights would take host memory there too).
CPU_TIER_CONFIG = OffloadConfig(backend="prefetch", group_size=1, num_in_group=1, prefetch_step=1)


@attrs.frozen(kw_only=True)
class BudgetExperts:
    """The expert options a budget plans with, where no `config` says them: `fit`'s
    ``expert_cache`` and ``expert_slots``, a routing profile the chosen configuration then
    holds (`OffloadConfig`'s fields of those names, checked as it checks them), and a
    routing trace `fit` costs the caches over (its ``routing``; checked against the model
    there).

    Raises:
        ConfigError: an option `OffloadConfig` refuses, naming it; a `routing_trace` that
            is not a `RoutingTrace`.
    """

    expert_cache: bool = True
    expert_slots: int | None = None
    routing_profile: RoutingProfile | None = None
    routing_trace: RoutingTrace | None = None

    def __attrs_post_init__(self) -> None:
        OffloadConfig(expert_cache=self.expert_cache, expert_slots=self.expert_slots,
                      routing_profile=self.routing_profile)
        trace: object = self.routing_trace
        if trace is not None and not isinstance(trace, RoutingTrace):
            raise ConfigError(f"routing_trace must be a RoutingTrace (record_routing(...).trace(), or "
                              f"trace_from_json), got {type(trace).__name__}", name="routing_trace", value=trace)

    @property
    def given(self) -> tuple[str, ...]:
        """The options set to other than their defaults."""
        return tuple(name for name, value, default in (
            ("expert_cache", self.expert_cache, True), ("expert_slots", self.expert_slots, None),
            ("routing_profile", self.routing_profile, None), ("routing_trace", self.routing_trace, None))
            if value != default)

    def on(self, config: OffloadConfig) -> OffloadConfig:
        """`config` with these options (its `expert_slots` kept where none is given here)."""
        return attrs.evolve(config, expert_cache=self.expert_cache, routing_profile=self.routing_profile,
                            expert_slots=config.expert_slots if self.expert_slots is None else self.expert_slots)

    def holding(self, chosen: OffloadConfig) -> OffloadConfig:
        """`fit`'s chosen configuration (which took the other options, and may have left
        the caches out) with the routing profile, where it has caches to hold it."""
        return attrs.evolve(chosen, routing_profile=self.routing_profile if chosen.expert_cache else None)


NO_EXPERT_OPTIONS = BudgetExperts()


def plan_model(spec: ModelSpec, env: EnvSnapshot, *, config: OffloadConfig | None, device_budget_bytes: int | None,
               outside_bytes: int, reserve_bytes: int = 0, profile: DeviceProfile | None = None,
               workload: Workload | None = None, disk: DiskRequest | None = None,
               layer_names: Sequence[str] = (), experts: BudgetExperts = NO_EXPERT_OPTIONS) -> OffloadPlan:
    """The plan `offload_model` runs: `config` as given, or `fit` for the device budget
    counting the weights outside the layers as resident (the device's whole memory when
    neither is given and there is an accelerator).

    With a host budget (`disk`), `fit` searches within both budgets: a configuration whose
    host copies do not fit runs with its last layers on disk (`offload.pure.disk.search`),
    and one no disk tier can hold is not chosen. On a machine without an accelerator, a host
    budget alone plans `CPU_TIER_CONFIG` (every layer offloaded, the disk tier taking what
    the budget does not hold).

    Args:
        layer_names: with `disk`, each layer's name in the model (``model.layers.3``), to
            read the disk layers from `disk.checkpoint` where they lie there.
        experts: without `config`, the expert options to plan with (`fit` searches with
            them; the CPU tier's configuration takes them).

    Raises:
        ConfigError: both `config` and `device_budget_bytes`, or neither without an
            accelerator and without a host budget (the CPU runtime saves no memory: say
            what to offload); `config` and expert options (the config carries its own).
        PlanError: nothing fits the budgets (from `fit`).
        CheckpointError: `disk.checkpoint` cannot be read.
    """
    if config is not None and device_budget_bytes is not None:
        raise ConfigError("give config or device_budget_bytes, not both", name="config", value=config)
    if config is not None:
        if experts.routing_trace is not None:
            raise ConfigError("routing_trace is for a budget: fit costs the expert caches over it; with config= "
                              "nothing is searched (give device_budget_bytes= instead, or drop it)",
                              name="routing_trace", value=experts.routing_trace)
        if experts.given:
            name = experts.given[0]
            raise ConfigError(f"{', '.join(experts.given)}: with config=, set {'them' if len(experts.given) > 1 else 'it'}"
                              f" on the config (OffloadConfig.{name})", name=name, value=getattr(experts, name))
        return make_plan(spec, config, env)
    platform = env.platform
    if device_budget_bytes is None:
        if not platform.has_cuda and disk is not None:
            log.info("no accelerator and a host budget of %s: every layer offloaded (%s), the disk tier holding "
                     "what the budget does not", format_bytes(disk.host_budget_bytes), CPU_TIER_CONFIG)
            if experts.routing_trace is not None:
                log.warning("the routing trace is not used: with no accelerator nothing is searched (every layer "
                            "is offloaded)")
            return make_plan(spec, experts.on(CPU_TIER_CONFIG), env)
        if not platform.has_cuda:
            raise ConfigError(
                "no accelerator: pass config= (what to offload), device_budget_bytes= (a device to plan for) or "
                "host_budget_bytes= (host memory to run in, the rest read from disk); on the CPU offloading to "
                "host memory saves no memory", name="device_budget_bytes", value=None)
        device_budget_bytes = platform.device_total_bytes
    chosen = profile or profile_for_device(platform.device_name) or PROFILES[DEFAULT_PROFILE]
    host = _tier_search(spec, env, chosen, disk, layer_names) if disk is not None else None
    result = fit(spec, env, chosen, workload or Workload(), device_budget_bytes, outside_bytes=outside_bytes,
                 reserve_bytes=reserve_bytes, host=host, expert_cache=experts.expert_cache,
                 expert_slots=experts.expert_slots, routing=experts.routing_trace)
    log.info("fit %s in %s%s on %s: %s", format_bytes(spec.nbytes + outside_bytes), format_bytes(device_budget_bytes),
             f" and {format_bytes(disk.host_budget_bytes)} of host memory" if disk is not None else "",
             chosen.name, result.chosen.config)
    if platform.has_cuda:
        if experts.routing_profile is None:
            return result.plan
        # The profile's held experts take slots the fit counted: the same device bytes.
        return make_plan(spec, experts.holding(result.chosen.config), planning_env(env, chosen))
    # Planned for the profile's device from a machine without one: the same configuration,
    # planned for this machine, so that the mechanics run here (saving nothing).
    return make_plan(spec, experts.holding(result.chosen.config), env)


def _tier_search(spec: ModelSpec, env: EnvSnapshot, profile: DeviceProfile, disk: DiskRequest,
                 layer_names: Sequence[str]) -> TierSearch:
    """The disk tier `fit` searches with for `disk`'s host budget (the checkpoint's tensors
    where it names one and the layers' names are known)."""
    found = checkpoint_extents(disk.checkpoint) if disk.checkpoint is not None and layer_names else None
    return tier_search(spec, env, profile, host_budget_bytes=disk.host_budget_bytes,
                       disk_gbps=float(disk.disk_gbps if disk.disk_gbps is not None else ASSUMED_DISK_GBPS),
                       read_ahead=disk.read_ahead, layer_names=layer_names if found is not None else (),
                       tensors=found.tensors if found is not None else None,
                       extents=found.extents if found is not None else None,
                       files=found.files if found is not None else ())


def offload_model(
    model: nn.Module,
    config: OffloadConfig | None = None,
    *,
    device_budget_bytes: int | None = None,
    env: EnvSnapshot | None = None,
    runtime: Runtime | None = None,
    reserve_bytes: int = 0,
    profile: DeviceProfile | None = None,
    workload: Workload | None = None,
    layers_path: str | Sequence[str] | None = None,
    host_budget_bytes: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    disk_gbps: float | None = None,
    read_ahead: int = 2,
    expert_cache: bool = True,
    expert_slots: int | None = None,
    routing_profile: RoutingProfile | None = None,
    routing_trace: RoutingTrace | None = None,
) -> ModelOffloader:
    """Offload a loaded model in one call: find its layer stack, plan, wrap, `post_init`.

    Works on a model on the host (``from_pretrained(...)`` without a device map) or on the
    device. Resident weights end on the compute device and offloaded ones in host memory,
    one tensor at a time, so a model larger than the device never has to fit on it.

    Args:
        model: the model, weights loaded (not on meta).
        config: what to offload; or leave it None and give `device_budget_bytes`.
        device_budget_bytes: device bytes the model may take (resident weights, static
            buffers, the weights outside the layers and `reserve_bytes`); `fit` picks the
            fastest configuration that fits. Default: the device's memory.
        env: the environment to plan for (default: `capture_env`).
        runtime: the effects (default: from the plan, `CudaRuntime` or `CpuRuntime`).
        reserve_bytes: with a budget: device bytes kept for activations and caches.
        profile: with a budget: the device's rates (default: matched from the device's
            name, else `DEFAULT_PROFILE`).
        workload: with a budget: tokens per step for the time estimate (default 1).
        layers_path: the dotted path of the layer stack to offload, or the paths of
            several in the order they run (default: every stack `find_stacks` finds,
            each prefetched as a cycle of its own).
        host_budget_bytes: host memory the offloaded weights may take (with the disk
            tier's staging ring); the last offloaded layers that do not fit are read
            from disk ahead of their copies (`offload.pure.disk.plan_disk_tier`; prefetch
            plans). With a device budget, `fit` chooses within both budgets; on a machine
            without an accelerator, a host budget alone offloads every layer
            (`CPU_TIER_CONFIG`). None: every offloaded weight in host memory.
        checkpoint: with a host budget, the checkpoint the model was loaded from: disk
            layers are read from it where their bytes are the model's (checked byte for
            byte at wrap); None: they are written to a spill file.
        spill_dir: with a host budget, where the spill file goes (a disk with room for
            the weights not read from the checkpoint; needed when there are any).
        disk_gbps: with a host budget, the disk's read rate for the estimate, GB/s.
        read_ahead: with a host budget, the staging buffers (reads ahead of the copies).
        expert_cache, expert_slots, routing_profile: with a budget, a mixture-of-experts
            model's expert options, as `OffloadConfig`'s (docs/moe.md): `fit` searches
            with them. With `config`, set them on it.
        routing_trace: with a budget, a routing trace of this model (`RoutingTrace`,
            recorded by `record_routing`): `fit` costs the expert caches over it instead of
            their worst case (`fit`'s ``routing``). Not with `config`.

    Returns:
        The offloader, ready: the model runs offloaded; ``restore()`` gives it back.

    Raises:
        ConfigError, PlanError: see `plan_model` and `find_layers`; a model on meta; a
            host budget the plan cannot meet, or disk options without a host budget.
        ExecutionError: a move failed; the model is left as it was.
    """
    disk = disk_request(host_budget_bytes, checkpoint=checkpoint, spill_dir=spill_dir, disk_gbps=disk_gbps,
                        read_ahead=read_ahead)
    experts = BudgetExperts(expert_cache=expert_cache, expert_slots=expert_slots, routing_profile=routing_profile,
                            routing_trace=routing_trace)
    return offload_stacks(model, find_stacks(model, layers_path), config, device_budget_bytes=device_budget_bytes,
                          env=env, runtime=runtime, reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                          disk=disk, experts=experts)


def offload_stacks(
    model: nn.Module,
    stacks: Sequence[nn.ModuleList],
    config: OffloadConfig | None = None,
    *,
    device_budget_bytes: int | None = None,
    env: EnvSnapshot | None = None,
    runtime: Runtime | None = None,
    reserve_bytes: int = 0,
    profile: DeviceProfile | None = None,
    workload: Workload | None = None,
    disk: DiskRequest | None = None,
    experts: BudgetExperts = NO_EXPERT_OPTIONS,
) -> ModelOffloader:
    """`offload_model` of the given stacks of `model` (found by the caller: `find_stacks`,
    or every component's of a pipeline, `offload.diffusers.offload_pipeline`); the rest of
    `model` goes to the device. Arguments and errors as `offload_model`'s; `disk`: its
    disk options (`disk_request`), or None; `experts`: its expert options."""
    if env is None:
        from offload.capture import capture_env

        env = capture_env()
    layers = [layer for stack in stacks for layer in stack]
    meta = next((name for name, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise PlanError(f"parameter {meta!r} is on the meta device: offload_model needs loaded weights (wrap "
                        "before loading with create_offloader(...).wrap_modules, or use offload_pretrained)",
                        name=meta, value="meta")
    spec = describe_stacks(stacks)
    rest = outside_tensors(model, layers)
    _refuse_ties_to_outside(spec, rest)
    names = {id(module): name for name, module in model.named_modules()}
    try:
        plan = plan_model(spec, env, config=config, device_budget_bytes=device_budget_bytes,
                          outside_bytes=outside_bytes(rest), reserve_bytes=reserve_bytes, profile=profile,
                          workload=workload, disk=disk, layer_names=[names[id(layer)] for layer in layers],
                          experts=experts)
    except PlanError as exc:
        if device_budget_bytes is None and config is not None:
            raise
        raise PlanError(f"{exc} (the model: {_stacks_text(model, stacks, spec)}, outside them "
                        f"{format_bytes(outside_bytes(rest))})", name=exc.name, value=exc.value) from exc
    from offload.create import create_offloader, default_runtime

    tier = plan_model_disk(model, layers, plan, env, disk) if disk is not None else None
    rt = runtime if runtime is not None else default_runtime(plan)
    _refuse_wrappers_to_move(rest, rt.device)
    offloader = ModelOffloader(model, layers, create_offloader(plan, rt, disk=tier,
                                                               spill_dir=disk.spill_dir if disk else None), rt)
    offloader.wrap_modules(layers)
    try:
        offloader.post_init()
    except BaseException as exc:
        offloader.restore()
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt and the like, after giving the model back
        raise ExecutionError(f"post_init failed, model restored: {exc}", name="post_init",
                             value=type(exc).__name__) from exc
    return offloader


def _stacks_text(model: nn.Module, stacks: Sequence[nn.ModuleList], spec: ModelSpec) -> str:
    """``model.encoder.layers 4 layers 3.1 MiB; model.decoder.layers 4 layers 4.0 MiB``."""
    paths = {id(module): name for name, module in model.named_modules()}
    parts = []
    for stack, (first, stop) in zip(stacks, spec.stack_ranges, strict=True):
        nbytes = sum(layer.nbytes for layer in spec.layers[first:stop])
        parts.append(f"{paths.get(id(stack), '?')} {stop - first} layers {format_bytes(nbytes)}")
    return "; ".join(parts)


def _refuse_wrappers_to_move(rest: Sequence[tuple[Slot, torch.Tensor]], device: torch.device) -> None:
    """Refuse, before anything moves, a quantised weight outside the layers that is not on
    the compute device: moving a tensor subclass there is its own conversion (torchao's
    ``.to``), which offload does not make for it yet."""
    for (module, name, _), tensor in rest:
        if is_wrapper(tensor) and tensor.device != device:
            kind = type(tensor).__qualname__
            raise PlanError(
                f"{type(module).__name__}.{name} is a quantised weight ({kind}) outside the layer stacks, on "
                f"{tensor.device}: offload does not move such weights to {device} yet; move that module there first "
                "(module.to(device)), or quantise only the layers", name=name, value=kind)


def _refuse_ties_to_outside(spec: ModelSpec, rest: Sequence[tuple[Slot, Any]]) -> None:
    # A quantised weight outside is told by its inner tensors, as describe tells those inside.
    outside = {key for _, tensor in rest for inner in inner_tensors(tensor) if (key := storage_key(inner)) is not None}
    for layer in spec.layers:
        for param in layer.params:
            if param.storage_key is not None and param.storage_key in outside:
                raise PlanError(
                    f"layer {layer.index} parameter {param.name!r} shares its storage with a tensor outside the "
                    "layers; such ties are not supported yet (offloading one would untie them)",
                    name=param.name, value=layer.index)
