"""`ExpertGroup`s of a ``ModuleList`` of experts (`Routing.CALLS`): the model's layers must
hold every expert's parameters under ``module.j.``, alike, and their bytes must be E x B;
anything else is refused naming what does not match."""

from __future__ import annotations

import pytest

from offload.errors import PlanError
from offload.pure import LayerSpec, ModelSpec, ParamSpec
from offload.pure.spec.experts import ExpertGroup, Routing
from offload.pure.spec.values import contiguous_stride


def _param(name: str, shape: tuple[int, ...], dtype: str = "float32") -> ParamSpec:
    return ParamSpec(name=name, shape=shape, stride=contiguous_stride(shape), dtype=dtype,
                     itemsize=2 if dtype == "bfloat16" else 4)


def _layer(shapes: list[tuple[int, int]], dtypes: tuple[str, ...] = ()) -> LayerSpec:
    params = [_param("gate.weight", (len(shapes), 4))]
    for j, (rows, cols) in enumerate(shapes):
        dtype = dtypes[j] if dtypes else "float32"
        params += [_param(f"moe.{j}.up.weight", (rows, cols), dtype), _param(f"moe.{j}.down.weight", (cols, rows),
                                                                           dtype)]
    return LayerSpec(index=0, name="layers.0", params=tuple(params))


def _group(experts: int, expert_bytes: int, names: tuple[str, ...] | None = None) -> ExpertGroup:
    params = names or tuple(f"moe.{j}.{w}.weight" for j in range(experts) for w in ("up", "down"))
    return ExpertGroup(layer=0, module="moe", num_experts=experts, params=params, expert_bytes=expert_bytes,
                       routing=Routing.CALLS)


def test_a_list_of_experts_alike_is_accepted() -> None:
    spec = ModelSpec(layers=(_layer([(3, 4)] * 3),), experts=(_group(3, 2 * 12 * 4),))
    group = spec.experts[0]
    assert not group.fused and group.kinds == 2
    assert group.expert_params(2) == ("moe.2.up.weight", "moe.2.down.weight")


@pytest.mark.parametrize(("layer", "group", "match"), [
    (_layer([(3, 4), (3, 5), (3, 4)]), _group(3, 96), "expert 1's parameters"),
    (_layer([(3, 4)] * 3, ("float32", "float32", "bfloat16")), _group(3, 96), "expert 2's parameters"),
    (_layer([(3, 4)] * 3), _group(3, 95), "not 3 x 95"),
    (_layer([(3, 4)] * 3), _group(3, 96, ("moe.0.up.weight", "moe.0.down.weight", "moe.1.up.weight",
                                          "moe.1.down.weight", "moe.2.up.weight")), "same number for each of 3"),
    (_layer([(3, 4)] * 3), _group(3, 96, ("moe.0.up.weight", "moe.0.down.weight", "moe.2.up.weight",
                                          "moe.2.down.weight", "moe.1.up.weight", "moe.1.down.weight")),
     "expert 1 has no parameter 'moe.2.up.weight'"),
])
def test_a_list_that_does_not_match_its_layer_is_refused(layer: LayerSpec, group: ExpertGroup,
                                                          match: str) -> None:
    with pytest.raises(PlanError, match=match):
        ModelSpec(layers=(layer,), experts=(group,))


@pytest.mark.parametrize(("top_k", "match"), [(0, "integer >= 1, got 0"), (True, "got True"), (2.0, "got 2.0"),
                                              (4, "top_k 4 is above its 3 experts")])
def test_a_top_k_outside_one_to_the_expert_count_is_refused_naming_it(top_k: object, match: str) -> None:
    with pytest.raises(PlanError, match=match) as caught:
        ExpertGroup(layer=0, module="moe", num_experts=3, params=("moe.w",), expert_bytes=4, routing=Routing.INDICES,
                    top_k=top_k)  # type: ignore[arg-type]  # deliberately wrong
    assert caught.value.name == "top_k"


@pytest.mark.parametrize("top_k", [None, 1, 3])
def test_a_top_k_from_one_to_the_expert_count_or_none_is_kept(top_k: int | None) -> None:
    group = ExpertGroup(layer=0, module="moe", num_experts=3, params=("moe.w",), expert_bytes=4,
                        routing=Routing.INDICES, top_k=top_k)
    assert group.top_k == top_k
