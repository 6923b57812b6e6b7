"""`parse_env`, `Platform` defaults and `EnvSnapshot.fingerprint`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import EnvError, OffloadError
from offload.pure import (
    EnvFlags,
    EnvSnapshot,
    PinReason,
    Platform,
    decide_pinning,
    decide_uva,
    parse_env,
)
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.env.numa import NumaTopology
from offload.pure.env.snapshot import VOLATILE
from tests.pure.strategies import env_snapshots

REPO = Path(__file__).resolve().parents[3]

# The variable names as the design spells them (not read from the code under test).
PIN = "OFFLOAD_DISABLE_PIN_MEMORY"
UVA = "OFFLOAD_DISABLE_UVA"
PIN_ALIAS = "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"
UVA_ALIAS = "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA"
ALL_VARIABLES = (PIN, UVA, PIN_ALIAS, UVA_ALIAS)
FLAG_OF = {PIN: "disable_pin_memory", PIN_ALIAS: "disable_pin_memory", UVA: "disable_uva", UVA_ALIAS: "disable_uva"}

# value -> what it means: True, False, or None for "not set" (same as False).
VALUES: list[tuple[str, bool | None]] = [
    ("1", True),
    ("0", False),
    ("true", True),
    ("false", False),
    ("TRUE", True),
    ("FALSE", False),
    ("True", True),
    ("fAlSe", False),
    ("yes", True),
    ("no", False),
    (" Yes ", True),
    ("NO", False),
    ("on", True),
    ("off", False),
    ("ON", True),
    ("Off", False),
    ("\t1\n", True),
    ("  0  ", False),
    ("", None),
    ("   ", None),
]

JUNK = ["2", "-1", "10", "y", "n", "t", "f", "tru", "enable", "disabled", "1.0", "yes please", "o n", "none", "null", "\u0661"]


@pytest.mark.parametrize("variable", ALL_VARIABLES)
@pytest.mark.parametrize(("raw", "meaning"), VALUES)
def test_each_variable_accepts_the_switch_values(variable: str, raw: str, meaning: bool | None) -> None:
    flags = parse_env({variable: raw})
    expected = EnvFlags(**{FLAG_OF[variable]: bool(meaning)})
    assert flags == expected


def test_unset_means_both_switches_off() -> None:
    assert parse_env({}) == EnvFlags(disable_pin_memory=False, disable_uva=False)
    assert EnvFlags() == EnvFlags(disable_pin_memory=False, disable_uva=False)


def test_unrelated_variables_are_ignored() -> None:
    environ = {"PATH": "/usr/bin", "OFFLOAD_DISABLE_PIN": "junk", "VLLM_DISABLE_UVA": "junk", "HOME": "x"}
    assert parse_env(environ) == EnvFlags()


def test_the_two_switches_are_independent() -> None:
    assert parse_env({PIN: "1"}) == EnvFlags(disable_pin_memory=True, disable_uva=False)
    assert parse_env({UVA: "1"}) == EnvFlags(disable_pin_memory=False, disable_uva=True)
    assert parse_env({PIN: "1", UVA_ALIAS: "on"}) == EnvFlags(disable_pin_memory=True, disable_uva=True)


def test_any_mapping_is_accepted() -> None:
    assert parse_env(types.MappingProxyType({PIN_ALIAS: "yes"})) == EnvFlags(disable_pin_memory=True)


@pytest.mark.parametrize("variable", ALL_VARIABLES)
@pytest.mark.parametrize("raw", JUNK)
def test_junk_raises_env_error_naming_variable_and_value(variable: str, raw: str) -> None:
    with pytest.raises(EnvError) as caught:
        parse_env({variable: raw})
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, OffloadError)
    assert error.name == variable
    assert error.value == raw
    assert variable in str(error)
    assert raw in str(error)


@pytest.mark.parametrize(("primary", "alias"), [(PIN, PIN_ALIAS), (UVA, UVA_ALIAS)])
@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        ("1", "1", True),
        ("0", "0", False),
        ("1", "yes", True),
        ("TRUE", " on ", True),
        ("no", "off", False),
        ("false", "0", False),
        # Empty means unset, so an empty spelling never disagrees with the other one.
        ("", "1", True),
        ("1", "", True),
        ("", "0", False),
        ("  ", "", False),
    ],
)
def test_both_spellings_that_agree(primary: str, alias: str, ours: str, theirs: str, expected: bool) -> None:
    flags = parse_env({primary: ours, alias: theirs})
    assert getattr(flags, FLAG_OF[primary]) is expected


@pytest.mark.parametrize(("primary", "alias"), [(PIN, PIN_ALIAS), (UVA, UVA_ALIAS)])
@pytest.mark.parametrize(("ours", "theirs"), [("1", "0"), ("0", "1"), ("true", "no"), ("off", "ON")])
def test_both_spellings_that_disagree_raise_naming_both(primary: str, alias: str, ours: str, theirs: str) -> None:
    with pytest.raises(EnvError) as caught:
        parse_env({primary: ours, alias: theirs})
    message = str(caught.value)
    assert primary in message
    assert alias in message
    assert ours in message
    assert theirs in message
    assert caught.value.name is not None
    assert primary in caught.value.name
    assert alias in caught.value.name


@pytest.mark.parametrize(("primary", "alias"), [(PIN, PIN_ALIAS), (UVA, UVA_ALIAS)])
def test_junk_in_the_alias_is_an_error_even_when_ours_is_valid(primary: str, alias: str) -> None:
    with pytest.raises(EnvError) as caught:
        parse_env({primary: "1", alias: "maybe"})
    assert caught.value.name == alias
    assert caught.value.value == "maybe"


@pytest.mark.parametrize(("alias", "flag"), [(PIN_ALIAS, "disable_pin_memory"), (UVA_ALIAS, "disable_uva")])
def test_alias_alone_sets_the_switch(alias: str, flag: str) -> None:
    assert getattr(parse_env({alias: "1"}), flag) is True
    assert getattr(parse_env({alias: "0"}), flag) is False


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_env_flags_accept_only_bools(bad: Any) -> None:
    with pytest.raises(OffloadError):
        EnvFlags(disable_pin_memory=bad)


# ---------------------------------------------------------------------------- Platform


def test_platform_defaults_describe_a_machine_without_an_accelerator() -> None:
    platform = Platform()
    assert platform.has_cuda is False
    assert platform.device_total_bytes == 0
    assert platform.is_integrated is False
    assert platform.pageable_memory_access is False
    assert platform.pageable_uses_host_page_tables is False
    assert platform.can_map_host_memory is False
    assert platform.is_wsl is False
    # And the decisions agree that there is nothing to pin for or to map into.
    env = EnvSnapshot()
    assert env.platform == platform
    assert env.flags == EnvFlags()
    pin = decide_pinning(env)
    assert pin.pin is False
    assert pin.reason is PinReason.NO_ACCELERATOR
    assert decide_uva(env, pin).enabled is False


def test_platform_has_the_fields_the_issue_lists() -> None:
    names = {f.name for f in attrs.fields(Platform)}
    assert names >= {
        "has_cuda",
        "device_name",
        "device_total_bytes",
        "is_integrated",
        "pageable_memory_access",
        "pageable_uses_host_page_tables",
        "can_map_host_memory",
        "is_wsl",
        "memlock_limit_bytes",
        "host_available_bytes",
        "torch_version",
    }


def test_snapshot_values_are_frozen() -> None:
    env = EnvSnapshot()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        env.flags = EnvFlags(disable_pin_memory=True)  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        env.platform.has_cuda = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "bad"),
    [("has_cuda", 1), ("device_total_bytes", -1), ("device_total_bytes", True), ("memlock_limit_bytes", -5)],
)
def test_platform_rejects_bad_field_values(field: str, bad: object) -> None:
    kwargs: dict[str, Any] = {field: bad}
    with pytest.raises(OffloadError) as caught:
        Platform(**kwargs)
    assert caught.value.name == field


# ---------------------------------------------------------------------------- fingerprint

_SNAPSHOT_CODE = """
from offload.pure import EnvFlags, EnvSnapshot, Platform
env = EnvSnapshot(
    flags=EnvFlags(disable_pin_memory=True),
    platform=Platform(has_cuda=True, device_name="NVIDIA H200", device_total_bytes=150_000_000_000,
                      can_map_host_memory=True, memlock_limit_bytes=None, host_available_bytes=1 << 40,
                      torch_version="2.11.0+cu130"),
)
"""


def _snapshot_here() -> EnvSnapshot:
    namespace: dict[str, Any] = {}
    exec(_SNAPSHOT_CODE, namespace)  # the same code the subprocesses run
    env = namespace["env"]
    assert isinstance(env, EnvSnapshot)
    return env


def _fingerprint_in_fresh_interpreter(hash_seed: str) -> str:
    code = _SNAPSHOT_CODE + "import json; print(json.dumps(env.fingerprint()))"
    environ = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=environ, capture_output=True, text=True, timeout=60, check=True
    )
    value = json.loads(done.stdout)
    assert isinstance(value, str)
    return value


def test_fingerprint_is_stable_across_fresh_interpreters() -> None:
    # Different hash seeds: a fingerprint built on hash() would differ between them.
    here = _snapshot_here().fingerprint()
    assert here != ""
    assert _fingerprint_in_fresh_interpreter("1") == here
    assert _fingerprint_in_fresh_interpreter("12345") == here


@settings(max_examples=60)
@given(env_snapshots())
def test_equal_snapshots_have_equal_fingerprints(env: EnvSnapshot) -> None:
    twin = EnvSnapshot(flags=attrs.evolve(env.flags), platform=attrs.evolve(env.platform))
    assert twin is not env
    assert twin == env
    assert twin.fingerprint() == env.fingerprint()
    assert isinstance(env.fingerprint(), str)


def _changed(value: object) -> object:
    """A different value of the same kind, for every field type a snapshot has."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if value is None:
        return 1 << 30
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, tuple):
        return (*value, "x")
    if isinstance(value, NumaTopology):
        return NumaTopology(nodes=(*value.nodes, max(value.nodes, default=-1) + 1), gpu_node=value.gpu_node)
    if isinstance(value, CgroupMemory):
        return CgroupMemory(version=2, limit_bytes=(value.limit_bytes or 0) + 1, limit_path="/sys/fs/cgroup/memory.max")
    raise AssertionError(f"no change known for {value!r}")


