"""Which offloaded positions go to disk, and how the staging ring reads them, from plain
numbers: the arithmetic `offload.pure.disk.tier.plan_disk_tier` runs on a plan and
`fit`'s search runs on each candidate it costs (`offload.pure.disk.search`), so that the
two agree by construction.

A position is a schedule position (the ``i``-th offloaded layer, `OffloadPlan.offloaded_layers`);
``layer_bytes`` and ``staged`` are per layer: the host bytes of its offloaded weights, and
the bytes they span in a staging buffer (`offload.pure.disk.params.layout`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from offload.errors import PlanError
from offload.pure.disk.params import ring_bytes

__all__ = ["disk_candidates", "first_reads_of", "least_host_bytes", "next_occupants_of", "read_order_of",
           "tier_bytes", "tier_positions"]


def disk_candidates(num_positions: int, kept: Collection[int], tied: Collection[int],
                    positions: Sequence[int]) -> list[int]:
    """The positions that may go to disk, in execution order: not kept (alone in a slot,
    loaded once) and not holding a layer whose host copies another layer shares."""
    return [i for i in range(num_positions) if i not in kept and positions[i] not in tied]


def tier_bytes(positions: Sequence[int], layer_bytes: Mapping[int, int], staged: Mapping[int, int],
               chosen: Sequence[int], read_ahead: int) -> tuple[int, int]:
    """(host tier bytes, staging ring bytes) with the `chosen` positions on disk."""
    total = sum(layer_bytes.get(layer, 0) for layer in positions)
    on_disk = sum(layer_bytes.get(positions[i], 0) for i in chosen)
    ring = ring_bytes(min(read_ahead, len(chosen)), max((staged.get(positions[i], 0) for i in chosen), default=0))
    return total - on_disk, ring


def tier_positions(positions: Sequence[int], layer_bytes: Mapping[int, int], staged: Mapping[int, int],
                   candidates: Sequence[int], *, host_budget_bytes: int, read_ahead: int) -> tuple[int, ...] | None:
    """As few of the last `candidates` as make the host tier plus the staging ring fit
    `host_budget_bytes` (in position order), or None when no count of them does."""
    for count in range(len(candidates) + 1):
        chosen = sorted(candidates[len(candidates) - count:])
        host, ring = tier_bytes(positions, layer_bytes, staged, chosen, read_ahead)
        if host + ring <= host_budget_bytes:
            return tuple(chosen)
    return None


def least_host_bytes(positions: Sequence[int], layer_bytes: Mapping[int, int], staged: Mapping[int, int],
                     candidates: Sequence[int], *, read_ahead: int) -> int:
    """The least host memory (host tier + ring) any count of the last `candidates` on disk
    takes: the smallest host budget `tier_positions` can meet."""
    return min(sum(tier_bytes(positions, layer_bytes, staged, sorted(candidates[len(candidates) - count:]),
                              read_ahead))
               for count in range(len(candidates) + 1))


def read_order_of(issued_after: Sequence[int | None], disk: Collection[int]) -> tuple[int, ...]:
    """The disk positions in the order a pass issues their copies (and so reads them)."""
    return tuple(t for t in issued_after if t is not None and t in disk)


def next_occupants_of(read_order: Sequence[int], staging: Sequence[int], cycle_of: Sequence[int] = (),
                      following: Mapping[int, int] | None = None) -> dict[int, int]:
    """Each disk position's buffer's next occupant: the read staged once the copy out of
    the position is done.

    It is the next read of the buffer later in the position's cycle (a stack's run); after
    a cycle's last read of the buffer, the buffer's first read in the cycle that runs next
    (`following`), else in the cycles after that, else the cycle's own first read of it
    (itself when the buffer is its alone: read once and kept).

    Args:
        read_order: the disk positions in read order.
        staging: ``staging[k]``: the buffer read ``k`` fills.
        cycle_of: each position's schedule cycle (`PrefetchSchedule.cycle_of`); empty: one cycle.
        following: the cycle expected to run after each cycle (an encoder's decoder, a
            decoder itself while it generates); None: each cycle's own (it repeats).
    """
    def cycle(position: int) -> int:
        return cycle_of[position] if position < len(cycle_of) else 0

    cycles = sorted({cycle(p) for p in read_order})
    first_in: dict[tuple[int, int], int] = {}
    for k, position in enumerate(read_order):
        first_in.setdefault((cycle(position), staging[k]), position)
    found: dict[int, int] = {}
    for k, position in enumerate(read_order):
        mine, buffer = cycle(position), staging[k]
        later = next((read_order[j] for j in range(k + 1, len(read_order))
                      if staging[j] == buffer and cycle(read_order[j]) == mine), None)
        if later is not None:
            found[position] = later
            continue
        start = (following or {}).get(mine, mine)
        order = cycles[cycles.index(start):] + cycles[:cycles.index(start)] if start in cycles else [mine]
        found[position] = next((first_in[(c, buffer)] for c in order if (c, buffer) in first_in),
                               first_in[(mine, buffer)])
    return found


def first_reads_of(read_order: Sequence[int], staging: Sequence[int], initial: Sequence[int]) -> tuple[int, ...]:
    """The reads started before the first pass (post_init): a pass's first copies in the
    order they are issued (the schedule's `initial` ones, then the read order), one per
    buffer, the first that each buffer serves."""
    disk = set(read_order)
    starts = [i for i in initial if i in disk]
    taken: set[int] = set()
    found: list[int] = []
    for position in [*starts, *(i for i in read_order if i not in starts)]:
        buffer = staging[list(read_order).index(position)]
        if buffer not in taken:
            taken.add(buffer)
            found.append(position)
    return tuple(found)


def refuse_budget(host_budget_bytes: int, host_bytes: int, ring: int, candidates: int, read_ahead: int) -> PlanError:
    """The error of a host budget no count of disk layers meets."""
    return PlanError(
        f"host budget {host_budget_bytes} bytes does not fit the offloaded weights: with every one of the "
        f"{candidates} layers that can be on disk there, the host still holds {host_bytes} bytes "
        f"of kept layers and a staging ring of {ring} bytes ({min(read_ahead, candidates)} x the largest "
        "disk layer)",
        name="host_budget_bytes", value=host_budget_bytes)
