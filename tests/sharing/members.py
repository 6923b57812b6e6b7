"""Members of a sharing group as threads of this process: a fake `Membership` (a gather
over a barrier, one in-process ``HashStore``), for fast tests of the protocol.

Threads run under ``torch.no_grad()`` themselves (grad mode is per thread), and models
are built before the threads start (``torch.manual_seed`` is global).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch
from torch._C._distributed_c10d import HashStore

from offload.sharing.coordinate import Membership

__all__ = ["Outcome", "ThreadGroup", "run_members", "run_threads"]

T = TypeVar("T")

#: The longest a test waits for its threads, in seconds.
JOIN_S = 30.0


class ThreadGroup:
    """`size` members in one process, gathering through a barrier."""

    def __init__(self, size: int, hosts: list[tuple[str, str, str]] | None = None) -> None:
        self.size = size
        self.hosts = hosts
        self.store = HashStore()
        self._barrier = threading.Barrier(size)
        self._slots: list[object] = [None] * size

    def membership(self, rank: int) -> Membership:
        """The membership of member `rank` (0 to size - 1)."""

        def gather(obj: object) -> list[Any]:
            self._slots[rank] = obj
            self._barrier.wait(JOIN_S)
            out = list(self._slots)
            self._barrier.wait(JOIN_S)
            return out

        return Membership(rank=rank, ranks=range(self.size), gather=gather, store=self.store,
                          host=self.hosts[rank] if self.hosts is not None else None)


@attrs.frozen
class Outcome:
    """What one member's function returned, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None

    def get(self) -> Any:
        """The value; the exception raised again where there was one."""
        if self.error is not None:
            raise self.error
        return self.value


def run_members(size: int, member: Callable[[int, Membership], T],
                hosts: list[tuple[str, str, str]] | None = None) -> list[Outcome]:
    """Run ``member(rank, membership)`` for every rank in its own thread, under
    ``torch.no_grad()``; each thread's result or exception, in rank order. `hosts`:
    the (hostname, boot id, shm id) each member reports (None: this machine's).

    Raises:
        AssertionError: a thread did not finish within `JOIN_S` seconds.
    """
    group = ThreadGroup(size, hosts)
    return run_threads(size, lambda rank: member(rank, group.membership(rank)))


def run_threads(size: int, body: Callable[[int], Any]) -> list[Outcome]:
    """Run ``body(rank)`` for every rank in its own thread under ``torch.no_grad()``; each
    thread's result or exception, in rank order.

    Raises:
        AssertionError: a thread did not finish within `JOIN_S` seconds.
    """
    outcomes: list[Outcome] = [Outcome() for _ in range(size)]

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                outcomes[rank] = Outcome(value=body(rank))
        except BaseException as exc:  # reported to the test, which asserts on it
            outcomes[rank] = Outcome(error=exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a member thread hung"
    return outcomes
