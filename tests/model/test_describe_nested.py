"""describe_layers on nested layers (blocks of submodules, as real models are): the spec is
the one built, through the validating constructors, from each layer's
``named_parameters(remove_duplicate=False)``; ties across submodules and layers share a
key; views, buffers, None entries, meta and host tensors are described as torch lists
them; and a module that torch walks its own way is still walked its way."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from offload.model.describe import _named_parameters, describe_layers, storage_key
from offload.pure import LayerSpec, ModelSpec, ParamSpec


def reference(layers: Sequence[nn.Module]) -> ModelSpec:
    """The spec of `layers` from first principles: each layer's
    ``named_parameters(remove_duplicate=False)``, each tensor's own metadata, and the
    validating constructors."""
    return ModelSpec(layers=tuple(
        LayerSpec(index=index, name=type(layer).__name__, params=tuple(
            ParamSpec(
                name=name,
                shape=tuple(tensor.shape),
                stride=tuple(tensor.stride()),
                dtype=str(tensor.dtype).removeprefix("torch."),
                itemsize=tensor.element_size(),
                storage_key=storage_key(tensor),
                device=str(tensor.device),
            )
            for name, tensor in layer.named_parameters(remove_duplicate=False)
        ))
        for index, layer in enumerate(layers)
    ))


def assert_described_as_reference(layers: Sequence[nn.Module]) -> ModelSpec:
    spec = describe_layers(layers)
    twin = reference(layers)
    assert spec == twin
    assert (hash(spec), repr(spec)) == (hash(twin), repr(twin))
    for layer, twin_layer in zip(spec.layers, twin.layers, strict=True):
        for p, q in zip(layer.params, twin_layer.params, strict=True):
            assert (p.numel, p.nbytes, p.buffer_key) == (q.numel, q.nbytes, q.buffer_key)
    assert (spec.nbytes, spec.num_params) == (twin.nbytes, twin.num_params)
    return spec


class Attention(nn.Module):
    def __init__(self, hidden: int, device: str) -> None:
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False, device=device)
        self.k = nn.Linear(hidden, hidden, bias=False, device=device)
        self.o = nn.Linear(hidden, hidden, device=device)
        self.register_buffer("rotary", torch.zeros(hidden, device=device))  # a buffer, not listed
        self.register_parameter("gate", None)  # None, not listed


class Block(nn.Module):
    """A transformer-like block: norms, attention, an MLP in a Sequential (with a module
    without parameters), a ModuleList of experts three levels deep, and a None submodule."""

    def __init__(self, hidden: int = 8, device: str = "cpu", shared: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, device=device)
        self.attn = Attention(hidden, device)
        self.norm2 = nn.BatchNorm1d(hidden, device=device)  # running stats: buffers
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden, device=device), nn.GELU(),
                                 nn.Linear(2 * hidden, hidden, bias=False, device=device))
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden, bias=False, device=device))
                                      for _ in range(2)])
        self.register_module("absent", None)
        if shared is not None:
            self.shared = shared


BLOCK_NAMES = [
    "norm1.weight", "norm1.bias",
    "attn.q.weight", "attn.k.weight", "attn.o.weight", "attn.o.bias",
    "norm2.weight", "norm2.bias",
    "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
    "experts.0.0.weight", "experts.1.0.weight",
]


def test_a_block_lists_its_parameters_in_named_parameters_order_by_their_full_names() -> None:
    spec = assert_described_as_reference([Block(), Block(device="meta")])
    assert [p.name for p in spec.layers[0].params] == BLOCK_NAMES
    assert [p.name for p in spec.layers[1].params] == BLOCK_NAMES
    up = {p.name: p for p in spec.layers[1].params}["mlp.0.weight"]
    assert (up.shape, up.stride, up.device, up.nbytes) == ((16, 8), (8, 1), "meta", 16 * 8 * 4)
    assert all(p.storage_key is not None for layer in spec.layers for p in layer.params)


def linear(layer: nn.Module, path: str) -> nn.Linear:
    module = layer.get_submodule(path)
    assert isinstance(module, nn.Linear)
    return module


def tied_model(device: str) -> list[nn.Module]:
    """Three blocks with ties inside a layer, across layers, by module and by parameter,
    and parameters that are views of one storage."""
    shared = nn.Linear(8, 8, bias=False, device=device)
    first, second, third = Block(device=device, shared=shared), Block(device=device), Block(device=device, shared=shared)
    linear(first, "experts.1.0").weight = first.attn.k.weight  # across submodules of one layer
    third.attn.o.weight = second.attn.o.weight  # across layers, by parameter
    base = torch.zeros(4, 8, 8, device=device)
    linear(second, "experts.0.0").weight = nn.Parameter(base[0])  # views of one storage,
    linear(second, "experts.1.0").weight = nn.Parameter(base[1])  # at offsets 0 and 64,
    linear(third, "experts.0.0").weight = nn.Parameter(base[0])  # the first view again: tied
    linear(third, "experts.1.0").weight = nn.Parameter(base[2].t())  # transposed: its own key
    return [first, second, third]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_ties_across_submodules_and_layers_share_a_key_and_nothing_else_does(device: str) -> None:
    layers = tied_model(device)
    spec = assert_described_as_reference(layers)
    keys: dict[str, set[tuple[int, str]]] = {}
    for layer in spec.layers:
        for p in layer.params:
            assert p.storage_key is not None
            keys.setdefault(p.storage_key, set()).add((layer.index, p.name))
    tied = sorted(sorted(group) for group in keys.values() if len(group) > 1)
    assert tied == sorted([
        [(0, "attn.k.weight"), (0, "experts.1.0.weight")],
        [(0, "shared.weight"), (2, "shared.weight")],
        [(1, "attn.o.weight"), (2, "attn.o.weight")],
        [(1, "experts.0.0.weight"), (2, "experts.0.0.weight")],
    ])
    params = {(layer.index, p.name): p for layer in spec.layers for p in layer.params}
    transposed = params[(2, "experts.1.0.weight")]
    assert (transposed.shape, transposed.stride, transposed.nbytes) == ((8, 8), (1, 8), 64 * 4)
    # Layer 0 counts its tie once; the model counts the three ties across layers once.
    assert spec.layers[0].nbytes == sum(p.nbytes for p in spec.layers[0].params) - 8 * 8 * 4
    assert spec.nbytes == sum(layer.nbytes for layer in spec.layers) - 3 * 8 * 8 * 4


def test_host_and_meta_submodules_in_one_layer_keep_their_devices() -> None:
    block = Block()
    block.attn = Attention(8, "meta")
    block.experts[1] = nn.Sequential(nn.Linear(8, 8, bias=False, dtype=torch.bfloat16, device="meta"))
    block.mlp[0].bias = nn.Parameter(torch.zeros(16, dtype=torch.int8), requires_grad=False)
    spec = assert_described_as_reference([block])
    devices = {p.name: (p.device, p.dtype, p.itemsize) for p in spec.layers[0].params}
    assert devices["attn.q.weight"] == ("meta", "float32", 4)
    assert devices["experts.1.0.weight"] == ("meta", "bfloat16", 2)
    assert devices["norm1.weight"] == ("cpu", "float32", 4)
    assert devices["mlp.0.bias"] == ("cpu", "int8", 1)


def test_nested_plain_layers_are_walked_in_one_pass() -> None:
    # The tests above hold the one-pass walk (a list) equal to torch; the layers below it
    # falls back on are held equal in their own tests.
    for layer in [*tied_model("cpu"), *tied_model("meta")]:
        assert isinstance(_named_parameters(layer), list)


class Hiding(nn.Module):
    """Walks its own way: hides its submodules from named_modules (and so named_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(2))
        self.hidden = nn.Linear(2, 2)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        yield prefix, self


