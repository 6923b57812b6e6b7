"""The host memory of a job's processes, as values: what one process takes as its role in
its sharing group says (`process_host_bytes`), what it tells the others (`ProcessMemory`),
and the job's machines with their checks (`HostMemory`, `JobMemory`), which
`offload.pure.sharing.admission` computes. No torch, no environment, no files."""

from __future__ import annotations

import attrs

from offload.pure.decide.admission import (
    HostFit,
    LimitCheck,
    host_demand,
)
from offload.pure.decide.moves import WhereKind, where_kind
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.plan.plan import OffloadPlan

__all__ = [
    "ROLES",
    "HostMemory",
    "JobCheck",
    "JobMemory",
    "ProcessMemory",
    "private_host_bytes",
    "process_host_bytes",
]

#: What a process is to its sharing group (`SharingPlan.role`).
ROLES = ("leader", "follower", "alone")


def private_host_bytes(plan: OffloadPlan) -> int:
    """New host memory `plan` takes with a private copy (what `make_plan` checked), in bytes."""
    return host_demand(plan.params, compute_device=plan.compute_device, host_bytes=plan.host_bytes,
                       buffer_bytes=plan.device_bytes_buffers, resident_bytes=plan.device_bytes_resident,
                       pin=plan.pin.pin).host_bytes


def process_host_bytes(plan: OffloadPlan, role: str, segment_bytes: int) -> int:
    """New host memory one process takes, in bytes, as its role in its sharing group says.

    - ``"leader"``: the whole segment (its pages are reserved before anything is written,
      whether its weights are on the device, in host memory or on meta);
    - ``"follower"``: its offloaded weights on meta (its loader fills private memory,
      released at ``post_init``); weights with data point at the segment and add nothing;
    - ``"alone"``: its private copy, as `make_plan` counts it (`private_host_bytes`);

    and, for the first two, the static buffers when the compute device is the CPU.

    Args:
        plan: the process's plan.
        role: one of `ROLES`.
        segment_bytes: the size of its host's segment, in bytes (the leader's).

    Raises:
        ValueError: `role` is not one of `ROLES`.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "alone":
        return private_host_bytes(plan)
    buffers = plan.device_bytes_buffers if plan.compute_device == "cpu" else 0
    if role == "leader":
        return segment_bytes + buffers
    loading = sum(p.nbytes for p in plan.offloaded_params
                  if p.tied_to is None and where_kind(p.param.device, plan.compute_device) is WhereKind.META)
    return loading + buffers


@attrs.frozen(kw_only=True)
class ProcessMemory:
    """What one process of the job tells the others about its host memory (exchanged once).

    Attributes:
        rank: its global rank.
        host: its hostname.
        boot_id: its kernel's boot id: processes with one share a machine's memory
            (``"unknown"`` when unread: the hostname tells machines apart then).
        shm_id: the shared-memory file system it sees.
        role: ``"leader"``, ``"follower"`` or ``"alone"`` in its sharing group.
        new_bytes: new host memory it will take (`process_host_bytes`), in bytes.
        private_bytes: what it would take with a private copy (`private_host_bytes`), in bytes.
        available_bytes: ``MemAvailable`` as it read it, in bytes; None when unread.
        cgroup: its cgroup's memory limit as it read it.
        host_check: its plan's ``config.host_check``.
        error: why it failed before this exchange ("" when it did not): the others fail too.
    """

    rank: int
    host: str
    boot_id: str
    shm_id: str
    role: str
    new_bytes: int
    private_bytes: int
    available_bytes: int | None
    cgroup: CgroupMemory
    host_check: str
    error: str = ""

    @property
    def machine(self) -> str:
        """What tells machines apart: the boot id, or the hostname where that is unknown."""
        return f"boot {self.boot_id}" if self.boot_id not in ("", "unknown") else f"host {self.host}"

    @property
    def container(self) -> tuple[str, ...]:
        """Processes with equal containers are taken to be in one cgroup."""
        return (self.host, self.boot_id, self.shm_id, self.cgroup.cgroup_path, self.cgroup.limit_path)


@attrs.frozen(kw_only=True)
class JobCheck:
    """One limit on one machine, and the processes whose new host memory it sums.

    Attributes:
        check: the limit, the bytes needed (the sum) and allowed.
        ranks: the processes summed, ascending.
        refuses: the sum exceeds the limit and one of them has ``host_check="refuse"``.
    """

    check: LimitCheck
    ranks: tuple[int, ...]
    refuses: bool


@attrs.frozen(kw_only=True)
class HostMemory:
    """The job's processes on one machine and whether their host memory fits.

    Attributes:
        host: the hostname of its lowest rank.
        processes: its processes, by rank.
        checks: the machine's ``MemAvailable`` check, then one cgroup check per container
            (none when nothing new is taken; a cgroup known to be unlimited has none).
        verdict: fits, does not fit, or unknown (no limit could be read).
        binding: the most exceeded check when it does not fit, else the one with least
            room left; None when nothing was compared.
        message: the verdict for people: the ranks, the bytes, what takes them, the limit.
    """

    host: str
    processes: tuple[ProcessMemory, ...]
    checks: tuple[JobCheck, ...]
    verdict: HostFit
    binding: JobCheck | None
    message: str

    @property
    def ranks(self) -> tuple[int, ...]:
        """Its processes' ranks, ascending."""
        return tuple(p.rank for p in self.processes)

    @property
    def needed_bytes(self) -> int:
        """New host memory its processes take together, in bytes."""
        return sum(p.new_bytes for p in self.processes)

    @property
    def unshared_bytes(self) -> int:
        """What they would take with a private copy each, in bytes."""
        return sum(p.private_bytes for p in self.processes)

    @property
    def refused(self) -> bool:
        """Its memory does not fit and one of the processes over the limit refuses that."""
        return any(c.refuses for c in self.checks)

    def process(self, rank: int) -> ProcessMemory | None:
        """The figures of `rank`, or None."""
        return next((p for p in self.processes if p.rank == rank), None)


@attrs.frozen(kw_only=True)
class JobMemory:
    """The host memory of every process of the job, per machine (`assess_job`).

    Attributes:
        hosts: one per machine, by lowest rank.
        failures: (rank, why) of processes that failed before the exchange.
    """

    hosts: tuple[HostMemory, ...]
    failures: tuple[tuple[int, str], ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every process of the job, ascending."""
        return tuple(sorted(r for h in self.hosts for r in h.ranks))

    def host_of(self, rank: int) -> HostMemory | None:
        """The machine of `rank`, or None when it is not in the job."""
        return next((h for h in self.hosts if rank in h.ranks), None)

    @property
    def refused(self) -> HostMemory | None:
        """The first machine whose memory does not fit and is refused; None when none is."""
        return next((h for h in self.hosts if h.refused), None)
