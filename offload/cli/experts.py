"""The experts modules of a checkpoint ``offload plan`` plans (`with_experts`): found by
shape on the class built on meta (`offload.model.experts.find_experts`), as a load finds
them on the live model, so that the plan gives each offloaded one the expert cache a load
gives it. The class is built only where the headers hold what could be experts
(`may_hold_experts`), and only for transformers models (diffusers models have none).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from offload.cli._shared import count_of
from offload.errors import CheckpointError, PlanError
from offload.pure.spec.experts import ExpertGroup
from offload.pure.spec.safetensors import printable
from offload.pure.spec.values import ModelSpec

if TYPE_CHECKING:  # torch is imported only where the class is built
    from torch.nn import Module

__all__ = ["may_hold_experts", "with_experts"]


def may_hold_experts(spec: ModelSpec) -> bool:
    """Whether a layer holds what could be experts: a module whose tensors all have two or
    more dimensions and one leading dimension, one of them three or more (fused experts),
    or tensors of a list of modules (a name segment that is a number)."""
    for layer in spec.layers:
        modules: dict[str, list[tuple[int, ...]]] = defaultdict(list)
        for p in layer.params:
            if any(part.isdigit() for part in p.name.split(".")):
                return True
            modules[p.name.rpartition(".")[0]].append(p.shape)
        for shapes in modules.values():
            if (all(len(s) >= 2 for s in shapes) and any(len(s) >= 3 for s in shapes)
                    and len({s[0] for s in shapes}) == 1):
                return True
    return False


def with_experts(root: Path, spec: ModelSpec, model: Module | None = None) -> tuple[ModelSpec, str]:
    """`spec` with the experts modules of the transformers class `root`'s config names,
    built on meta (`offload.hf.streamed.build_on_meta`; `model` where the caller built it
    already), and a line saying what was found; `spec` as it is, with the reason, where the
    class cannot be built or its layers are not those of `spec`.
    """
    from offload.hf.pretrained import saved_class
    from offload.hf.streamed import build_on_meta
    from offload.model.experts import find_experts

    if model is None:
        try:
            model_class, _ = saved_class(root / "config.json")
            if model_class is None or not hasattr(model_class, "_from_config"):
                return spec, ""
            model = build_on_meta(model_class, root)
        except CheckpointError as exc:
            return spec, f"experts:  not looked for (the class was not built: {printable(exc.message)})"
    groups: list[ExpertGroup] = []
    for layer in spec.layers:
        try:
            module = model.get_submodule(layer.name)
        except AttributeError:
            return spec, f"experts:  not looked for (the class has no module {printable(layer.name)})"
        groups.extend(find_experts(layer.index, module, layer))
    if not groups:
        return spec, ""
    try:
        found = attrs.evolve(spec, experts=tuple(groups))
    except PlanError as exc:
        return spec, f"experts:  not planned ({printable(exc.message)})"
    kinds = sorted({(g.module, g.num_experts) for g in groups})
    named = ", ".join(f"{printable(module)} (E {e})" for module, e in kinds)
    return found, (f"experts:  {count_of(len(groups), 'experts module')} found on the class built on meta: "
                   f"{named}; each offloaded one gets an expert cache")
