"""The pure side of sharing: layouts, fingerprints, who shares with whom, the words."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from offload import EnvSnapshot, OffloadConfig, OffloadPlan, describe_layers, make_plan
from offload.capture.smaps import parse_smaps
from offload.pure.sharing.plan import (
    CACHE_LINE,
    MemberInfo,
    describe_mismatch,
    lay_out,
    mismatched,
    plan_sharing,
    weights_digest,
    weights_of,
)
from offload.pure.units import ranks_text
from offload.sharing import render_sharing
from tests.executors.models import TiedBlock, layer_list, mixed_model, transformer_model

PAGE = 4096


def plan_of(model: nn.Module, config: OffloadConfig | None = None) -> OffloadPlan:
    config = config or OffloadConfig(group_size=1, num_in_group=1, prefetch_step=2)
    return make_plan(describe_layers(layer_list(model)), config, EnvSnapshot())


def info(rank: int, *, host: str = "a", boot: str = "b1", shm: str = "7", digest: str = "d", seg: int = 100,
         session: str | None = None) -> MemberInfo:
    return MemberInfo(rank=rank, host=host, boot_id=boot, shm_id=shm, pid=1000 + rank,
                      session=session or f"s{rank}", digest=digest, storages=3, host_bytes=90, segment_bytes=seg)


@pytest.mark.parametrize("align", [CACHE_LINE, PAGE])
def test_slots_are_aligned_disjoint_in_plan_order_and_skip_ties(align: int) -> None:
    plan = plan_of(mixed_model())
    layout = lay_out(plan, align)
    owners = [(p.layer, p.name) for p in plan.offloaded_params if p.tied_to is None and p.nbytes]
    assert [s.ref for s in layout.slots] == owners
    ends = 0
    for s in layout.slots:
        assert s.offset % align == 0 and s.offset >= ends
        ends = s.offset + s.nbytes
    assert layout.total_bytes % align == 0 and ends <= layout.total_bytes < ends + align
    assert layout.payload_bytes == sum(p.nbytes for p in plan.offloaded_params if p.tied_to is None)
    tied = [p for p in plan.offloaded_params if p.tied_to is not None]
    assert tied and all(layout.slot((p.layer, p.name)) is None for p in tied)  # one copy per storage


@given(st.integers(min_value=0, max_value=16).map(lambda k: 1 << k))
def test_any_power_of_two_aligns(align: int) -> None:
    layout = lay_out(plan_of(transformer_model(1)), align)
    assert all(s.offset % align == 0 for s in layout.slots)


@pytest.mark.parametrize("align", [0, 3, 48, -64])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(align: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        lay_out(plan_of(transformer_model(1)), align)


def test_nothing_offloaded_lays_out_nothing() -> None:
    layout = lay_out(plan_of(transformer_model(2), OffloadConfig(backend="none")), PAGE)
    assert layout.slots == () and layout.total_bytes == 0


def test_the_fingerprint_is_equal_for_equal_weights_and_differs_for_any_difference() -> None:
    a, b = weights_of(plan_of(transformer_model(2, seed=1))), weights_of(plan_of(transformer_model(2, seed=2)))
    assert weights_digest(a, CACHE_LINE, "none") == weights_digest(b, CACHE_LINE, "none")  # values are not in it
    assert weights_digest(a, CACHE_LINE, "none") != weights_digest(a, PAGE, "none")
    assert weights_digest(a, PAGE, "register") != weights_digest(a, PAGE, "alloc")
    model = transformer_model(2)
    weight = model.get_parameter("1.mlp.up.weight")
    weight.data = weight.data.half()
    assert weights_digest(weights_of(plan_of(model)), CACHE_LINE, "none") != weights_digest(a, CACHE_LINE, "none")


def test_a_difference_is_described_by_parameter_count_or_alignment() -> None:
    ours = weights_of(plan_of(transformer_model(2)))
    other = list(ours)
    layer, name, shape, stride, _, tied = other[5]
    other[5] = (layer, name, shape, stride, "bfloat16", tied)
    text = describe_mismatch(0, ours, 3, other, reference_align=64, align=64)
    assert text.startswith("offloaded parameter #5: rank 0 has layer 0")
    assert "float32" in text and "rank 3 has" in text and "bfloat16" in text
    shorter = describe_mismatch(0, ours, 1, ours[:-2], reference_align=64, align=64)
    assert f"rank 0 offloads {len(ours)} parameters, rank 1 offloads {len(ours) - 2}" in shorter
    assert "the first only rank 0 has: layer 1" in shorter
    assert "4096-byte alignment, rank 0 at 64" in describe_mismatch(0, ours, 2, ours, reference_align=64, align=4096)


def test_tied_weights_name_their_tie_in_a_difference() -> None:
    tied = weights_of(plan_of(nn.Sequential(TiedBlock())))
    untied = [(*entry[:5], None) for entry in tied]
    text = describe_mismatch(0, tied, 1, untied, reference_align=64, align=64)
    assert text.startswith("offloaded parameter #1: rank 0 has layer 0 parameter 'b.weight'")
    assert "tied to layer 0 'a.weight', rank 1 has" in text


def test_mismatched_ranks_are_those_differing_from_the_lowest_rank() -> None:
    assert mismatched([info(3, digest="x"), info(1), info(2, digest="y"), info(5)]) == (2, 3)
    assert mismatched([info(0), info(1)]) == ()
    assert mismatched([]) == ()


def test_members_share_per_host_led_by_the_lowest_rank() -> None:
    infos = [info(4, host="b"), info(0), info(5, host="b"), info(1), info(2, boot="b2"), info(3, shm="9")]
    plans = {r: plan_sharing(infos, r, timeout_s=5) for r in range(6)}
    assert [h.ranks for h in plans[0].hosts] == [(0, 1), (2,), (3,), (4, 5)]  # boot id and shm id tell hosts apart
    assert plans[1].role == "follower" and plans[1].leader == 0 and plans[0].role == "leader"
    assert plans[5].local.ranks == (4, 5) and plans[5].leader == 4 and plans[5].shared
    assert plans[2].role == "alone" and "the only member" in plans[2].reason and plans[2].segment_bytes == 0
    assert {p.session for p in plans.values()} == {"s0"}  # the lowest rank's names the group's keys
    assert plans[1].group_ranks == (0, 1, 2, 3, 4, 5)


def test_bytes_per_process_and_per_host() -> None:
    p = plan_sharing([info(r, seg=120) for r in range(4)], 1, timeout_s=5)
    assert (p.host_bytes, p.segment_bytes) == (90, 120)
    assert p.host_bytes_per_host == 120 and p.host_bytes_unshared_per_host == 360 and p.host_bytes_per_process == 30
    alone = plan_sharing([info(0, seg=120)], 0, timeout_s=5)
    assert alone.host_bytes_per_host == 90 == alone.host_bytes_unshared_per_host


def test_nothing_to_share_is_not_shared() -> None:
    p = plan_sharing([info(0, seg=0), info(1, seg=0)], 1, timeout_s=5)
    assert not p.shared and p.role == "alone" and p.reason == "nothing is offloaded to host memory"


def test_a_rank_twice_or_missing_is_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        plan_sharing([info(0), info(0)], 0, timeout_s=5)
    with pytest.raises(ValueError, match="rank 7 is not a member"):
        plan_sharing([info(0)], 7, timeout_s=5)


def test_the_sharing_plan_is_an_immutable_value() -> None:
    p = plan_sharing([info(0), info(1)], 1, timeout_s=5)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.rank = 3  # type: ignore[misc]
    assert p == plan_sharing([info(1), info(0)], 1, timeout_s=5)


def test_render_says_who_writes_what_is_saved_and_the_hosts() -> None:
    infos = [info(r, seg=1 << 30) for r in range(4)] + [info(r, host="n2", seg=1 << 30) for r in (4, 5)]
    text = render_sharing(plan_sharing(infos, 2, timeout_s=30))
    assert "ranks 0-3 on host a map one host copy, written by rank 0 (this is rank 2, a follower" in text
    assert "1 copy of 1.00 GiB on this host instead of 4 x 90 B" in text and "256.0 MiB per process" in text
    assert "hosts:    a: ranks 0-3; n2: ranks 4, 5" in text
    assert "timeout:  30 s per step" in text
    lone = render_sharing(plan_sharing([info(0)], 0, timeout_s=1))
    assert "not shared" in lone and "hosts:    a: rank 0" in lone


@pytest.mark.parametrize(("ranks", "text"), [([0, 1, 2, 3], "0-3"), ([4, 5], "4, 5"), ([0, 2, 5], "0, 2, 5"),
                                             ([7], "7"), ([3, 1, 2], "1-3")])
def test_ranks_text(ranks: list[int], text: str) -> None:
    assert ranks_text(ranks) == text


SMAPS = """\
7f00000000-7f00100000 r--s 00000000 00:1b 239                        /dev/shm/offload-abc (deleted)
Size:               1024 kB
KernelPageSize:        4 kB
Rss:                 512 kB
Pss:                 128 kB
Shared_Clean:        512 kB
7f00100000-7f00200000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
Pss:                1024 kB
7f00200000-7f00300000 rw-s 00000000 00:1b 239                        /dev/shm/offload-abc (deleted)
Size:               1024 kB
Rss:                1024 kB
Pss:                 256 kB
VmFlags: rd wr sh mr mw me ms sd
"""


def test_smaps_entries_of_one_segment_are_added_up() -> None:
    m = parse_smaps(SMAPS, "offload-abc")
    assert (m.mappings, m.size_bytes, m.rss_bytes, m.pss_bytes) == (2, 2048 << 10, 1536 << 10, 384 << 10)
    assert parse_smaps(SMAPS, "offload-other").mappings == 0
