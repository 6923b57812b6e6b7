"""`OffloadPlan.from_json` against hand-edited and hostile documents.

A plan read from a file is run by executors that index layers, schedule positions, buffer
keys and tie targets by what the plan says, so every such index must be checked when the
plan is built. And no document, however malformed, may get anything but a `PlanError`
out of the reader (no RecursionError, ValueError, OverflowError, TypeError, ...).

The tamper tables edit documents written by `make_plan`; the properties feed arbitrary
JSON values, mutated plan data and mutated plan text, and check what comes back against
an oracle written here from the plan's documented rules, not from the code under test.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.errors import PlanError
from offload.pure import (
    EnvSnapshot,
    LayerSpec,
    ModelSpec,
    OffloadConfig,
    OffloadPlan,
    ParamSpec,
    Placement,
    Platform,
    make_plan,
)
from offload.pure.serialize import MAX_JSON_DEPTH, from_data, parse_json
from tests.pure.strategies import env_snapshots, model_specs, offload_configs

FORMAT = "offload-plan/1"  # as the design spells it
GPU = EnvSnapshot(platform=Platform(has_cuda=True, device_name="Test GPU", device_total_bytes=1 << 30,
                                    can_map_host_memory=True, can_register_host_memory=True,
                                    host_pointer_for_registered_memory=True))

Document = dict[str, Any]
Tamper = Callable[[Document], None]


def _param(name: str, *, key: str | None = None, elements: int = 16) -> ParamSpec:
    return ParamSpec(name=name, shape=(elements,), stride=(1,), dtype="float16", itemsize=2, storage_key=key)


def _model(*layers: list[ParamSpec]) -> ModelSpec:
    return ModelSpec(layers=tuple(LayerSpec(index=i, name=f"layers.{i}", params=tuple(ps))
                                  for i, ps in enumerate(layers)))


def _document(spec: ModelSpec, config: OffloadConfig) -> Document:
    document = json.loads(make_plan(spec, config, GPU).to_json())
    assert isinstance(document, dict)
    return document


def prefetch_document() -> Document:
    """6 layers of (a.weight, b.weight); layers 1, 3, 5 prefetched into slots 0, 1, 0."""
    document = _document(_model(*([_param("a.weight"), _param("b.weight")] for _ in range(6))),
                         OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2))
    plan = document["plan"]
    assert plan["offloaded_layers"] == [1, 3, 5]
    assert [p["slot"] for p in plan["params"][2::4]] == [0, 1, 0]
    return document


def prefetch_tied_document() -> Document:
    """4 layers of (a.weight, b.weight) sharing one storage per layer; layers 1 and 3
    prefetched, b tied to a in its own layer."""
    document = _document(_model(*([_param("a.weight", key=f"k{i}"), _param("b.weight", key=f"k{i}")]
                                  for i in range(4))),
                         OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2))
    params = document["plan"]["params"]
    assert params[3]["tied_to"] == [1, "a.weight"] and params[3]["placement"] == "prefetch"
    return document


def uva_document() -> Document:
    """6 layers; embed (layer 0), mid (layer 2) and head (layer 5) share one storage."""
    layers: list[list[ParamSpec]] = [[_param("w")] for _ in range(6)]
    layers[0].append(_param("embed.weight", key="E"))
    layers[2].append(_param("mid.weight", key="E"))
    layers[5].append(_param("head.weight", key="E"))
    document = _document(_model(*layers), OffloadConfig(backend="uva", uva_max_bytes=1 << 20))
    params = document["plan"]["params"]
    assert all(p["placement"] == "uva" for p in params)
    assert [p["tied_to"] for p in params if p["param"]["storage_key"] == "E"] == [
        None, [0, "embed.weight"], [0, "embed.weight"]]
    return document


def prefetch_partial_document() -> Document:
    """4 layers; layers 1 and 3 prefetched into slots 0 and 1; only layer 1 has b.weight,
    so b's buffer has slot 0 alone."""
    document = _document(_model([_param("a.weight")], [_param("a.weight"), _param("b.weight")],
                                [_param("a.weight")], [_param("a.weight")]),
                         OffloadConfig(group_size=2, num_in_group=1, prefetch_step=2))
    assert [b["slots"] for b in document["plan"]["buffers"]] == [[0, 1], [0]]
    return document


