"""Every wait of the sharing protocol is bounded by `ShareWith.timeout_s`, the gathers of
``create_offloader`` included: a member that never calls it makes the others raise
`ExecutionError` within the timeout, naming it (``value``: the ranks that did not come),
instead of waiting in ``all_gather_object`` for the process group's own timeout (30
minutes on gloo). The arrival barrier itself (`arrive`) over one in-process store, the
protocol with members as threads, and once with real processes over gloo."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch._C._distributed_c10d import HashStore

from offload import ConfigError, ExecutionError
from offload.pure.sharing.plan import MemberInfo
from offload.runtime.cpu import CpuRuntime
from offload.sharing import ShareWith, share_offloader
from offload.sharing.arrival import arrive
from offload.sharing.coordinate import Membership
from tests.executors.helpers import cpu_plan
from tests.sharing.cluster import run_ranks
from tests.sharing.jobs import run_job
from tests.sharing.members import run_members, run_threads
from tests.sharing.scenarios import CONFIGS, build
from tests.sharing.workers import GLOO_TIMEOUT_S
from tests.sharing.workers import TIMEOUT_S as PROCESS_TIMEOUT_S

#: Seconds a member waits for another where the test waits for the timeout to run out.
TIMEOUT_S = 1.0
#: Seconds a member waits where the others must come (or fail) well within.
PATIENT_S = 10.0


def refused(call: Any) -> tuple[ExecutionError, float]:
    """(the ExecutionError `call` raised, seconds until it came); it must raise one."""
    start = time.monotonic()
    try:
        call()
    except ExecutionError as exc:
        return exc, time.monotonic() - start
    raise AssertionError("no ExecutionError")


def create(m: Membership, *, timeout_s: float = TIMEOUT_S, dtype: torch.dtype | None = None) -> Any:
    """A member's ``share_offloader`` call, for `refused` (one weight in `dtype` where given)."""
    model = build(2, hidden=32)
    if dtype is not None:
        weight = model.get_parameter("1.mlp.up.weight")
        weight.data = weight.data.to(dtype)
    plan = cpu_plan(model, CONFIGS["prefetch"])
    return lambda: share_offloader(plan, CpuRuntime(), ShareWith(timeout_s=timeout_s), membership=m)


def test_a_member_that_never_calls_create_offloader_makes_the_others_raise_within_the_timeout() -> None:
    def member(rank: int, m: Membership) -> tuple[ExecutionError, float] | None:
        if rank == 2:
            return None  # never calls create_offloader
        return refused(create(m))

    outcomes = [o.get() for o in run_members(3, member)]
    assert outcomes[2] is None
    for outcome in outcomes[:2]:
        assert outcome is not None
        exc, seconds = outcome
        assert exc.name == "share_with" and exc.value == (2,)
        assert "for rank 2 to call create_offloader with share_with" in str(exc)
        assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 3


def test_a_process_of_the_job_that_never_calls_makes_every_other_raise_within_the_timeout() -> None:
    # Two sharing groups of one job ({0, 2} and {1, 3}): rank 3 never calls. Rank 1 waits
    # for it in its group's gather; ranks 0 and 2 meet in theirs, then wait in the job's
    # for ranks 1 and 3 (rank 1 raised before it came there).
    def member(rank: int, m: Membership) -> tuple[ExecutionError, float] | None:
        if rank == 3:
            return None
        return refused(create(m))

    outcomes = [o.get() for o in run_job([[0, 2], [1, 3]], member)]
    by_rank = {rank: o for rank, o in enumerate(outcomes) if o is not None}
    assert sorted(by_rank) == [0, 1, 2]
    exc, seconds = by_rank[1]
    assert exc.value == (3,) and "for rank 3 to call create_offloader with share_with" in str(exc)
    assert seconds < TIMEOUT_S + 3
    for rank in (0, 2):
        exc, seconds = by_rank[rank]
        assert exc.value == (1, 3), exc.value
        assert "for ranks 1, 3 to" in str(exc) and "host memory" in str(exc)
        assert seconds < 2 * TIMEOUT_S + 3


def test_a_member_that_skips_the_mismatch_exchange_makes_the_others_raise_within_the_timeout() -> None:
    # Rank 2 offloads a weight in another dtype, and (by its fake gather) believes every
    # member's digest equals its own: it skips the second gather the others hold to name
    # the difference, and goes straight to the job's exchange, where they tell it.
    def member(rank: int, m: Membership) -> tuple[ExecutionError, float]:
        if rank != 2:
            return refused(create(m))
        real = m.gather

        def believing(obj: object) -> list[Any]:
            out = real(obj)
            if isinstance(obj, MemberInfo):
                return [attrs.evolve(g, digest=obj.digest) if isinstance(g, MemberInfo) else g for g in out]
            return out

        return refused(create(attrs.evolve(m, gather=believing), timeout_s=PATIENT_S, dtype=torch.float64))

    outcomes = [o.get() for o in run_members(3, member)]
    for exc, seconds in outcomes[:2]:
        assert exc.value == (2,) and "for rank 2 to" in str(exc) and "differ" in str(exc)
        assert TIMEOUT_S * 0.9 <= seconds < TIMEOUT_S + 3
    exc, seconds = outcomes[2]
    assert "rank 0 failed creating its offloader" in str(exc) and exc.value == (0, 1)
    assert seconds < PATIENT_S


