"""A parameter that is a wrapper tensor subclass (torchao's quantised ``Int8Tensor``, a
``DTensor``: its bytes live in inner tensors) is refused when the layers are described,
naming the parameter, its type and its inner tensors, before anything moves; a plain
Python subclass of Parameter (its data in its own storage) is described as any other."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload import OffloadConfig, PlanError, describe_layers
from offload.hf import offload_model


class Quantised(torch.Tensor):
    """The shape of torchao's quantised weights: a wrapper whose data are int8 values and a
    scale per row (``__tensor_flatten__``), dequantised for every op."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Quantised:
        made: Quantised = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype,
                                                              device=qdata.device)
        return made

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> Quantised:
        return Quantised(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func is torch.ops.aten.detach.default:  # what nn.Parameter asks of it
            (t,) = args
            return Quantised(t.qdata.detach(), t.scale.detach())

        def plain(t: Any) -> Any:
            return t.qdata.to(t.scale.dtype) * t.scale if isinstance(t, Quantised) else t
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def _quantised_linear() -> nn.Linear:
    layer = nn.Linear(4, 3)
    weight = layer.weight.detach()
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    layer.weight = nn.Parameter(Quantised((weight / scale).round().to(torch.int8), scale), requires_grad=False)
    return layer


def test_a_wrapper_subclass_parameter_is_refused_by_name_type_and_inner_tensors() -> None:
    layer = _quantised_linear()
    weight: Any = layer.weight
    assert torch.allclose(layer(torch.ones(1, 4)), torch.ones(1, 4) @ (weight.qdata * weight.scale).T + layer.bias,
                          atol=1e-6)  # the premise: it computes
    with pytest.raises(PlanError) as caught:
        describe_layers([nn.Linear(4, 4), layer])
    message = str(caught.value)
    assert message.startswith("layer 1: parameter 'weight' is a ")
    assert "Quantised (a tensor subclass whose data are the inner tensors 'qdata', 'scale')" in message
    assert (caught.value.name, caught.value.value) == ("weight", f"{__name__}.Quantised")


def test_offload_model_refuses_it_before_anything_moves() -> None:
    model = nn.Sequential(nn.ModuleList([_quantised_linear(), _quantised_linear()]))
    stack = model[0]
    before = [(p, p.data_ptr() if not isinstance(p, Quantised) else p.qdata.data_ptr()) for p in model.parameters()]
    with pytest.raises(PlanError, match="is a .*Quantised"):
        offload_model(model, OffloadConfig(group_size=1))
    after = [(p, p.data_ptr() if not isinstance(p, Quantised) else p.qdata.data_ptr()) for p in model.parameters()]
    assert [(id(a), b) for a, b in before] == [(id(a), b) for a, b in after]
    assert all("forward" not in module.__dict__ for module in stack.modules())


class _Tagged(nn.Parameter):
    """A plain Python subclass of Parameter: its data in its own storage."""


def test_a_plain_parameter_subclass_is_described_as_any_other() -> None:
    holder = nn.Module()
    holder.w = _Tagged(torch.zeros(3, 2))
    spec = describe_layers([holder])
    assert [(p.name, p.shape, p.nbytes) for p in spec.layers[0].params] == [("w", (3, 2), 24)]