def none_document() -> Document:
    return _document(_model(*([_param("w")] for _ in range(4))), OffloadConfig())


def _read(document: Document) -> OffloadPlan:
    return OffloadPlan.from_json(json.dumps(document))


def _params(document: Document) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = document["plan"]["params"]
    return params


def _index(document: Document, layer: int, name: str) -> int:
    (found,) = [i for i, p in enumerate(_params(document)) if p["layer"] == layer and p["param"]["name"] == name]
    return found


def _make_resident(document: Document, *indices: int) -> None:
    for i in indices:
        _params(document)[i].update(placement="resident", slot=None)


def _add_buffer_bytes(document: Document, nbytes: int) -> None:
    document["plan"]["device_bytes_buffers"] += nbytes


# ---------------------------------------------------------------- tampers and what they name


def _layer_past_the_model(document: Document) -> None:
    # A plan edited by hand: an offloaded parameter of a layer past the model, not the last entry.
    _params(document)[2]["layer"] = 99


def _layer_equal_to_num_layers(document: Document) -> None:
    _params(document)[1]["layer"] = document["plan"]["num_layers"]


def _offloaded_layer_past_the_model_with_its_params(document: Document) -> None:
    document["plan"]["offloaded_layers"][1] = 9
    for i in (6, 7):
        _params(document)[i]["layer"] = 9


def _offloaded_layer_past_the_model_without_params(document: Document) -> None:
    _make_resident(document, 10, 11)
    document["plan"]["offloaded_layers"][2] = 9


def _offloaded_layers_out_of_order(document: Document) -> None:
    document["plan"]["offloaded_layers"] = [1, 5, 3]
    for i in (6, 7):
        _params(document)[i]["slot"] = 0
    for i in (10, 11):
        _params(document)[i]["slot"] = 1


def _offloaded_layer_repeated(document: Document) -> None:
    _make_resident(document, 10, 11)
    document["plan"]["offloaded_layers"] = [1, 3, 3]
    for i in (6, 7):
        _params(document)[i]["slot"] = 0


def _offloaded_layer_without_prefetch_params(document: Document) -> None:
    _make_resident(document, 10, 11)


def _params_out_of_layer_order(document: Document) -> None:
    params = _params(document)
    params[2], params[4] = params[4], params[2]


def _param_listed_twice(document: Document) -> None:
    params = _params(document)
    params[1] = copy.deepcopy(params[0])


def _buffer_listed_twice(document: Document) -> None:
    buffers = document["plan"]["buffers"]
    buffers.append(copy.deepcopy(buffers[0]))
    _add_buffer_bytes(document, buffers[0]["slot_bytes"] * len(buffers[0]["slots"]))


def _buffer_slot_listed_twice(document: Document) -> None:
    buffer = document["plan"]["buffers"][0]
    buffer["slots"] = [0, 0, 1]
    _add_buffer_bytes(document, buffer["slot_bytes"])


def _buffer_slot_outside_the_schedule(document: Document) -> None:
    buffer = document["plan"]["buffers"][0]
    buffer["slots"] = [0, 1, 2]
    _add_buffer_bytes(document, buffer["slot_bytes"])


def _buffer_no_parameter_uses(document: Document) -> None:
    buffers = document["plan"]["buffers"]
    extra = dict(copy.deepcopy(buffers[0]), name="c.weight")
    buffers.append(extra)
    _add_buffer_bytes(document, extra["slot_bytes"] * len(extra["slots"]))


def _buffer_slot_no_parameter_uses(document: Document) -> None:
    buffer = document["plan"]["buffers"][1]
    buffer["slots"] = [0, 1]
    _add_buffer_bytes(document, buffer["slot_bytes"])


