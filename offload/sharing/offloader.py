"""`SharedOffloader`: an executor whose host copies lie in one segment per host, shared by
the members of a torch.distributed group that hold identical weights.

``create_offloader(plan, share_with=group)`` builds it (`share_offloader`): every member
tells the others who it is and what it offloads (one ``all_gather_object``), mismatched
weights are refused on every member by name before anything is mapped, and the members
on each host share one copy (`SharingPlan`). Then every process of the job
(`ShareWith.job`) tells the others what it will take of its host's memory (a second
``all_gather_object``; a failure so far travels with it, so the whole job raises), and
each judges the sums per host alike (`offload.pure.sharing.admission`): its executor's plan
carries its part, and a host that does not fit is refused by ``wrap_modules`` on every
process, before anything moves. Each gather starts only once every member has come to
it (`arrive`, through the store): a member that never calls ``create_offloader`` makes
the others raise `ExecutionError` naming it within `ShareWith.timeout_s`, not the
process group's own timeout. Then, per host, through the store:

``wrap_modules``
    leader: create the segment (sparse), publish its name, wait until every follower
    has mapped it, unlink the name, reserve its pages, write every offloaded weight into
    it (the executor's own moves, with the `SharedHostSource`), say it is written.
    follower: map it read-only, wait until it is written, compare a sample of each of
    its weights that has data with its slot and tell the group (its verdict), then move:
    offloaded weights point at the read-only slots, or at private memory for weights
    still on meta (a loader fills those).
``post_init``
    leader: the executor's post_init (post-processed weights rewritten into their
    slots), then say the copy is final. follower: wait for that, compare the weights its
    loader filled likewise and tell the group, point them at their slots (the private
    memory is released by the executor's re-read), then the executor's post_init.
``restore``
    every member: the executor's restore, then weights that would come back as tensors
    over the segment get private copies, and the segment is let go. Its memory returns
    when the last process restores or exits.

Other values of the same shapes (tensor-parallel ranks put in one group) stop the whole
group: ``wrap_modules`` and ``post_init`` return on no member, on any host, before every
follower that compares (`SharingPlan.verifiers`, `ShareWith.verify`) has told what it
found (`Verdicts`), and where one differs every member raises at that call, naming the
ranks and the first weight: a follower moves nothing before the verdicts are in, the
leader (and a member alone on its host) puts back what its executor moved at a refused
wrap, and a refused post_init leaves the weights in host memory (``restore()`` works).

A member that fails tells the others in the key they wait on, so they raise at once (a
follower's failure takes the place of its verdict); one that dies makes them raise
`ExecutionError` when `ShareWith.timeout_s` runs out; nothing ever waits longer. A
follower's model is untouched until the leader's copy is complete and every verdict in.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.build import build_executor
from offload.executors.common import Ref
from offload.executors.reload import Weights
from offload.protocols import Offloader, RegisteredRanges, Runtime
from offload.pure.check import LiveCheck
from offload.pure.decide.pinning import PinMethod
from offload.pure.env.snapshot import Platform
from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.admission import (
    HostMemory,
    JobMemory,
    ProcessMemory,
    assess_job,
    job_plan,
    private_host_bytes,
    process_host_bytes,
    refusal_text,
)
from offload.pure.sharing.plan import (
    CACHE_LINE,
    MemberInfo,
    SegmentLayout,
    SharingPlan,
    describe_mismatch,
    lay_out,
    mismatched,
    plan_sharing,
    weights_digest,
    weights_of,
)
from offload.pure.stats import OffloadStats
from offload.pure.units import format_bytes, ranks_text
from offload.runtime.copies import span_chunks
from offload.sharing.arrival import arrive
from offload.sharing.coordinate import Channel, Membership, ShareWith, host_identity, membership_of
from offload.sharing.pinning import PinCalls
from offload.sharing.segment import (
    SegmentMapping,
    check_room,
    create_segment,
    open_segment,
    reserve_segment,
    shm_free_bytes,
    unlink_segment,
)
from offload.sharing.source import SharedHostSource, slot_moves
from offload.sharing.verdicts import Verdicts

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["SharedOffloader", "SharingTimes", "share_offloader"]

log = logging.getLogger(__name__)


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


def _private_copy(data: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own with `data`'s shape, strides, dtype and bits."""
    out = torch.empty_strided(tuple(data.shape), tuple(data.stride()), dtype=data.dtype, device="cpu")
    for dst, src in span_chunks(out, data):
        dst.copy_(src)
    return out


