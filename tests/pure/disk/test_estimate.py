"""The step predicted with a disk tier (`offload.pure.disk.estimate`): an instant disk
predicts the step without one; a slow disk makes the step the disk's (each layer sharing a
staging buffer read once per step, none faster); a slower disk never predicts a faster
step; each disk layer's read is itemised."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import EnvSnapshot, OffloadConfig, OffloadPlan, make_plan
from offload.pure.disk.estimate import disk_reads, estimate_with_tier
from offload.pure.disk.tier import DiskTierPlan, plan_disk_tier
from offload.pure.fit.estimate import Workload, estimate
from offload.pure.fit.profiles import PROFILES
from offload.pure.spec.presets import preset_spec

PROFILE = PROFILES["h200-pcie5"]


def _planned(read_ahead: int = 2, share: float = 0.5) -> tuple[OffloadPlan, DiskTierPlan]:
    plan = make_plan(preset_spec("llama-8b"), OffloadConfig(group_size=1, prefetch_step=2), EnvSnapshot())
    tier = plan_disk_tier(plan, host_budget_bytes=int(plan.host_bytes * share), disk_gbps=1.0, read_ahead=read_ahead)
    assert 2 * read_ahead < len(tier.disk_positions) < len(plan.offloaded_layers)
    return plan, tier


def _shared(tier: DiskTierPlan) -> set[int]:
    """The disk layers that share their staging buffer (read every step)."""
    layer_at = dict(zip(tier.disk_positions, tier.disk_layers, strict=True))
    return {layer_at[position] for k, position in enumerate(tier.read_order) if tier.staging.count(tier.staging[k]) > 1}


def test_an_instant_disk_predicts_the_step_without_a_disk_tier() -> None:
    plan, tier = _planned()
    fast = attrs.evolve(tier, disk_gbps=1e12)
    without = estimate(plan, PROFILE, Workload())
    got = estimate_with_tier(plan, fast, PROFILE, Workload())
    assert got.step_seconds == pytest.approx(without.step_seconds, rel=1e-3)
    assert got.disk_read_seconds > 0  # still itemised, however small


def test_a_slow_disk_makes_the_step_the_disks() -> None:
    plan, tier = _planned()
    slow = attrs.evolve(tier, disk_gbps=0.01)
    got = estimate_with_tier(plan, slow, PROFILE, Workload())
    shared = _shared(slow)
    per_layer = {p.layer: 0 for p in slow.params}
    for p in slow.params:
        per_layer[p.layer] += p.nbytes
    reads = sum(per_layer[layer] for layer in shared) / (slow.disk_gbps * 1e9)
    assert got.disk_read_seconds == pytest.approx(reads)
    assert reads <= got.step_seconds <= reads * 1.05
    for layer in got.layers:
        expected = per_layer[layer.layer] / (slow.disk_gbps * 1e9) if layer.layer in shared else 0.0
        assert layer.disk_read_seconds == pytest.approx(expected)


@settings(max_examples=40, deadline=None)
@given(slower=st.floats(0.05, 50.0), faster=st.floats(1.0, 20.0), read_ahead=st.integers(1, 3))
def test_a_slower_disk_never_predicts_a_faster_step(slower: float, faster: float, read_ahead: int) -> None:
    plan, tier = _planned(read_ahead)
    a = estimate_with_tier(plan, attrs.evolve(tier, disk_gbps=slower), PROFILE, Workload())
    b = estimate_with_tier(plan, attrs.evolve(tier, disk_gbps=slower * faster), PROFILE, Workload())
    assert b.step_seconds <= a.step_seconds * (1 + 1e-9)
    assert a.step_seconds >= a.disk_read_seconds * (1 - 1e-9)  # no step beats reading the disk tier


def test_post_init_reads_one_position_per_buffer_in_the_order_copies_are_issued() -> None:
    plan, tier = _planned(read_ahead=3)
    reads = disk_reads(plan, tier)
    assert len(reads.first) == tier.buffers
    assert len({tier.staging[tier.read_order.index(p)] for p in reads.first}) == tier.buffers
    assert [position for position, _ in reads.next_of] == list(tier.read_order)


def test_the_limit_holds_the_disks_floor_and_the_text_says_so() -> None:
    from offload.pure.fit.render import render_estimate

    plan, tier = _planned()
    slow = attrs.evolve(tier, disk_gbps=0.01)
    got = estimate_with_tier(plan, slow, PROFILE, Workload())
    assert got.disk_read_seconds > max(got.compute_seconds, got.link_seconds)
    assert got.limit_seconds == got.disk_read_seconds  # bound by the disk: no step is faster
    assert 1.0 <= got.ratio_to_limit <= 1.05
    text = render_estimate(got)
    assert "(compute, link, disk)" in text
    # Without a disk tier the limit is compute and link, as before.
    assert "(compute, link)\n" in render_estimate(estimate(plan, PROFILE, Workload()))


def test_a_step_bound_by_the_disk_warns_of_the_disk_not_of_the_prefetch_depth() -> None:
    from offload.pure.disk.render import tier_warnings
    from offload.pure.plan.plan import WarningCode

    plan, tier = _planned()  # every layer offloaded at depth 2: the plan warns of stalls
    assert WarningCode.PREFETCH_STALLS in {w.code for w in plan.warnings}
    slow = attrs.evolve(tier, disk_gbps=0.01)
    warnings = tier_warnings(plan, slow, estimate_with_tier(plan, slow, PROFILE, Workload()))
    codes = [w.code for w in warnings]
    assert WarningCode.PREFETCH_STALLS not in codes and codes.count(WarningCode.DISK_BOUND) == 1
    (bound,) = [w for w in warnings if w.code is WarningCode.DISK_BOUND]
    assert "no prefetch depth helps" in bound.message and "host budget" in bound.message
    assert "0.01 GB/s" in bound.message
    # The plan's other warnings stay, in their order.
    assert [w for w in warnings if w.code is not WarningCode.DISK_BOUND] == \
        [w for w in plan.warnings if w.code is not WarningCode.PREFETCH_STALLS]
    # A disk fast enough to hide its reads leaves the plan's warnings as they are.
    fast = attrs.evolve(tier, disk_gbps=1e12)
    assert tier_warnings(plan, fast, estimate_with_tier(plan, fast, PROFILE, Workload())) == plan.warnings
