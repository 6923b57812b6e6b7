"""The core refuses numbers that mean nothing: sizes in GiB that overflow or
round to 0 bytes, rates that make estimates infinite or zero, token counts whose FLOPs
overflow; and every accepted number gives a finite, non-zero estimate."""

from __future__ import annotations

import itertools
import math
from typing import Any

import attrs
import pytest

from offload import ConfigError, EnvSnapshot, OffloadConfig, make_plan
from offload.pure import preset_spec
from offload.pure.env.snapshot import Platform
from offload.pure.fit.estimate import MAX_TOKENS_PER_STEP, Workload, estimate
from offload.pure.fit.profiles import GB, MAX_RATE, MIN_RATE, TFLOP, profile_by_name, profile_from_numbers
from offload.pure.units import GIB, MAX_BYTES, gib_to_bytes

# ---- sizes in GiB -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "allow_zero", "expected"),
    [(0, True, 0), (0.0, True, 0), (1 / GIB, True, 1), (0.6 / GIB, True, 1), (1.5, True, 3 << 29),
     (MAX_BYTES / GIB, True, MAX_BYTES), (2**30, False, MAX_BYTES), (1, False, GIB)],
)
def test_gib_to_bytes_accepts_sizes_from_one_byte_to_two_to_the_sixty(value: float, allow_zero: bool,
                                                                      expected: int) -> None:
    assert gib_to_bytes(value, allow_zero=allow_zero) == expected


@pytest.mark.parametrize(
    ("value", "allow_zero", "needle"),
    [(1e308, True, "more than 2**60 bytes"), (2**30 + 1, True, "more than 2**60 bytes"),
     (1e-12, True, "rounds to 0 bytes"), (0.4 / GIB, True, "rounds to 0 bytes"), (0, False, "got 0"),
     (-1.0, True, "got -1.0"), (math.nan, True, "got nan"), (math.inf, True, "got inf"), (True, True, "got True"),
     ("1", True, "got '1'")],
)
def test_gib_to_bytes_refuses_the_rest_by_name(value: object, allow_zero: bool, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        gib_to_bytes(value, name="budget_gib", allow_zero=allow_zero)
    assert info.value.name == "budget_gib"
    assert info.value.value is value
    assert info.value.message.startswith("budget_gib must be ")
    assert needle in info.value.message


# ---- rates -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "name"),
    [({"link_gbps": 1e-320}, "link_gbps"), ({"link_gbps": 1e308}, "link_gbps"), ({"tflops": 1e-320}, "tflops"),
     ({"tflops": 1e308}, "tflops"), ({"link_gbps": 0.0}, "link_gbps"), ({"tflops": -1.0}, "tflops"),
     ({"pageable_gbps": 1e-300}, "pageable_gbps"), ({"weight_read_gbps": 1e300}, "weight_read_gbps"),
     ({"device_gib": 1e308}, "device_gib"), ({"device_gib": 1e-12}, "device_gib"), ({"device_gib": 0.0}, "device_gib"),
     ({"zero_copy_fraction": 1e-300}, "zero_copy_fraction")],
)
def test_profile_from_numbers_refuses_numbers_out_of_range_by_name(given: dict[str, float], name: str) -> None:
    numbers: dict[str, Any] = {"link_gbps": 25.0, "tflops": 150.0}
    numbers.update(given)
    with pytest.raises(ConfigError) as info:
        profile_from_numbers(**numbers)
    assert info.value.name == name
    assert info.value.value == given[name]


def test_profile_from_numbers_takes_the_ends_of_its_range() -> None:
    low = profile_from_numbers(link_gbps=1 / GB, tflops=1 / TFLOP, device_gib=1 / GIB)
    assert (low.pinned_h2d_bytes_per_s, low.bf16_flops_per_s, low.device_memory_bytes) == (1.0, 1.0, 1)
    assert low.pageable_h2d_bytes_per_s >= MIN_RATE and low.zero_copy_bytes_per_s >= MIN_RATE
    high = profile_from_numbers(link_gbps=MAX_RATE / GB, tflops=MAX_RATE / TFLOP, device_gib=2**30)
    assert (high.pinned_h2d_bytes_per_s, high.device_memory_bytes) == (MAX_RATE, MAX_BYTES)


@pytest.mark.parametrize("field", ["pinned_h2d_bytes_per_s", "pageable_h2d_bytes_per_s", "bf16_flops_per_s",
                                   "weight_read_bytes_per_s"])
@pytest.mark.parametrize("value", [1e-320, MIN_RATE / 2, MAX_RATE * 2, math.inf, math.nan, 0.0])
def test_device_profile_refuses_rates_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        changes: dict[str, Any] = {field: value}
        attrs.evolve(profile_by_name("h200-pcie5"), **changes)
    assert info.value.name == field


def test_device_profile_refuses_a_zero_copy_rate_below_the_range() -> None:
    slow = attrs.evolve(profile_by_name("h200-pcie5"), pinned_h2d_bytes_per_s=MIN_RATE, zero_copy_fraction=1.0)
    assert slow.zero_copy_bytes_per_s == MIN_RATE
    with pytest.raises(ConfigError) as info:
        attrs.evolve(slow, zero_copy_fraction=0.5)
    assert info.value.name == "zero_copy_fraction"


# ---- tokens ------------------------------------------------------------------------------------


def test_workload_takes_tokens_up_to_two_to_the_forty() -> None:
    assert Workload(tokens_per_step=MAX_TOKENS_PER_STEP).tokens_per_step == 2**40
    for tokens in (MAX_TOKENS_PER_STEP + 1, 10**20, 10**5000):
        with pytest.raises(ConfigError) as info:
            Workload(tokens_per_step=tokens)
        assert info.value.name == "tokens_per_step" and info.value.value == tokens
        assert len(info.value.message) < 200  # a 5000-digit number is not printed whole
    assert "100000000000000000000" in str(pytest.raises(ConfigError, Workload, tokens_per_step=10**20).value)


# ---- every accepted number gives a finite, non-zero estimate ------------------------------------


@pytest.mark.parametrize(("link", "flops", "tokens"), list(itertools.product(
    (1.0, MAX_RATE), (1.0, MAX_RATE), (1, MAX_TOKENS_PER_STEP))))
def test_estimates_at_the_ends_of_every_range_are_finite_and_non_zero(link: float, flops: float,
                                                                      tokens: int) -> None:
    profile = profile_from_numbers(link_gbps=link / GB, tflops=flops / TFLOP)
    env = EnvSnapshot(platform=Platform(has_cuda=True, device_name="x", device_total_bytes=MAX_BYTES,
                                        can_map_host_memory=True, can_register_host_memory=True,
                                        host_pointer_for_registered_memory=True))
    spec = preset_spec("llama-70b")
    for config in (OffloadConfig(group_size=4, num_in_group=1, prefetch_step=2),
                   OffloadConfig(backend="uva", uva_max_bytes=spec.nbytes // 2)):
        step = estimate(make_plan(spec, config, env), profile, Workload(tokens_per_step=tokens))
        for value in (step.step_seconds, step.limit_seconds, step.ratio_to_limit):
            assert math.isfinite(value) and value > 0, (config, value)
        assert step.ratio_to_limit >= 1 - 1e-9
