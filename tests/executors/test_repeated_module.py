"""One module at two places of a stack (``[a, shared, b, shared]``, as accelerate's
tied-module test builds it): the plan ties its later place to the first,
the layer runs exactly at both places on every backend, and `restore` leaves no hook."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import EnvFlags, EnvSnapshot, OffloadConfig, OffloadPlan, create_offloader, describe_layers, make_plan
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE, on_compute_device
from tests.executors.models import TransformerBlock

ALL = 1 << 40


def _cuda(spec_layers: list[nn.Module], config: OffloadConfig, *, uva: bool) -> OffloadPlan:
    env = EnvSnapshot(flags=EnvFlags(disable_uva=not uva), platform=CUDA_LIKE)
    return make_plan(on_compute_device(describe_layers(spec_layers)), config, env)


PLANS: dict[str, Callable[[list[nn.Module]], OffloadPlan]] = {
    "prefetch": lambda ls: make_plan(describe_layers(ls), OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot()),
    "prefetch-pinned": lambda ls: _cuda(ls, OffloadConfig(group_size=1, prefetch_step=2), uva=True),
    "uva": lambda ls: _cuda(ls, OffloadConfig(backend="uva", uva_max_bytes=ALL), uva=True),
    "on-demand": lambda ls: make_plan(describe_layers(ls), OffloadConfig(backend="uva", uva_max_bytes=ALL),
                                      EnvSnapshot()),
    "on-demand-pinned": lambda ls: _cuda(ls, OffloadConfig(backend="uva", uva_max_bytes=ALL), uva=False),
}


def _run(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


@pytest.mark.parametrize("kind", list(PLANS))
def test_a_module_twice_in_the_stack_runs_exactly_and_restores_cleanly(kind: str) -> None:
    torch.manual_seed(0)
    a, shared, b = TransformerBlock(), TransformerBlock(), TransformerBlock()
    layers: list[nn.Module] = [a, shared, b, shared]
    twins = copy.deepcopy(nn.ModuleList([a, shared, b]))
    reference = [twins[0], twins[1], twins[2], twins[1]]
    plan = PLANS[kind](layers)
    assert all(p.tied_to == (1, p.name) for p in plan.params if p.layer == 3)  # the plan sees the tie
    off = create_offloader(plan, FakeRuntime())
    off.wrap_modules(layers)
    off.post_init()
    generator = torch.Generator().manual_seed(1)
    for shape in ((2, 5, 16), (1, 3, 16), (2, 5, 16)):
        x = torch.randn(*shape, generator=generator)
        assert torch.equal(_run(layers, x), _run(reference, x))
    off.restore()
    for module in (a, shared, b):
        assert "forward" not in vars(module) and "_apply" not in vars(module)
        assert not [k for k in vars(module) if k.startswith("_offload")]
    x = torch.randn(2, 4, 16, generator=generator)
    assert torch.equal(_run(layers, x), _run(reference, x))
    for (name, p), (_, q) in zip(nn.ModuleList([a, shared, b]).named_parameters(), twins.named_parameters(),
                                 strict=True):
        assert torch.equal(p, q), name
