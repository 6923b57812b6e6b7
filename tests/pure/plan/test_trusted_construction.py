"""Values built without their validators (the trusted builders) are the values
the classes build: equal, hashing alike, the same repr and JSON, the same derived sizes;
and what users give is still checked at the boundary, naming the bad value."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError, PlanError
from offload.pure import (
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamPlan,
    ParamSpec,
    Placement,
    Platform,
    make_plan,
)
from offload.pure._slots import slot_setters
from offload.pure.decide.selection import tied_storages
from offload.pure.plan._rules import check_plan
from offload.pure.plan.layout import layer_buffers, prefetch_buffers
from offload.pure.plan.plan import BufferPlan, trusted_param_plan
from offload.pure.serialize import from_data, to_data
from offload.pure.spec.values import (
    param_sizes,
    trusted_layer_spec,
    trusted_model_spec,
    trusted_param_spec,
)
from tests.pure.strategies import env_snapshots, model_specs, offload_configs, param_specs

GPU = EnvSnapshot(platform=Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=1 << 30,
                                    can_map_host_memory=True))


def spanned(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """The span as `ParamSpec.nbytes` was first written: the last element's offset + 1."""
    if any(size == 0 for size in shape):
        return 0
    return (sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) + 1) * itemsize


def trusted_copy(p: ParamSpec) -> ParamSpec:
    return trusted_param_spec(p.name, p.shape, p.stride, p.dtype, p.itemsize, p.storage_key, p.device,
                              *param_sizes(p.shape, p.stride, p.itemsize))


def assert_same(trusted: object, validated: object) -> None:
    """Equal both ways, hash alike, print alike, serialise alike and read back equal."""
    assert type(trusted) is type(validated)
    assert trusted == validated
    assert validated == trusted
    assert hash(trusted) == hash(validated)
    assert repr(trusted) == repr(validated)
    assert to_data(trusted) == to_data(validated)
    assert from_data(type(validated), json.loads(json.dumps(to_data(trusted)))) == validated


# ---------------------------------------------------------------------------- ParamSpec

_KEYS = st.one_of(st.none(), st.text(min_size=1, max_size=12))


@settings(max_examples=200)
@given(param_specs(), _KEYS)
def test_trusted_param_spec_is_the_validated_one(p: ParamSpec, key: str | None) -> None:
    p = attrs.evolve(p, storage_key=key)
    q = trusted_copy(p)
    assert_same(q, p)
    assert (q.buffer_key, q.numel, q.nbytes) == (p.buffer_key, p.numel, p.nbytes)
    assert q.nbytes == spanned(p.shape, p.stride, p.itemsize)
    assert q.buffer_key == (p.name, p.shape, p.stride, p.dtype)


@settings(max_examples=100)
@given(param_specs())
def test_derived_sizes_are_the_same_filled_or_computed_late(p: ParamSpec) -> None:
    # Unpickling restores the fields alone: the derived slots are empty, and the cached
    # properties compute them on first read, as the constructors would have.
    back = pickle.loads(pickle.dumps(p))
    with pytest.raises(AttributeError):
        ParamSpec.__dict__["nbytes"].__get__(back, ParamSpec)
    assert back == p
    assert (back.nbytes, back.numel, back.buffer_key) == (p.nbytes, p.numel, p.buffer_key)
    assert p.nbytes == spanned(p.shape, p.stride, p.itemsize)


def test_constructors_fill_the_derived_sizes() -> None:
    p = ParamSpec(name="w", shape=(4, 6), stride=(10, 1), dtype="float32", itemsize=4)
    q = trusted_copy(p)
    for spec in (p, q):  # read off the slots, without the properties' fallback
        assert ParamSpec.__dict__["nbytes"].__get__(spec, ParamSpec) == (3 * 10 + 5 + 1) * 4
        assert ParamSpec.__dict__["numel"].__get__(spec, ParamSpec) == 24
        assert ParamSpec.__dict__["buffer_key"].__get__(spec, ParamSpec) == ("w", (4, 6), (10, 1), "float32")