def _buffer_slot_bytes_wrong(document: Document) -> None:
    buffer = document["plan"]["buffers"][0]
    _add_buffer_bytes(document, (1 - buffer["slot_bytes"]) * len(buffer["slots"]))
    buffer["slot_bytes"] = 1


def _uva_placement_in_a_prefetch_plan(document: Document) -> None:
    _params(document)[6].update(placement="uva", slot=None)


def _on_demand_placement_in_a_none_plan(document: Document) -> None:
    _params(document)[1]["placement"] = "on_demand"


def _prefetch_placement_in_a_uva_plan(document: Document) -> None:
    # Its layer is in offloaded_layers and its slot agrees, so only the backend says no.
    document["plan"]["offloaded_layers"] = [0]
    document["plan"]["schedule"] = {"num_slots": 1, "initial": [0], "slots": [0], "next_after": [0]}
    _params(document)[0].update(placement="prefetch", slot=0)


def _tied_to_a_missing_parameter(document: Document) -> None:
    _params(document)[3]["tied_to"] = [1, "nope.weight"]


def _tied_to_itself(document: Document) -> None:
    _params(document)[3]["tied_to"] = [1, "b.weight"]


def _tied_to_a_layer_past_the_model(document: Document) -> None:
    _params(document)[3]["tied_to"] = [99, "a.weight"]


def _tied_forward(document: Document) -> None:
    params = _params(document)
    embed, head = _index(document, 0, "embed.weight"), _index(document, 5, "head.weight")
    params[embed]["tied_to"] = [5, "head.weight"]
    params[head]["tied_to"] = None


def _tied_in_a_chain(document: Document) -> None:
    _params(document)[_index(document, 5, "head.weight")]["tied_to"] = [2, "mid.weight"]


def _tied_across_storages(document: Document) -> None:
    _params(document)[_index(document, 5, "head.weight")]["param"]["storage_key"] = "F"


def _tied_without_a_storage(document: Document) -> None:
    _params(document)[_index(document, 5, "head.weight")]["param"]["storage_key"] = None


def _tied_to_a_resident_parameter(document: Document) -> None:
    _params(document)[_index(document, 0, "embed.weight")]["placement"] = "resident"


