"""Sharing host copies among the processes of one host.

Data-parallel replicas each keep a host copy of the same offloaded weights (8 replicas x
140 GB = 1.1 TB). ``create_offloader(plan, share_with=group)`` makes the members of a
torch.distributed group that hold identical weights share one copy per host: the lowest
rank on each host writes every offloaded weight once into exact-size POSIX shared memory,
the others map it read-only, and every executor's host copies (prefetch sources, UVA
views, on-demand sources) point into it. `plan` holds the pure decisions (`SharingPlan`,
the segment layout, fingerprints), `admission` the host memory of the whole job (what
every process takes, summed per host: `JobMemory`), `render` shows them, `segment`
makes and maps the memory, `pinning` page-locks it, `source` is the executors'
`HostSource`, `coordinate` talks to torch.distributed, `join` brings the members together
(`share_offloader`), and `offloader` runs the steps (its parts: `members`, `wrapping`).
"""

from __future__ import annotations

from offload.pure.sharing.memory import HostMemory, JobMemory, ProcessMemory
from offload.pure.sharing.plan import HostShare, SegmentLayout, SharingPlan, Slot
from offload.pure.sharing.render import render_sharing
from offload.sharing.coordinate import DEFAULT_TIMEOUT_S, ShareWith
from offload.sharing.join import share_offloader
from offload.sharing.members import SharingTimes
from offload.sharing.offloader import SharedOffloader
from offload.sharing.segment import SEGMENT_PREFIX, leftover_segments

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SEGMENT_PREFIX",
    "HostMemory",
    "HostShare",
    "JobMemory",
    "ProcessMemory",
    "SegmentLayout",
    "ShareWith",
    "SharedOffloader",
    "SharingPlan",
    "SharingTimes",
    "Slot",
    "leftover_segments",
    "render_sharing",
    "share_offloader",
]