@final
class SharedOffloader:
    """An `Offloader` whose host copies are shared with the other members on its host.
    Create it with ``create_offloader(plan, share_with=group)``.

    Args:
        inner: the executor (its host copies come from `source`).
        sharing: what was decided (`SharingPlan`).
        layout: the segment's slots.
        source: this member's view of the segment; None when not shared.
        channel: this host's keys in the store; None when not shared.
        shm_dir: where the segment is made.
        numa_node: the NUMA node the leader places the segment's pages on; None: none.
        refused: the job's host whose memory does not fit and is refused
            (`JobMemory.refused`): `wrap_modules` raises, on every process of the job.
        verdicts: the group's followers' verdicts on their values, which every member
            waits for at `wrap_modules` and `post_init`; None when no follower compares.
        runtime: the executor's runtime (a follower waits for its device before the
            leader writes new weights, `load_weights`); None: it cannot wait.
    """

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

    # ---- lifecycle ------------------------------------------------------------------

    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """The executor's `wrap_modules`, with the host's one copy: the leader writes it,
        followers map it read-only (see the module docstring). It returns once every
        follower of the group that compares (`SharingPlan.verifiers`) found its values
        equal to its host's copy.

        Raises:
            ExecutionError: the host memory of the job's processes on some host does not
                fit and a process there refuses that (``host_check="refuse"``): raised on
                every process of the job, before anything moved, with the limit, the
                numbers and the ranks (``name`` the limit, ``value`` (bytes needed, bytes
                allowed)); some follower of the group, on any host, holds other values
                than its host's copy, or failed before it could compare: raised on every
                member of the group, naming those ranks (``value``) and the first weight
                that differs; another member failed or did not answer in time, or the
                segment could not be made or mapped. The model is left as it was (a
                follower moved nothing; the leader and a member alone on its host put
                back what the executor moved). Otherwise as the executor.
            PlanError: from the executor.
        """
        if self._refused is not None and not self._done:
            raise _job_refusal(self._refused)
        source, channel = self._source, self._channel
        if self._done or ((source is None or channel is None) and self._verdicts is None):
            out = self._inner.wrap_modules(layers)  # nothing to share, or the executor refuses a second wrap
        else:
            # Keys per attempt: members that retry a failed wrap together meet afresh.
            prefix = f"wrap{self._attempts}/"
            self._attempts += 1
            if source is None or channel is None:  # alone on its host: hears the others' verdicts
                out = self._inner.wrap_modules(layers)
                self._layers = list(out)
                self._hear(f"{prefix}checked", "wrap_modules", undo=True)
            elif source.leader:
                out = self._lead_wrap(layers, source, channel, prefix)
            else:
                out = self._follow_wrap(layers, source, channel, prefix)
            self._prefix = prefix
        self._layers = list(out)
        self._wrapped = self._done = True
        return out

    def _lead_wrap(self, layers: Sequence[nn.Module], source: SharedHostSource, channel: Channel,
                   prefix: str) -> list[nn.Module]:
        followers = self._sharing.local.ranks[1:]
        total = self._layout.total_bytes
        start = time.monotonic()
        stage = f"{prefix}segment"  # the key the followers wait on now: a failure is reported there
        try:
            check_room(total, shm_free_bytes(self._shm_dir), self._shm_dir)
            mapping, fd = create_segment(total, self._shm_dir)
            try:
                channel.put(f"{prefix}segment", {"ok": True, "name": mapping.name, "bytes": total})
                stage = f"{prefix}wrapped"
                mapped_at = time.monotonic()
                try:
                    replies = channel.wait([f"{prefix}mapped/{r}" for r in followers], followers,
                                           "map the shared host copy")
                finally:
                    # Every member has mapped it, or never will: from here on a crash leaves nothing.
                    unlink_segment(mapping.name, self._shm_dir)
                waited = time.monotonic() - mapped_at
                failed = [(r, v) for r, v in zip(followers, replies, strict=True) if not v.get("ok")]
                if failed:
                    rank, reply = failed[0]
                    raise ExecutionError(f"rank {rank} could not map the shared host copy: {reply.get('error')}",
                                         name="share_with", value=tuple(r for r, _ in failed))
                self._place_numa(mapping)
                reserve_segment(fd, total, self._shm_dir)
            finally:
                os.close(fd)
            source.attach(mapping)
            written_at = time.monotonic()
            out = self._inner.wrap_modules(layers)
            write_s = time.monotonic() - written_at
        except BaseException as exc:
            channel.fail(stage, exc)
            source.close()
            raise
        self._layers = list(out)  # what restore() puts back, should the wrap be undone
        try:
            channel.put(f"{prefix}wrapped", {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
        except BaseException:
            self.restore()  # the followers cannot be told: leave the model as it was
            raise
        publish_s = time.monotonic() - start
        heard = self._hear(f"{prefix}checked", "wrap_modules", undo=True)  # the followers' verdicts
        self._times = SharingTimes(map_s=publish_s - waited - write_s, wait_s=waited + heard, write_s=write_s,
                                   publish_s=publish_s)
        log.info("shared host copy %s: %s written for ranks %s in %.2f s (%.2f s waiting for them to map it)",
                 mapping.name, format_bytes(total), ranks_text(self._sharing.local.ranks), publish_s, waited)
        return out

    def _place_numa(self, mapping: SegmentMapping) -> None:
        """Prefer the plan's NUMA node for the segment's pages, before they exist."""
        if self._numa_node is None:
            return
        from offload.runtime.numa import HostPlacer

        HostPlacer(self._numa_node).place(mapping.base, mapping.nbytes)

    def _follow_wrap(self, layers: Sequence[nn.Module], source: SharedHostSource, channel: Channel,
                     prefix: str) -> list[nn.Module]:
        leader, me = self._sharing.leader, self._sharing.rank
        call = f"{prefix}checked"
        start = time.monotonic()
        try:
            segment = channel.wait([f"{prefix}segment"], [leader], "create the shared host copy")[0]
            if not segment.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed before publishing the shared "
                                     f"host copy: {segment.get('error')}; nothing was moved on rank {me}",
                                     name="share_with", value=leader)
            opened = time.monotonic()
            try:
                mapping = open_segment(str(segment["name"]), int(segment["bytes"]), self._shm_dir)
            except BaseException as exc:
                channel.fail(f"{prefix}mapped/{me}", exc)
                raise
            map_s = time.monotonic() - opened
            try:
                channel.put(f"{prefix}mapped/{me}", {"ok": True})
                # Two of the leader's steps: waiting for every follower to map, then writing.
                done = channel.wait([f"{prefix}wrapped"], [leader], "write the shared host copy", steps=2)[0]
                if not done.get("ok"):
                    raise ExecutionError(f"rank {leader}, the leader on this host, failed writing the shared host "
                                         f"copy: {done.get('error')}; nothing was moved on rank {me}",
                                         name="share_with", value=leader)
                waited = time.monotonic() - start - map_s
                source.attach(mapping)
                source.allow_except((int(r[0]), str(r[1])) for r in done.get("unwritten", ()))
                # Compared before the executor moves anything: a refusal leaves the model as it was.
                _, differ = slot_moves(self._inner.plan, layers, self._layout, source)
                waited += self._judge(call, "wrap_modules", differ)
                moved_at = time.monotonic()
                out = self._inner.wrap_modules(layers)
            except BaseException:
                source.close()
                raise
        except BaseException as exc:
            self._tell_failure(call, exc)
            raise
        self._times = SharingTimes(map_s=map_s, wait_s=waited, write_s=time.monotonic() - moved_at)
        log.info("rank %d maps the shared host copy %s (%s) written by rank %d", me, mapping.name,
                 format_bytes(mapping.nbytes), leader)
        return out

    def post_init(self) -> None:
        """The executor's `post_init`, with the copy final on every member: the leader
        says when it is; followers then point the weights their loader filled at it. It
        returns once every follower of the group that compares found its values equal.

        Raises:
            ExecutionError: the leader's post_init failed or did not end in time
                (weights left in host memory, as a failed post_init leaves them); some
                follower of the group, on any host, holds other values than its host's
                copy, or failed before it could compare: raised on every member of the
                group, naming those ranks (``value``) and the first weight that differs
                (weights left in host memory: a follower pointed none at the copy, and
                ``restore()`` gives every member its weights back). Otherwise as the
                executor.
        """
        source, channel = self._source, self._channel
        mapped = source is not None and channel is not None and source.mapping is not None
        if not self._wrapped or (not mapped and self._verdicts is None):
            self._inner.post_init()
            return
        key = f"{self._prefix}post_init/{self._post_inits}"
        self._post_inits += 1
        if source is None or channel is None or source.mapping is None:  # alone on its host
            self._inner.post_init()
            self._hear(key, "post_init", undo=False)
            return
        if source.leader:
            try:
                self._inner.post_init()
            except BaseException as exc:
                channel.fail(key, exc)
                raise
            source.loaded()
            channel.put(key, {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
            self._hear(key, "post_init", undo=False)
            return
        try:
            leader = self._sharing.leader
            start = time.monotonic()
            final = channel.wait([key], [leader], "finish post_init")[0]
            if not final.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed post_init: "
                                     f"{final.get('error')}; weights left in host memory on rank {self._sharing.rank}",
                                     name="share_with", value=leader)
            self._times = attrs.evolve(self._times, wait_s=self._times.wait_s + time.monotonic() - start)
            source.allow_except((int(r[0]), str(r[1])) for r in final.get("unwritten", ()))
            self._point_at_slots(source, key)
            self._inner.post_init()
        except BaseException as exc:
            self._tell_failure(key, exc)
            raise

    def _point_at_slots(self, source: SharedHostSource, call: str) -> None:
        """Follower: point every offloaded weight that is not in the segment yet (its
        loader filled private memory, or replaced it) at its written slot, once every
        follower of the group has found its values equal (`_judge`); the executor's
        post_init then releases the private copies."""
        moves, differ = slot_moves(self._inner.plan, self._layers, self._layout, source)
        self._judge(call, "post_init", differ)
        for params, view in moves:
            for param in params:
                param.data = view
        if moves:
            log.info("rank %d: %d weights its loader wrote now point at the shared host copy", self._sharing.rank,
                     len(moves))

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

    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """New weights for every member, without restoring (the executor's `load_weights`,
        coordinated on each host): every member of the group calls it, with the same
        weights (an engine's reload runs on every rank).

        The leader waits until every follower on its host has stopped reading the shared
        copy (their copies and kernels finished), writes the new weights into it and its
        own resident weights, refills its buffers, and says so; each follower then writes
        what is its own (resident weights, buffers, host copies not shared) and refills
        its buffers from the new shared copy. Without sharing it is the executor's.

        Args:
            weights: as the executor's: a mapping or (name, tensor) pairs.
            prefix: what every name starts with, stripped.
            skip_read_only: as the executor's (the followers here always skip the shared
                copies: their leader writes them).

        Raises:
            ExecutionError: as the executor's (on the leader, a bad name or shape is
                raised on every follower of its host too), or another member failed or
                did not answer within `ShareWith.timeout_s`.
        """
        source, channel = self._source, self._channel
        if source is None or channel is None or source.mapping is None:
            self._inner.load_weights(weights, prefix=prefix, skip_read_only=skip_read_only)
            return
        key = f"{self._prefix}load_weights/{self._reloads}/"
        self._reloads += 1
        if source.leader:
            followers = self._sharing.local.ranks[1:]
            try:
                replies = channel.wait([f"{key}quiet/{r}" for r in followers], followers,
                                       "stop reading the shared host copy (call load_weights)")
                failed = [r for r, v in zip(followers, replies, strict=True) if not v.get("ok")]
                if failed:
                    raise ExecutionError(f"rank {failed[0]} could not stop reading the shared host copy: "
                                         f"{replies[followers.index(failed[0])].get('error')}; nothing was written",
                                         name="share_with", value=tuple(failed))
                with source.writing():
                    self._inner.load_weights(weights, prefix=prefix)
            except BaseException as exc:
                channel.fail(f"{key}written", exc)
                raise
            channel.put(f"{key}written", {"ok": True})
            return
        leader, me = self._sharing.leader, self._sharing.rank
        try:
            if self._rt is not None:
                # Nothing of ours may read the shared copy while the leader writes it: the
                # device's work (copies, UVA kernels reading it in place) is all done.
                self._rt.synchronize()
        except BaseException as exc:
            channel.fail(f"{key}quiet/{me}", exc)
            raise
        channel.put(f"{key}quiet/{me}", {"ok": True})
        try:
            # Two of the leader's steps: waiting for every follower, then writing.
            done = channel.wait([f"{key}written"], [leader], "write the new weights into the shared host copy",
                                steps=2)[0]
            if not done.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed load_weights: {done.get('error')}",
                                     name="share_with", value=leader)
        except ExecutionError as exc:
            # The copy may hold some of the new weights: the buffers follow what it holds.
            self._refill_after(exc, prefix)
            raise ExecutionError(f"{exc}; rank {me} wrote nothing of its own and refilled its buffers from the shared "
                                 "copy, which may hold some of the new weights: call load_weights again on every member",
                                 name=exc.name, value=exc.value) from exc
        self._inner.load_weights(weights, prefix=prefix, skip_read_only=True)

    def _refill_after(self, failure: BaseException, prefix: str) -> None:
        """Follower: make the executor's buffers follow the shared copy after the leader's
        load_weights failed (an empty load: wait for the device, refill); never raises."""
        try:
            self._inner.load_weights({}, prefix=prefix, skip_read_only=True)
        except Exception:
            log.warning("rank %d: refilling the buffers after %s failed too", self._sharing.rank, failure,
                        exc_info=True)

    def sync_prev_onload(self) -> None:
        """The executor's."""
        self._inner.sync_prev_onload()

    def join_after_forward(self) -> None:
        """The executor's."""
        self._inner.join_after_forward()

    def restore(self) -> None:
        """The executor's `restore`; then every weight that would be a tensor over the
        segment gets a private copy (bit for bit, ties kept), and the segment is let go.

        Raises:
            ExecutionError: as the executor (call restore() again to finish).
        """
        self._inner.restore()
        source = self._source
        if source is None or source.mapping is None:
            return
        copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
        for layer in self._layers:
            for _, param in layer.named_parameters(remove_duplicate=False):
                data = param.data
                if not source.owns(data):
                    continue
                key = (data.data_ptr(), tuple(data.shape), tuple(data.stride()), data.dtype)
                private = copies.get(key)
                if private is None:
                    private = copies[key] = _private_copy(data)
                param.data = private
        source.close()
        self._wrapped = False
        log.info("rank %d restored its weights from the shared host copy (%d private copies)", self._sharing.rank,
                 len(copies))

    def check(self) -> LiveCheck:
        """The executor's."""
        return self._inner.check()

    def stats(self) -> OffloadStats:
        """The executor's (its ``host_bytes`` counts the segment's slots this process holds)."""
        return self._inner.stats()

    def __repr__(self) -> str:
        return f"SharedOffloader({self._sharing.role}, rank {self._sharing.rank}, {type(self._inner).__name__})"


def _job_refusal(host: HostMemory) -> ExecutionError:
    """What every process of the job raises when `host` does not fit (named like `admit`'s)."""
    binding = host.binding
    name = binding.check.limit.value if binding is not None else "host_check"
    value = (binding.check.needed_bytes, binding.check.allowed_bytes) if binding is not None else None
    return ExecutionError(refusal_text(host), name=name, value=value)


def share_offloader(plan: OffloadPlan, runtime: Runtime, share_with: dist.ProcessGroup | ShareWith, *,
                    membership: Membership | None = None, pin_calls: PinCalls | None = None,
                    host_memory: Platform | None = None) -> SharedOffloader:
    """The offloader for `plan` whose host copies are shared with `share_with`'s members
    on this host. Every member must call it, and every process of the job
    (`ShareWith.job`): it gathers from the sharing group once, then from the job once.

    The second gather is the host admission check of the job (`offload.pure.sharing.admission`):
    what every process will take of its host's memory (the segment on leaders, nothing
    on followers whose weights have data, a private copy on processes that do not
    share), summed per host against the host's limits. The offloader's plan carries
    this process's verdict from it (`OffloadPlan.host_admission`, so a follower is never
    refused for a private copy it does not take), `SharedOffloader.sharing` the job's
    figures, and where a host does not fit and ``host_check`` is "refuse" there,
    ``wrap_modules`` refuses on every process of the job before anything moves.

    Args:
        plan: this member's plan (its offloaded weights must equal every member's).
        runtime: the effects (the executor's and the pinning device's).
        share_with: the group, or `ShareWith` with the group, the job and timeouts.
        membership: how this process reaches the others; from the groups when None
            (tests pass fakes).
        pin_calls: the CUDA registration calls; the real ones for the runtime's device
            when None (tests pass fakes).
        host_memory: this process's host memory readings (``host_available_bytes``,
            ``cgroup_memory``; nothing else is read); read from /proc and the cgroup file
            system now when None (tests pass their own).

    Raises:
        ExecutionError: torch.distributed is not initialised; some member's offloaded
            weights differ from the lowest rank's (naming each such rank and the first
            difference; raised on every member); the plan pins with cudaHostAlloc; any
            of these, or a `PlanError`, on another process of the job (raised on every
            process of the job, naming it).
        PlanError: from the executor.
    """
    options = share_with if isinstance(share_with, ShareWith) else ShareWith(group=share_with)
    member = membership if membership is not None else membership_of(options.group, options.job)
    where = member.host if member.host is not None else host_identity(options.shm_dir)
    host, boot_id, shm_id = where
    pin = plan.pin.method
    align = mmap.PAGESIZE if pin is not PinMethod.NONE else CACHE_LINE
    layout = lay_out(plan, align)
    weights = weights_of(plan)
    digest = weights_digest(weights, align, pin.value)
    info = MemberInfo(rank=member.rank, host=host, boot_id=boot_id, shm_id=shm_id, pid=os.getpid(),
                      session=os.urandom(8).hex(), digest=digest, storages=len(layout.slots),
                      host_bytes=plan.host_bytes, segment_bytes=layout.total_bytes, verify=options.verify)
    # A collective waits for a member that never comes as long as its process group says
    # (30 minutes on gloo): every gather starts only once every member is there.
    arrive(member.store, rank=member.rank, ranks=member.ranks, topic="share", timeout_s=options.timeout_s,
           doing="call create_offloader with share_with")
    gathered = member.gather(info)
    # What fails from here is held until the job's exchange: the other processes of the
    # job (other sharing groups too) wait in it, and learn of the failure there.
    failure: Exception | None = None
    sharing: SharingPlan | None = None
    source: SharedHostSource | None = None
    try:
        infos = _members(gathered)
        bad = mismatched(infos)
        if bad:
            raise _mismatch(member, infos, bad, (align, pin.value, weights), options.timeout_s)
        sharing = plan_sharing(infos, member.rank, timeout_s=options.timeout_s)
        if sharing.shared:
            source = SharedHostSource(layout, leader=sharing.role == "leader", rank=member.rank,
                                      leader_rank=sharing.leader, pin=pin, device=runtime.device,
                                      verify=options.verify, pin_calls=pin_calls,
                                      ranges=runtime if isinstance(runtime, RegisteredRanges) else None)
        build_executor(plan, runtime, host_source=source)  # a plan its backend refuses fails here, before the exchange
    except Exception as exc:  # every kind is told to the others, then raised as it was
        failure = exc
    job = _job_memory(member, plan, sharing, where, host_memory, failure, options.timeout_s)
    if failure is not None:
        raise failure
    if job.failures:
        rank, error = job.failures[0]
        raise ExecutionError(f"rank {rank} failed creating its offloader ({error}); nothing was mapped on rank "
                             f"{member.rank}: every process of the job stops", name="share_with",
                             value=tuple(r for r, _ in job.failures))
    if sharing is None:  # set whenever nothing failed
        raise ExecutionError(f"rank {member.rank} has no sharing plan", name="share_with", value=member.rank)
    sharing = attrs.evolve(sharing, job=job)
    channel: Channel | None = None
    if sharing.shared:
        channel = Channel(member.store, f"offload-share/{sharing.session}/{sharing.leader}/", member.rank,
                          options.timeout_s)
    verdicts: Verdicts | None = None
    if sharing.verifiers:  # every member of the group, on every host, hears the followers' verdicts
        verdicts = Verdicts(member.store, f"offload-share/{sharing.session}/verdicts/", member.rank,
                            sharing.verifiers, options.timeout_s)
    inner = build_executor(job_plan(plan, job, member.rank), runtime, host_source=source)
    numa = plan.host_numa.node if pin is PinMethod.REGISTER else None
    log.info("rank %d: %s", member.rank, sharing.reason)
    mine = job.host_of(member.rank)
    if mine is not None:
        log.info("rank %d: host memory of the job on this host: %s", member.rank, mine.message)
    return SharedOffloader(inner, sharing, layout, source, channel, shm_dir=options.shm_dir, numa_node=numa,
                           refused=job.refused, verdicts=verdicts, runtime=runtime)


def _read_host_memory() -> Platform:
    """MemAvailable and the cgroup's memory limit, read now (nothing about the device)."""
    from offload.capture import probe_platform, read_proc_text
    from offload.capture.cgroup import with_cgroup_memory

    return with_cgroup_memory(probe_platform(read_proc_text, None))


def _job_memory(member: Membership, plan: OffloadPlan, sharing: SharingPlan | None, where: tuple[str, str, str],
                host_memory: Platform | None, failure: Exception | None, timeout_s: float) -> JobMemory:
    """Tell every process of the job what this one takes of its host's memory (or that it
    failed), and judge the job from what they all told (the same on every process).

    Raises:
        ExecutionError: a process of the job did not come within `timeout_s` seconds
            (``value`` those ranks), or sent something else.
    """
    readings = host_memory if host_memory is not None else _read_host_memory()
    role = sharing.role if sharing is not None else "alone"
    new = process_host_bytes(plan, role, sharing.segment_bytes) if sharing is not None else 0
    figures = ProcessMemory(rank=member.rank, host=where[0], boot_id=where[1], shm_id=where[2], role=role,
                            new_bytes=new, private_bytes=private_host_bytes(plan),
                            available_bytes=readings.host_available_bytes, cgroup=readings.cgroup_memory,
                            host_check=plan.config.host_check,
                            error="" if failure is None else f"{type(failure).__name__}: {failure}")
    arrive(member.store, rank=member.rank, ranks=member.job, topic="job", timeout_s=timeout_s,
           doing="join the job's exchange of host memory at create_offloader (ShareWith.job)")
    gathered = (member.job_gather or member.gather)(figures)
    processes = [g for g in gathered if isinstance(g, ProcessMemory)]
    if len(processes) != len(gathered):
        raise ExecutionError("a process of the job sent something other than its ProcessMemory (do all processes "
                             "of the job run the same version of offload, and call create_offloader with share_with "
                             "at the same point?)", name="share_with", value=len(gathered))
    return assess_job(processes)


def _members(gathered: Sequence[Any]) -> list[MemberInfo]:
    infos = [g for g in gathered if isinstance(g, MemberInfo)]
    if len(infos) != len(gathered):
        raise ExecutionError("a member of the share_with group sent something other than its MemberInfo (do all "
                             "members run the same version of offload?)", name="share_with", value=len(gathered))
    return infos


def _mismatch(member: Membership, infos: Sequence[MemberInfo], bad: Sequence[int],
              ours: tuple[int, str, Any], timeout_s: float) -> ExecutionError:
    """The error every member raises, naming the members whose weights differ from the
    lowest rank's and the first difference of the first of them (a second gather: every
    member takes this branch, since every member saw the same digests).

    Raises:
        ExecutionError: a member did not come to the second gather within `timeout_s`
            seconds (``value`` those ranks).
    """
    arrive(member.store, rank=member.rank, ranks=member.ranks, topic="mismatch", timeout_s=timeout_s,
           doing=f"join the exchange that names how the weights of rank{'s' if len(bad) > 1 else ''} "
                 f"{ranks_text(bad)} differ")
    gathered = member.gather((member.rank, *ours))
    by_rank = {int(g[0]): g for g in gathered}
    reference = min(i.rank for i in infos)
    _, ref_align, ref_pin, ref_weights = by_rank[reference]
    _, align, pin, weights = by_rank[bad[0]]
    if ref_pin != pin:
        why = f"rank {bad[0]} pins host memory with {pin}, rank {reference} with {ref_pin}"
    else:
        why = describe_mismatch(reference, ref_weights, bad[0], weights, reference_align=ref_align, align=align)
    return ExecutionError(
        f"refusing to share host copies: the offloaded weights of rank{'s' if len(bad) > 1 else ''} "
        f"{ranks_text(bad)} differ from rank {reference}'s ({why}); nothing was mapped. Members of a sharing group "
        "must offload identical weights with identical plans", name="share_with", value=tuple(bad))