# Readings that change from moment to moment are documented (env.VOLATILE) to be left out
# of the fingerprint, so that two captures of one machine agree; every other field is in.
_VOLATILE = {f.name for f in attrs.fields(Platform) if f.metadata.get(VOLATILE, False)}
_PLATFORM_FIELDS = [f.name for f in attrs.fields(Platform) if f.name not in _VOLATILE]
_FLAG_FIELDS = [f.name for f in attrs.fields(EnvFlags)]


def test_only_free_host_memory_is_volatile() -> None:
    assert _VOLATILE == {"host_available_bytes"}
    env = _snapshot_here()
    moved = attrs.evolve(env, platform=attrs.evolve(env.platform, host_available_bytes=123))
    assert moved.fingerprint() == env.fingerprint()


@pytest.mark.parametrize("field", _PLATFORM_FIELDS)
def test_fingerprint_changes_when_a_platform_field_changes(field: str) -> None:
    env = _snapshot_here()
    change: dict[str, Any] = {field: _changed(getattr(env.platform, field))}
    changed = attrs.evolve(env, platform=attrs.evolve(env.platform, **change))
    assert changed != env
    assert changed.fingerprint() != env.fingerprint()


@pytest.mark.parametrize("field", _FLAG_FIELDS)
def test_fingerprint_changes_when_a_flag_changes(field: str) -> None:
    env = _snapshot_here()
    changed = attrs.evolve(env, flags=attrs.evolve(env.flags, **{field: not getattr(env.flags, field)}))
    assert changed.fingerprint() != env.fingerprint()


