"""What sharing host copies among the processes of one host decides: pure values.

No torch, no environment, no files: the shell (`offload.sharing.join`) gathers one
`MemberInfo` from every member of the sharing group and calls these.

- `weights_of`: the offloaded weights every member must hold identically, and
  `weights_digest`, their fingerprint (with the segment's alignment and pinning).
- `lay_out`: where each host copy lies in the host's one shared segment (`SegmentLayout`).
- `mismatched` / `describe_mismatch`: which members differ, and how, in words;
  `describe_differences`: which followers hold other values than their host's copy.
- `plan_sharing`: who shares with whom, who writes, the bytes per process and per host
  (`SharingPlan`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence

import attrs

from offload.pure.plan.plan import OffloadPlan
from offload.pure.sharing.memory import JobMemory
from offload.pure.units import ranks_text

__all__ = [
    "CACHE_LINE",
    "HostShare",
    "MemberInfo",
    "SegmentLayout",
    "SharingPlan",
    "Slot",
    "WeightEntry",
    "describe_differences",
    "describe_mismatch",
    "lay_out",
    "mismatched",
    "plan_sharing",
    "weights_digest",
    "weights_of",
]

#: Alignment of host copies in a segment nobody registers with CUDA, in bytes: a cache
#: line, more than any dtype needs.
CACHE_LINE = 64

#: (layer, name, shape, stride, dtype, tied_to): one offloaded parameter as planned.
WeightEntry = tuple[int, str, tuple[int, ...], tuple[int, ...], str, tuple[int, str] | None]


def weights_of(plan: OffloadPlan) -> tuple[WeightEntry, ...]:
    """Every offloaded parameter of `plan` as (layer, name, shape, stride, dtype,
    tied_to), in plan order: what members sharing one host copy must agree on."""
    return tuple((p.layer, p.name, p.shape, p.stride, p.dtype, p.tied_to) for p in plan.offloaded_params)


def weights_digest(weights: Sequence[WeightEntry], align: int, pin: str) -> str:
    """A fingerprint of `weights` laid out with `align` and pinned with `pin` (the pin
    method's value), 16 hex digits: equal exactly when the members' segments would have
    the same layout, hold the same parameters and be page-locked the same way."""
    text = json.dumps([align, pin, [list(w) for w in weights]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen(kw_only=True)
class Slot:
    """Where one host copy lies in the segment.

    Attributes:
        ref: (layer, name) of the parameter owning the storage (ties share it).
        offset: from the segment's start, in bytes; a multiple of the layout's alignment.
        nbytes: bytes from its first element to its last (the tensor's span).
        shape, stride: in elements.
        dtype: the torch dtype's name without ``torch.``.
    """

    ref: tuple[int, str]
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@attrs.frozen(kw_only=True)
class SegmentLayout:
    """The host's one shared segment: every offloaded storage once, in plan order.

    Attributes:
        slots: one per owning parameter with bytes (empty tensors have no slot).
        align: slot alignment in bytes (the page size where slots are registered with
            CUDA one by one, so that no two share a page; `CACHE_LINE` otherwise).
        total_bytes: the segment's size, in bytes: the last slot's end rounded up to
            `align` (0 when there is nothing to share).
    """

    slots: tuple[Slot, ...]
    align: int
    total_bytes: int

    def slot(self, ref: tuple[int, str]) -> Slot | None:
        """The slot of `ref`, or None."""
        return self.by_ref.get(ref)

    @functools.cached_property
    def by_ref(self) -> dict[tuple[int, str], Slot]:
        """Slots by their owner's (layer, name) (built once: lookups are per parameter)."""
        return {s.ref: s for s in self.slots}

    @property
    def payload_bytes(self) -> int:
        """Bytes of the host copies themselves (the total less alignment padding)."""
        return sum(s.nbytes for s in self.slots)


def _round_up(value: int, align: int) -> int:
    return -(-value // align) * align


def lay_out(plan: OffloadPlan, align: int) -> SegmentLayout:
    """Slots for every offloaded storage of `plan`, packed in plan order at `align`.

    Args:
        plan: the plan every member runs.
        align: slot alignment in bytes, a power of two.

    Raises:
        ValueError: `align` is not a positive power of two.
    """
    if align < 1 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align}")
    slots: list[Slot] = []
    end = 0
    for p in plan.offloaded_params:
        if p.tied_to is not None or p.nbytes == 0:
            continue
        offset = _round_up(end, align)
        slots.append(Slot(ref=(p.layer, p.name), offset=offset, nbytes=p.nbytes, shape=p.shape, stride=p.stride,
                          dtype=p.dtype))
        end = offset + p.nbytes
    return SegmentLayout(slots=tuple(slots), align=align, total_bytes=_round_up(end, align))


@attrs.frozen(kw_only=True)
class MemberInfo:
    """What one member of a sharing group tells the others (exchanged once).

    Attributes:
        rank: its global rank in torch.distributed.
        host: its hostname.
        boot_id: the kernel's boot id (``/proc/sys/kernel/random/boot_id``): two
            machines with one hostname are told apart by it.
        shm_id: the identity of the shared-memory file system it sees (its device
            number): containers on one machine share a segment only if they see the same.
        pid: its process id (for messages).
        session: a random id; the lowest rank's names the group's keys in the store.
        digest: `weights_digest` of its offloaded weights and alignment.
        storages: host copies in its layout.
        host_bytes: its plan's host bytes (one process's copies without sharing).
        segment_bytes: its layout's total bytes.
        verify: as a follower, it compares a sample of its values with the copy and
            tells every member what it found (`ShareWith.verify`).
    """

    rank: int
    host: str
    boot_id: str
    shm_id: str
    pid: int
    session: str
    digest: str
    storages: int
    host_bytes: int
    segment_bytes: int
    verify: bool = True

    @property
    def host_key(self) -> tuple[str, str, str]:
        """Members with equal keys can map one segment."""
        return (self.host, self.boot_id, self.shm_id)


def mismatched(infos: Sequence[MemberInfo]) -> tuple[int, ...]:
    """Ranks whose weights differ from the lowest rank's (by digest), in rank order."""
    if not infos:
        return ()
    first = min(infos, key=lambda i: i.rank)
    return tuple(sorted(i.rank for i in infos if i.digest != first.digest))


def _entry_text(entry: WeightEntry) -> str:
    layer, name, shape, stride, dtype, tied = entry
    tie = f", tied to layer {tied[0]} {tied[1]!r}" if tied is not None else ""
    return f"layer {layer} parameter {name!r} shape {shape} stride {stride} {dtype}{tie}"


def describe_mismatch(reference: int, theirs: Sequence[WeightEntry], rank: int, ours: Sequence[WeightEntry],
                      *, reference_align: int, align: int) -> str:
    """How rank `rank`'s offloaded weights differ from rank `reference`'s, in words: the
    first parameter that differs, or the counts, or the alignment (pinning differs)."""
    if reference_align != align:
        return (f"rank {rank} lays out its host copies at {align}-byte alignment, rank {reference} at "
                f"{reference_align} (one pins host memory and the other does not)")
    for index, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            return f"offloaded parameter #{index}: rank {reference} has {_entry_text(a)}, rank {rank} has {_entry_text(b)}"
    if len(ours) == len(theirs):
        return f"rank {rank}'s offloaded weights have another fingerprint than rank {reference}'s"
    longer, who = (ours, rank) if len(ours) > len(theirs) else (theirs, reference)
    return (f"rank {reference} offloads {len(theirs)} parameters, rank {rank} offloads {len(ours)} (the first only "
            f"rank {who} has: {_entry_text(longer[min(len(ours), len(theirs))])})")


#: Ranks whose differences are told one by one (the rest are counted).
_RANKS_NAMED = 3


def describe_differences(differ: Sequence[tuple[int, int, tuple[int, str], int]], what: str, left: str) -> str:
    """Why every member of the group refuses `what`, in words.

    Args:
        differ: per rank whose values differ from its host's copy: (rank, the leader
            that wrote the copy, the first weight that differs as (layer, name), how
            many weights differ), in rank order.
        what: the lifecycle call refused ("wrap_modules", "post_init").
        left: what the refused call leaves on the member that raises, in words.

    Returns:
        One message, the same on every member but for `left`.
    """
    parts = []
    for rank, leader, (layer, name), count in differ[:_RANKS_NAMED]:
        more = f", and {count - 1} more" if count > 1 else ""
        parts.append(f"rank {rank}'s weights differ from the shared host copy rank {leader} wrote (layer {layer} "
                     f"parameter {name!r}{more}; a sample of their values)")
    if len(differ) > _RANKS_NAMED:
        parts.append(f"and those of {len(differ) - _RANKS_NAMED} more ranks")
    return (f"refusing {what} on every member of the sharing group: {'; '.join(parts)}. Members of a sharing group "
            "must hold identical weights (tensor-parallel ranks hold different shards: never put them in one "
            f"group); {left}")


@attrs.frozen(kw_only=True)
class HostShare:
    """The members of the sharing group on one host.

    Attributes:
        host: the hostname.
        ranks: their global ranks, ascending; the first is the leader, which writes the
            host copy.
    """

    host: str
    ranks: tuple[int, ...]

    @property
    def leader(self) -> int:
        """The lowest rank: it writes every offloaded weight once."""
        return self.ranks[0]


@attrs.frozen(kw_only=True)
class SharingPlan:
    """How this process shares its host copies: with whom, who writes, what it saves.

    Attributes:
        rank: this process's global rank.
        group_ranks: every member of the sharing group, ascending.
        hosts: the members by host (each host's members share one copy among themselves).
        local: this host's members.
        shared: True when this process's host copies lie in the host's shared segment;
            False when it is alone on its host or nothing is offloaded (see `reason`).
        reason: why it shares or not, in words.
        digest: the fingerprint every member's weights have (`weights_digest`).
        storages: host copies in the segment.
        host_bytes: host bytes of one process's copies (the plan's host bytes), as each
            process would hold them without sharing.
        segment_bytes: bytes of the shared segment on this host (the one copy, padded to
            its alignment); 0 when not shared.
        session: the id naming this group's keys in the torch.distributed store.
        timeout_s: the longest one member waits for another at one step, in seconds.
        job: the host memory of every process of the job (`ShareWith.job`), per
            machine, and whether it fits (`offload.pure.sharing.admission.assess_job`); None
            until it is gathered at ``create_offloader``.
        verifiers: the followers of the whole group (every host) that compare their
            values with their host's copy, ascending: every member waits for what they
            found before ``wrap_modules`` and ``post_init`` return.
    """

    rank: int
    group_ranks: tuple[int, ...]
    hosts: tuple[HostShare, ...]
    local: HostShare
    shared: bool
    reason: str
    digest: str
    storages: int
    host_bytes: int
    segment_bytes: int
    session: str
    timeout_s: float
    job: JobMemory | None = None
    verifiers: tuple[int, ...] = ()

    @property
    def leader(self) -> int:
        """The rank that writes this host's copy."""
        return self.local.leader

    @property
    def role(self) -> str:
        """``"leader"`` (writes the copy), ``"follower"`` (maps it read-only) or
        ``"alone"`` (not shared)."""
        if not self.shared:
            return "alone"
        return "leader" if self.rank == self.leader else "follower"

    @property
    def host_bytes_per_host(self) -> int:
        """Host bytes the copies of this host's members take: the segment once when
        shared, each member's own otherwise."""
        return self.segment_bytes if self.shared else len(self.local.ranks) * self.host_bytes

    @property
    def host_bytes_unshared_per_host(self) -> int:
        """What this host's members would take without sharing: one copy each."""
        return len(self.local.ranks) * self.host_bytes

    @property
    def host_bytes_per_process(self) -> int:
        """This process's proportional share of its host's copies (what Pss counts), bytes."""
        return self.host_bytes_per_host // len(self.local.ranks)


def plan_sharing(infos: Sequence[MemberInfo], rank: int, *, timeout_s: float) -> SharingPlan:
    """Who shares with whom, from every member's `MemberInfo` (all with one digest: check
    `mismatched` first).

    Args:
        infos: one per member, in any order.
        rank: this process's rank (one of them).
        timeout_s: recorded in the plan.

    Raises:
        ValueError: `rank` is not among `infos`, or a rank appears twice.
    """
    by_rank = {i.rank: i for i in infos}
    if len(by_rank) != len(infos):
        raise ValueError(f"a rank appears twice among {sorted(i.rank for i in infos)}")
    me = by_rank.get(rank)
    if me is None:
        raise ValueError(f"rank {rank} is not a member ({sorted(by_rank)})")
    groups: dict[tuple[str, str, str], list[int]] = {}
    for info in sorted(infos, key=lambda i: i.rank):
        groups.setdefault(info.host_key, []).append(info.rank)
    hosts = tuple(sorted((HostShare(host=by_rank[ranks[0]].host, ranks=tuple(ranks)) for ranks in groups.values()),
                         key=lambda h: h.leader))
    local = next(h for h in hosts if rank in h.ranks)
    session = by_rank[min(by_rank)].session
    if me.segment_bytes == 0:
        shared, reason = False, "nothing is offloaded to host memory"
    elif len(local.ranks) == 1:
        shared, reason = False, f"rank {rank} is the only member on host {me.host}"
    else:
        shared = True
        reason = (f"ranks {ranks_text(local.ranks)} on host {me.host} map one host copy, written by rank "
                  f"{local.leader}")
    # Every member computes the same: the digests (segment bytes included) are equal.
    verifiers = () if me.segment_bytes == 0 else tuple(
        r for h in hosts for r in h.ranks[1:] if by_rank[r].verify)
    return SharingPlan(rank=rank, group_ranks=tuple(sorted(by_rank)), hosts=hosts, local=local, shared=shared,
                       reason=reason, digest=me.digest, storages=me.storages, host_bytes=me.host_bytes,
                       segment_bytes=me.segment_bytes if shared else 0, session=session, timeout_s=timeout_s,
                       verifiers=tuple(sorted(verifiers)))
