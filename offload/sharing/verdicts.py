"""What the followers of a sharing group found comparing their values with their host's
copy (`Verdicts`), at each ``wrap_modules`` and ``post_init``: every member waits for all
of them before the call returns, so that other values anywhere (tensor-parallel ranks
put in one group) stop the whole group at that call, on every host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from torch.distributed.distributed_c10d import Store

from offload.errors import ExecutionError
from offload.pure.sharing.plan import describe_differences
from offload.pure.units import ranks_text
from offload.sharing.coordinate import Channel

__all__ = ["Verdicts"]


#: Weights a follower names in its verdict (the rest are counted).
_NAMED = 3


@final
class Verdicts:
    """What the group's followers found comparing their values with their host's copy:
    one verdict per follower that checks (`SharingPlan.verifiers`) and lifecycle call,
    as keys in the store that every member of the group, on every host, reads.

    A verdict is ``{"ok": true, "leader": rank, "differ": [[layer, name], ...], "count":
    n}`` (the leader whose copy it compared with, the first weights whose sample
    differs, how many differ; none: equal), or ``{"ok": false, "error": ...}`` from a
    follower that failed before it could compare.

    Args:
        store: the store every member reaches.
        prefix: this group session's verdict keys.
        rank: this process's global rank.
        verifiers: the followers that compare, ascending (the same on every member).
        timeout_s: the longest one of another member's steps may take, in seconds.
    """

    def __init__(self, store: Store, prefix: str, rank: int, verifiers: Sequence[int], timeout_s: float) -> None:
        self._channel = Channel(store, prefix, rank, timeout_s)
        self._rank = rank
        self.verifiers = tuple(verifiers)

    def publish(self, call: str, leader: int, differ: Sequence[tuple[int, str]]) -> None:
        """This follower's verdict on `call`: the weights (layer, name) whose values
        differ from rank `leader`'s copy, in plan order; none: equal.

        Raises:
            ExecutionError: the store failed.
        """
        self._channel.put(f"{call}/{self._rank}", {"ok": True, "leader": leader, "count": len(differ),
                                                   "differ": [list(ref) for ref in differ[:_NAMED]]})

    def fail(self, call: str, error: BaseException | str) -> None:
        """This follower failed `call` before it could compare (never raises)."""
        self._channel.fail(f"{call}/{self._rank}", error)

    def collect(self, call: str, what: str, left: str, *, steps: int = 2) -> None:
        """Wait for every verifier's verdict on `call`; return when every one found its
        values equal to its host's copy.

        Args:
            call: the lifecycle call's key (one per wrap attempt and post_init).
            what: its name for messages ("wrap_modules", "post_init").
            left: what the failed call leaves on this member, in words.
            steps: the wait spans that many of another member's steps (a follower on
                another host compares after its own leader's steps).

        Raises:
            ExecutionError: some follower's values differ (``value`` those ranks; the
                message names the first weight of each and the leader it compared with),
                some follower failed `what` (``value`` those ranks), or did not answer
                within `steps` timeouts (``value`` the ranks not heard from).
        """
        ranks = self.verifiers
        values = self._channel.wait([f"{call}/{r}" for r in ranks], ranks,
                                    f"compare its weights with its host's shared copy at {what}", steps=steps)
        differ = [(r, v) for r, v in zip(ranks, values, strict=True) if v.get("ok") and v.get("count")]
        if differ:
            named = [(r, int(v.get("leader", -1)), _first(v), int(v["count"])) for r, v in differ]
            raise ExecutionError(describe_differences(named, what, left), name="share_with",
                                 value=tuple(r for r, _ in differ))
        failed = [(r, v) for r, v in zip(ranks, values, strict=True) if not v.get("ok")]
        if failed:
            rank, verdict = failed[0]
            who = f"rank{'s' if len(failed) > 1 else ''} {ranks_text([r for r, _ in failed])}"
            raise ExecutionError(f"rank {rank} failed {what} ({verdict.get('error')}), so {who} could not compare "
                                 f"its weights with its host's shared copy: every member of the sharing group stops "
                                 f"at {what}; {left}", name="share_with", value=tuple(r for r, _ in failed))


def _first(verdict: dict[str, Any]) -> tuple[int, str]:
    """The first weight a verdict names, as (layer, name)."""
    names = verdict.get("differ")
    if isinstance(names, list) and names and isinstance(names[0], list) and len(names[0]) == 2:
        return int(names[0][0]), str(names[0][1])
    return -1, "?"
