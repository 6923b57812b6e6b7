"""`SharedOffloader`: an executor whose host copies lie in one segment per host, shared by
the members of a torch.distributed group that hold identical weights.

``create_offloader(plan, share_with=group)`` builds it (`share_offloader`): every member
tells the others who it is and what it offloads (one ``all_gather_object``), mismatched
weights are refused on every member by name before anything is mapped, and the members
on each host share one copy (`SharingPlan`). Then every process of the job
(`ShareWith.job`) tells the others what it will take of its host's memory (a second
``all_gather_object``; a failure so far travels with it, so the whole job raises), and
each judges the sums per host alike (`offload.sharing.admission`): its executor's plan
carries its part, and a host that does not fit is refused by ``wrap_modules`` on every
process, before anything moves. Then, per host, through the store:

``wrap_modules``
    leader: create the segment (sparse), publish its name, wait until every follower
    has mapped it, unlink the name, reserve its pages, write every offloaded weight into
    it (the executor's own moves, with the `SharedHostSource`), say it is written.
    follower: map it read-only, wait until it is written, then move: offloaded weights
    point at the read-only slots (a sample of each compared with the follower's own), or
    at private memory for weights still on meta (a loader fills those).
``post_init``
    leader: the executor's post_init (post-processed weights rewritten into their
    slots), then say the copy is final. follower: wait for that, point weights its
    loader filled at their slots (compared likewise; the private memory is released by
    the executor's re-read), then the executor's post_init.
``restore``
    every member: the executor's restore, then weights that would come back as tensors
    over the segment get private copies, and the segment is let go. Its memory returns
    when the last process restores or exits.

A member that fails tells the others in the key they wait on, so they raise at once; one
that dies makes them raise `ExecutionError` when `ShareWith.timeout_s` runs out; nothing
ever waits longer. A follower's model is untouched until the leader's copy is complete.
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
from offload.executors.common import Ref, find_parameter
from offload.executors.live import LiveCheck
from offload.protocols import Offloader, RegisteredRanges, Runtime
from offload.pure.decisions import PinMethod
from offload.pure.env import Platform
from offload.pure.plan import OffloadPlan
from offload.pure.units import format_bytes
from offload.runtime.copies import span_chunks
from offload.sharing.admission import (
    HostMemory,
    JobMemory,
    ProcessMemory,
    assess_job,
    job_plan,
    private_host_bytes,
    process_host_bytes,
    refusal_text,
)
from offload.sharing.coordinate import Channel, Membership, ShareWith, host_identity, membership_of
from offload.sharing.pinning import PinCalls
from offload.sharing.plan import (
    CACHE_LINE,
    MemberInfo,
    SegmentLayout,
    SharingPlan,
    describe_mismatch,
    lay_out,
    mismatched,
    plan_sharing,
    ranks_text,
    weights_digest,
    weights_of,
)
from offload.sharing.segment import (
    SegmentMapping,
    check_room,
    create_segment,
    open_segment,
    reserve_segment,
    shm_free_bytes,
    unlink_segment,
)
from offload.sharing.source import SharedHostSource, same_sample
from offload.stats import OffloadStats

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
            a follower: for the leader to write it, and to finish post_init).
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


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (tuple(a.shape), tuple(a.stride()), a.dtype) == (tuple(b.shape), tuple(b.stride()), b.dtype)


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
    """

    def __init__(self, inner: Offloader, sharing: SharingPlan, layout: SegmentLayout,
                 source: SharedHostSource | None, channel: Channel | None, *, shm_dir: str,
                 numa_node: int | None = None, refused: HostMemory | None = None) -> None:
        self._inner = inner
        self._refused = refused
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
        followers map it read-only (see the module docstring).

        Raises:
            ExecutionError: the host memory of the job's processes on some host does not
                fit and a process there refuses that (``host_check="refuse"``): raised on
                every process of the job, before anything moved, with the limit, the
                numbers and the ranks (``name`` the limit, ``value`` (bytes needed, bytes
                allowed)); another member failed or did not answer in time, the segment
                could not be made or mapped, or this member's weights differ from the
                leader's; nothing was moved on this member. Otherwise as the executor.
            PlanError: from the executor.
        """
        if self._refused is not None and not self._done:
            raise _job_refusal(self._refused)
        if self._source is None or self._channel is None or self._done:
            out = self._inner.wrap_modules(layers)  # nothing to share, or the executor refuses a second wrap
        else:
            # Keys per attempt: members that retry a failed wrap together meet afresh.
            prefix = f"wrap{self._attempts}/"
            self._attempts += 1
            if self._source.leader:
                out = self._lead_wrap(layers, self._source, self._channel, prefix)
            else:
                out = self._follow_wrap(layers, self._source, self._channel, prefix)
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
        try:
            channel.put(f"{prefix}wrapped", {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
        except BaseException:
            self._inner.restore()  # the followers cannot be told: leave the model as it was
            source.close()
            raise
        publish_s = time.monotonic() - start
        self._times = SharingTimes(map_s=publish_s - waited - write_s, wait_s=waited, write_s=write_s,
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
        start = time.monotonic()
        segment = channel.wait([f"{prefix}segment"], [leader], "create the shared host copy")[0]
        if not segment.get("ok"):
            raise ExecutionError(f"rank {leader}, the leader on this host, failed before publishing the shared host "
                                 f"copy: {segment.get('error')}; nothing was moved on rank {me}",
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
                raise ExecutionError(f"rank {leader}, the leader on this host, failed writing the shared host copy: "
                                     f"{done.get('error')}; nothing was moved on rank {me}",
                                     name="share_with", value=leader)
            waited = time.monotonic() - start - map_s
            source.attach(mapping)
            source.allow_except((int(r[0]), str(r[1])) for r in done.get("unwritten", ()))
            moved_at = time.monotonic()
            out = self._inner.wrap_modules(layers)
        except BaseException:
            source.close()
            raise
        self._times = SharingTimes(map_s=map_s, wait_s=waited, write_s=time.monotonic() - moved_at)
        log.info("rank %d maps the shared host copy %s (%s) written by rank %d", me, mapping.name,
                 format_bytes(mapping.nbytes), leader)
        return out

    def post_init(self) -> None:
        """The executor's `post_init`, with the copy final on every member: the leader
        says when it is; followers then point the weights their loader filled at it.

        Raises:
            ExecutionError: the leader's post_init failed or did not end in time
                (weights left in host memory, as a failed post_init leaves them), or a
                follower's weight differs from the leader's. Otherwise as the executor.
        """
        source, channel = self._source, self._channel
        if source is None or channel is None or not self._wrapped or source.mapping is None:
            self._inner.post_init()
            return
        key = f"{self._prefix}post_init/{self._post_inits}"
        self._post_inits += 1
        if source.leader:
            try:
                self._inner.post_init()
            except BaseException as exc:
                channel.fail(key, exc)
                raise
            source.loaded()
            channel.put(key, {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
            return
        leader = self._sharing.leader
        start = time.monotonic()
        final = channel.wait([key], [leader], "finish post_init")[0]
        if not final.get("ok"):
            raise ExecutionError(f"rank {leader}, the leader on this host, failed post_init: {final.get('error')}; "
                                 f"weights left in host memory on rank {self._sharing.rank}", name="share_with",
                                 value=leader)
        self._times = attrs.evolve(self._times, wait_s=self._times.wait_s + time.monotonic() - start)
        source.allow_except((int(r[0]), str(r[1])) for r in final.get("unwritten", ()))
        self._point_at_slots(source)
        self._inner.post_init()

    def _point_at_slots(self, source: SharedHostSource) -> None:
        """Follower: point every offloaded weight that is not in the segment yet (its
        loader filled private memory, or replaced it) at its written slot, after checking
        them all; the executor's post_init then releases the private copies."""
        owners: dict[Ref, list[nn.Parameter]] = {}
        for p in self._inner.plan.offloaded_params:
            param = find_parameter(self._layers[p.layer], p.name)
            if param is None:
                continue
            members = owners.setdefault(p.tied_to or (p.layer, p.name), [])
            if all(param is not seen for seen in members):
                members.append(param)
        moves: list[tuple[list[nn.Parameter], torch.Tensor]] = []
        differ: list[Ref] = []
        for owner, params in owners.items():
            data = params[0].data
            if source.owns(data) or data.device.type == "meta" or self._layout.slot(owner) is None:
                continue
            view = source.slot_view(owner)
            if view is None or not _fits(data, view):
                continue  # not written by the leader, or changed shape: stays private
            if source.verify and not same_sample(data, view):
                differ.append(owner)
            moves.append((params, view))
        if differ:
            names = ", ".join(f"layer {layer} {name!r}" for layer, name in differ[:3])
            raise ExecutionError(
                f"rank {self._sharing.rank}'s weights differ from the shared host copy rank {self._sharing.leader} "
                f"wrote ({len(differ)} of them: {names}{', ...' if len(differ) > 3 else ''}; a sample of their "
                "values): members of a sharing group must hold identical weights (tensor-parallel ranks hold "
                "different shards: never put them in one group); weights left in host memory",
                name="share_with", value=self._sharing.rank)
        for params, view in moves:
            for param in params:
                param.data = view
        if moves:
            log.info("rank %d: %d weights its loader wrote now point at the shared host copy", self._sharing.rank,
                     len(moves))

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

    The second gather is the host admission check of the job (`offload.sharing.admission`):
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
    from offload.create import build_executor

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
                      host_bytes=plan.host_bytes, segment_bytes=layout.total_bytes)
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
            raise _mismatch(member, infos, bad, (align, pin.value, weights))
        sharing = plan_sharing(infos, member.rank, timeout_s=options.timeout_s)
        if sharing.shared:
            source = SharedHostSource(layout, leader=sharing.role == "leader", rank=member.rank,
                                      leader_rank=sharing.leader, pin=pin, device=runtime.device,
                                      verify=options.verify, pin_calls=pin_calls,
                                      ranges=runtime if isinstance(runtime, RegisteredRanges) else None)
        build_executor(plan, runtime, host_source=source)  # a plan its backend refuses fails here, before the exchange
    except Exception as exc:  # every kind is told to the others, then raised as it was
        failure = exc
    job = _job_memory(member, plan, sharing, where, host_memory, failure)
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
    inner = build_executor(job_plan(plan, job, member.rank), runtime, host_source=source)
    numa = plan.host_numa.node if pin is PinMethod.REGISTER else None
    log.info("rank %d: %s", member.rank, sharing.reason)
    mine = job.host_of(member.rank)
    if mine is not None:
        log.info("rank %d: host memory of the job on this host: %s", member.rank, mine.message)
    return SharedOffloader(inner, sharing, layout, source, channel, shm_dir=options.shm_dir, numa_node=numa,
                           refused=job.refused)


