"""Numbers given over a profile (``offload plan --profile NAME --link-gbps X --tflops Y``)
change the estimate's terms they name, and only those: the link moves the pinned rate and
the pageable rate with it, at the base's own ratio (GH200's pageable reads run at half its
pinned rate, not at PCIe's 6.6x slower one); FLOP/s move the compute term unless a step is
bound by reading its weights (the roofline's other side, which the base keeps)."""

from __future__ import annotations

import pytest

from offload.pure.fit.profiles import GB, MAX_RATE, MIN_RATE, PAGEABLE_RATIO, PROFILES, profile_from_numbers


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_base_profiles_own_link_leaves_every_rate_as_it_was(name: str) -> None:
    base = PROFILES[name]
    same = profile_from_numbers(link_gbps=base.pinned_h2d_bytes_per_s / GB, base=base)
    assert same.pinned_h2d_bytes_per_s == pytest.approx(base.pinned_h2d_bytes_per_s)
    assert same.pageable_h2d_bytes_per_s == pytest.approx(base.pageable_h2d_bytes_per_s)
    assert same.zero_copy_bytes_per_s == pytest.approx(base.zero_copy_bytes_per_s)


def test_a_measured_link_over_gh200_keeps_its_pageable_ratio() -> None:
    # The preset: 375 GB/s pinned, 187.5 pageable (half, through the host's page tables).
    profile = profile_from_numbers(link_gbps=300, base=PROFILES["gh200"])
    assert profile.pinned_h2d_bytes_per_s == pytest.approx(300e9)
    assert profile.pageable_h2d_bytes_per_s == pytest.approx(150e9)  # was 300e9 x 8.4 / 55.4 = 45.5e9


def test_a_measured_link_over_a_pcie_profile_keeps_pcies_ratio() -> None:
    profile = profile_from_numbers(link_gbps=25, base=PROFILES["h200-pcie5"])
    assert profile.pageable_h2d_bytes_per_s == pytest.approx(25e9 * PAGEABLE_RATIO)


def test_a_pageable_rate_given_wins_over_the_base_ratio() -> None:
    profile = profile_from_numbers(link_gbps=300, pageable_gbps=20, base=PROFILES["gh200"])
    assert profile.pageable_h2d_bytes_per_s == pytest.approx(20e9)


def test_the_scaled_pageable_rate_stays_in_a_profiles_range() -> None:
    slow = profile_from_numbers(link_gbps=1e-9, tflops=1, pageable_gbps=1e-9)  # 1 B/s both
    fast_base = profile_from_numbers(link_gbps=1e-9, pageable_gbps=MAX_RATE / GB, tflops=1)
    assert profile_from_numbers(link_gbps=1e-9, base=slow).pageable_h2d_bytes_per_s == pytest.approx(1.0)
    high = profile_from_numbers(link_gbps=MAX_RATE / GB, base=fast_base)
    assert MIN_RATE <= high.pageable_h2d_bytes_per_s <= MAX_RATE


def test_tflops_over_a_profile_keep_its_weight_read_rate() -> None:
    base = PROFILES["h200-pcie5"]
    profile = profile_from_numbers(tflops=0.05, base=base)
    assert profile.bf16_flops_per_s == pytest.approx(0.05e12)
    assert profile.weight_read_bytes_per_s == base.weight_read_bytes_per_s
