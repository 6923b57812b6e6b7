"""Plans, expected counts and models shared by the UVA executor tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from offload import OffloadConfig, OffloadPlan, ParamPlan
from tests.executors.helpers import cpu_plan, cuda_like_plan
from tests.executors.models import HIDDEN, Mlp

__all__ = [
    "ALL",
    "OptionalTiedBlock",
    "copied_per_layer",
    "copies_per_forward",
    "cross_layer_tied_model",
    "on_demand_plan",
    "owner",
    "storages",
    "view_plan",
]

#: A UVA byte budget larger than any test model: everything eligible is offloaded.
ALL = 1 << 40


def on_demand_plan(model: nn.Module, budget: int = ALL) -> OffloadPlan:
    """The uva plan a CUDA machine makes with UVA switched off and pinning on: every
    parameter ON_DEMAND, its host copy (played) page-locked, so host copies happen and can
    be counted or failed. (This machine's own plan, `cpu_on_demand_plan`, adopts the
    weights in place instead.)"""
    return view_plan(model, budget, uva=False)


def cpu_on_demand_plan(model: nn.Module, budget: int = ALL) -> OffloadPlan:
    """The uva plan this machine (no accelerator) makes: every parameter ON_DEMAND."""
    return cpu_plan(model, OffloadConfig(backend="uva", uva_max_bytes=budget))


def view_plan(model: nn.Module, budget: int = ALL, *, pin: bool = True, uva: bool = True) -> OffloadPlan:
    """The uva plan a CUDA machine makes with the pin and UVA switches as given (UVA
    placements only with both on)."""
    config = OffloadConfig(backend="uva", uva_max_bytes=budget)
    return cuda_like_plan(model, config, disable_pin_memory=not pin, disable_uva=not uva)


def owner(p: ParamPlan) -> tuple[int, str]:
    """The (layer, name) holding `p`'s host copy in the plan."""
    return p.tied_to or (p.layer, p.name)


def storages(plan: OffloadPlan) -> int:
    """Host copies the plan asks for: one per offloaded storage."""
    return sum(p.tied_to is None for p in plan.offloaded_params)


def copied_per_layer(plan: OffloadPlan) -> dict[int, tuple[int, int]]:
    """Per layer, (copies, bytes) of one on-demand call: the layer copies each storage its
    offloaded parameters use once, whichever layer owns it."""
    nbytes = {(p.layer, p.name): p.nbytes for p in plan.offloaded_params if p.tied_to is None}
    per_layer: dict[int, set[tuple[int, str]]] = {}
    for p in plan.offloaded_params:
        per_layer.setdefault(p.layer, set()).add(owner(p))
    return {layer: (len(used), sum(nbytes[o] for o in used)) for layer, used in per_layer.items()}


def copies_per_forward(plan: OffloadPlan) -> tuple[int, int]:
    """(copies, bytes) one on-demand forward makes (`copied_per_layer`, summed)."""
    per_layer = copied_per_layer(plan).values()
    return sum(c for c, _ in per_layer), sum(n for _, n in per_layer)


def cross_layer_tied_model(*, seed: int = 0) -> nn.Sequential:
    """Five `Mlp` layers with ties across layers: layer 3's ``up.weight`` is layer 0's
    Parameter object (one module shared by two layers), and layer 4's ``down.weight`` is
    another Parameter object over layer 1's storage."""
    torch.manual_seed(seed)
    layers = [Mlp() for _ in range(5)]
    layers[3].up.weight = layers[0].up.weight
    layers[4].down.weight = nn.Parameter(layers[1].down.weight.data)
    return nn.Sequential(*layers)


class OptionalTiedBlock(nn.Module):
    """Two Parameter objects over one storage, ``first`` (the owner) and ``second``;
    post-processing may delete ``first``, and the block still computes with ``second``."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        weight = torch.randn(hidden, hidden) / hidden**0.5
        self.first = nn.Parameter(weight)
        self.second = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = getattr(self, "first", None)
        y = F.linear(x, self.second)
        return x + torch.tanh(y if first is None else F.linear(y, first))