def _read_host_memory() -> Platform:
    """MemAvailable and the cgroup's memory limit, read now (nothing about the device)."""
    from offload.capture import probe_platform, read_proc_text
    from offload.cgroup_probe import with_cgroup_memory

    return with_cgroup_memory(probe_platform(read_proc_text, None))


def _job_memory(member: Membership, plan: OffloadPlan, sharing: SharingPlan | None, where: tuple[str, str, str],
                host_memory: Platform | None, failure: Exception | None) -> JobMemory:
    """Tell every process of the job what this one takes of its host's memory (or that it
    failed), and judge the job from what they all told (the same on every process)."""
    readings = host_memory if host_memory is not None else _read_host_memory()
    role = sharing.role if sharing is not None else "alone"
    new = process_host_bytes(plan, role, sharing.segment_bytes) if sharing is not None else 0
    figures = ProcessMemory(rank=member.rank, host=where[0], boot_id=where[1], shm_id=where[2], role=role,
                            new_bytes=new, private_bytes=private_host_bytes(plan),
                            available_bytes=readings.host_available_bytes, cgroup=readings.cgroup_memory,
                            host_check=plan.config.host_check,
                            error="" if failure is None else f"{type(failure).__name__}: {failure}")
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
              ours: tuple[int, str, Any]) -> ExecutionError:
    """The error every member raises, naming the members whose weights differ from the
    lowest rank's and the first difference of the first of them (a second gather: every
    member takes this branch, since every member saw the same digests)."""
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
