"""Plans from the parameters' real devices, backends by name, and checks shared by the
tests of how executors move weights (`tests/executors/test_moves*.py`).

With ``FakeRuntime(device="cuda:0")`` a CPU parameter is in host memory as the executors
see it, so `gpu_plan` (a CUDA-like platform, planned from the live ``cpu`` devices, unlike
`cuda_like_plan` which rewrites them to ``cuda:0``) runs the GPU paths on this machine.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from offload import EnvFlags, EnvSnapshot, OffloadConfig, OffloadPlan, create_offloader, describe_layers, make_plan
from offload.protocols import Offloader
from offload.pure.decide.moves import Move
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE
from tests.executors.models import TiedBlock, TransformerBlock, bits, layer_list

__all__ = [
    "KINDS",
    "PIN",
    "build_model",
    "config_for",
    "cpu_plan_for",
    "gpu_plan",
    "has_bits",
    "largest_tensor_bytes",
    "model_bytes",
    "moved",
    "run",
    "same_bits",
    "storages_with",
]

#: The ways an executor runs a plan: prefetch, uva (zero-copy views), on_demand (uva
#: plan with UVA off) and none (nothing offloaded).
KINDS = ("prefetch", "uva", "on_demand", "none")

#: Pinning on and off, as test ids.
PIN = {"pin-on": True, "pin-off": False}


def config_for(kind: str, model: nn.Module) -> OffloadConfig:
    """A config for `kind` that offloads part of `model` and keeps the rest resident."""
    if kind == "prefetch":
        return OffloadConfig(group_size=2, num_in_group=1)
    if kind == "none":
        return OffloadConfig(backend="none")
    # Half the model's bytes: the first layers are offloaded, the later ones resident.
    return OffloadConfig(backend="uva", uva_max_bytes=model_bytes(model) // 2)


def gpu_plan(model: nn.Module, kind: str, *, pin: bool, keep_host_params: bool = False) -> OffloadPlan:
    """The plan a CUDA machine makes for `model` where its parameters are (the host, or meta)."""
    config = config_for(kind, model)
    if keep_host_params:
        config = attrs.evolve(config, keep_host_params=True)
    flags = EnvFlags(disable_pin_memory=not pin, disable_uva=kind == "on_demand")
    return make_plan(describe_layers(layer_list(model)), config, EnvSnapshot(platform=CUDA_LIKE, flags=flags))


def cpu_plan_for(model: nn.Module, kind: str) -> OffloadPlan:
    """The plan this machine (no accelerator) makes: uva and on_demand are the same plan."""
    return make_plan(describe_layers(layer_list(model)), config_for(kind, model), EnvSnapshot())


def run(plan: OffloadPlan, runtime: FakeRuntime, model: nn.Module) -> Offloader:
    """Create the offloader for `plan`, wrap `model`'s layers and run post_init."""
    off = create_offloader(plan, runtime)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off


def build_model(*, seed: int = 0) -> nn.Sequential:
    """Transformer blocks and tied blocks (one Parameter under two names), in the current
    default device (build it inside ``with torch.device("meta")`` for a meta model)."""
    torch.manual_seed(seed)
    return nn.Sequential(TransformerBlock(), TiedBlock(), TransformerBlock(), TiedBlock(), TransformerBlock(),
                         TransformerBlock())


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's layers, each storage once."""
    return describe_layers(layer_list(model)).nbytes


def largest_tensor_bytes(plan: OffloadPlan) -> int:
    """Bytes of the plan's largest parameter."""
    return max(p.nbytes for p in plan.params)


def storages_with(plan: OffloadPlan, *moves: Move) -> int:
    """How many storages (tied ones once) the plan moves by one of `moves`, from the
    devices it was planned on."""
    return sum(p.tied_to is None and plan.move_of(p) in moves for p in plan.params)


def moved(plan: OffloadPlan, move: Move) -> list[str]:
    """Qualified names (``"3.mlp.up.weight"``) of the parameters the plan moves by `move`."""
    return [f"{p.layer}.{p.name}" for p in plan.params if plan.move_of(p) is move]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaNs and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def has_bits(tensor: torch.Tensor, expected: torch.Tensor) -> bool:
    """`tensor`'s bits are `expected` (a `bits` tensor, as `ParamState.bits` holds)."""
    return torch.equal(bits(tensor), expected)