# (id, document, tamper, the error's name, the error's value)
TAMPERS: list[tuple[str, Callable[[], Document], Tamper, str, object]] = [
    ("uva: a middle parameter's layer past the model", uva_document, _layer_past_the_model,
     "params[2].layer", 99),
    ("prefetch: a middle parameter's layer past the model", prefetch_document, _layer_past_the_model,
     "params[2].layer", 99),
    ("none: a parameter's layer equal to num_layers", none_document, _layer_equal_to_num_layers,
     "params[1].layer", 4),
    ("offloaded layer past the model, with its parameters", prefetch_document,
     _offloaded_layer_past_the_model_with_its_params, "offloaded_layers[1]", 9),
    ("offloaded layer past the model, no parameters there", prefetch_document,
     _offloaded_layer_past_the_model_without_params, "offloaded_layers[2]", 9),
    ("offloaded layers out of order", prefetch_document, _offloaded_layers_out_of_order,
     "offloaded_layers[2]", 3),
    ("an offloaded layer repeated", prefetch_document, _offloaded_layer_repeated, "offloaded_layers[2]", 3),
    ("an offloaded layer without a prefetch parameter", prefetch_document,
     _offloaded_layer_without_prefetch_params, "offloaded_layers[2]", 5),
    ("parameters out of layer order", prefetch_document, _params_out_of_layer_order, "params[3].layer", 1),
    ("a parameter listed twice", prefetch_document, _param_listed_twice, "params[1]", (0, "a.weight")),
    ("a buffer listed twice", prefetch_document, _buffer_listed_twice, "buffers[2]",
     ("a.weight", (16,), (1,), "float16")),
    ("a buffer slot listed twice", prefetch_document, _buffer_slot_listed_twice, "buffers[0].slots", (0, 0, 1)),
    ("a buffer slot outside the schedule", prefetch_document, _buffer_slot_outside_the_schedule,
     "buffers[0].slots", (0, 1, 2)),
    ("a buffer no parameter uses", prefetch_document, _buffer_no_parameter_uses, "buffers[2]",
     ("c.weight", (16,), (1,), "float16")),
    ("a buffer slot no parameter uses", prefetch_partial_document, _buffer_slot_no_parameter_uses,
     "buffers[1].slots", (0, 1)),
    ("a buffer's slot bytes disagree with its parameters", prefetch_document, _buffer_slot_bytes_wrong,
     "buffers[0].slot_bytes", 1),
    ("uva placement in a prefetch plan", prefetch_document, _uva_placement_in_a_prefetch_plan,
     "params[6].placement", "uva"),
    ("on-demand placement in a none plan", none_document, _on_demand_placement_in_a_none_plan,
     "params[1].placement", "on_demand"),
    ("prefetch placement in a uva plan", uva_document, _prefetch_placement_in_a_uva_plan,
     "params[0].placement", "prefetch"),
    ("tied to a parameter not in the plan", prefetch_tied_document, _tied_to_a_missing_parameter,
     "params[3].tied_to", (1, "nope.weight")),
    ("tied to itself", prefetch_tied_document, _tied_to_itself, "params[3].tied_to", (1, "b.weight")),
    ("tied to a layer past the model", prefetch_tied_document, _tied_to_a_layer_past_the_model,
     "params[3].tied_to", (99, "a.weight")),
    ("tied to a later parameter", uva_document, _tied_forward, "params[1].tied_to", (5, "head.weight")),
    ("tied to a parameter that is itself tied", uva_document, _tied_in_a_chain,
     "params[8].tied_to", (2, "mid.weight")),
    ("tied across storage keys", uva_document, _tied_across_storages, "params[8].tied_to", (0, "embed.weight")),
    ("tied without a storage key", uva_document, _tied_without_a_storage, "params[8].tied_to",
     (0, "embed.weight")),
    ("offloaded and tied to a resident parameter", uva_document, _tied_to_a_resident_parameter,
     "params[4].tied_to", (0, "embed.weight")),
]


@pytest.mark.parametrize(("make", "tamper", "name", "value"), [t[1:] for t in TAMPERS], ids=[t[0] for t in TAMPERS])
def test_from_json_refuses_a_plan_executors_would_misindex(
    make: Callable[[], Document], tamper: Tamper, name: str, value: object
) -> None:
    document = make()
    assert_sound(_read(document))  # the untouched document is a plan
    tamper(document)
    with pytest.raises(PlanError) as caught:
        _read(document)
    assert caught.value.name == name, str(caught.value)
    assert caught.value.value == value, str(caught.value)
    assert name.split(".")[0].split("[")[0] in str(caught.value)
    assert str(value if not isinstance(value, tuple) else value[-1]) in str(caught.value)


