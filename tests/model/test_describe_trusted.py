"""`describe_layers` builds its spec without validating it again (for speed: a thousand
layers take well under a second): the spec is the one the validating constructors build
from the same values, its storage keys are `storage_key`'s, its parameters are
``named_parameters(remove_duplicate=False)``'s, and what torch cannot describe is still
refused, naming the parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import attrs
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from offload.errors import PlanError
from offload.model.describe import _named_parameters, describe_layers, describe_tensor, storage_key
from offload.pure import (
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    Platform,
    make_plan,
)
from offload.pure.serialize import from_data, to_data


class Holder(nn.Module):
    """A layer holding exactly the given parameters (None ones registered as None)."""

    def __init__(self, params: Mapping[str, nn.Parameter | None]) -> None:
        super().__init__()
        for name, param in params.items():
            self.register_parameter(name, param)


class Block(nn.Module):
    def __init__(self, shared: nn.Module | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, dtype=dtype, device=device)
        self.up = nn.Linear(8, 16, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(16, 8, dtype=dtype, device=device)
        self.tied = self.up  # the same module under two names: its weight twice
        if shared is not None:
            self.shared = shared


class Listing(nn.Module):
    """Lists its parameters its own way: describe_layers must ask it, not walk it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        yield "b_first", self.b
        yield "a_second", self.a


