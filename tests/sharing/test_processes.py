"""Sharing across real processes on this machine: 2 and 4 ranks over torch.distributed
(gloo, a FileStore), each building the same seeded model. Outputs bit for bit, the
memory the one copy takes (Pss summed over ranks), restore, and what a killed or
mismatched member does to the others (one that never comes: `test_arrival.py`). Every
test leaves /dev/shm as it found it (conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sharing.cluster import run_ranks
from tests.sharing.workers import TIMEOUT_S

#: The most the Pss of the segment, summed over every rank, may be: per offloaded byte.
PSS_LIMIT = 1.05


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_runs_bit_for_bit_from_one_copy_that_takes_the_memory_of_one(world: int, tmp_path: Path) -> None:
    kinds = ["prefetch", "uva"] if world == 2 else ["prefetch"]
    results = [r.result for r in run_ranks(world, "parity", tmp_path, kinds=kinds)]
    for kind in kinds:
        seen = [r[kind] for r in results]
        assert len({s["segment"] for s in seen}) == 1
        for s in seen:
            assert all(s["equal"]) and all(s["equal_after_restore"]), kind
            assert s["in_segment"] == s["offloaded"] > 0, kind
            assert s["restored"] == "", kind
            assert s["mappings_after_restore"] == 0, kind  # restored: the process maps nothing any more
            # Each rank really maps (and has touched) the whole copy...
            assert s["memory"]["mappings"] == 1 and s["memory"]["rss"] >= s["host_bytes"], kind
        # ... and the pages are there once: Pss adds up to one copy, not `world`.
        offloaded = seen[0]["host_bytes"]
        pss = sum(s["memory"]["pss"] for s in seen)
        assert pss <= PSS_LIMIT * offloaded, (kind, pss, offloaded)
        assert pss >= 0.95 * offloaded, (kind, pss, offloaded)


def test_engine_lifecycle_on_four_ranks_ends_with_one_copy(tmp_path: Path) -> None:
    results = [r.result for r in run_ranks(4, "engine", tmp_path, kind="prefetch")]
    for r in results:
        assert all(r["equal"]) and r["restored_bits"]
        assert r["in_segment"] == r["offloaded"] > 0
    assert sum(r["memory"]["pss"] for r in results) <= PSS_LIMIT * results[0]["host_bytes"]


def test_a_leader_killed_before_publishing_makes_the_others_raise_within_the_timeout(tmp_path: Path) -> None:
    ranks = run_ranks(3, "leader_killed", tmp_path)
    assert ranks[0].exitcode == 17 and ranks[0].written is None  # it died where it was meant to
    for follower in ranks[1:]:
        r = follower.result
        assert "for rank 0 to write the shared host copy" in r["error"], r["error"]
        assert r["seconds"] < 2 * TIMEOUT_S + 3  # the wait spans two of the leader's steps
        assert r["untouched"]


def test_a_follower_killed_after_mapping_leaves_the_others_working(tmp_path: Path) -> None:
    ranks = run_ranks(3, "follower_killed", tmp_path)
    assert ranks[1].exitcode == 0 and ranks[1].written is None
    for survivor in (ranks[0], ranks[2]):
        r = survivor.result
        assert r["dead"] and all(r["first"]) and all(r["after"]) and r["restored"]


def test_mismatched_members_are_refused_by_name(tmp_path: Path) -> None:
    leader, follower = (r.result for r in run_ranks(2, "mismatch", tmp_path))
    for r in (leader, follower):
        assert "rank 1 differ from rank 0's" in r["refused"]
        assert "layer 1 parameter 'mlp.down.weight'" in r["refused"] and "bfloat16" in r["refused"]
    for r in (leader, follower):  # other values of the same shapes: refused at wrap_modules on both
        assert "rank 1's weights differ from the shared host copy rank 0 wrote" in r["differs"]
        assert r["restored"]