def test_the_tamper_documents_keep_their_layout() -> None:
    # The tampers index by position; these are the positions they mean.
    uva = _params(uva_document())
    assert [(p["layer"], p["param"]["name"]) for p in uva[:2]] == [(0, "w"), (0, "embed.weight")]
    assert _index(uva_document(), 5, "head.weight") == 8
    assert _index(uva_document(), 2, "mid.weight") == 4
    assert [p["layer"] for p in _params(prefetch_document())] == [i // 2 for i in range(12)]


def test_direct_construction_refuses_a_parameter_past_the_model_too() -> None:
    plan = make_plan(_model(*([_param("w")] for _ in range(3))), OffloadConfig(backend="uva", uva_max_bytes=1 << 20),
                     GPU)
    moved = (attrs.evolve(plan.params[0], layer=7), *plan.params[1:])
    with pytest.raises(PlanError) as caught:
        attrs.evolve(plan, params=moved)
    assert (caught.value.name, caught.value.value) == ("params[0].layer", 7)


# ---------------------------------------------------------------- hostile documents


def _with_plan(raw_plan: str) -> str:
    return '{"format": "%s", "plan": %s}' % (FORMAT, raw_plan)  # noqa: UP031  # JSON braces


HOSTILE: list[tuple[str, str]] = [
    ("nested a million deep", "[" * 1_000_000 + "]" * 1_000_000),
    ("nested objects deep", '{"a":' * 100_000 + "1" + "}" * 100_000),
    ("nested deep inside the plan", _with_plan('{"config": ' + "[" * 5000 + "]" * 5000 + "}")),
    ("unclosed deep nesting", "[" * 50_000),
    ("a 5000-digit integer", _with_plan('{"num_layers": 1' + "0" * 5000 + "}")),
    ("a 5000-digit negative integer", _with_plan('{"num_layers": -1' + "0" * 5000 + "}")),
    ("NaN", _with_plan('{"num_layers": NaN}')),
    ("Infinity", _with_plan('{"num_layers": Infinity}')),
    ("-Infinity", _with_plan('{"num_layers": -Infinity}')),
    ("a float that overflows", _with_plan('{"num_layers": 1e999}')),
    ("NaN as the document", "NaN"),
    ("a lone surrogate", '"\\ud800"'),
    ("a control character in a string", '{"format": "offload-plan/1\x01"}'),
    ("a duplicate key at the top", '{"format": "%s", "format": "%s", "plan": {}}' % (FORMAT, FORMAT)),  # noqa: UP031
    ("format is a list", '{"format": [1, 2], "plan": {}}'),
    ("format is an object", '{"format": {"a": 1}, "plan": {}}'),
]


@pytest.mark.parametrize("text", [h[1] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_documents_raise_plan_error_only(text: str) -> None:
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(text)
    assert caught.value.name
    assert len(str(caught.value)) < 2000  # says what was wrong without echoing the document


def test_deep_nesting_is_refused_before_parsing_naming_the_depth() -> None:
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json("[" * 1_000_000 + "]" * 1_000_000)
    assert caught.value.name == "json"
    assert "deep" in str(caught.value)
    assert caught.value.__cause__ is None  # refused before json.loads could recurse


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    document = prefetch_document()
    document["plan"]["warnings"] = [{"code": "plan_revised", "message": "[" * 10_000 + "{" * 10_000}]
    plan = _read(document)
    assert plan.warnings[0].message == "[" * 10_000 + "{" * 10_000


def _nested(depth: int) -> tuple[str, object]:
    """Text alternating arrays and objects `depth` deep, and the value it denotes."""
    text, value = "0", 0
    value_of: object = value
    for level in range(depth):
        if level % 2:
            text, value_of = '{"k": ' + text + "}", {"k": value_of}
        else:
            text, value_of = "[" + text + "]", [value_of]
    return text, value_of


def test_nesting_up_to_the_limit_is_read_and_one_more_is_refused() -> None:
    assert MAX_JSON_DEPTH >= 8  # a plan document nests 6 deep
    text, value = _nested(MAX_JSON_DEPTH)
    assert parse_json(text) == value
    with pytest.raises(PlanError) as caught:
        parse_json(_nested(MAX_JSON_DEPTH + 1)[0])
    assert (caught.value.name, caught.value.value) == ("json", MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('["\\"", "[[[["]', ['"', "[[[["]),  # an escaped quote does not end the string
        ('["\\\\", "]"]', ["\\", "]"]),  # an escaped backslash does not escape the quote
        ('{"[": "{", "a\\u005b": [1]}', {"[": "{", "a[": [1]}),
        ("[" * 20 + '"' + "[" * 100 + '"' + "]" * 20, "[" * 100),  # 20 lists around one string
    ],
)
def test_brackets_in_strings_and_escapes_do_not_count(text: str, value: object) -> None:
    parsed = parse_json(text)
    while isinstance(parsed, list) and len(parsed) == 1 and isinstance(value, str):
        parsed = parsed[0]
    assert parsed == value


def test_unclosed_and_stray_brackets_are_json_errors_or_too_deep() -> None:
    for text, name in [("[" * 10, "json"), ("]" * 10, "json"), ("[]]" + "[" * 100, "json"), ("[[]" * 50, "json")]:
        with pytest.raises(PlanError) as caught:
            parse_json(text)
        assert caught.value.name == name


def test_a_long_integer_is_refused_saying_why() -> None:
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(_with_plan('{"num_layers": 1' + "0" * 5000 + "}"))
    assert "digits" in str(caught.value)
    assert len(str(caught.value)) < 500


def test_a_duplicate_key_is_refused_by_name() -> None:
    document = prefetch_document()
    text = json.dumps(document)
    assert text.endswith("}}")
    # The last spelling would win silently: a plan for 7 layers read as one for 6.
    doubled = text[:-2] + ', "num_layers": 7}}'
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(doubled)
    assert caught.value.name == "num_layers"
    assert "num_layers" in str(caught.value)


def test_a_long_bad_value_is_not_echoed_whole() -> None:
    document = prefetch_document()
    document["plan"]["num_layers"] = list(range(100_000))
    with pytest.raises(PlanError) as caught:
        _read(document)
    assert caught.value.name == "OffloadPlan.num_layers"
    assert len(str(caught.value)) < 1000


@pytest.mark.parametrize("text", [None, 5, ["{}"], {"format": FORMAT}], ids=repr)
def test_text_that_is_not_a_string_is_a_plan_error(text: object) -> None:
    with pytest.raises(PlanError) as caught:
        OffloadPlan.from_json(text)  # type: ignore[arg-type]  # what a careless caller passes
    assert caught.value.name == "text"


def test_bytes_are_read_like_text() -> None:
    document = prefetch_document()
    assert OffloadPlan.from_json(json.dumps(document).encode()) == _read(document)
    with pytest.raises(PlanError):
        OffloadPlan.from_json(b"\xff\xfe\x00junk")


@attrs.frozen(kw_only=True)
class _Rate:
    per_s: float


@pytest.mark.parametrize("value", [10**400, float("inf"), float("nan"), -float("inf")], ids=repr)
def test_from_data_refuses_numbers_a_float_cannot_hold(value: object) -> None:
    with pytest.raises(PlanError) as caught:
        from_data(_Rate, {"per_s": value})
    assert caught.value.name == "_Rate.per_s"


def test_from_data_still_reads_finite_floats() -> None:
    assert from_data(_Rate, {"per_s": 3}) == _Rate(per_s=3.0)
    assert from_data(_Rate, {"per_s": 2.5e300}) == _Rate(per_s=2.5e300)


# ---------------------------------------------------------------- the oracle


def assert_sound(plan: OffloadPlan) -> None:
    """The rules executors index by, written from the plan's documentation."""
    num_layers = plan.num_layers
    refs: dict[tuple[int, str], int] = {}
    previous_layer = 0
    for position, p in enumerate(plan.params):
        assert 0 <= p.layer < num_layers
        assert p.layer >= previous_layer
        previous_layer = p.layer
        ref = (p.layer, p.name)
        assert ref not in refs
        refs[ref] = position
    by_ref = {(p.layer, p.name): p for p in plan.params}
    for position, p in enumerate(plan.params):
        if p.tied_to is not None:
            assert refs.get(p.tied_to, position) < position
            target = by_ref[p.tied_to]
            assert target.tied_to is None
            assert p.param.storage_key is not None
            assert target.param.storage_key == p.param.storage_key
            assert target.offloaded == p.offloaded
    allowed = {"prefetch": {Placement.RESIDENT, Placement.PREFETCH},
               "uva": {Placement.RESIDENT, Placement.UVA, Placement.ON_DEMAND},
               "none": {Placement.RESIDENT}}[plan.backend.value]
    assert {p.placement for p in plan.params} <= allowed
    prefetch_layers = sorted({p.layer for p in plan.params if p.placement is Placement.PREFETCH})
    assert list(plan.offloaded_layers) == prefetch_layers
    assert plan.schedule.num_positions == len(plan.offloaded_layers)
    slot_of = dict(zip(plan.offloaded_layers, plan.schedule.slots, strict=True))
    used: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], set[int]] = {}
    for p in plan.params:
        if p.placement is Placement.PREFETCH:
            assert p.slot == slot_of[p.layer]
            if p.tied_to is None or p.tied_to[0] != p.layer:
                used.setdefault((p.name, p.shape, p.stride, p.dtype), set()).add(slot_of[p.layer])
    keys = [b.key for b in plan.buffers]
    assert len(keys) == len(set(keys))
    assert {b.key: set(b.slots) for b in plan.buffers} == used
    for b in plan.buffers:
        assert list(b.slots) == sorted(set(b.slots))
        assert all(0 <= s < plan.schedule.num_slots for s in b.slots)
    assert plan.device_bytes_buffers == sum(b.slot_bytes * len(b.slots) for b in plan.buffers)
    assert OffloadPlan.from_json(plan.to_json()) == plan


