"""`offload_pipeline`: a diffusers pipeline's components offloaded by one offloader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from offload.errors import ConfigError, PlanError
from offload.hf.layers import find_stacks
from offload.hf.model import ModelOffloader, offload_stacks
from offload.logs import logger
from offload.protocols import Runtime
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile

__all__ = ["offload_pipeline", "pipeline_components"]

log = logger("offload.plan")


class _Components(nn.Module):
    """The pipeline's module components as children of one module, by their names: what
    `ModelOffloader` walks for the tensors outside the stacks. The components are not
    changed by being held here."""

    def __init__(self, components: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, module in components:
            self.add_module(name, module)


def pipeline_components(pipe: Any, names: Sequence[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The pipeline's components that are modules, as ``(name, module)``: those named (in
    that order), or every one in the pipeline's order.

    Raises:
        ConfigError: `pipe` has no ``components``; a name that is no module component of it.
    """
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise ConfigError(f"offload_pipeline takes a diffusers pipeline (with .components), got a "
                          f"{type(pipe).__name__}", name="pipe", value=type(pipe).__name__)
    modules = {name: module for name, module in components.items() if isinstance(module, nn.Module)}
    if names is None:
        return list(modules.items())
    missing = [name for name in names if name not in modules]
    if missing:
        raise ConfigError(f"the pipeline has no module component {missing[0]!r} (it has {', '.join(modules)})",
                          name="components", value=tuple(missing))
    return [(name, modules[name]) for name in names]


def offload_pipeline(
    pipe: Any,
    config: OffloadConfig | None = None,
    *,
    device_budget_bytes: int | None = None,
    env: EnvSnapshot | None = None,
    runtime: Runtime | None = None,
    reserve_bytes: int = 0,
    profile: DeviceProfile | None = None,
    workload: Workload | None = None,
    components: Sequence[str] | None = None,
) -> ModelOffloader:
    """Offload a diffusers pipeline in one call: every layer stack of every module
    component (`find_stacks`), planned against one budget (a config, or `fit` for
    `device_budget_bytes`), each stack prefetched on its own; every other tensor of the
    components goes to the compute device. A component without a stack stays whole on the
    device. The pipeline then runs as usual; ``restore()`` gives every tensor back where
    it was.

    Args:
        pipe: the pipeline (weights loaded, e.g. ``FluxPipeline.from_pretrained(...)``
            without moving it to the device).
        config, device_budget_bytes, env, runtime, reserve_bytes, profile, workload: as
            for `offload.hf.offload_model` (the budget covers every component).
        components: the components to offload and place, by name (default: every module
            component); the others are left where they are.

    Returns:
        The offloader, ready (its ``model`` holds the components by name).

    Raises:
        ConfigError: not a pipeline, an unknown component; as `offload_model`.
        PlanError: no component has a layer stack; as `offload_model`.
        ExecutionError: a move failed; every component is left as it was.
    """
    chosen = pipeline_components(pipe, components)
    stacks: list[nn.ModuleList] = []
    for name, module in chosen:
        try:
            found = find_stacks(module)
        except PlanError:
            log.info("component %s has no layer stack: it stays whole on the device", name)
            continue
        stacks.extend(found)
    if not stacks:
        raise PlanError(f"no component of the pipeline has a layer stack ({', '.join(n for n, _ in chosen)})",
                        name="components", value=tuple(n for n, _ in chosen))
    holder = _Components(chosen)
    return offload_stacks(holder, stacks, config, device_budget_bytes=device_budget_bytes, env=env, runtime=runtime,
                          reserve_bytes=reserve_bytes, profile=profile, workload=workload)
