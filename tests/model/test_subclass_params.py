"""A parameter that is a wrapper tensor subclass (torchao's quantised ``Int8Tensor``: its
bytes live in inner tensors) is described by its inner tensors, named and ordered as the
layer lists them once unpacked (`offload.model.wrappers`), and offloaded by them, bit for
bit; one that cannot be unpacked is refused by name and type before anything moves; a
plain Python subclass of Parameter (its data in its own storage) is described as any other."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from offload import OffloadConfig, PlanError, describe_layers
from offload.executors.placement.unpack import unpack
from offload.hf import offload_model
from offload.model.describe import describe_tensor
from offload.model.wrappers import is_wrapper


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
            return type(t)(t.qdata.detach(), t.scale.detach())

        def plain(t: Any) -> Any:
            return t.qdata.to(t.scale.dtype) * t.scale if isinstance(t, Quantised) else t
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def _quantised_linear() -> nn.Linear:
    layer = nn.Linear(4, 3)
    weight = layer.weight.detach()
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    layer.weight = nn.Parameter(Quantised((weight / scale).round().to(torch.int8), scale), requires_grad=False)
    return layer


class _Block(nn.Module):
    """A quantised weight beside plain ones, in a module with children and in one without."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.proj = _quantised_linear()
        self.inner = nn.Sequential(nn.LayerNorm(4), _quantised_linear())
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.proj(x * self.scale) + self.inner(x))
        return out


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(torch.nn.functional.pad(x, (0, 1)))
        return x


def _layouts() -> dict[str, nn.Module]:
    """Layers holding wrapper weights in every place a module tree allows."""
    own = _quantised_linear()  # the layer itself holds one
    both = nn.Linear(4, 3)
    both.weight = _quantised_linear().weight
    both.bias = nn.Parameter(Quantised(torch.ones(3, dtype=torch.int8), torch.full((3,), 0.5)), requires_grad=False)
    nested = _Block()
    nested.inner[1].extra = nn.Linear(3, 3)  # a child below a module holding a wrapper
    tied = _Block()
    tied.inner[1].weight = tied.proj.weight  # one wrapper in two modules
    return {"own": own, "both": both, "nested": nested, "tied": tied, "block": _Block()}


@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_a_wrapper_is_described_by_its_inner_tensors_as_named_once_unpacked(layout: str) -> None:
    layer = _layouts()[layout]
    before = [(n, id(p)) for n, p in layer.named_parameters(remove_duplicate=False)]
    classes = [type(m) for m in layer.modules()]
    spec = describe_layers([layer]).layers[0]
    inner = [p for p in spec.params if ".parametrizations." in f".{p.name}"]
    assert inner and all(p.name.rpartition(".")[2] in ("original0", "original1") for p in inner)
    unpacked = unpack([layer])
    assert len(unpacked) == sum(t is not None and is_wrapper(t) for m in _layouts()[layout].modules()
                                for t in m._parameters.values())
    # The names and order describe gave are those of the unpacked layer, and so are the
    # shapes, dtypes and ties (storage keys) of what they name.
    live = [(p.name, p.shape, p.dtype, p.storage_key) for p in describe_layers([layer]).layers[0].params]
    assert [(p.name, p.shape, p.dtype, p.storage_key) for p in spec.params] == live
    assert [n for n, _ in layer.named_parameters(remove_duplicate=False)] == [p.name for p in spec.params]
    assert all(type(p) is nn.Parameter for _, p in layer.named_parameters())
    unpacked.pack()
    assert [(n, id(p)) for n, p in layer.named_parameters(remove_duplicate=False)] == before
    assert [type(m) for m in layer.modules()] == classes


def test_the_inner_tensors_are_what_unpacked_layers_compute_with() -> None:
    layer = _Block()
    x = torch.randn(2, 4)
    want = layer(x)
    unpacked = unpack([layer])
    assert torch.equal(layer(x), want)
    # Each inner tensor is a Parameter of its own: moving one moves what the layer reads.
    proj: Any = layer.proj
    original = proj.parametrizations.weight.original1
    original.data = original.data * 2
    assert not torch.equal(layer(x), want)
    original.data = original.data / 2
    unpacked.pack()
    assert torch.equal(layer(x), want)


class _Opaque(Quantised):
    def __tensor_flatten__(self) -> tuple[list[str], None]:
        raise RuntimeError("no flattening here")


class _Nested(Quantised):
    """A wrapper whose inner tensor is a wrapper: refused, not unpacked half way."""


def _holding(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(4, 3)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


@pytest.mark.parametrize("case", ["flatten fails", "inner is a wrapper", "already parametrised"])
def test_a_wrapper_that_cannot_be_unpacked_is_refused_by_name_and_type_before_anything_moves(case: str) -> None:
    qdata, scale = torch.ones(3, 4, dtype=torch.int8), torch.ones(3, 1)
    if case == "flatten fails":
        layer = _holding(_Opaque(qdata, scale))
        match = r"layer 1: parameter 'weight' is a .*_Opaque .*__tensor_flatten__ failed \(RuntimeError: no flat"
    elif case == "inner is a wrapper":
        layer = _holding(_Nested(Quantised(qdata, scale), scale))
        match = r"parameter 'weight' is a .*_Nested .*its inner 'qdata' is a .*Quantised"
    else:
        layer = _holding(Quantised(qdata, scale))
        layer.other = nn.Parameter(torch.ones(2))
        torch.nn.utils.parametrize.register_parametrization(layer, "other", nn.Identity())
        match = r"module '\(the layer\)' holds a quantised weight and is already parametrised"
    layer_list = nn.ModuleList([nn.Linear(4, 4), layer])
    model = nn.Sequential(layer_list)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    with pytest.raises(PlanError, match=match):
        describe_layers(layer_list)
    with pytest.raises(PlanError, match=match):
        offload_model(model, OffloadConfig(group_size=1), layers_path="0")
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_describe_tensor_of_a_wrapper_names_its_inner_tensors() -> None:
    with pytest.raises(PlanError, match=r"parameter 'w' is a tensor subclass whose data are the inner tensors "
                                        r"'qdata', 'scale'"):
        describe_tensor(0, "w", Quantised(torch.ones(2, 2, dtype=torch.int8), torch.ones(2, 1)))


@pytest.mark.parametrize("backend", ["prefetch", "on-demand"])
def test_offload_model_offloads_a_wrapper_by_its_inner_tensors_bit_for_bit(backend: str) -> None:
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(2, 3)
    with torch.no_grad():
        want = model(x)
    config = OffloadConfig(group_size=1) if backend == "prefetch" else OffloadConfig(backend="uva",
                                                                                     uva_max_bytes=1 << 40)
    off = offload_model(model, config)
    names = {p.name for p in off.plan.offloaded_params}
    assert "proj.parametrizations.weight.original0" in names and "inner.1.parametrizations.weight.original1" in names
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)
    off.restore()
    assert all(isinstance(m.weight, Quantised) for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        assert torch.equal(model(x), want)


class _Tagged(nn.Parameter):
    """A plain Python subclass of Parameter: its data in its own storage."""


def test_a_plain_parameter_subclass_is_described_as_any_other() -> None:
    holder = nn.Module()
    holder.w = _Tagged(torch.zeros(3, 2))
    spec = describe_layers([holder])
    assert [(p.name, p.shape, p.nbytes) for p in spec.layers[0].params] == [("w", (3, 2), 24)]