class OwnWalk(nn.Module):
    """Walks its own way: named_modules (and so named_parameters) lists it, not its child."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.hidden = nn.Linear(2, 2)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        yield prefix, self


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _parametrized() -> nn.Module:
    layer = nn.Linear(4, 4)
    parametrize.register_parametrization(layer, "weight", _Double())
    return layer


def _views() -> nn.Module:
    base = torch.randn(6, 10)
    return Holder({
        "transposed": nn.Parameter(torch.randn(8, 4).t()),
        "sliced": nn.Parameter(base[:, :6]),
        "empty": nn.Parameter(torch.empty(0, 4)),
        "scalar": nn.Parameter(torch.tensor(1.0)),
        "nothing": None,
        "int8": nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False),
        "fp8": nn.Parameter(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), requires_grad=False),
    })


def models() -> dict[str, list[nn.Module]]:
    shared = nn.Linear(8, 8, bias=False)
    embed = nn.Parameter(torch.randn(10, 8))
    meta_shared = nn.Linear(8, 8, bias=False, device="meta")
    return {
        "blocks sharing a module": [Block(shared), Block(shared), Block()],
        "bf16 blocks": [Block(dtype=torch.bfloat16) for _ in range(3)],
        "meta blocks sharing a module": [Block(meta_shared, device="meta"), Block(meta_shared, device="meta")],
        "views, empty, None, int8, fp8": [_views(), _views()],
        "tied across layers": [Holder({"embed": embed}), Holder({"head": embed, "bias": nn.Parameter(torch.zeros(10))})],
        "its own listing": [Listing(), Listing()],
        "parametrized": [_parametrized(), _parametrized()],
        "mixed devices": [Block(device="meta"), Block(), Holder({"w": nn.Parameter(torch.zeros(8, 8))})],
        "deeply nested": [nn.Sequential(Block(shared), nn.Sequential(nn.ModuleList([Block(), Block(shared)])))
                          for _ in range(2)],
        "a submodule walked its own way": [nn.Sequential(Block(), OwnWalk()), OwnWalk()],
    }


def validated(spec: ModelSpec) -> ModelSpec:
    """`spec` rebuilt through the validating constructors."""
    fields = [f.name for f in attrs.fields(ParamSpec)]
    return ModelSpec(layers=tuple(
        LayerSpec(index=layer.index, name=layer.name,
                  params=tuple(ParamSpec(**{f: getattr(p, f) for f in fields}) for p in layer.params))
        for layer in spec.layers
    ))


@pytest.mark.parametrize("name", list(models()))
def test_the_spec_is_the_one_the_constructors_build(name: str) -> None:
    spec = describe_layers(models()[name])
    twin = validated(spec)
    assert spec == twin
    assert hash(spec) == hash(twin)
    assert repr(spec) == repr(twin)
    assert to_data(spec) == to_data(twin)
    assert from_data(ModelSpec, json.loads(json.dumps(to_data(spec)))) == twin
    for layer, twin_layer in zip(spec.layers, twin.layers, strict=True):
        assert hash(layer) == hash(twin_layer)
        for p, q in zip(layer.params, twin_layer.params, strict=True):
            assert type(p) is ParamSpec
            assert (p.nbytes, p.numel, p.buffer_key, hash(p)) == (q.nbytes, q.numel, q.buffer_key, hash(q))
    assert (spec.nbytes, spec.num_params) == (twin.nbytes, twin.num_params)
    plan = make_plan(spec, OffloadConfig(uva_max_bytes=1 << 40), _env())
    assert plan == make_plan(twin, OffloadConfig(uva_max_bytes=1 << 40), _env())
    assert OffloadPlan.from_json(plan.to_json()) == plan


def _env() -> EnvSnapshot:
    return EnvSnapshot(platform=Platform(has_cuda=False))


@pytest.mark.parametrize("name", list(models()))
def test_parameters_are_named_parameters_without_removing_duplicates(name: str) -> None:
    for layer in models()[name]:
        expected = list(layer.named_parameters(remove_duplicate=False))
        walked = [(n, t) for n, t in _named_parameters(layer) if t is not None]
        assert [n for n, _ in walked] == [n for n, _ in expected]
        assert all(a is b for (_, a), (_, b) in zip(walked, expected, strict=True))
        described = describe_layers([layer]).layers[0].params
        assert [p.name for p in described] == [n for n, _ in expected]
        for p, (_, tensor) in zip(described, expected, strict=True):
            assert p.storage_key == storage_key(tensor)
            assert p == describe_tensor(0, p.name, tensor)


def test_a_layer_listing_its_own_parameters_is_asked() -> None:
    assert [p.name for p in describe_layers([Listing()]).layers[0].params] == ["b_first", "a_second"]


def test_tied_names_share_a_key_and_others_do_not() -> None:
    spec = describe_layers(models()["blocks sharing a module"])
    keys = {(layer.index, p.name): p.storage_key for layer in spec.layers for p in layer.params}
    assert keys[(0, "up.weight")] == keys[(0, "tied.weight")] is not None
    assert keys[(0, "shared.weight")] == keys[(1, "shared.weight")] is not None
    assert keys[(0, "up.weight")] != keys[(1, "up.weight")]
    assert keys[(2, "down.weight")] != keys[(2, "down.bias")]


class _ListShape(nn.Parameter):
    """A parameter whose sizes do not hash (as symbolic sizes do not)."""

    @property
    def shape(self) -> list[int]:  # type: ignore[override]
        return list(super().shape)


def test_sizes_that_do_not_hash_are_described_one_by_one() -> None:
    odd = _ListShape(torch.zeros(3, 2))
    spec = describe_layers([Holder({"odd": odd, "plain": nn.Parameter(torch.zeros(3, 2))})])
    odd_spec, plain_spec = spec.layers[0].params
    assert (odd_spec.shape, odd_spec.stride, odd_spec.nbytes) == ((3, 2), (2, 1), 24)
    assert attrs.evolve(odd_spec, name="plain", storage_key=plain_spec.storage_key) == plain_spec
    assert validated(spec) == spec


def _sparse() -> nn.Parameter:
    tensor = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), check_invariants=True)
    return nn.Parameter(tensor, requires_grad=False)


def test_a_sparse_parameter_deep_in_a_layer_is_refused_by_name() -> None:
    inner = Holder({"s": _sparse()})
    layer = nn.Module()
    layer.add_module("inner", inner)
    with pytest.raises(PlanError, match="layer 1: parameter 'inner.s' has layout torch.sparse_coo") as caught:
        describe_layers([Block(), layer])
    assert (caught.value.name, caught.value.value) == ("inner.s", "torch.sparse_coo")


def test_a_sparse_parameter_after_dense_ones_of_its_shape_is_refused() -> None:
    # The dense (2, 2) parameters before it fill the memo; the sparse one must not hit it.
    layer = Holder({"a": nn.Parameter(torch.zeros(2, 2)), "s": _sparse()})
    with pytest.raises(PlanError) as caught:
        describe_layers([Holder({"d": nn.Parameter(torch.zeros(2, 2))}), layer])
    assert caught.value.name == "s"


def test_what_is_not_a_layer_is_still_refused() -> None:
    with pytest.raises(PlanError) as caught:
        describe_layers([Block(), "layer"])  # type: ignore[list-item]
    assert (caught.value.name, caught.value.value) == ("layers[1]", "layer")
