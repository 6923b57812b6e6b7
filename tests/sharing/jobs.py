"""A job of several sharing groups as threads of this process (tensor-parallel ranks share
with different groups and are still one job): each member gathers over its own group
and over the whole job (`Membership.job_gather`), through barriers, with one in-process
``HashStore``. Built like `tests.sharing.members`, whose `Outcome` it returns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch._C._distributed_c10d import HashStore

from offload.sharing.coordinate import Gather, Membership
from tests.sharing.members import JOIN_S, Outcome, run_threads

__all__ = ["run_job"]

T = TypeVar("T")


class _Gathering:
    """One collective's members (global ranks): ``gather(rank)`` is a member's gather."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        self._ranks = list(ranks)
        self._barrier = threading.Barrier(len(ranks))
        self._slots: dict[int, object] = {}

    def gather(self, rank: int) -> Gather:
        def gather(obj: object) -> list[Any]:
            self._slots[rank] = obj
            self._barrier.wait(JOIN_S)
            out = [self._slots[r] for r in self._ranks]
            self._barrier.wait(JOIN_S)
            return out

        return gather


def run_job(groups: Sequence[Sequence[int]], member: Callable[[int, Membership], T],
            hosts: Sequence[tuple[str, str, str]] | None = None) -> list[Outcome]:
    """Run ``member(rank, membership)`` for every rank of the job (ranks 0 to n - 1, each
    in exactly one of `groups`, its sharing group) in its own thread under
    ``torch.no_grad()``; each thread's result or exception, in rank order. `hosts`: the
    (hostname, boot id, shm id) each rank reports (None: this machine's).

    Raises:
        AssertionError: the groups do not cover ranks 0 to n - 1 once, or a thread did not
            finish within `JOIN_S` seconds.
    """
    size = sum(len(g) for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(size)), groups
    store = HashStore()
    job = _Gathering(range(size))
    gatherings = [_Gathering(sorted(g)) for g in groups]
    of_rank = {r: gathering for g, gathering in zip(groups, gatherings, strict=True) for r in g}

    def body(rank: int) -> T:
        membership = Membership(rank=rank, ranks=of_rank[rank].ranks, gather=of_rank[rank].gather(rank), store=store,
                                host=hosts[rank] if hosts is not None else None, job_gather=job.gather(rank),
                                job_ranks=range(size))
        return member(rank, membership)

    return run_threads(size, body)
