"""`ParamSpec`, `LayerSpec`, `ModelSpec`: sizes for any strides and dtypes, ties, validation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings

from offload.errors import PlanError
from offload.pure import DTYPE_ITEMSIZE, LayerSpec, ModelSpec, ParamSpec, contiguous_stride
from tests.pure.strategies import DTYPES, model_specs, param_specs, row_major


def spanned_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Brute force: visit every element, take the furthest offset."""
    if any(size == 0 for size in shape):
        return 0
    furthest = max(
        (sum(i * s for i, s in zip(index, stride, strict=True)) for index in itertools.product(*map(range, shape))),
        default=0,
    )
    return (furthest + 1) * itemsize


# shape, stride, dtype, itemsize, bytes (worked out by hand)
NBYTES: list[tuple[str, tuple[int, ...], tuple[int, ...], str, int, int]] = [
    ("contiguous bf16", (4, 8), (8, 1), "bfloat16", 2, 64),
    ("transposed fp32", (8, 4), (1, 8), "float32", 4, 128),
    ("slice of a wider row", (4, 3), (5, 1), "float16", 2, (3 * 5 + 3) * 2),
    ("every other column", (2, 4), (8, 2), "float32", 4, (8 + 6 + 1) * 4),
    ("broadcast row", (1000, 16), (0, 1), "float32", 4, 64),
    ("int8", (16, 16), (16, 1), "int8", 1, 256),
    ("uint8", (3,), (1,), "uint8", 1, 3),
    ("float8 e4m3", (32, 8), (8, 1), "float8_e4m3fn", 1, 256),
    ("float8 e5m2 transposed", (8, 32), (1, 8), "float8_e5m2", 1, 256),
    ("int64", (5,), (1,), "int64", 8, 40),
    ("scalar", (), (), "float32", 4, 4),
    ("zero rows", (0, 16), (16, 1), "bfloat16", 2, 0),
    ("zero columns", (16, 0), (1, 1), "bfloat16", 2, 0),
    ("zero in the middle", (2, 0, 3), (3, 3, 1), "float32", 4, 0),
    ("a dtype we do not list", (10,), (1,), "some_future_dtype", 3, 30),
]


@pytest.mark.parametrize(("shape", "stride", "dtype", "itemsize", "expected"), [c[1:] for c in NBYTES],
                         ids=[c[0] for c in NBYTES])
def test_nbytes_table(shape: tuple[int, ...], stride: tuple[int, ...], dtype: str, itemsize: int,
                      expected: int) -> None:
    p = ParamSpec(name="w", shape=shape, stride=stride, dtype=dtype, itemsize=itemsize)
    assert p.nbytes == expected
    assert p.nbytes == spanned_bytes(shape, stride, itemsize)


@settings(max_examples=300)
@given(param_specs())
def test_nbytes_is_the_span_of_the_elements(p: ParamSpec) -> None:
    assert p.nbytes == spanned_bytes(p.shape, p.stride, p.itemsize)
    if p.stride == row_major(p.shape):
        assert p.nbytes == p.numel * p.itemsize


@pytest.mark.parametrize(
    ("shape", "stride"),
    [
        # As torch reports them: torch.empty(*shape).stride().
        ((), ()),
        ((5,), (1,)),
        ((4, 8), (8, 1)),
        ((2, 3, 4), (12, 4, 1)),
        ((3, 0), (1, 1)),
        ((0, 3), (3, 1)),
        ((2, 0, 3), (3, 3, 1)),
    ],
)
def test_contiguous_stride_matches_torch(shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    assert contiguous_stride(shape) == stride


def test_known_itemsizes_are_torchs() -> None:
    for dtype, itemsize in DTYPES.items():
        assert DTYPE_ITEMSIZE[dtype] == itemsize


BAD_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("shape and stride lengths differ", {"shape": (2, 3), "stride": (1,)}),
    ("itemsize disagrees with the dtype", {"dtype": "bfloat16", "itemsize": 4}),
    ("float8 is one byte", {"dtype": "float8_e4m3fn", "itemsize": 2}),
    ("negative size", {"shape": (-1,), "stride": (1,)}),
    ("negative stride", {"shape": (2,), "stride": (-1,)}),
    ("bool size", {"shape": (True,), "stride": (1,)}),
    ("list shape", {"shape": [2], "stride": (1,)}),
    ("zero itemsize", {"dtype": "weird", "itemsize": 0}),
    ("empty name", {"name": ""}),
    ("empty dtype", {"dtype": "", "itemsize": 1}),
    ("empty storage key", {"storage_key": ""}),
]


@pytest.mark.parametrize("changes", [c[1] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS])
def test_param_spec_validation(changes: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"name": "w", "shape": (2,), "stride": (1,), "dtype": "float32", "itemsize": 4}
    kwargs.update(changes)
    with pytest.raises(PlanError):
        ParamSpec(**kwargs)


def _p(name: str, n: int = 4, key: str | None = None) -> ParamSpec:
    return ParamSpec(name=name, shape=(n,), stride=(1,), dtype="float32", itemsize=4, storage_key=key)


def test_layer_names_are_unique() -> None:
    with pytest.raises(PlanError) as caught:
        LayerSpec(index=0, name="l", params=(_p("w"), _p("w")))
    assert caught.value.name == "w"


@pytest.mark.parametrize("indices", [(1,), (0, 2), (1, 0), (0, 0)])
def test_layer_indices_run_from_zero(indices: tuple[int, ...]) -> None:
    with pytest.raises(PlanError):
        ModelSpec(layers=tuple(LayerSpec(index=i, name=str(i), params=()) for i in indices))


def test_tied_storage_is_counted_once() -> None:
    spec = ModelSpec(layers=(
        LayerSpec(index=0, name="0", params=(_p("embed", 10, "e"), _p("a", 5))),
        LayerSpec(index=1, name="1", params=(_p("head", 10, "e"), _p("b", 5), _p("c", 5, "e2"), _p("d", 5, "e2"))),
    ))
    assert spec.nbytes == 4 * (10 + 5 + 5 + 5)
    assert spec.layers[1].nbytes == 4 * (10 + 5 + 5)
    assert spec.num_params == 6


@settings(max_examples=100)
@given(model_specs(max_layers=6))
def test_model_bytes_count_each_storage_once(spec: ModelSpec) -> None:
    by_storage: dict[object, int] = {}
    for layer in spec.layers:
        for p in layer.params:
            key: object = p.storage_key if p.storage_key is not None else (layer.index, p.name)
            by_storage.setdefault(key, p.nbytes)
    assert spec.nbytes == sum(by_storage.values())
