"""The public surface of `offload` is explicit, sorted and complete."""

from __future__ import annotations

import pytest

import offload
import offload.pure


def test_all_is_sorted_and_unique() -> None:
    assert list(offload.__all__) == sorted(set(offload.__all__))
    assert list(offload.pure.__all__) == sorted(set(offload.pure.__all__))


def test_every_exported_name_resolves() -> None:
    for name in offload.__all__:
        assert getattr(offload, name) is not None, name
    for name in offload.pure.__all__:
        assert getattr(offload.pure, name) is not None, name


#: The top level: the pipeline a README user calls, the values built and read, the errors
#: and the roles (written out here, so that a name joins or leaves it on purpose; the
#: names that left it are listed in CHANGELOG.md).
TOP_LEVEL = {
    "capture_env", "describe_layers", "describe_stacks", "spec_from_checkpoint", "make_plan", "render_plan", "fit", "estimate",
    "create_offloader", "decide_pinning", "decide_uva", "decide_host_admission", "parse_env", "schedule_prefetch",
    "check_schedule", "render_stats", "render_check",
    "EnvFlags", "EnvSnapshot", "Platform", "OffloadConfig", "ParamSpec", "LayerSpec", "ModelSpec", "Workload",
    "OffloadPlan", "ParamPlan", "Placement", "Backend", "PinDecision", "UvaDecision", "PrefetchSchedule",
    "WarningCode", "OffloadStats", "LiveCheck",
    "OffloadError", "ConfigError", "EnvError", "PlanError", "CheckpointError", "ExecutionError",
    "Offloader", "Runtime",
}


def test_the_top_level_is_the_pipeline_and_its_values() -> None:
    assert set(offload.__all__) == TOP_LEVEL
    assert len(offload.__all__) <= 45


def test_top_level_core_names_are_the_cores_objects() -> None:
    for name in set(offload.__all__) & set(offload.pure.__all__):
        assert getattr(offload, name) is getattr(offload.pure, name), name


def test_public_names_without_underscore_are_listed() -> None:
    # Every public module attribute that is not a submodule is in __all__, so nothing is
    # public by accident.
    import types

    public = {
        name
        for name, value in vars(offload).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name not in {"annotations"}
    }
    assert public - set(offload.__all__) - {"TYPE_CHECKING", "Any", "importlib"} == set()


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(offload, "no_such_name")  # noqa: B009 (attribute access would not type-check)


def test_error_tree() -> None:
    assert issubclass(offload.ConfigError, ValueError)
    assert issubclass(offload.EnvError, ValueError)
    assert issubclass(offload.PlanError, ValueError)
    assert issubclass(offload.CheckpointError, ValueError)
    assert issubclass(offload.ExecutionError, RuntimeError)
    for cls in (offload.ConfigError, offload.EnvError, offload.PlanError, offload.ExecutionError, offload.CheckpointError):
        assert issubclass(cls, offload.OffloadError)
    err = offload.ConfigError("bad group_size", name="group_size", value=-1)
    assert (err.name, err.value, str(err)) == ("group_size", -1, "bad group_size")
