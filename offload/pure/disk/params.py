"""The values of the disk tier's parameters and how they lie in a staging buffer: where a
disk parameter is read from (`DiskSource`, `DiskParam`), and the congruent layout of a
layer's parameters in its buffer (`residue`, `layout`), for `offload.pure.disk.tier`."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least
from offload.pure.spec.extents import DiskExtent

__all__ = ["READ_BLOCK", "STAGING_ALIGN", "DiskParam", "DiskSource", "layout", "residue", "ring_bytes", "staged"]


#: Where a parameter whose file offset is not element-aligned starts in its staging
#: buffer: a multiple of this many bytes (any dtype's element, and what device copies like
#: to start on).
STAGING_ALIGN = 256

#: The block of an ``O_DIRECT`` read (`offload.runtime.diskio.BLOCK_BYTES`). A parameter
#: starts in its staging buffer (which starts on such a block) at the offset of its bytes
#: in their file modulo this: congruent, so that its whole blocks are read straight in.
READ_BLOCK = 4096

#: A file offset whose residue is not a multiple of this is not followed (the typed view
#: of the parameter in the buffer needs its element's alignment): it starts on `STAGING_ALIGN`.
_ELEMENT_ALIGN = 8


def ring_bytes(buffers: int, staging_bytes: int) -> int:
    """Host bytes of `buffers` staging buffers of `staging_bytes` (each allocated one read
    block larger, to start on a block)."""
    return buffers * (staging_bytes + READ_BLOCK) if buffers and staging_bytes else 0


def residue(p: DiskParam) -> int:
    """Where in a `READ_BLOCK` `p` starts in its staging buffer: its checkpoint offset's
    residue (when element-aligned), else 0 (the spill file writes on block boundaries)."""
    if p.extent is None:
        return 0
    found = p.extent.offset % READ_BLOCK
    return found if found % _ELEMENT_ALIGN == 0 else -1


class DiskSource(enum.Enum):
    """Where a disk parameter's bytes are read from."""

    CHECKPOINT = "checkpoint"  # the checkpoint's own bytes, as they lie
    SPILL = "spill"  # a file the offloader writes once


@attrs.frozen(kw_only=True)
class DiskParam:
    """One parameter of a disk layer.

    Attributes:
        layer: its layer's index.
        name: its name in the layer.
        nbytes: bytes read per pass.
        source: where from.
        extent: CHECKPOINT: its bytes in the checkpoint; SPILL: None (the spill file's
            layout is the offloader's).
        reason: SPILL: why it is not read from the checkpoint; CHECKPOINT: empty.
        in_place: a parameter of an expert cache (`OffloadPlan.experts`): the cache reads
            the experts it misses from its file, expert by expert, and the staging ring
            never reads it (`staged`).
    """

    layer: int = attrs.field(validator=int_at_least(0, PlanError))
    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    nbytes: int = attrs.field(validator=int_at_least(0, PlanError))
    source: DiskSource = attrs.field(validator=attrs.validators.instance_of(DiskSource))
    extent: DiskExtent | None = None
    reason: str = ""
    in_place: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        mapped = self.source is DiskSource.CHECKPOINT
        if mapped != (self.extent is not None) or mapped == bool(self.reason):
            raise PlanError(f"layer {self.layer} parameter {self.name!r}: a {self.source.value} parameter has "
                            f"{'an extent and no reason' if mapped else 'a reason and no extent'}, got extent "
                            f"{self.extent!r} and reason {self.reason!r}", name=self.name, value=self.layer)
        if self.extent is not None and self.extent.length != self.nbytes:
            raise PlanError(f"layer {self.layer} parameter {self.name!r}: {self.nbytes} bytes, but its extent holds "
                            f"{self.extent.length}", name=self.name, value=self.extent.length)


def staged(params: Sequence[DiskParam]) -> list[DiskParam]:
    """The parameters of `params` the staging ring reads: all but those read in place."""
    return [p for p in params if not p.in_place]


def layout(params: Sequence[DiskParam]) -> tuple[tuple[int, ...], int]:
    """Where `params` (one layer's) lie in a staging buffer that starts on a `READ_BLOCK`,
    in their order, and the bytes they span.

    The checkpoint ones go first, in file order. Each starts congruent with its file
    offset modulo `READ_BLOCK` (`residue`), and one that follows the previous one in its
    file without a gap follows it in the buffer the same way, so that a run of them is one
    read. Then the spilled ones, each on a block (as the spill file writes them). One
    whose file offset is not element-aligned starts on `STAGING_ALIGN`.
    """
    def where(i: int) -> tuple[bool, str, int, int]:
        extent = params[i].extent
        return (extent is None, extent.path if extent is not None else "", extent.offset if extent is not None else 0,
                i)

    offsets = [0] * len(params)
    end = 0
    run: tuple[str, int, int] | None = None  # the previous one: its file, where it ends there and in the buffer
    for i in sorted(range(len(params)), key=where):
        p, wanted = params[i], residue(params[i])
        extent = p.extent
        if extent is not None and wanted >= 0 and run is not None and run[:2] == (extent.path, extent.offset):
            start = run[2]
        elif wanted < 0:
            start = -(-end // STAGING_ALIGN) * STAGING_ALIGN
        else:
            start = end + (wanted - end) % READ_BLOCK
        offsets[i] = start
        end = max(end, start + p.nbytes)
        run = (extent.path, extent.offset + extent.length, start + p.nbytes) if extent is not None and wanted >= 0 \
            else None
    return tuple(offsets), end
