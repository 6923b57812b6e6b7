"""`render_sharing`: a `SharingPlan` for people, a few aligned lines (pure)."""

from __future__ import annotations

from offload.pure.decide.admission import HostFit
from offload.pure.sharing.memory import JobMemory
from offload.pure.sharing.plan import SharingPlan
from offload.pure.units import format_bytes, ranks_text

__all__ = ["render_sharing"]


def render_sharing(sharing: SharingPlan) -> str:
    """What `offloader.sharing` says, as lines like::

        sharing:  ranks 0-3 on host node-1 map one host copy, written by rank 0 (this is rank 2, a follower)
        host:     1 copy of 3.25 GiB on this host instead of 4 x 3.25 GiB = 13.00 GiB; 832.0 MiB per process
        hosts:    node-1: ranks 0-3; node-2: ranks 4-7
        weights:  fingerprint 3f4e01941e45452b, 48 host copies, equal on every member
        timeout:  30 s per step (a member that fails or dies makes the others raise within it)
        job:      8 processes (ranks 0-7) on 2 hosts, host memory summed per host: fits
          fits: ranks 0-3 on host node-1 need 6.50 GiB of new host memory (rank 0 3.25 GiB (writes a shared
            copy), rank 1 3.25 GiB (writes a shared copy); ranks 2, 3 none (they map a shared copy)); the
            tightest limit, the host's MemAvailable, allows 100.00 GiB (13.00 GiB with private copies)
          ...
    """
    s = sharing
    who = {"leader": "the leader: it writes the copy", "follower": "a follower: it maps the copy read-only",
           "alone": "not shared"}[s.role]
    lines = [f"sharing:  {s.reason} (this is rank {s.rank}, {who})"]
    n = len(s.local.ranks)
    if s.shared:
        lines.append(f"host:     1 copy of {format_bytes(s.segment_bytes)} on this host instead of {n} x "
                     f"{format_bytes(s.host_bytes)} = {format_bytes(s.host_bytes_unshared_per_host)}; "
                     f"{format_bytes(s.host_bytes_per_process)} per process")
    else:
        lines.append(f"host:     {format_bytes(s.host_bytes)} of host copies in this process, not shared")
    lines.append("hosts:    " + "; ".join(f"{h.host}: rank{'s' if len(h.ranks) > 1 else ''} {ranks_text(h.ranks)}"
                                         for h in s.hosts))
    lines.append(f"weights:  fingerprint {s.digest}, {s.storages} host copies, equal on every member")
    lines.append(f"timeout:  {s.timeout_s:g} s per step (a member that fails or dies makes the others raise within it)")
    if s.job is not None:
        lines += _job_lines(s.job)
    return "\n".join(lines)


#: Hosts shown one per line; the rest are counted.
_HOSTS_SHOWN = 8


def _job_lines(job: JobMemory) -> list[str]:
    """The job's host memory: a summary, then each host's verdict."""
    hosts = job.hosts
    refused = job.refused
    over = [h for h in hosts if h.verdict is HostFit.DOES_NOT_FIT]
    unknown = [h for h in hosts if h.verdict is HostFit.UNKNOWN]
    if refused is not None:
        verdict = f"does not fit on host {refused.host}: wrap_modules refuses it on every rank"
    elif over:
        verdict = (f"does not fit on host {', '.join(h.host for h in over)} (offloading anyway: host_check is 'warn' "
                   "or 'off' there)")
    elif unknown:
        verdict = f"unknown on host {', '.join(h.host for h in unknown)} (no limit could be read)"
    else:
        verdict = "fits"
    ranks = job.ranks
    lines = [f"job:      {len(ranks)} process{'es' if len(ranks) != 1 else ''} (rank{'s' if len(ranks) != 1 else ''} "
             f"{ranks_text(ranks)}) on {len(hosts)} host{'s' if len(hosts) != 1 else ''}, host memory summed per "
             f"host: {verdict}"]
    for h in hosts[:_HOSTS_SHOWN]:
        lines.append(f"  {h.message} ({format_bytes(h.unshared_bytes)} with private copies)")
    if len(hosts) > _HOSTS_SHOWN:
        lines.append(f"  ... and {len(hosts) - _HOSTS_SHOWN} more hosts")
    for rank, error in job.failures:
        lines.append(f"  rank {rank} failed: {error}")
    return lines
