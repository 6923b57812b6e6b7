"""A member of a sharing group as the sharing offloader holds it: what was decided, its
segment and its keys, the seconds it spent (`SharingTimes`), and the group's verdicts on
the values of its followers (`_judge`, `_hear`, `_tell_failure`), which every member waits
for at `wrap_modules` and `post_init` (see `offload.sharing.offloader`).

The parts build on it in one line: `SharedMember` → `SharedWrap` (`wrapping.py`) →
`SharedOffloader` (`offloader.py`).
"""


from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
from torch import nn

from offload.errors import ExecutionError
from offload.executors.common import Ref
from offload.protocols import Offloader, Runtime
from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.memory import HostMemory
from offload.pure.sharing.plan import SegmentLayout, SharingPlan
from offload.sharing.coordinate import Channel
from offload.sharing.segment import SegmentMapping
from offload.sharing.source import SharedHostSource
from offload.sharing.verdicts import Verdicts

__all__ = ["SharedMember", "SharingTimes"]


@attrs.frozen(kw_only=True)
class SharingTimes:
    """Where `wrap_modules` and `post_init` spent their time on this member, in seconds.

    Attributes:
        map_s: the leader: creating, mapping and reserving the segment's pages (which
            zeroes them); a follower: opening and mapping it.
        wait_s: waiting for other members (the leader: for every follower to map it;
            a follower: for the leader to write it, and to finish post_init; every
            member: for the group's verdicts on their values).
        write_s: the executor's moves: on the leader, writing every weight into the
            segment; on a follower, pointing its weights at it.
        publish_s: leader: from the start of wrap_modules until the copy was written
            and announced; 0 on followers.
    """

    map_s: float = 0.0
    wait_s: float = 0.0
    write_s: float = 0.0
    publish_s: float = 0.0


class SharedMember:
    """What a member holds, and the group's verdicts (see `SharedOffloader`)."""

    def __init__(self, inner: Offloader, sharing: SharingPlan, layout: SegmentLayout,
                 source: SharedHostSource | None, channel: Channel | None, *, shm_dir: str,
                 numa_node: int | None = None, refused: HostMemory | None = None,
                 verdicts: Verdicts | None = None, runtime: Runtime | None = None) -> None:
        self._inner = inner
        self._rt = runtime
        self._refused = refused
        self._verdicts = verdicts
        self._sharing = sharing
        self._layout = layout
        self._source = source
        self._channel = channel
        self._shm_dir = shm_dir
        self._numa_node = numa_node
        self._layers: list[nn.Module] = []
        self._wrapped = False  # wrapped and not restored
        self._done = False  # wrap_modules succeeded once (the executor refuses another)
        self._attempts = 0  # wrap_modules calls that ran the protocol
        self._prefix = ""  # the store keys of the wrap that succeeded
        self._post_inits = 0
        self._reloads = 0  # load_weights calls that ran the protocol
        self._told: set[str] = set()  # the calls this follower's verdict (or failure) is out for
        self._times = SharingTimes()

    # ---- what it runs ---------------------------------------------------------------

    @property
    def plan(self) -> OffloadPlan:
        """The executor's plan (revised at post_init as the executor revises it)."""
        return self._inner.plan

    @property
    def sharing(self) -> SharingPlan:
        """Who shares this process's host copies, who writes them, the bytes per process
        and per host (`offload.sharing.render_sharing` shows it)."""
        return self._sharing

    @property
    def inner(self) -> Offloader:
        """The executor (`PrefetchOffloader`, `UVAOffloader` or `NoopOffloader`)."""
        return self._inner

    @property
    def layout(self) -> SegmentLayout:
        """Where each host copy lies in the segment."""
        return self._layout

    @property
    def segment(self) -> SegmentMapping | None:
        """This process's mapping of the segment while it holds one (None otherwise)."""
        return self._source.mapping if self._source is not None else None

    @property
    def times(self) -> SharingTimes:
        """Seconds spent mapping, waiting and writing so far."""
        return self._times

    # ---- the group's verdicts -------------------------------------------------------

    def _left(self, what: str) -> str:
        """What a refused `what` leaves on this member, in words."""
        if what == "wrap_modules":
            return f"rank {self._sharing.rank}'s model is left as it was"
        return f"weights left in host memory on rank {self._sharing.rank} (restore() gives them back)"

    def _judge(self, call: str, what: str, differ: Sequence[Ref]) -> float:
        """Follower: tell the group what this member found comparing its values at `call`
        (`differ`: the weights that differ), then hear every verifier's verdict; the
        seconds it waited.

        Raises:
            ExecutionError: some follower's values differ, or it failed (every member
                raises the same).
        """
        verdicts = self._verdicts
        if verdicts is None or self._sharing.rank not in verdicts.verifiers:
            if differ:  # a follower that compares is a verifier: this guards the invariant
                raise ExecutionError(f"rank {self._sharing.rank}'s weights differ from the shared host copy (layer "
                                     f"{differ[0][0]} parameter {differ[0][1]!r}); {self._left(what)}",
                                     name="share_with", value=(self._sharing.rank,))
        else:
            verdicts.publish(call, self._sharing.leader, differ)
            self._told.add(call)
        return self._hear(call, what, undo=False)

    def _hear(self, call: str, what: str, *, undo: bool) -> float:
        """Wait for every verifier's verdict on `call` (none without verdicts); the
        seconds it waited. With `undo` (a wrap whose executor already moved the
        weights, `_layers` set), a refusal first puts the model back as it was
        (`restore`: bit for bit, in private memory).

        Raises:
            ExecutionError: as `Verdicts.collect`.
        """
        verdicts = self._verdicts
        if verdicts is None:
            return 0.0
        start = time.monotonic()
        try:
            verdicts.collect(call, what, self._left(what))
        except BaseException:
            if undo:
                self.restore()  # private weights again (none over the segment), the segment let go
            raise
        return time.monotonic() - start

    def _tell_failure(self, call: str, error: BaseException) -> None:
        """Follower: a failure of `call` before this member's verdict was out, told to
        the group in its place (so that nobody waits for it); never raises."""
        verdicts = self._verdicts
        if verdicts is not None and self._sharing.rank in verdicts.verifiers and call not in self._told:
            verdicts.fail(call, error)
            self._told.add(call)

    def restore(self) -> None:
        """`SharedOffloader.restore`: what the parts call to put a wrap back as it was."""
        raise NotImplementedError