# ---------------------------------------------------------------- properties

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**30), 10**30), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from(["prefetch", "uva", "none", "resident", "on_demand", FORMAT, "a.weight"]),
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
_BASES: tuple[Callable[[], Document], ...] = (
    prefetch_document, prefetch_tied_document, prefetch_partial_document, uva_document, none_document)


def _read_or_refuse(text: str) -> None:
    try:
        plan = OffloadPlan.from_json(text)
    except PlanError as exc:
        assert exc.name is not None
        return
    assert_sound(plan)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES, st.booleans())
def test_arbitrary_json_is_a_sound_plan_or_a_plan_error(value: object, wrapped: bool) -> None:
    document = {"format": FORMAT, "plan": value} if wrapped else value
    _read_or_refuse(json.dumps(document))


def _nodes(node: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _nodes(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _nodes(value, (*path, i))
    return found


def _mutate(document: Document, path: tuple[object, ...], action: int, value: object) -> None:
    *parents, last = path
    parent: Any = document
    for step in parents:
        parent = parent[step]
    if action == 0:  # replace
        parent[last] = value
    elif action == 1:  # delete
        del parent[last]
    elif action == 2 and isinstance(parent[last], dict):  # add a key
        parent[last]["extra"] = value
    elif action == 2 and isinstance(parent[last], list):  # append
        parent[last].append(value)
    elif isinstance(parent[last], int) and not isinstance(parent[last], bool):  # nudge a number
        parent[last] += 1 if action == 3 else -1
    else:
        parent[last] = value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_BASES), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 4), JSON_VALUES),
                                          min_size=1, max_size=3))
