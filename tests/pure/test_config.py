"""`OffloadConfig` validation and `segment_matches`."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError, OffloadError
from offload.pure import Backend, BackendReason, OffloadConfig, resolve_backend, segment_matches


def test_defaults_are_the_issues() -> None:
    config = OffloadConfig()
    assert config.backend == "auto"
    assert config.group_size == 0
    assert config.num_in_group == 1
    assert config.prefetch_step == 1
    assert config.uva_max_bytes == 0
    assert config.param_filter == ()


# kwargs, the fields the error may name (a combination may be blamed on either of its fields)
CONFIG_ERRORS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("unknown backend", {"backend": "fast"}, {"backend"}),
    ("backend in capitals", {"backend": "PREFETCH", "group_size": 2}, {"backend"}),
    ("backend empty", {"backend": ""}, {"backend"}),
    ("backend None", {"backend": None}, {"backend"}),
    ("negative group_size", {"group_size": -1}, {"group_size"}),
    ("zero num_in_group", {"group_size": 4, "num_in_group": 0}, {"num_in_group"}),
    ("negative num_in_group", {"group_size": 4, "num_in_group": -2}, {"num_in_group"}),
    ("zero prefetch_step", {"group_size": 4, "prefetch_step": 0}, {"prefetch_step"}),
    ("negative prefetch_step", {"prefetch_step": -1}, {"prefetch_step"}),
    ("negative uva budget", {"uva_max_bytes": -1}, {"uva_max_bytes"}),
    ("num_in_group > group_size", {"group_size": 2, "num_in_group": 3}, {"num_in_group", "group_size"}),
    ("num_in_group > group_size, explicit", {"backend": "prefetch", "group_size": 1, "num_in_group": 2},
     {"num_in_group", "group_size"}),
    ("explicit prefetch, group_size 0", {"backend": "prefetch"}, {"group_size"}),
    ("explicit prefetch, group_size 0, with budget", {"backend": "prefetch", "uva_max_bytes": 10}, {"group_size"}),
    ("explicit uva, zero budget", {"backend": "uva"}, {"uva_max_bytes"}),
    ("explicit uva, zero budget, with group", {"backend": "uva", "group_size": 4}, {"uva_max_bytes"}),
    # bool is an int subclass; True as a size is a mistake.
    ("bool group_size", {"group_size": True}, {"group_size"}),
    ("bool num_in_group", {"group_size": 4, "num_in_group": True}, {"num_in_group"}),
    ("bool prefetch_step", {"group_size": 4, "prefetch_step": True}, {"prefetch_step"}),
    ("bool uva budget", {"uva_max_bytes": True}, {"uva_max_bytes"}),
    ("float group_size", {"group_size": 4.0}, {"group_size"}),
    ("str group_size", {"group_size": "4"}, {"group_size"}),
    ("float uva budget", {"uva_max_bytes": 1e9}, {"uva_max_bytes"}),
    # Filter segments: dotted names with no empty parts.
    ("empty segment", {"param_filter": ("",)}, {"param_filter"}),
    ("empty part in the middle", {"param_filter": ("experts..w2_weight",)}, {"param_filter"}),
    ("leading dot", {"param_filter": (".w2_weight",)}, {"param_filter"}),
    ("trailing dot", {"param_filter": ("experts.",)}, {"param_filter"}),
    ("only a dot", {"param_filter": (".",)}, {"param_filter"}),
    ("empty among good ones", {"param_filter": ("w2_weight", "")}, {"param_filter"}),
    ("not a string", {"param_filter": (3,)}, {"param_filter"}),
    ("a bare string, not a tuple", {"param_filter": "experts"}, {"param_filter"}),
    ("a list, not a tuple", {"param_filter": ["experts"]}, {"param_filter"}),
]


@pytest.mark.parametrize(("kwargs", "names"), [c[1:] for c in CONFIG_ERRORS], ids=[c[0] for c in CONFIG_ERRORS])
def test_config_errors_name_the_field(kwargs: dict[str, Any], names: set[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        OffloadConfig(**kwargs)
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, OffloadError)
    assert error.name in names
    assert str(error.name) in str(error)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "prefetch", "group_size": 8, "num_in_group": 8},
        {"backend": "prefetch", "group_size": 1, "num_in_group": 1, "prefetch_step": 16},
        {"backend": "uva", "uva_max_bytes": 1},
        {"backend": "none"},
        {"backend": "auto"},
        {"backend": "auto", "group_size": 4, "uva_max_bytes": 1 << 30},
        {"group_size": 4, "num_in_group": 2, "param_filter": ("experts.w2_weight", "mlp", "self_attn.q_proj.weight")},
        {"backend": "uva", "uva_max_bytes": 10, "param_filter": ("w13_weight",)},
    ],
)
def test_valid_configs_keep_their_values(kwargs: dict[str, Any]) -> None:
    config = OffloadConfig(**kwargs)
    for field, value in kwargs.items():
        assert getattr(config, field) == value


def test_config_is_frozen_and_evolve_revalidates() -> None:
    config = OffloadConfig(group_size=4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.group_size = 2  # type: ignore[misc]
    with pytest.raises(ConfigError) as caught:
        attrs.evolve(config, num_in_group=5)
    assert caught.value.name in {"num_in_group", "group_size"}


# config, backend, reason
RESOLVE: list[tuple[OffloadConfig, Backend, BackendReason]] = [
    (OffloadConfig(), Backend.NONE, BackendReason.AUTO_NOTHING_CONFIGURED),
    (OffloadConfig(group_size=4), Backend.PREFETCH, BackendReason.AUTO_GROUP_SIZE),
    (OffloadConfig(uva_max_bytes=5), Backend.UVA, BackendReason.AUTO_UVA_BUDGET),
    # Both set: prefetch wins (the plan warns; see test_plan).
    (OffloadConfig(group_size=4, uva_max_bytes=5), Backend.PREFETCH, BackendReason.AUTO_GROUP_SIZE),
    (OffloadConfig(backend="none", group_size=4, uva_max_bytes=5), Backend.NONE, BackendReason.EXPLICIT),
    (OffloadConfig(backend="uva", group_size=4, uva_max_bytes=5), Backend.UVA, BackendReason.EXPLICIT),
    (OffloadConfig(backend="prefetch", group_size=4, uva_max_bytes=5), Backend.PREFETCH, BackendReason.EXPLICIT),
]


@pytest.mark.parametrize(("config", "backend", "reason"), RESOLVE)
def test_auto_resolution(config: OffloadConfig, backend: Backend, reason: BackendReason) -> None:
    assert resolve_backend(config) == (backend, reason)


# ---------------------------------------------------------------------------- segments

SEGMENTS: list[tuple[str, str, bool]] = [
    ("experts.w2_weight", "mlp.experts.w2_weight", True),
    ("experts.w2_weight", "mlp.experts.w2_weight_scale", False),
    ("experts.w2_weight", "mlp.shared_experts.w2_weight", False),
    ("experts.w2_weight", "experts.w2_weight", True),
    ("experts.w2_weight", "experts.w2_weight.extra", True),
    ("experts.w2_weight", "w2_weight", False),
    ("w2_weight", "mlp.experts.w2_weight", True),
    ("w2_weight", "mlp.experts.w2_weight_scale", False),
    ("w2", "mlp.experts.w2_weight", False),
    ("experts", "mlp.experts.w2_weight", True),
    ("xperts", "mlp.experts.w2_weight", False),
    ("mlp.experts", "mlp.experts.w2_weight", True),
    ("mlp", "mlp.up.weight", True),
    ("weight", "mlp.up.weight", True),
    ("up", "mlp.up_proj.weight", False),
    ("up.weight", "mlp.up.weight", True),
    # Parts must be adjacent, in order.
    ("mlp.weight", "mlp.up.weight", False),
    ("weight.up", "mlp.up.weight", False),
    ("mlp.up.weight", "up.weight", False),
    ("1", "experts.10.w", False),
    ("1", "experts.1.w", True),
    ("a.a", "a.b.a.a", True),
    ("a.b", "a.a.b", True),
]


@pytest.mark.parametrize(("segment", "name", "expected"), SEGMENTS)
def test_segment_matches_whole_parts(segment: str, name: str, expected: bool) -> None:
    assert segment_matches(segment, name) is expected


_PART = st.sampled_from(("a", "b", "ab", "w2", "w2_weight", "experts", "mlp", "0", "1", "10"))
_DOTTED = st.lists(_PART, min_size=1, max_size=5).map(".".join)


@settings(max_examples=300)
@given(_DOTTED, _DOTTED)
def test_segment_matches_is_substring_on_dot_boundaries(segment: str, name: str) -> None:
    # An independent statement of "whole dot-separated parts".
    assert segment_matches(segment, name) is (f".{segment}." in f".{name}.")
    assert segment_matches(name, name) is True