class OwnHash(nn.Linear):
    """Hashed its own (valid) way: torch's walk puts it in a set, which calls this."""

    def __hash__(self) -> int:
        return 7


class Unhashable(nn.Linear):
    """Compares by value and so has no hash: torch's walk cannot put it in its set."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unhashable) and other.in_features == self.in_features

    __hash__ = None  # type: ignore[assignment]


def test_a_submodule_walked_its_own_way_is_walked_its_way() -> None:
    layer = Block()
    layer.mlp[1] = Hiding()
    layer.experts[0] = OwnHash(8, 8)
    other = Block()
    other.attn.k = OwnHash(8, 8, bias=False)
    layers = [layer, other, Hiding()]
    for item in layers:
        assert not isinstance(_named_parameters(item), list)
    spec = assert_described_as_reference(layers)
    names = [p.name for p in spec.layers[0].params]
    assert "mlp.1.seen" in names and "mlp.1.hidden.weight" not in names
    assert "experts.0.weight" in names and "experts.0.bias" in names
    assert [p.name for p in spec.layers[2].params] == ["seen"]


def test_a_submodule_without_a_hash_fails_as_in_torch() -> None:
    layer = Block()
    layer.mlp[1] = Unhashable(2, 2)
    with pytest.raises(TypeError, match="unhashable") as torch_error:
        list(layer.named_parameters(remove_duplicate=False))
    with pytest.raises(TypeError) as ours:
        describe_layers([layer])
    assert str(ours.value) == str(torch_error.value)


# Random nested layers: trees of modules whose parameters are new tensors (meta or host),
# views of one storage, None, or a parameter or module already in the model (a tie).

_SHAPES = st.sampled_from([(3,), (2, 3), (0, 2), ()])


@st.composite
def nested_models(draw: st.DrawFn) -> list[nn.Module]:
    seen_params: list[nn.Parameter] = []
    seen_modules: list[nn.Module] = []
    base = torch.zeros(4, 6)

    def parameter() -> nn.Parameter | None:
        choice = draw(st.sampled_from(["new", "meta", "view", "none", "tie"]))
        if choice == "none":
            return None
        if choice == "tie" and seen_params:
            return draw(st.sampled_from(seen_params))
        if choice == "view":
            row = draw(st.integers(0, 3))
            tensor = base[row, 1:] if draw(st.booleans()) else base[:, row]
        else:
            tensor = torch.zeros(draw(_SHAPES), device="meta" if choice == "meta" else "cpu")
        param = nn.Parameter(tensor)
        seen_params.append(param)
        return param

    def module(depth: int) -> nn.Module:
        if depth > 0 and seen_modules and draw(st.integers(0, 5)) == 0:
            return draw(st.sampled_from(seen_modules))
        mod = nn.Module()
        for i in range(draw(st.integers(0, 2))):
            mod.register_parameter(f"p{i}", parameter())
        if draw(st.booleans()):
            mod.register_buffer("buf", torch.zeros(2))
        for i in range(draw(st.integers(0, 3)) if depth < 3 else 0):
            child = None if draw(st.integers(0, 6)) == 0 else module(depth + 1)
            mod.register_module(f"m{i}", child)
        seen_modules.append(mod)
        return mod

    return [module(0) for _ in range(draw(st.integers(1, 3)))]


def view_identity(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two tensors the same view (tied), from torch's own metadata: None for a
    host tensor without memory, whose identity cannot be told."""
    storage = tensor.untyped_storage()
    if tensor.is_meta:
        where: tuple[object, ...] = ("meta", storage._cdata)
    elif storage.data_ptr() == 0:
        return None
    else:
        where = (str(tensor.device), storage.data_ptr())
    return (*where, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


@given(nested_models())
def test_random_nested_layers_are_described_as_named_parameters_lists_them(layers: list[nn.Module]) -> None:
    spec = assert_described_as_reference(layers)
    described = [(p, tensor) for layer, layer_spec in zip(layers, spec.layers, strict=True)
                 for p, (_, tensor) in zip(layer_spec.params, layer.named_parameters(remove_duplicate=False),
                                           strict=True)]
    for p, a in described:
        assert (p.storage_key is None) == (view_identity(a) is None)
        for q, b in described:
            if p.storage_key is not None and q.storage_key is not None:
                assert (p.storage_key == q.storage_key) == (view_identity(a) == view_identity(b))
