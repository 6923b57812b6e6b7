"""`offload` is for inference: a forward that would record autograd history through
offloaded weights is refused with an `ExecutionError` that says what to do, for prefetch
and on-demand layers (their weights sit in a shared slot or a per-call copy, so a backward
would give wrong gradients, or none). With grad off, or with nothing requiring grad, the
forward runs and matches the resident model bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import ExecutionError, OffloadConfig, OffloadPlan, create_offloader
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import cpu_plan, inputs
from tests.executors.models import layer_list, transformer_model
from tests.executors.uva_helpers import cpu_on_demand_plan, on_demand_plan


def _plan(kind: str, model: nn.Module) -> OffloadPlan:
    if kind == "prefetch":
        return cpu_plan(model, OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1))
    if kind == "on-demand-cpu":
        return cpu_on_demand_plan(model)
    return on_demand_plan(model)  # a CUDA-like plan with UVA off: pinned copies made per call


KINDS = ["prefetch", "on-demand-cpu", "on-demand-pinned"]


def _ready(kind: str) -> tuple[nn.Module, nn.Module]:
    model = transformer_model(4)
    reference = copy.deepcopy(model)
    plan = _plan(kind, model)
    off = create_offloader(plan, FakeRuntime() if plan.compute_device == "cuda" else None)
    off.wrap_modules(layer_list(model))
    off.post_init()
    return model, reference


@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_recording_history_through_offloaded_weights_is_refused(kind: str) -> None:
    model, reference = _ready(kind)
    x = next(inputs(seed=1))
    with torch.enable_grad(), pytest.raises(ExecutionError, match="autograd recording") as info:
        model(x)
    assert info.value.name == "grad_enabled"
    message = str(info.value)
    assert "require grad" in message and "torch.inference_mode()" in message and "requires_grad_(False)" in message
    # Refused before anything ran: the next forward without autograd simply works.
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("kind", KINDS)
def test_an_input_that_requires_grad_is_refused_too(kind: str) -> None:
    model, _ = _ready(kind)
    model.requires_grad_(False)
    x = next(inputs(seed=2)).requires_grad_(True)
    with torch.enable_grad(), pytest.raises(ExecutionError, match="an input requires grad"):
        model(x)


@pytest.mark.parametrize("kind", KINDS)
def test_with_grad_on_but_nothing_requiring_grad_the_forward_runs(kind: str) -> None:
    model, reference = _ready(kind)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    with torch.enable_grad():
        for x in inputs(seed=3):
            out = model(x)
            assert not out.requires_grad
            assert torch.equal(out, reference(x))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_modes_run(mode: str) -> None:
    model, reference = _ready("prefetch")
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with torch.enable_grad(), context:
        for x in inputs(seed=4):
            assert torch.equal(model(x), reference(x))