@pytest.mark.parametrize(
    ("shape", "stride", "itemsize"),
    [((), (), 4), ((0, 3), (3, 1), 2), ((3, 0), (1, 3), 2), ((1000, 16), (0, 1), 4), ((4, 3), (5, 1), 2)],
)
def test_param_sizes_table(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> None:
    numel, nbytes = param_sizes(shape, stride, itemsize)
    expected_numel = 1
    for size in shape:
        expected_numel *= size
    assert (numel, nbytes) == (expected_numel, spanned(shape, stride, itemsize))


# ---------------------------------------------------------------------------- LayerSpec, ModelSpec


@settings(max_examples=100)
@given(model_specs(max_layers=6))
def test_trusted_layer_and_model_specs_are_the_validated_ones(spec: ModelSpec) -> None:
    layers = tuple(
        trusted_layer_spec(layer.index, layer.name, tuple(trusted_copy(p) for p in layer.params))
        for layer in spec.layers
    )
    for trusted, validated in zip(layers, spec.layers, strict=True):
        assert_same(trusted, validated)
        assert trusted.nbytes == validated.nbytes
    model = trusted_model_spec(layers)
    assert_same(model, spec)
    assert (model.nbytes, model.num_params) == (spec.nbytes, spec.num_params)
    # A plan of either is the same plan.
    assert make_plan(model, OffloadConfig(uva_max_bytes=1 << 40), GPU) == make_plan(
        spec, OffloadConfig(uva_max_bytes=1 << 40), GPU)


# ---------------------------------------------------------------------------- plans

_PLAN_INPUTS = (model_specs(max_layers=7, max_params=4), offload_configs(), env_snapshots())


@settings(max_examples=80, deadline=None)
@given(*_PLAN_INPUTS)
def test_made_plans_pass_every_check_of_the_constructor(spec: ModelSpec, config: OffloadConfig,
                                                          env: EnvSnapshot) -> None:
    plan = make_plan(spec, config, env)
    check_plan(plan)
    rebuilt = attrs.evolve(plan)  # through OffloadPlan.__init__: every validator and rule
    assert_same(plan, rebuilt)
    assert plan.to_json() == rebuilt.to_json()
    assert OffloadPlan.from_json(plan.to_json()) == plan
    for p in plan.params:
        validated = ParamPlan(layer=p.layer, param=p.param, placement=p.placement, slot=p.slot, tied_to=p.tied_to)
        assert_same(p, validated)
        assert_same(trusted_param_plan(p.layer, p.param, p.placement, p.slot, p.tied_to), validated)


@settings(max_examples=80, deadline=None)
@given(model_specs(min_layers=1, max_layers=9, max_params=4), offload_configs(), env_snapshots())
def test_the_planner_and_revise_lay_buffers_out_alike(spec: ModelSpec, config: OffloadConfig,
                                                       env: EnvSnapshot) -> None:
    config = attrs.evolve(config, backend="prefetch", group_size=max(config.group_size, config.num_in_group))
    plan = make_plan(spec, config, env)
    assert prefetch_buffers(plan.params) == plan.buffers


def naive_buffers(layers: Sequence[tuple[tuple[ParamSpec, ...], int]]) -> tuple[BufferPlan, ...]:
    """One parameter at a time, in order: the layout `layer_buffers` must give."""
    slots: dict[object, set[int]] = {}
    first: dict[object, ParamSpec] = {}
    for specs, slot in layers:
        for p in specs:
            slots.setdefault(p.buffer_key, set()).add(slot)
            first.setdefault(p.buffer_key, p)
    return tuple(BufferPlan(name=p.name, shape=p.shape, stride=p.stride, dtype=p.dtype, itemsize=p.itemsize,
                            slot_bytes=p.nbytes, slots=tuple(sorted(slots[k]))) for k, p in first.items())


def _p(name: str, n: int = 4) -> ParamSpec:
    return ParamSpec(name=name, shape=(n,), stride=(1,), dtype="float32", itemsize=4)


@pytest.mark.parametrize(
    "pattern",
    [
        ["ab", "ab", "ab", "ab"],  # one pattern
        ["ab", "ba", "ab", "b"],  # alternating orders and a subset
        ["a", "bc", "ab", "cd", "a"],  # keys spread over patterns, first seen late
        ["abc", "", "abc"],  # a layer owning no buffer
    ],
)
def test_layer_buffers_keep_first_use_order_and_every_slot(pattern: list[str]) -> None:
    layers = [(tuple(_p(c) for c in names), i % 3) for i, names in enumerate(pattern)]
    assert layer_buffers(layers) == naive_buffers(layers)
    assert [b.name for b in layer_buffers(layers)] == list(dict.fromkeys("".join(pattern)))


def test_layer_buffers_tell_keys_apart_by_shape_not_only_name() -> None:
    layers = [((_p("a", 4), _p("b")), 0), ((_p("a", 8), _p("b")), 1)]
    buffers = layer_buffers(layers)
    assert buffers == naive_buffers(layers)
    assert [(b.name, b.shape, b.slots) for b in buffers] == [("a", (4,), (0,)), ("b", (4,), (0, 1)),
                                                             ("a", (8,), (1,))]


@settings(max_examples=100)
@given(model_specs(max_layers=8))
def test_tied_storages_are_the_keys_shared_by_several_parameters(spec: ModelSpec) -> None:
    by_key: dict[str, list[tuple[int, ParamSpec]]] = {}
    for layer in spec.layers:
        for p in layer.params:
            if p.storage_key is not None:
                by_key.setdefault(p.storage_key, []).append((layer.index, p))
    assert tied_storages(spec) == tuple(tuple(m) for m in by_key.values() if len(m) > 1)


# ---------------------------------------------------------------------------- the builders


def test_slot_setters_refuse_a_builder_that_would_miss_a_field() -> None:
    with pytest.raises(TypeError, match="tied_to"):
        slot_setters(ParamPlan, ("layer", "param", "placement", "slot"))
    with pytest.raises(TypeError, match="fields are"):
        slot_setters(ParamPlan, ("param", "layer", "placement", "slot", "tied_to"))
    with pytest.raises(TypeError, match="not a slot"):
        slot_setters(ParamPlan, ("layer", "param", "placement", "slot", "tied_to"), derived=("name",))
    assert len(slot_setters(ParamSpec, tuple(f.name for f in attrs.fields(ParamSpec)),
                            derived=("buffer_key", "numel", "nbytes"))) == 10


# ---------------------------------------------------------------------------- the boundary still checks

_GOOD: dict[str, Any] = {"name": "w", "shape": (2,), "stride": (1,), "dtype": "float32", "itemsize": 4}


@pytest.mark.parametrize(
    ("changes", "value"),
    [
        ({"shape": (-1,)}, (-1,)),
        ({"stride": (2, 1)}, ((2,), (2, 1))),
        ({"dtype": "bfloat16", "itemsize": 4}, 4),
        ({"name": ""}, ""),
        ({"storage_key": ""}, ""),
        ({"itemsize": True}, True),
    ],
)
def test_a_param_spec_by_hand_is_checked_naming_the_value(changes: dict[str, Any], value: object) -> None:
    with pytest.raises(PlanError) as caught:
        ParamSpec(**{**_GOOD, **changes})
    assert caught.value.value == value


def test_layer_and_model_specs_by_hand_are_checked() -> None:
    w = ParamSpec(**_GOOD)
    with pytest.raises(PlanError) as caught:
        LayerSpec(index=0, name="l", params=(w, w))
    assert caught.value.name == "w"
    with pytest.raises(PlanError) as caught:
        ModelSpec(layers=(LayerSpec(index=1, name="l", params=(w,)),))
    assert caught.value.value == 1


def test_a_plan_entry_by_hand_is_checked_naming_the_value() -> None:
    w = ParamSpec(**_GOOD)
    with pytest.raises(PlanError) as caught:
        ParamPlan(layer=0, param=w, placement=Placement.RESIDENT, slot=2)
    assert caught.value.value == 2
    with pytest.raises(PlanError) as caught:
        ParamPlan(layer=-1, param=w, placement=Placement.RESIDENT)
    assert caught.value.value == (-1, None, None)


def _spec() -> ModelSpec:
    w = ParamSpec(**_GOOD)
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=str(i), params=(w,)) for i in range(4)))


def test_a_plan_changed_by_hand_is_checked_though_make_plan_skips_the_checks() -> None:
    plan = make_plan(_spec(), OffloadConfig(group_size=2, prefetch_step=1), GPU)
    with pytest.raises(PlanError) as caught:
        attrs.evolve(plan, num_layers=1)
    assert caught.value.name == "offloaded_layers[0]"
    assert caught.value.value == 1


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("params", 0, "layer"), -3, (-3, None, None)),
        (("params", 0, "param", "shape"), [-4], (-4,)),
        (("params", 1, "slot"), 7, 7),
        (("num_layers", ), 1, 1),
    ],
)
def test_a_plan_read_from_json_is_checked_naming_the_value(path: tuple[Any, ...], value: object,
                                                           expected: object) -> None:
    plan = make_plan(_spec(), OffloadConfig(group_size=2, prefetch_step=1), GPU)
    document = json.loads(plan.to_json())
    node = document["plan"]
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(json.dumps(document))
    assert caught.value.value == expected


def test_a_config_is_checked_naming_the_value() -> None:
    with pytest.raises(ConfigError) as caught:
        OffloadConfig(group_size=-1)
    assert (caught.value.name, caught.value.value) == ("group_size", -1)