@settings(max_examples=60)
@given(env_snapshots(), env_snapshots())
def test_different_snapshots_have_different_fingerprints(a: EnvSnapshot, b: EnvSnapshot) -> None:
    def steady(env: EnvSnapshot) -> EnvSnapshot:
        cgroup = attrs.evolve(env.platform.cgroup_memory, current_bytes=None, reclaimable_bytes=None)
        return attrs.evolve(env, platform=attrs.evolve(env.platform, host_available_bytes=None, cgroup_memory=cgroup))

    assert (a.fingerprint() == b.fingerprint()) == (steady(a) == steady(b))


def test_fingerprint_of_the_default_snapshot_is_repeatable() -> None:
    assert EnvSnapshot().fingerprint() == EnvSnapshot(flags=EnvFlags(), platform=Platform()).fingerprint()


# Values that are not strings: a caller passing a config dict or ``os.environb``.
NOT_STRINGS: list[object] = [True, False, 1, 0, 1.0, None, b"1", bytearray(b"0"), ["1"], ("on",), {"1": 1}, object()]


@pytest.mark.parametrize("variable", ALL_VARIABLES)
@pytest.mark.parametrize("raw", NOT_STRINGS, ids=repr)
def test_a_value_that_is_not_a_string_raises_env_error_naming_variable_and_value(variable: str, raw: object) -> None:
    environ: dict[str, Any] = {variable: raw}
    with pytest.raises(EnvError) as caught:
        parse_env(environ)
    assert caught.value.name == variable
    assert caught.value.value is raw
    assert variable in str(caught.value)
    assert repr(raw) in str(caught.value)
    assert type(raw).__name__ in str(caught.value)


@pytest.mark.parametrize(("primary", "alias"), [(PIN, PIN_ALIAS), (UVA, UVA_ALIAS), (PIN_ALIAS, PIN), (UVA_ALIAS, UVA)])
def test_a_non_string_beside_a_valid_spelling_is_still_refused(primary: str, alias: str) -> None:
    environ: dict[str, Any] = {primary: "1", alias: True}
    with pytest.raises(EnvError) as caught:
        parse_env(environ)
    assert caught.value.name == alias
    assert caught.value.value is True


def test_a_string_subclass_is_read_as_a_string() -> None:
    class Text(str):
        pass

    assert parse_env({PIN: Text(" ON "), UVA_ALIAS: Text("0")}) == EnvFlags(disable_pin_memory=True, disable_uva=False)


_ANY_VALUE = st.one_of(st.text(max_size=6), st.sampled_from(["1", "0", " on ", "OFF", ""]), st.booleans(),
                       st.integers(), st.none(), st.binary(max_size=3), st.lists(st.text(max_size=2), max_size=2))


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from(ALL_VARIABLES), _ANY_VALUE))
def test_any_values_give_flags_or_an_env_error_naming_a_variable(environ: dict[str, Any]) -> None:
    try:
        flags = parse_env(environ)
    except EnvError as exc:
        assert exc.name is not None
        assert any(variable in exc.name for variable in environ)
        return
    assert all(isinstance(value, str) for value in environ.values())
    assert isinstance(flags, EnvFlags)