def test_mutated_plan_data_is_a_sound_plan_or_a_plan_error(
    make: Callable[[], Document], mutations: list[tuple[int, int, object]]
) -> None:
    document = make()
    for pick, action, value in mutations:
        paths = [p for p in _nodes(document) if p]
        if not paths:  # both top-level keys deleted
            break
        _mutate(document, paths[pick % len(paths)], action, value)
    _read_or_refuse(json.dumps(document))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(_BASES), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2), st.text(max_size=3)),
                                          min_size=1, max_size=4))
def test_mutated_plan_text_is_a_sound_plan_or_a_plan_error(
    make: Callable[[], Document], edits: list[tuple[int, int, str]]
) -> None:
    text = json.dumps(make())
    for pick, action, chars in edits:
        at = pick % (len(text) + 1)
        if action == 0:
            text = text[:at] + chars + text[at:]
        elif action == 1:
            text = text[:at] + text[at + len(chars) + 1:]
        else:
            text = text[:at] + chars + text[at + len(chars):]
    _read_or_refuse(text)


@settings(max_examples=40, deadline=None)
@given(model_specs(max_layers=6, max_params=4), offload_configs(), env_snapshots())
def test_every_made_plan_is_sound(spec: ModelSpec, config: OffloadConfig, env: EnvSnapshot) -> None:
    assert_sound(make_plan(spec, config, env))
