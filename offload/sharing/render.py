"""`render_sharing`: a `SharingPlan` for people, a few aligned lines (pure)."""

from __future__ import annotations

from offload.pure.units import format_bytes
from offload.sharing.plan import SharingPlan, ranks_text

__all__ = ["render_sharing"]


def render_sharing(sharing: SharingPlan) -> str:
    """What `offloader.sharing` says, as lines like::

        sharing:  ranks 0-3 on host node-1 map one host copy, written by rank 0 (this is rank 2, a follower)
        host:     1 copy of 3.25 GiB on this host instead of 4 x 3.25 GiB = 13.00 GiB; 832.0 MiB per process
        hosts:    node-1: ranks 0-3; node-2: ranks 4-7
        weights:  fingerprint 3f4e01941e45452b, 48 host copies, equal on every member
        timeout:  30 s per step (a member that fails or dies makes the others raise within it)
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
    return "\n".join(lines)
