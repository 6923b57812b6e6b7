"""Note [compiled then eager]: after a compiled forward with a graph break in every layer
(the custom ops then run outside a graph and move the slots' version counters), an eager
forward runs and computes exactly what the resident model does; a write into a slot is
still refused, before any compiled forward and again after the eager one took the
counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from offload import EnvSnapshot, ExecutionError, OffloadConfig, create_offloader, describe_layers, make_plan
from offload.runtime.cpu import CpuRuntime


class Block(nn.Module):
    """A layer whose forward breaks the graph in its middle."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        torch._dynamo.graph_break()
        return torch.relu(y)


def _run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


@pytest.fixture
def offloaded() -> Iterator[tuple[nn.ModuleList, nn.ModuleList]]:
    torch.manual_seed(0)
    layers = nn.ModuleList([Block() for _ in range(4)])
    reference = nn.ModuleList([Block() for _ in range(4)])
    reference.load_state_dict(layers.state_dict())
    plan = make_plan(describe_layers(layers), OffloadConfig(group_size=1, prefetch_step=1), EnvSnapshot())
    offloader = create_offloader(plan, CpuRuntime())
    offloader.wrap_modules(list(layers))
    offloader.post_init()
    yield layers, reference
    offloader.restore()
    torch._dynamo.reset()


def test_an_eager_forward_after_a_compiled_one_with_graph_breaks_is_exact(
        offloaded: tuple[nn.ModuleList, nn.ModuleList]) -> None:
    layers, reference = offloaded
    torch._dynamo.reset()
    compiled = torch.compile(_run, backend="aot_eager")
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _run(reference, x)
        assert torch.equal(compiled(layers, x), want)
        assert torch.equal(_run(layers, x), want)  # was refused: "written in place after post_init"
        assert torch.equal(compiled(layers, x), want)
        assert torch.equal(_run(layers, x), want)


def test_a_write_into_a_slot_before_any_compiled_forward_is_refused(
        offloaded: tuple[nn.ModuleList, nn.ModuleList]) -> None:
    layers, _ = offloaded
    first: Block = layers[0]  # type: ignore[assignment]  # a ModuleList of Blocks
    with torch.no_grad():
        first.lin.weight.add_(1.0)
        with pytest.raises(ExecutionError, match="written in place after post_init"):
            _run(layers, torch.randn(2, 16))


def test_a_write_into_a_slot_after_the_eager_forward_took_the_counters_is_refused(
        offloaded: tuple[nn.ModuleList, nn.ModuleList]) -> None:
    layers, _ = offloaded
    torch._dynamo.reset()
    compiled = torch.compile(_run, backend="aot_eager")
    x = torch.randn(2, 16)
    first: Block = layers[0]  # type: ignore[assignment]  # a ModuleList of Blocks
    with torch.no_grad():
        compiled(layers, x)
        _run(layers, x)  # takes the counters the ops moved
        first.lin.weight.add_(1.0)
        with pytest.raises(ExecutionError, match="written in place after post_init"):
            _run(layers, x)
