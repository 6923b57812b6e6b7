"""The models of `benchmarks/bench_plan.py`: the nested one holds the flat one's parameters,
one per sub-module, so the two describe_layers rows differ only in the modules walked. No
timing assertions."""

from __future__ import annotations

from benchmarks.bench_plan import PARAMS_PER_LAYER, big_layers, nested_layers
from offload.model.describe import describe_layers


def test_the_nested_layers_hold_the_flat_layers_parameters_one_per_submodule() -> None:
    flat, nested = big_layers(2), nested_layers(2)
    assert [sum(1 for _ in layer.modules()) for layer in flat] == [5, 5]
    assert [sum(1 for _ in layer.modules()) for layer in nested] == [PARAMS_PER_LAYER + 1] * 2
    for layer in nested:
        for _, child in layer.named_children():
            assert [name for name, _ in child.named_parameters()] == ["weight"]
            assert list(child.children()) == []
    flat_spec, nested_spec = describe_layers(flat), describe_layers(nested)
    assert nested_spec.num_params == flat_spec.num_params == 2 * PARAMS_PER_LAYER
    assert nested_spec.nbytes == flat_spec.nbytes == 2 * (16 * 1024 * 1024 + 4 * 1024) * 2
    for flat_layer, nested_layer in zip(flat_spec.layers, nested_spec.layers, strict=True):
        assert ([(p.shape, p.stride, p.dtype, p.device) for p in nested_layer.params]
                == [(p.shape, p.stride, p.dtype, p.device) for p in flat_layer.params])
    assert [p.name for p in nested_spec.layers[0].params[:3]] == ["norm0.weight", "proj1.weight", "proj2.weight"]