# ---- the arrival barrier itself -----------------------------------------------------------


def test_members_meet_again_and_again_each_call_its_own_meeting() -> None:
    store = HashStore()
    numbers = run_threads(3, lambda rank: [arrive(store, rank=rank, ranks=(0, 1, 2), topic="t", doing="meet",
                                                  timeout_s=PATIENT_S) for _ in range(3)])
    assert [o.get() for o in numbers] == [[1, 2, 3]] * 3


def test_a_member_that_comes_after_the_others_stopped_waiting_raises_at_once_and_the_next_meeting_holds() -> None:
    store = HashStore()
    first, _ = refused(lambda: arrive(store, rank=0, ranks=(0, 1), topic="t", doing="meet", timeout_s=0.3))
    assert first.value == (1,) and "for rank 1 to meet" in str(first)
    late, seconds = refused(lambda: arrive(store, rank=1, ranks=(0, 1), topic="t", doing="meet", timeout_s=PATIENT_S))
    assert late.value == (1,) and "stopped waiting" in str(late) and seconds < 0.3  # told, not timed out
    again = run_threads(2, lambda rank: arrive(store, rank=rank, ranks=(0, 1), topic="t", doing="meet",
                                               timeout_s=PATIENT_S))
    assert [o.get() for o in again] == [2, 2]


def test_meetings_of_other_topics_or_groups_do_not_mix() -> None:
    store = HashStore()
    for _ in range(2):  # a group of one meets alone, each time afresh
        arrive(store, rank=0, ranks=(0,), topic="t", doing="meet", timeout_s=PATIENT_S)
    assert arrive(store, rank=0, ranks=(0,), topic="u", doing="meet", timeout_s=PATIENT_S) == 1  # counted apart
    exc, _ = refused(lambda: arrive(store, rank=0, ranks=(0, 1), topic="t", doing="meet", timeout_s=0.2))
    assert exc.value == (1,)


def test_a_rank_outside_the_meeting_is_refused() -> None:
    with pytest.raises(ExecutionError, match="rank 5 is not one of ranks 0, 1") as info:
        arrive(HashStore(), rank=5, ranks=(0, 1), topic="t", doing="meet", timeout_s=PATIENT_S)
    assert info.value.value == 5


def test_the_arrival_wait_ends_when_another_member_gives_up() -> None:
    # Rank 2 never comes; rank 0 gives up after 0.3 s, and rank 1, patient, hears of it then.
    store = HashStore()

    def member(rank: int) -> tuple[ExecutionError, float]:
        return refused(lambda: arrive(store, rank=rank, ranks=(0, 1, 2), topic="t", doing="meet",
                                      timeout_s=0.3 if rank == 0 else PATIENT_S))

    (first, _), (second, seconds) = (o.get() for o in run_threads(2, member))
    assert first.value == (2,) and second.value == (2,)
    assert "stopped waiting" in str(second) and seconds < 3  # not its own 10 s


# ---- real processes ---------------------------------------------------------------------


def test_a_process_that_never_calls_makes_the_others_raise_long_before_gloos_timeout(tmp_path: Path) -> None:
    ranks = run_ranks(3, "absent", tmp_path)
    assert ranks[2].result == {"absent": True}
    for rank in ranks[:2]:
        r = rank.result
        assert r["type"] == "ExecutionError" and r["value"] == [2], r
        assert "for rank 2 to call create_offloader with share_with" in r["error"]
        assert r["seconds"] < PROCESS_TIMEOUT_S + 5 < GLOO_TIMEOUT_S


@pytest.mark.parametrize(("ranks", "job_ranks", "name"), [((0, 1), None, "ranks"), ((0, 3), (0, 1), "job_ranks")])
def test_a_membership_whose_rank_is_not_among_its_ranks_is_refused(ranks: tuple[int, ...],
                                                                   job_ranks: tuple[int, ...] | None,
                                                                   name: str) -> None:
    with pytest.raises(ConfigError, match=f"rank 3 is not among the {name} of its membership") as info:
        Membership(rank=3, ranks=ranks, gather=lambda obj: [obj], store=HashStore(), job_ranks=job_ranks)
    assert info.value.name == name and info.value.value == 3
