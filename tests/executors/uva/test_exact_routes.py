"""On-demand layers take the same kernel routes as their resident originals: the tensors
swapped in for a call require grad exactly when the Parameters do, and are ordinary
tensors (not inference tensors) for those that do, so PyTorch's dispatch decisions (the
fold in ``matmul`` under ``F.linear``: one ``mm`` for a weight that requires grad, a
batched one otherwise) are the resident model's and outputs are equal bit for bit.

The case is the one a Mamba model hits while generating: a 3-d input whose leading
dimensions cannot be flattened without a copy, through a linear layer without bias."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload import Placement, create_offloader
from offload.runtime.cpu import CpuRuntime
from tests.executors.helpers import uva
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan

IN, OUT = 512, 1024


class Projection(nn.Module):
    """A bias-free projection whose input arrives non-contiguous (``(2, 1, IN)`` with
    strides ``(IN, 1, 1)``), as a selective-scan step's does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = x.reshape(2, IN).as_strided((2, 1, IN), (IN, 1, 1))
        y: torch.Tensor = self.proj(step)
        return x + y[:, 0, :IN] * 1e-3


def _layers(requires_grad: bool) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(Projection() for _ in range(3))
    layers.requires_grad_(requires_grad)
    return layers


def _run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _inputs() -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        yield torch.randn(2, IN, generator=generator)


MODES: dict[str, Callable[[], AbstractContextManager[object]]] = {
    "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def test_the_case_takes_another_route_for_a_weight_that_does_not_require_grad() -> None:
    # The premise: without the fix the routes differ (else the tests below prove nothing).
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(OUT, IN))
    x = torch.randn(2, IN).as_strided((2, 1, IN), (IN, 1, 1))
    with torch.no_grad():
        assert not torch.equal(F.linear(x, weight), F.linear(x, weight.detach().clone()))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("requires_grad", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("planned", ["cpu", "cuda-like"])
def test_on_demand_outputs_equal_the_resident_ones_bit_for_bit(mode: str, requires_grad: bool, planned: str) -> None:
    layers = _layers(requires_grad)
    reference = copy.deepcopy(layers)
    plan = (cpu_on_demand_plan if planned == "cpu" else on_demand_plan)(layers)
    assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    off = uva(plan)
    off.wrap_modules(list(layers))
    off.post_init()
    with MODES[mode]():
        for x in _inputs():
            assert torch.equal(_run(layers, x), _run(reference, x))
    # The Parameters are as they were: the flags belong to the call's copies only.
    assert all(p.requires_grad is requires_grad for p in layers.parameters())
    off.restore()
    assert all(torch.equal(a, b) for a, b in zip(layers.parameters(), reference.parameters(), strict=True))


def test_under_autocast_the_copies_are_freed_when_the_layer_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    # Autocast caches its casts of float32 leaves that require grad until its region ends:
    # with the cache on, every call's copies would stay alive for the whole region.
    layers = _layers(True)
    runtime = CpuRuntime()
    copies: list[weakref.ref[torch.Tensor]] = []
    to_device = runtime.to_device

    def watched(host: torch.Tensor) -> torch.Tensor:
        out = to_device(host)
        copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(runtime, "to_device", watched)
    off = create_offloader(cpu_on_demand_plan(layers), runtime)
    off.wrap_modules(list(layers))
    off.post_init()
    x = next(_inputs())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for layer in layers:
            x = layer(x)
            assert copies and all(ref() is None for ref in copies)
        assert torch.is_autocast_cache_enabled()  # given back as it was
    assert len(copies) == len(layers)
    off.restore()
