"""Host admission for a job whose processes share host copies: the verdict, pure.

`make_plan` checks one process holding a private copy (`OffloadPlan.host_admission`).
With sharing a host holds something else: one segment per sharing group on it (its
leader's), the private copies of processes that do not share, and each process's own
extras (static buffers when the compute device is the CPU; a follower's weights on meta,
which its loader fills in private memory until ``post_init``). Tensor-parallel ranks are
in different sharing groups and still share the host's memory. So every process of the
job says what it will take (`ProcessMemory`, gathered once at ``create_offloader`` over
`offload.sharing.ShareWith.job`) and every process computes the same verdict from the
same figures (`assess_job`): no member decides alone, so none has to wait to hear
another's decision, and all refuse together.

What is summed, and against what (the limits of `offload.pure.decide.admission`):

- per machine (processes with one boot id): the new host memory of all of them, against
  the smallest ``MemAvailable`` any of them read;
- per cgroup: the new host memory of the processes taken to be in one container (one
  hostname, boot id, ``/dev/shm`` and cgroup paths), against the least headroom any of
  them read. Processes whose cgroups cannot be told apart (cgroup namespaces show every
  container its own cgroup as ``/``) are summed together, the cautious side.

The pinned-memory limits (memlock, device memory) stay each process's own, as its plan
recorded them. No torch, no environment, no files: the shell (`offload.sharing.join`)
reads and gathers the figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from offload.pure.decide.admission import (
    ADVISORY_LIMITS,
    HostAdmission,
    HostDemand,
    HostFit,
    HostLimit,
    LimitCheck,
    assess_host_memory,
    over_text,
)
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.env.snapshot import EnvSnapshot, Platform
from offload.pure.plan.plan import OffloadPlan, PlanWarning, WarningCode
from offload.pure.sharing.memory import HostMemory, JobCheck, JobMemory, ProcessMemory
from offload.pure.units import format_bytes, ranks_text

__all__ = ["assess_job", "job_plan", "local_admission", "refusal_text"]

_HOST_LIMITS = (HostLimit.HOST_AVAILABLE, HostLimit.CGROUP)
_ALLOWS = {HostLimit.HOST_AVAILABLE: "only {} is available", HostLimit.CGROUP: "the container allows {} more"}
_SHORT = {HostLimit.HOST_AVAILABLE: "MemAvailable", HostLimit.CGROUP: "the cgroup limit"}
#: Processes named one by one in a message; the rest are counted.
_NAMED = 6


def _least(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _tightest_cgroup(processes: Sequence[ProcessMemory]) -> CgroupMemory:
    """The cgroup reading with least headroom (else one with a limit, else the first)."""
    known = [p.cgroup for p in processes if p.cgroup.headroom_bytes is not None]
    if known:
        return min(known, key=lambda c: c.headroom_bytes or 0)
    return next((p.cgroup for p in processes if p.cgroup.limit_bytes is not None), processes[0].cgroup)


def _limit_check(limit: HostLimit, needed: int, available: int | None, cgroup: CgroupMemory) -> LimitCheck | None:
    """`limit`'s check of `needed` new bytes as `offload.pure.decide.admission` makes it (None
    where it does not apply: a cgroup known to be unlimited)."""
    platform = Platform(host_available_bytes=available, cgroup_memory=cgroup)
    demand = HostDemand(host_bytes=needed, pinned_bytes=0, device_bytes=0)
    return next((c for c in assess_host_memory(demand, EnvSnapshot(platform=platform)).checks if c.limit is limit),
                None)


def _margin(check: JobCheck) -> int:
    return check.check.margin_bytes or 0


def _scope(processes: Sequence[ProcessMemory]) -> str:
    """``ranks 0-3 on host node-1`` (the hostnames of all of them, in rank order)."""
    ranks = [p.rank for p in processes]
    hosts = list(dict.fromkeys(p.host for p in processes))
    return (f"rank{'s' if len(ranks) != 1 else ''} {ranks_text(ranks)} on host{'s' if len(hosts) > 1 else ''} "
            f"{', '.join(hosts)}")


def _verb(ranks: Sequence[int], plural: str) -> str:
    """`plural` ("need", "take") for several ranks, with an s for one."""
    return plural if len(ranks) != 1 else f"{plural}s"


def _parts(processes: Sequence[ProcessMemory]) -> str:
    """What each process takes: ``rank 0 30.00 GiB (writes a shared copy), rank 4 10.00 GiB
    (a private copy); ranks 1, 2 none (they map a shared copy)``."""
    what = {"leader": "writes a shared copy", "follower": "a follower's own", "alone": "a private copy"}
    taking = [p for p in processes if p.new_bytes > 0]
    named = [f"rank {p.rank} {format_bytes(p.new_bytes)} ({what[p.role]})" for p in taking[:_NAMED]]
    if len(taking) > _NAMED:
        named.append(f"{len(taking) - _NAMED} more ranks {format_bytes(sum(p.new_bytes for p in taking[_NAMED:]))}")
    mapping = [p.rank for p in processes if p.new_bytes == 0 and p.role == "follower"]
    idle = [p.rank for p in processes if p.new_bytes == 0 and p.role != "follower"]
    text = ", ".join(named) if named else "nothing new"
    if mapping:
        many = len(mapping) > 1
        text += f"; rank{'s' if many else ''} {ranks_text(mapping)} none ({'they map' if many else 'it maps'} a shared copy)"
    if idle:
        text += f"; rank{'s' if len(idle) > 1 else ''} {ranks_text(idle)} none"
    return text


def _over(check: JobCheck, processes: Sequence[ProcessMemory]) -> str:
    c = check.check
    mine = [p for p in processes if p.rank in check.ranks]
    return (f"{_scope(mine)} {_verb(check.ranks, 'need')} {format_bytes(c.needed_bytes)} of new host "
            f"memory ({_parts(mine)}); "
            f"{_ALLOWS[c.limit].format(format_bytes(c.allowed_bytes or 0))} ({c.source})")


def _assess_host(processes: Sequence[ProcessMemory]) -> HostMemory:
    host = processes[0].host
    needed = sum(p.new_bytes for p in processes)
    checks: list[JobCheck] = []
    if needed > 0:
        available = _least(p.available_bytes for p in processes)
        scopes: list[tuple[HostLimit, list[ProcessMemory]]] = [(HostLimit.HOST_AVAILABLE, list(processes))]
        containers: dict[tuple[str, ...], list[ProcessMemory]] = {}
        for p in processes:
            containers.setdefault(p.container, []).append(p)
        scopes += [(HostLimit.CGROUP, members) for members in containers.values()]
        for limit, members in scopes:
            total = sum(p.new_bytes for p in members)
            check = _limit_check(limit, total, available, _tightest_cgroup(members)) if total else None
            if check is not None:
                checks.append(JobCheck(check=check, ranks=tuple(p.rank for p in members),
                                       refuses=check.fits is False and any(p.host_check == "refuse" for p in members)))
    failed = [c for c in checks if c.check.fits is False]
    known = [c for c in checks if c.check.allowed_bytes is not None]
    ranks = [p.rank for p in processes]
    if failed:
        worst = min(failed, key=_margin)
        message = _over(worst, processes)
        others = sorted({_SHORT[c.check.limit] for c in failed if c is not worst})
        if others:
            message += f"; also over {' and '.join(others)}"
        return HostMemory(host=host, processes=tuple(processes), checks=tuple(checks), verdict=HostFit.DOES_NOT_FIT,
                          binding=worst, message=message)
    if needed == 0:
        return HostMemory(host=host, processes=tuple(processes), checks=tuple(checks), verdict=HostFit.FITS,
                          binding=None,
                          message=f"fits: {_scope(processes)} {_verb(ranks, 'take')} no new host memory")
    if not known:
        return HostMemory(host=host, processes=tuple(processes), checks=tuple(checks), verdict=HostFit.UNKNOWN,
                          binding=None,
                          message=(f"unknown: {_scope(processes)} {_verb(ranks, 'need')} {format_bytes(needed)} of "
                                   f"new host memory ({_parts(processes)}), but neither MemAvailable nor the cgroup's "
                                   "memory limit could be read"))
    tightest = min(known, key=_margin)
    message = (f"fits: {_scope(processes)} {_verb(ranks, 'need')} {format_bytes(needed)} of new host memory "
               f"({_parts(processes)}); "
               f"the tightest limit, {tightest.check.source}, allows {format_bytes(tightest.check.allowed_bytes or 0)}")
    if tightest.check.needed_bytes != needed:
        message += f" for the {format_bytes(tightest.check.needed_bytes)} of ranks {ranks_text(tightest.ranks)}"
    return HostMemory(host=host, processes=tuple(processes), checks=tuple(checks), verdict=HostFit.FITS,
                      binding=tightest, message=message)


def assess_job(processes: Sequence[ProcessMemory]) -> JobMemory:
    """Whether the host memory of the job's processes fits, per machine: the verdict every
    process computes from the same gathered figures.

    Args:
        processes: one per process of the job, in any order.

    Returns:
        Per machine, the sums, the limits and the verdict; and who failed before.

    Raises:
        ValueError: a rank appears twice, or there are none.
    """
    ranks = [p.rank for p in processes]
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"every process of the job once, got ranks {sorted(ranks)}")
    machines: dict[str, list[ProcessMemory]] = {}
    for p in sorted(processes, key=lambda p: p.rank):
        machines.setdefault(p.machine, []).append(p)
    failures = tuple((p.rank, p.error) for p in sorted(processes, key=lambda p: p.rank) if p.error)
    return JobMemory(hosts=tuple(_assess_host(ps) for ps in machines.values()), failures=failures)


def local_admission(job: JobMemory, rank: int, own: HostAdmission) -> HostAdmission:
    """`rank`'s admission as the job's verdict says: its machine's ``MemAvailable`` check
    and its container's cgroup check (the sums), with its own pinned-memory checks as its
    plan recorded them (`own`). What its executor obeys at ``wrap_modules``.

    Raises:
        ValueError: `rank` is not in `job`.
    """
    host = job.host_of(rank)
    me = host.process(rank) if host is not None else None
    if host is None or me is None:
        raise ValueError(f"rank {rank} is not in the job ({ranks_text(job.ranks)})")
    shared = [c for c in host.checks if rank in c.ranks]
    pinned = [c for c in own.checks if c.pinned]
    checks = tuple(c.check for c in shared) + tuple(pinned)
    advice = "".join(f"; over {'the locked-memory limit' if c.limit is HostLimit.MEMLOCK else 'device memory'} "
                     f"(advisory: {over_text(c, own.pinned_bytes)}; pinning may fail and fall back to pageable "
                     "memory)" for c in pinned if c.fits is False and c.limit in ADVISORY_LIMITS)

    def admission(verdict: HostFit, message: str, binding: HostLimit | None = None) -> HostAdmission:
        return HostAdmission(verdict=verdict, host_bytes=me.new_bytes, pinned_bytes=own.pinned_bytes, checks=checks,
                             binding=binding, message=message + advice)

    binding_pinned = [c for c in pinned if c.limit not in ADVISORY_LIMITS]
    failed = [c for c in shared if c.check.fits is False]
    failed_pinned = [c for c in binding_pinned if c.fits is False]
    if failed or failed_pinned:
        margins = [(c.check.margin_bytes or 0, c.check, _local_over(c, host)) for c in failed]
        margins += [(c.margin_bytes or 0, c, over_text(c, own.pinned_bytes)) for c in failed_pinned]
        _, worst, text = min(margins, key=lambda m: m[0])
        return admission(HostFit.DOES_NOT_FIT, text, worst.limit)
    known = [c.check for c in shared if c.check.allowed_bytes is not None]
    known += [c for c in binding_pinned if c.allowed_bytes is not None]
    together = f"for {_scope(host.processes)}"
    if host.needed_bytes > 0 and not any(c.limit in _HOST_LIMITS for c in known):
        return admission(HostFit.UNKNOWN, f"unknown: {format_bytes(host.needed_bytes)} of new host memory {together}, "
                         "but neither MemAvailable nor the cgroup's memory limit could be read")
    if not known:
        return admission(HostFit.FITS, f"fits: no new host memory {together}")
    tightest = min(known, key=lambda c: c.margin_bytes or 0)
    what = "pinned host memory" if tightest.pinned else "new host memory"
    if not tightest.pinned:
        what += f" {together}"
    message = (f"fits: {format_bytes(tightest.needed_bytes)} of {what}; the tightest limit, {tightest.source}, allows "
               f"{format_bytes(tightest.allowed_bytes or 0)}")
    return admission(HostFit.FITS, message, tightest.limit)


def _local_over(check: JobCheck, host: HostMemory) -> str:
    """``needs 60.00 GiB of new host memory for ranks 0-3 on host node-1 (...); ...``:
    what `admit` says after "the plan "."""
    c = check.check
    mine = [p for p in host.processes if p.rank in check.ranks]
    return (f"needs {format_bytes(c.needed_bytes)} of new host memory for {_scope(mine)} "
            f"({_parts(mine)}); {_ALLOWS[c.limit].format(format_bytes(c.allowed_bytes or 0))} ({c.source})")


def job_plan(plan: OffloadPlan, job: JobMemory, rank: int) -> OffloadPlan:
    """`plan` with the admission `local_admission` gives `rank` (what its executor obeys),
    and its host-memory warning (`WarningCode.HOST_MEMORY_SHORT`) saying the same.

    Raises:
        ValueError: `rank` is not in `job`.
    """
    admission = local_admission(job, rank, plan.host_admission)
    warnings = [w for w in plan.warnings if w.code is not WarningCode.HOST_MEMORY_SHORT]
    mode = plan.config.host_check
    check = admission.binding_check
    if mode != "off" and admission.verdict is HostFit.DOES_NOT_FIT and check is not None and not check.pinned:
        outcome = ("wrap_modules refuses it on every rank of the job" if job.refused is not None else
                   "host_check='warn': it runs anyway, and the processes may be killed")
        warnings.append(PlanWarning(code=WarningCode.HOST_MEMORY_SHORT, message=(
            f"the plan {admission.message}; free host memory, raise the container's memory limit, offload less or "
            f"share more; {outcome}")))
    return attrs.evolve(plan, host_admission=admission, warnings=tuple(warnings))


def refusal_text(host: HostMemory) -> str:
    """The refusal every process of the job raises when `host` does not fit."""
    return (f"refusing to offload on every rank of the job, nothing was moved: {host.message}. Free memory, offload "
            "less or share more, or pass OffloadConfig(host_check='warn') to every rank to offload anyway (the kernel "
            "may kill the processes)")
