"""Sharing host copies on a real CUDA device: two rank processes on one GPU,
plans made for this machine (pinning as it decides: the leader registers its slots with
cudaHostRegister, followers theirs with cudaHostRegisterReadOnly), weights from the
host. Outputs bit for bit against a resident copy on the device, every host copy
page-locked and in the segment, the live check clean, the segment's memory once, restore.

Skipped without CUDA (see conftest.py). The ranks come from `tests.sharing.cluster`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sharing.cluster import run_ranks


@pytest.mark.parametrize("kind", ["prefetch", "uva"])
def test_two_ranks_share_one_page_locked_copy(kind: str, tmp_path: Path) -> None:
    results = [r.result for r in run_ranks(2, "cuda", tmp_path, deadline_s=120, kind=kind)]
    assert [r["role"] for r in results] == ["leader", "follower"]
    for r in results:
        assert all(r["equal"]), r
        assert r["in_segment"] == r["offloaded"] > 0, r
        if r["pin"] == "register":
            assert r["pinned"] == r["offloaded"] and r["fallbacks"] == 0, r  # read-only registration worked
        assert r["differences"] == [], r
        assert r["restored"], r
    assert sum(r["pss"] for r in results) <= 1.05 * results[0]["host_bytes"]
