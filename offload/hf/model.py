"""`offload_model`: plan, wrap and prepare a whole model in one call; `ModelOffloader`
runs the executor of its layer stacks (every one, by default: `find_stacks`) and keeps
everything outside them on the compute device.

Everything outside the planned layer parameters (embeddings, the output head, the final
norm, every buffer such as rotary tables) is resident: it is moved to the compute device
one tensor at a time when the model is wrapped, and given back where it was by
`restore`. Nothing here needs `transformers`; any `nn.Module` with a layer stack works.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, final

import torch
from torch import nn

from offload.errors import ConfigError, ExecutionError, PlanError
from offload.executors.common import normal_tensors, raise_as_execution_error
from offload.hf.layers import find_stacks
from offload.model.describe import describe_stacks, storage_key
from offload.model.wrappers import inner_tensors, is_wrapper
from offload.protocols import Offloader, Runtime
from offload.pure.check import LiveCheck
from offload.pure.config import OffloadConfig
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import PROFILES, DeviceProfile, profile_for_device
from offload.pure.fit.search import fit
from offload.pure.plan.make import make_plan
from offload.pure.plan.plan import OffloadPlan
from offload.pure.spec.values import ModelSpec
from offload.pure.stats import OffloadStats
from offload.pure.units import format_bytes

__all__ = ["DEFAULT_PROFILE", "ModelOffloader", "offload_model", "offload_stacks", "outside_tensors", "plan_model"]

log = logging.getLogger("offload.hf")

#: The profile `fit` uses when none is given and the device's name matches none.
DEFAULT_PROFILE = "h200-pcie5"

#: Where a tensor outside the layers sits: (module, attribute name, is it a parameter).
Slot = tuple[nn.Module, str, bool]


def outside_tensors(model: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[Slot, torch.Tensor]]:
    """Every tensor of `model` that the layers' plan does not place: parameters outside
    the layers and every buffer (inside the layers too), in module order."""
    inside = {id(module) for layer in layers for module in layer.modules()}
    found: list[tuple[Slot, torch.Tensor]] = []
    for module in model.modules():
        if id(module) not in inside:
            for name, param in module._parameters.items():
                if param is not None:
                    found.append(((module, name, True), param))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                found.append(((module, name, False), buffer))
    return found


def _outside_bytes(tensors: Sequence[tuple[Slot, torch.Tensor]]) -> int:
    """Bytes of the tensors outside the layers, each storage once (a quantised weight's:
    its inner tensors')."""
    seen: set[object] = set()
    total = 0
    for _, outer in tensors:
        for tensor in inner_tensors(outer):
            key: object = storage_key(tensor) or id(tensor)
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total


@final
class ModelOffloader:
    """The `Offloader` of a whole model: `inner` runs the plan on the layer stack, and
    every other tensor of the model is put on the runtime's device (and back on restore).

    Create it with `offload_model`.

    Args:
        model: the whole model.
        layers: its layer stack, the layers `inner`'s plan describes.
        inner: the executor for the layers (`create_offloader`).
        runtime: the effects `inner` uses.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], inner: Offloader, runtime: Runtime) -> None:
        self._model = model
        self._layers = list(layers)
        self._inner = inner
        self._rt = runtime
        self._moved: list[tuple[Slot, torch.device]] = []  # what went to the device, and from where

    @property
    def model(self) -> nn.Module:
        """The model."""
        return self._model

    @property
    def inner(self) -> Offloader:
        """The executor that runs the plan on the layers."""
        return self._inner

    @property
    def plan(self) -> OffloadPlan:
        """The layers' plan (see `Offloader.plan`)."""
        return self._inner.plan

    @property
    def disk_tier(self) -> DiskTierPlan | None:
        """The layers' disk tier (`PrefetchOffloader.disk_tier`), or None."""
        from offload.executors.prefetch import PrefetchOffloader

        return self._inner.disk_tier if isinstance(self._inner, PrefetchOffloader) else None

    @normal_tensors
    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Offload the layers as the plan says, then put every other tensor of the model
        on the compute device. If anything fails, the model is left as it was.

        Args:
            layers: the layer stack this offloader was made for.

        Raises:
            PlanError: `layers` are not that stack (or, from the executor, do not match the plan).
            ExecutionError: a move failed (the cause attached); nothing stays moved.
        """
        given = list(layers)
        if len(given) != len(self._layers) or any(a is not b for a, b in zip(given, self._layers, strict=False)):
            raise PlanError("wrap_modules got other layers than the model's stack this offloader was made for",
                            name="layers", value=len(given))
        wrapped = self._inner.wrap_modules(given)
        try:
            self._place_rest()
        except BaseException as exc:
            self._give_back()
            self._inner.restore()
            raise_as_execution_error(exc, "moving the weights outside the layers to the device failed, model left "
                                     "as it was", "wrap_modules")
        return wrapped

    def _place_rest(self) -> None:
        device = self._rt.device
        done: dict[object, torch.Tensor] = {}
        tensors = outside_tensors(self._model, self._layers)
        for (module, name, is_param), tensor in tensors:
            if tensor.device == device:
                continue
            if tensor.device.type == "meta":
                raise PlanError(f"{type(module).__name__}.{name} is on the meta device: load the weights first",
                                name=name, value="meta")
            key: object = storage_key(tensor) or id(tensor)
            origin = tensor.device  # read first: for a parameter, _set changes `tensor` itself
            data = done.get(key)
            if data is None:
                data = done[key] = self._rt.copy_to(tensor, device)
            self._set((module, name, is_param), data)
            self._moved.append(((module, name, is_param), origin))
        if self._moved:
            log.info("moved %d tensors outside the layers (%s) to %s", len(self._moved),
                     format_bytes(sum(t.numel() * t.element_size() for t in done.values())), device)

    @staticmethod
    def _set(slot: Slot, data: torch.Tensor) -> None:
        module, name, is_param = slot
        if is_param:
            param = module._parameters[name]
            if param is not None:
                param.data = data
        else:
            module._buffers[name] = data

    @staticmethod
    def _get(slot: Slot) -> torch.Tensor | None:
        module, name, is_param = slot
        return module._parameters[name] if is_param else module._buffers[name]

    def _give_back(self) -> None:
        """Put every tensor moved to the device back where it was, one storage at a time."""
        back: dict[object, torch.Tensor] = {}
        while self._moved:
            slot, origin = self._moved[-1]
            tensor = self._get(slot)
            if tensor is not None:
                key: object = (storage_key(tensor) or id(tensor), str(origin))
                data = back.get(key)
                if data is None:
                    data = back[key] = self._rt.copy_to(tensor, origin)
                self._set(slot, data)
            self._moved.pop()

    @normal_tensors
    def post_init(self) -> None:
        """See `Offloader.post_init`."""
        self._inner.post_init()

    def sync_prev_onload(self) -> None:
        """See `Offloader.sync_prev_onload`."""
        self._inner.sync_prev_onload()

    def join_after_forward(self) -> None:
        """See `Offloader.join_after_forward`."""
        self._inner.join_after_forward()

    @normal_tensors
    def restore(self) -> None:
        """Give every weight back where it was: the layers' (see the executor's
        `restore`), then the tensors outside them.

        Raises:
            ExecutionError: a copy back failed; `restore` can be called again to finish.
        """
        self._inner.restore()
        try:
            self._give_back()
        except BaseException as exc:
            raise_as_execution_error(exc, "giving back the tensors outside the layers stopped part way (call "
                                     "restore() again to finish)", "restore")

    def stats(self) -> OffloadStats:
        """The layers' executor's counters (see `Offloader.stats`)."""
        return self._inner.stats()

    def check(self) -> LiveCheck:
        """Where the layers' planned parameters are (see `Offloader.check`; the tensors
        outside the layers are resident on the device and not listed)."""
        return self._inner.check()


def plan_model(spec: ModelSpec, env: EnvSnapshot, *, config: OffloadConfig | None, device_budget_bytes: int | None,
               outside_bytes: int, reserve_bytes: int = 0, profile: DeviceProfile | None = None,
               workload: Workload | None = None) -> OffloadPlan:
    """The plan `offload_model` runs: `config` as given, or `fit` for the device budget
    counting the weights outside the layers as resident (the device's whole memory when
    neither is given and there is an accelerator).

    Raises:
        ConfigError: both `config` and `device_budget_bytes`, or neither without an
            accelerator (the CPU runtime saves no memory: say what to offload).
        PlanError: nothing fits the budget (from `fit`).
    """
    if config is not None and device_budget_bytes is not None:
        raise ConfigError("give config or device_budget_bytes, not both", name="config", value=config)
    if config is not None:
        return make_plan(spec, config, env)
    platform = env.platform
    if device_budget_bytes is None:
        if not platform.has_cuda:
            raise ConfigError(
                "no accelerator: pass config= (what to offload) or device_budget_bytes= (a device to plan for); "
                "on the CPU offloading saves no memory", name="device_budget_bytes", value=None)
        device_budget_bytes = platform.device_total_bytes
    chosen = profile or profile_for_device(platform.device_name) or PROFILES[DEFAULT_PROFILE]
    result = fit(spec, env, chosen, workload or Workload(), device_budget_bytes, outside_bytes=outside_bytes,
                 reserve_bytes=reserve_bytes)
    log.info("fit %s in %s on %s: %s", format_bytes(spec.nbytes + outside_bytes), format_bytes(device_budget_bytes),
             chosen.name, result.chosen.config)
    if platform.has_cuda:
        return result.plan
    # Planned for the profile's device from a machine without one: the same configuration,
    # planned for this machine, so that the mechanics run here (saving nothing).
    return make_plan(spec, result.chosen.config, env)


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
            plans). None: every offloaded weight in host memory.
        checkpoint: with a host budget, the checkpoint the model was loaded from: disk
            layers are read from it where their bytes are the model's (checked byte for
            byte at wrap); None: they are written to a spill file.
        spill_dir: with a host budget, where the spill file goes (a disk with room for
            the weights not read from the checkpoint; needed when there are any).
        disk_gbps: with a host budget, the disk's read rate for the estimate, GB/s.
        read_ahead: with a host budget, the staging buffers (reads ahead of the copies).

    Returns:
        The offloader, ready: the model runs offloaded; ``restore()`` gives it back.

    Raises:
        ConfigError, PlanError: see `plan_model` and `find_layers`; a model on meta; a
            host budget the plan cannot meet, or disk options without a host budget.
        ExecutionError: a move failed; the model is left as it was.
    """
    return offload_stacks(model, find_stacks(model, layers_path), config, device_budget_bytes=device_budget_bytes,
                          env=env, runtime=runtime, reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                          host_budget_bytes=host_budget_bytes, checkpoint=checkpoint, spill_dir=spill_dir,
                          disk_gbps=disk_gbps, read_ahead=read_ahead)


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
    host_budget_bytes: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    disk_gbps: float | None = None,
    read_ahead: int = 2,
) -> ModelOffloader:
    """`offload_model` of the given stacks of `model` (found by the caller: `find_stacks`,
    or every component's of a pipeline, `offload.diffusers.offload_pipeline`); the rest of
    `model` goes to the device. Arguments and errors as `offload_model`'s."""
    if host_budget_bytes is None:
        given = next((name for name, value in (("checkpoint", checkpoint), ("spill_dir", spill_dir),
                                               ("disk_gbps", disk_gbps)) if value is not None), None)
        if given is not None or read_ahead != 2:
            raise ConfigError(f"{given or 'read_ahead'} is a disk tier option: give host_budget_bytes too",
                              name=given or "read_ahead", value=host_budget_bytes)
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
    try:
        plan = plan_model(spec, env, config=config, device_budget_bytes=device_budget_bytes,
                          outside_bytes=_outside_bytes(rest), reserve_bytes=reserve_bytes, profile=profile,
                          workload=workload)
    except PlanError as exc:
        if device_budget_bytes is None and config is not None:
            raise
        raise PlanError(f"{exc} (the model: {_stacks_text(model, stacks, spec)}, outside them "
                        f"{format_bytes(_outside_bytes(rest))})", name=exc.name, value=exc.value) from exc
    from offload.create import create_offloader, default_runtime

    disk = None
    if host_budget_bytes is not None:
        from offload.hf.disk import plan_model_disk

        disk = plan_model_disk(model, layers, plan, env, host_budget_bytes=host_budget_bytes, checkpoint=checkpoint,
                               disk_gbps=disk_gbps, read_ahead=read_ahead)
    rt = runtime if runtime is not None else default_runtime(plan)
    _refuse_wrappers_to_move(rest, rt.device)
    offloader = ModelOffloader(model, layers, create_offloader(plan, rt, disk=disk, spill_dir=spill_dir), rt)
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
