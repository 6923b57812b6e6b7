"""The forward path's shape: eager forwards call the executor directly (the
custom ops are for torch.compile, which still gets them), and nothing fixed at post_init is
looked up again per call. Timings are in benchmarks/bench_overhead.py, never here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import fx, nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, create_offloader
from offload.executors import ops
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, inputs, pinned_plan
from tests.executors.models import TiedBlock, layer_list, mixed_model, transformer_model
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan

PREFETCH = OffloadConfig(group_size=1, prefetch_step=2)
KINDS = ["prefetch", "prefetch-pinned", "on-demand", "on-demand-pinned"]


def _plan(kind: str, model: nn.Module) -> OffloadPlan:
    return {
        "prefetch": lambda: cpu_plan(model, PREFETCH),
        "prefetch-pinned": lambda: pinned_plan(model, PREFETCH),
        "on-demand": lambda: cpu_on_demand_plan(model),
        "on-demand-pinned": lambda: on_demand_plan(model),
    }[kind]()


def _ready(kind: str, model: nn.Module) -> Any:
    off = create_offloader(_plan(kind, model), FakeRuntime())
    off.wrap_modules(layer_list(model))
    off.post_init()
    return off


def _refuse(*_: object, **__: object) -> None:
    raise AssertionError("called on the eager forward path")


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", KINDS)
def test_eager_forwards_call_the_executor_not_the_custom_ops(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = mixed_model()
    reference = copy.deepcopy(model)
    off = _ready(kind, model)
    for name in ("wait_prefetch", "start_prefetch", "copy_on_demand"):
        monkeypatch.setattr(ops, name, _refuse)
    for x in inputs(seed=11, shapes=((1, 3), (2, 5), (1, 3))):
        assert torch.equal(model(x), reference(x))
    assert off.stats().copies_issued > 0
    monkeypatch.undo()
    off.restore()


@pytest.mark.parametrize("kind", KINDS)
def test_eager_forwards_look_up_no_parameter_by_name(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What each layer copies and where its parameters are is fixed at post_init: a
    forward does not walk the module tree again (tied weights included)."""
    model = nn.Sequential(*transformer_model(3), TiedBlock(), TiedBlock())
    reference = copy.deepcopy(model)
    off = _ready(kind, model)
    for method in ("get_parameter", "get_submodule", "named_parameters"):
        monkeypatch.setattr(nn.Module, method, _refuse)
    for x in inputs(seed=12, shapes=((1, 3), (2, 5))):
        assert torch.equal(model(x), reference(x))
    monkeypatch.undo()
    off.restore()


@pytest.mark.parametrize("kind", ["on-demand", "on-demand-pinned"])
def test_a_parameter_object_replaced_after_post_init_is_refused_on_demand(kind: str) -> None:
    """The eager on-demand path swaps the parameters it bound at post_init; a Parameter the
    user put in place of one of them afterwards would be silently ignored, so it is refused."""
    model = transformer_model(2)
    off = _ready(kind, model)
    layer = layer_list(model)[1]
    old = layer.get_parameter("mlp.up.weight")
    layer.get_submodule("mlp.up").weight = nn.Parameter(old.detach().clone() * 2)
    with pytest.raises(ExecutionError, match="no longer points at its host copy") as info:
        model(next(inputs(seed=13)))
    assert info.value.name == "mlp.up.weight" and info.value.value == 1
    off.restore()


def _ops_in_graph(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The offload custom ops in the graph dynamo captures from one compiled call."""
    found: list[str] = []

    def backend(gm: fx.GraphModule, example: list[torch.Tensor]) -> Any:
        found.extend(str(node.target) for node in gm.graph.nodes
                     if node.op == "call_function" and "offload" in str(node.target))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(x)
    return found


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("kind", "expected"), [
    ("prefetch", {"offload.wait_prefetch", "offload.start_prefetch"}),
    ("on-demand-pinned", {"offload.copy_on_demand"}),
])
def test_torch_compile_still_traces_the_custom_ops(kind: str, expected: set[str]) -> None:
    model = transformer_model(3)
    off = _ready(kind, model)
    found = _ops_in_graph(model, next(inputs(seed=14)))
    assert {name.removeprefix("offload::").replace("::", ".").rsplit(".default", 1)[0] for name in found} \
        >= expected, found
    assert len(found) >= 3  # one per offloaded layer at least
    off.restore()


@pytest.mark.parametrize("kind", ["on-demand", "on-demand-pinned"])
def test_a_submodule_replaced_after_post_init_is_refused_on_demand(kind: str) -> None:
    """The sites bound at post_init belong to the submodules then; a new submodule in place
    of one of them would run with weights the plan knows nothing of."""
    model = transformer_model(2)
    off = _ready(kind, model)
    layer = layer_list(model)[0]
    mlp = layer.get_submodule("mlp")
    mlp.up = nn.Linear(mlp.up.in_features, mlp.up.out_features)  # type: ignore[union-attr, arg-type]
    with pytest.raises(ExecutionError, match="no longer points at its host copy") as info:
        model(next(inputs(seed=15)))
    assert str(info.value.name).startswith("mlp.up.") and "the module holding it was replaced" in str(info.value)
    off.restore()


class Recursive(nn.Module):
    """A layer that calls itself once more (its forward re-enters through ``self(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return self(y, again=False) if again else y


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_that_calls_itself_runs_with_its_weights(kind: str) -> None:
    model = nn.Sequential(Recursive(), Recursive())
    reference = copy.deepcopy(model)
    off = _ready(kind, model)
    for x in inputs(seed=16, shapes=((1, 3), (2, 5))):
        assert torch.equal(model(x), reference(x))
    off.restore()
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
