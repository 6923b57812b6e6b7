"""Joining a sharing group: `share_offloader`, which every member calls (through
``create_offloader(plan, share_with=group)``).

Every member tells the others who it is and what it offloads (one ``all_gather_object``),
mismatched weights are refused on every member by name before anything is mapped, and the
members on each host share one copy (`SharingPlan`). Then every process of the job
(`ShareWith.job`) tells the others what it will take of its host's memory (a second
``all_gather_object``; a failure so far travels with it, so the whole job raises), and
each judges the sums per host alike (`offload.pure.sharing.admission`): its executor's plan
carries its part, and a host that does not fit is refused by ``wrap_modules`` on every
process, before anything moves. Each gather starts only once every member has come to
it (`arrive`, through the store): a member that never calls ``create_offloader`` makes
the others raise `ExecutionError` naming it within `ShareWith.timeout_s`, not the
process group's own timeout. What happens next, per host, is `SharedOffloader`'s.
"""


from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from offload.errors import ExecutionError
from offload.executors.build import build_executor
from offload.protocols import RegisteredRanges, Runtime
from offload.pure.decide.pinning import PinMethod
from offload.pure.env.snapshot import Platform
from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.admission import assess_job, job_plan
from offload.pure.sharing.memory import JobMemory, ProcessMemory, private_host_bytes, process_host_bytes
from offload.pure.sharing.plan import (
    CACHE_LINE,
    MemberInfo,
    SharingPlan,
    describe_mismatch,
    lay_out,
    mismatched,
    plan_sharing,
    weights_digest,
    weights_of,
)
from offload.pure.units import ranks_text
from offload.sharing.arrival import arrive
from offload.sharing.coordinate import Channel, Membership, ShareWith, host_identity, membership_of
from offload.sharing.pinning import PinCalls
from offload.sharing.source import SharedHostSource
from offload.sharing.verdicts import Verdicts

if TYPE_CHECKING:
    import torch.distributed as dist
from offload.logs import logger
from offload.sharing.offloader import SharedOffloader

__all__ = ["share_offloader"]

log = logger("offload.sharing")


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
