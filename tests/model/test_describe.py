"""describe_layers on real small modules: metadata only, tied storage found, nothing copied."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload.errors import PlanError
from offload.model.describe import describe_layers, storage_key
from offload.pure.spec.values import LayerSpec, ModelSpec, ParamSpec


class Mlp(nn.Module):
    def __init__(self, hidden: int = 8, inner: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)


class Block(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = Mlp(hidden)


class Holder(nn.Module):
    """A layer holding exactly the given parameters under the given names."""

    def __init__(self, params: Mapping[str, nn.Parameter]) -> None:
        super().__init__()
        for name, param in params.items():
            self.register_parameter(name, param)


def params_by_name(layer: LayerSpec) -> dict[str, ParamSpec]:
    return {p.name: p for p in layer.params}


def test_names_are_relative_to_the_layer_in_named_parameters_order() -> None:
    layers = nn.ModuleList([Block(), Block()])
    spec = describe_layers(layers)
    assert [(layer.index, layer.name) for layer in spec.layers] == [(0, "Block"), (1, "Block")]
    assert [p.name for p in spec.layers[1].params] == ["norm.weight", "norm.bias", "mlp.up.weight", "mlp.down.weight"]
    up = params_by_name(spec.layers[0])["mlp.up.weight"]
    assert (up.shape, up.stride, up.dtype, up.itemsize, up.device) == ((16, 8), (8, 1), "float32", 4, "cpu")
    assert up.nbytes == 16 * 8 * 4
    assert spec.nbytes == 2 * (8 * 4 + 8 * 4 + 2 * 16 * 8 * 4)


def test_transposed_and_sliced_weights_keep_their_shape_and_stride() -> None:
    w = torch.randn(8, 16)
    base = torch.randn(4, 10)
    layer = Holder({
        "transposed": nn.Parameter(w.t()),
        "sliced": nn.Parameter(base[:, :6]),
    })
    params = params_by_name(describe_layers([layer]).layers[0])
    assert (params["transposed"].shape, params["transposed"].stride) == ((16, 8), (1, 16))
    assert params["transposed"].nbytes == 16 * 8 * 4
    # A slice spans its rows' full stride except after the last element: 3 * 10 + 5 + 1.
    assert (params["sliced"].shape, params["sliced"].stride) == ((4, 6), (10, 1))
    assert params["sliced"].nbytes == 36 * 4


@pytest.mark.parametrize(
    ("dtype", "name", "itemsize"),
    [
        (torch.int8, "int8", 1),
        (torch.uint8, "uint8", 1),
        (torch.float8_e4m3fn, "float8_e4m3fn", 1),
        (torch.float8_e5m2, "float8_e5m2", 1),
        (torch.bfloat16, "bfloat16", 2),
        (torch.int32, "int32", 4),
        (torch.float64, "float64", 8),
    ],
)
def test_dtype_name_and_itemsize(dtype: torch.dtype, name: str, itemsize: int) -> None:
    layer = Holder({"w": nn.Parameter(torch.zeros(3, 5, dtype=dtype), requires_grad=False)})
    (param,) = describe_layers([layer]).layers[0].params
    assert (param.dtype, param.itemsize) == (name, itemsize)
    assert param.nbytes == 15 * itemsize


def test_weights_tied_across_two_layers_share_a_key() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    spec = describe_layers([embed, head])
    (embed_weight,) = spec.layers[0].params
    (head_weight,) = spec.layers[1].params
    assert embed_weight.storage_key is not None
    assert embed_weight.storage_key == head_weight.storage_key
    assert (spec.layers[0].name, spec.layers[1].name) == ("Embedding", "Linear")
    assert spec.nbytes == 10 * 4 * 4  # counted once


def test_weights_tied_within_one_layer_are_listed_under_each_name() -> None:
    block = Block()
    block.mlp.down.weight = block.mlp.up.weight  # (16, 8), same Parameter under two names
    layer = describe_layers([block]).layers[0]
    params = params_by_name(layer)
    assert list(params) == ["norm.weight", "norm.bias", "mlp.up.weight", "mlp.down.weight"]
    assert params["mlp.up.weight"].storage_key is not None
    assert params["mlp.up.weight"].storage_key == params["mlp.down.weight"].storage_key
    assert layer.nbytes == 8 * 4 + 8 * 4 + 16 * 8 * 4


def test_distinct_parameters_and_distinct_views_get_distinct_keys() -> None:
    base = torch.randn(8, 4)
    w = torch.randn(4, 4)
    layer = Holder({
        "top": nn.Parameter(base[:4]),  # same storage, offset 0
        "bottom": nn.Parameter(base[4:]),  # same storage, offset 16
        "w": nn.Parameter(w),
        "w_t": nn.Parameter(w.t()),  # same storage and offset, other stride
        "w_bytes": nn.Parameter(w.view(torch.int32), requires_grad=False),  # other dtype
    })
    spec = describe_layers([layer, Block(), Block()])
    keys = [p.storage_key for layer_spec in spec.layers for p in layer_spec.params]
    assert None not in keys
    assert len(set(keys)) == len(keys)


def test_storage_key_is_equal_exactly_for_the_same_view() -> None:
    w = torch.randn(4, 4)
    assert storage_key(w) == storage_key(w.view(4, 4))
    assert storage_key(w) == storage_key(nn.Parameter(w))
    assert storage_key(w) != storage_key(w.view(16))
    assert storage_key(w) != storage_key(torch.randn(4, 4))


def test_tied_meta_parameters_share_a_key_and_nothing_else_does() -> None:
    """A meta model (planned before loading) knows its ties."""
    with torch.device("meta"):
        meta_embed = nn.Embedding(10, 4)
        meta_head = nn.Linear(4, 10, bias=False)
        other = nn.Linear(4, 10, bias=False)
    meta_head.weight = meta_embed.weight
    spec = describe_layers([meta_embed, meta_head, other])
    embed, head, untied = (layer.params[0] for layer in spec.layers)
    assert (embed.shape, embed.device) == ((10, 4), "meta")
    assert embed.storage_key is not None and embed.storage_key.startswith("meta@")
    assert head.storage_key == embed.storage_key
    assert untied.storage_key not in (None, embed.storage_key)
    weight = meta_embed.weight
    assert storage_key(weight.t()) not in (None, embed.storage_key)  # another view of the storage
    assert storage_key(weight[1:]) != storage_key(weight)


def test_a_plan_from_a_meta_model_ties_what_the_loaded_model_ties() -> None:
    def build(device: str) -> list[nn.Module]:
        with torch.device(device):
            embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        head.weight = embed.weight
        return [embed, head]

    meta, real = describe_layers(build("meta")), describe_layers(build("cpu"))
    assert [[p.storage_key is not None for p in layer.params] for layer in meta.layers] == [[True], [True]]
    assert (meta.layers[0].params[0].storage_key == meta.layers[1].params[0].storage_key) is (
        real.layers[0].params[0].storage_key == real.layers[1].params[0].storage_key) is True
    assert meta.nbytes == real.nbytes == 10 * 4 * 4  # the tied weight counted once


def test_storageless_parameters_have_no_key() -> None:
    layer = Holder({"empty": nn.Parameter(torch.empty(0, 4))})
    spec = describe_layers([layer])
    empty = spec.layers[0].params[0]
    assert (empty.shape, empty.storage_key, empty.nbytes) == ((0, 4), None, 0)


# torch.utils._python_dispatch is unannotated; this test-only recorder is its one user.
class RecordOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every aten operator that runs: any copy, allocation or compute shows up."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_weight_is_copied_or_allocated() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    weight_t = nn.Parameter(torch.randn(8, 16).t())
    transposed = Holder({"w": weight_t})
    layers = [Block(), embed, head, transposed]
    before = [(p, p.data_ptr(), p.stride()) for layer in layers for p in layer.parameters()]

    with RecordOps() as recorder:
        spec = describe_layers(layers)
    assert recorder.ops == []
    after = [(p, p.data_ptr(), p.stride()) for layer in layers for p in layer.parameters()]
    assert len(after) == len(before)
    for (param_before, ptr_before, stride_before), (param_after, ptr_after, stride_after) in zip(
        before, after, strict=True
    ):
        assert param_after is param_before
        assert (ptr_after, stride_after) == (ptr_before, stride_before)
    assert spec.num_params == 4 + 1 + 1 + 1

    # The recorder does see a copy when one happens, so the empty list above means something.
    with RecordOps() as control:
        weight_t.detach().contiguous()
    assert "aten.clone.default" in control.ops


def test_a_non_module_element_is_rejected() -> None:
    with pytest.raises(PlanError, match=r"layers\[1\] is a Tensor, not a torch.nn.Module") as caught:
        describe_layers([nn.Linear(2, 2), torch.zeros(2)])  # type: ignore[list-item]
    assert caught.value.name == "layers[1]"


def test_a_single_module_is_rejected() -> None:
    with pytest.raises(PlanError, match="takes a sequence of layers, got a Linear") as caught:
        describe_layers(nn.Linear(2, 2))  # type: ignore[arg-type]
    assert caught.value.name == "layers"


def test_a_sparse_parameter_is_rejected() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), check_invariants=True)
    layer = Holder({"s": nn.Parameter(sparse, requires_grad=False)})
    with pytest.raises(PlanError, match="parameter 's' has layout torch.sparse_coo") as caught:
        describe_layers([layer])
    assert caught.value.name == "s"


def test_no_layers_give_an_empty_spec() -> None:
    assert describe_layers([]) == ModelSpec(layers=())
