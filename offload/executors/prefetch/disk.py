"""The disk tier as a prefetch offloader runs it (Note [disk tier]): the disk parameters'
copies in their files (`DiskHost`), the staging ring and its reader, from `post_init` to
`restore`. It decides nothing: which layers, which buffer, which read after which copy
are the `DiskTierPlan`'s."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import final

import attrs
import torch
from torch import nn

from offload.capture.pagemap import written_pages
from offload.capture.smaps import written_ranges
from offload.errors import ExecutionError, PlanError
from offload.executors.common import Ref, find_parameter
from offload.executors.diskhost import DiskHost
from offload.executors.hoststore import HostStore
from offload.executors.staging import StagingRing
from offload.logs import logger
from offload.model.checkpoint import changed_files
from offload.protocols import Event, HostWaits, Runtime
from offload.pure.check import FileCheck
from offload.pure.disk.tier import READ_BLOCK, DiskTierPlan, first_reads
from offload.pure.plan.plan import OffloadPlan
from offload.runtime.diskio import DiskReader, DiskReadStats
from offload.runtime.spill import SpillFile

__all__ = ["DiskIO", "DiskStream"]

log = logger("offload.disk")


def _check_tier(plan: OffloadPlan, tier: DiskTierPlan, when: str) -> None:
    """Refuse a disk tier that is not `plan`'s: its positions, layers and parameters (each
    untied offloaded parameter of a disk layer, with the bytes the tier reads)."""
    layers = plan.offloaded_layers
    kept = plan.schedule.kept_positions
    for position, layer in zip(tier.disk_positions, tier.disk_layers, strict=True):
        if position >= len(layers) or layers[position] != layer or position in kept:
            raise PlanError(f"{when}: the disk tier puts layer {layer} at schedule position {position}, which the plan "
                            f"{'keeps loaded' if position in kept else 'does not offload there'}: plan the disk tier "
                            "from this plan (plan_disk_tier)", name="disk_positions", value=position)
    on = set(tier.disk_layers)
    planned = {(p.layer, p.param.name): p.param.nbytes for p in plan.offloaded_params
               if p.layer in on and p.tied_to is None}
    tiered = {(p.layer, p.name): p.nbytes for p in tier.params}
    if planned != tiered:
        ref = next(iter(sorted(set(planned.items()) ^ set(tiered.items()))))
        raise PlanError(f"{when}: layer {ref[0][0]} parameter {ref[0][1]!r} is "
                        f"{'read by the disk tier' if ref in tiered.items() else 'offloaded'} with {ref[1]} bytes, "
                        "but not so in the "
                        f"{'plan' if ref in tiered.items() else 'disk tier'}: plan the disk tier from the plan as it "
                        "is (after post-processing)", name=ref[0][1], value=ref[0][0])


def _refuse_changed_files(tier: DiskTierPlan, when: str) -> None:
    """Refuse when a checkpoint file the tier reads is not as planned."""
    changed = changed_files(tier.files)
    if changed:
        path, fields = changed[0]
        raise ExecutionError(f"{when}: checkpoint file {path!r} changed after the disk tier was planned "
                             f"({', '.join(fields)} differ): its bytes may no longer be the model's weights; plan "
                             "again from the checkpoint as it is", name="path", value=path)


def _like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` as a host tensor with `like`'s dtype, shape and strides (itself when it is
    one already), converted as ``copy_`` converts."""
    data = values.detach()
    if data.device.type == "cpu" and data.dtype == like.dtype and data.shape == like.shape and \
            data.stride() == like.stride():
        return data
    out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
    out.copy_(data)
    return out


@attrs.frozen(kw_only=True)
class DiskIO:
    """How a disk tier reads and spills: made here, injected by tests (failing reads, a
    full disk).

    Attributes:
        reader: makes the reader of a run (from post_init to restore).
        spill: makes the spill file in a directory.
    """

    reader: Callable[[], DiskReader] = DiskReader
    spill: Callable[[str | os.PathLike[str]], SpillFile] = SpillFile


@final
class DiskStream:
    """A prefetch offloader's disk tier (see the module docstring).

    Args:
        plan: the prefetch plan.
        tier: its disk tier (`plan_disk_tier`).
        spill_dir: where weights that are not read from the checkpoint are written.
        io: how it reads and spills (`DiskIO`).

    Raises:
        PlanError: the tier is not the plan's.
        ExecutionError: it spills and no `spill_dir` is given.
    """

    def __init__(self, plan: OffloadPlan, tier: DiskTierPlan, *, spill_dir: str | os.PathLike[str] | None,
                 io: DiskIO | None = None) -> None:
        _check_tier(plan, tier, "the disk tier")
        self.tier = tier
        self._io = io if io is not None else DiskIO()
        self.host = DiskHost(tier, spill_dir=spill_dir, spill=self._io.spill)
        self._reader: DiskReader | None = None
        self._ring: StagingRing | None = None
        self._allocations: list[torch.Tensor] = []  # the staging buffers as allocated
        self._buffers: list[torch.Tensor] = []  # each from its first read block on
        self._rt: Runtime | None = None
        self._disk = frozenset(tier.disk_positions)
        self._versions: dict[Ref, tuple[nn.Parameter, int, torch.Tensor, int]] = {}  # at wrap (`written`)
        self._written: set[Ref] = set()  # copies found written in their mappings (`scan_for_writes`)
        self.fallbacks = 0  # staging buffers the plan pins that stayed pageable
        self._read_bytes = 0  # of readers closed before
        self._read_seconds = 0.0
        self._waited = 0.0
        self._misses = 0

    def before_wrap(self) -> None:
        """Refuse to map files that changed since planning."""
        _refuse_changed_files(self.tier, "wrap_modules")

    def wrapped(self, layers: Sequence[nn.Module], host: HostStore) -> None:
        """After wrap: note each disk parameter's version counter and its copy's, so that
        post_init sees a write into one (`written`)."""
        self._versions = {}
        for p in self.tier.params:
            param = find_parameter(layers[p.layer], p.name)
            copy = host.get((p.layer, p.name))
            if param is not None and copy is not None:
                self._versions[(p.layer, p.name)] = (param, param._version, copy, copy._version)

    def scan_for_writes(self) -> None:
        """Before post_init re-reads the weights: find the disk copies this process wrote
        (pages copied on write in their private mappings: a write through ``param.data``
        moves no version counter), for `written`. Where the process's mappings cannot be
        read, only the version counters tell (logged)."""
        spans = self.host.spans()
        ranges = {ref: (start, end) for ref, (_, start, end) in spans.items()}
        try:
            found = written_ranges(list(ranges.values()))
        except OSError as exc:
            log.warning("cannot tell which disk-tier copies were written before post_init (%s): a write through "
                        "param.data would not reach the disk reads", exc)
            self._written = set()
            return
        # A mapping holds many copies (a checkpoint file is mapped whole): of those in a
        # mapping with written pages, the copies whose own pages were written (a page
        # shared with a neighbour counts for both: that one is spilled as it is, unchanged).
        hits = [ref for ref, hit in zip(ranges, found, strict=True) if hit]
        try:
            pages = written_pages([ranges[ref] for ref in hits])
        except OSError as exc:
            log.info("cannot read which pages of the disk-tier mappings were written (%s): every copy in a written "
                     "mapping is copied again", exc)
            pages = (True,) * len(hits)
        self._written = {ref for ref, hit in zip(hits, pages, strict=True) if hit}
        if self._written:
            log.info("%d disk-tier weights were written before post_init: they are copied again, to the spill file",
                     len(self._written))

    def written(self, ref: Ref, param: nn.Parameter) -> bool:
        """Whether disk parameter `ref` (now `param`) was written in place since wrap: its
        copy maps its file privately, so the write went to this process's copy of the
        page and the reads from the file would not bring it (post_init then copies it
        again: to the spill file)."""
        entry = self._versions.get(ref)
        if entry is None:
            return False
        before, version, copy, copy_version = entry
        if before is not param or param.data_ptr() != copy.data_ptr():
            return False  # replaced since: the storage check sees it (or it was copied again already)
        return ref in self._written or param._version != version or copy._version != copy_version

    # ---- new weights (`offload.executors.reload.NewCopies`) -------------------------------

    def takes(self, ref: Ref) -> bool:
        """Whether `ref` is a disk parameter (its copy lies in a file: new values go to the
        spill file)."""
        return self.host.claims(ref)

    def refusal(self, ref: Ref) -> str | None:
        """Why disk parameter `ref` cannot take new values: no spill directory; else None."""
        if self.host.takes_new_weights:
            return None
        return ("it is a disk-tier weight, read from its file at every step, and its new values would be written "
                "to the spill file, but no spill_dir was given: pass spill_dir= (offload_model, offload_pretrained, "
                "create_offloader) to give disk-tier layers new weights")

    def replace(self, store: HostStore, items: Sequence[tuple[Ref, torch.Tensor]]) -> None:
        """New values for disk parameters (Note [new weights]): each converted to its
        copy's dtype and layout (one at a time: at most one tensor in host memory), written
        to the spill file, the file written back; then each becomes its parameter's copy in
        `store` and the staging ring reads it from there (a buffer holding the old bytes is
        read again). Call with no device copy in flight. The checkpoint is never written.

        Raises:
            ExecutionError: no spill directory, a copy missing, or the write failed (a full
                disk): nothing is replaced, and the model reads its old weights as before.
        """
        made: list[tuple[Ref, torch.Tensor]] = []
        try:
            for ref, values in items:
                old = store.get(ref)
                if old is None:
                    raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r} has no host copy", name=ref[1],
                                         value=ref[0])
                try:
                    fresh = _like(values, old)
                except RuntimeError as exc:
                    raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r}: converting its new values failed: "
                                         f"{exc}", name=ref[1], value=ref[0]) from exc
                made.append((ref, self.host.new_copy(ref, fresh)))
                del fresh
            self.host.flush()
        except BaseException:
            for _, copy in made:
                self.host.drop_new(copy)
            raise
        for ref, copy in made:
            store.put(ref, copy)  # the store asks the disk host, which takes the copy it made
        if self._ring is not None and made:
            sources = self.host.sources
            # Those read in place (an expert cache's) are read from their new copies by the cache.
            self._ring.move({ref: sources[ref] for ref, _ in made if self._ring.stages(ref)})
        log.debug("%d disk-tier weights took new values: written to the spill file, read from there", len(made))

    def start(self, plan: OffloadPlan, rt: Runtime) -> None:
        """At post_init (`plan` as revised): check the files and the tier, allocate the
        staging buffers (pinned as the plan says), start the reader, and stage the first
        reads of a pass.

        Raises:
            ExecutionError: a checkpoint file changed since planning, or an allocation failed.
            PlanError: post-processing changed the disk layers' parameters.
        """
        _refuse_changed_files(self.tier, "post_init")
        _check_tier(plan, self.tier, "post_init")
        self.host.finish()
        tier = self.tier
        # Each buffer starts on a read block, so that a parameter laid out congruent with
        # its file offset (`staging_layout`) is read straight in (one block more to shift by).
        like = torch.empty(tier.staging_bytes + READ_BLOCK, dtype=torch.uint8, device="meta")
        self._rt = rt
        self._allocations = []
        for _ in range(tier.buffers):  # one at a time: `stop` gives back those made if one fails
            self._allocations.append(rt.host_empty(like, pin=plan.pin.method))
        self._buffers = [b[(-b.data_ptr()) % READ_BLOCK:][:tier.staging_bytes] for b in self._allocations]
        self.fallbacks = sum(1 for b in self._allocations if plan.pin.pin and b.numel() and not rt.is_pinned(b))
        if self.fallbacks:
            log.warning("%d of %d disk staging buffers stayed in pageable memory (pinning them failed): each copy "
                        "out of one blocks until the copy stream reaches it", self.fallbacks, len(self._buffers))
        specs = {(p.layer, p.param.name): p.param for p in plan.offloaded_params if p.layer in set(tier.disk_layers)}
        self._reader = self._io.reader()
        self._ring = StagingRing(tier, self._reader, self._buffers, self.host.sources, specs,
                                 plan.schedule.cycle_of)
        for position in first_reads(tier, plan.schedule.initial):  # a pass's first copies, one per buffer
            self._ring.stage(position)

    @property
    def staging_bytes(self) -> int:
        """Host bytes the staging buffers hold now (0 before post_init and after restore)."""
        return sum(allocation.untyped_storage().nbytes() for allocation in self._allocations)

    def files_now(self) -> tuple[FileCheck, ...]:
        """Each checkpoint file the tier reads, against the plan (for `check()`)."""
        changed = dict(changed_files(self.tier.files))
        return tuple(FileCheck(f.path, changed.get(f.path, ())) for f in self.tier.files)

    def on_disk(self, position: int) -> bool:
        """Whether `position`'s copies come through the ring."""
        return position in self._disk

    def source(self, position: int, owner: Ref) -> torch.Tensor:
        """What `owner`'s copy at disk `position` reads: its view in the staging buffer."""
        if self._ring is None:
            raise ExecutionError("the disk tier is not started (post_init)", name="state", value=position)
        return self._ring.views(position)[owner]

    def before_copy(self, position: int) -> None:
        """Block until disk `position` is in its staging buffer (reading it now if it is not).

        Raises:
            ExecutionError: a read failed, naming the file and offset (the next copy of
                `position` reads it again).
        """
        if self._ring is not None:
            self._ring.ready(position)

    def run_begins(self, cycle: int) -> None:
        """A run of schedule `cycle` begins: the ring's next occupants follow the order the
        stacks run in (`StagingRing.ran`)."""
        if self._ring is not None:
            self._ring.ran(cycle)

    def after_copy(self, position: int, done: Event) -> None:
        """The device copy out of `position`'s buffer is issued (`done` its event): stage
        the buffer's next occupant, to be read once that copy is done."""
        if self._ring is None or self._rt is None:
            return
        self._ring.copied(position, self._blocker(self._rt, done))

    def note_copy(self, position: int, done: Event) -> None:
        """A copy out of `position`'s buffer that failed part way was issued up to `done`:
        the next refill of the buffer waits for it (nothing is staged)."""
        if self._ring is not None and self._rt is not None:
            self._ring.note_copy(position, self._blocker(self._rt, done))

    @staticmethod
    def _blocker(rt: Runtime, done: Event) -> Callable[[], object]:
        if isinstance(rt, HostWaits):
            return lambda: rt.block_on(done)
        return rt.synchronize

    def stop(self) -> None:
        """Wait for the reads in flight, stop the reader, give back the staging buffers
        (call with no device copy in flight). Idempotent."""
        if self._ring is not None:
            self._ring.drain()
            self._waited += self._ring.waited_seconds
            self._misses += self._ring.misses
            self._ring = None
        if self._reader is not None:
            self._reader.close()
            found = self._reader.stats()
            self._read_bytes += found.bytes_read
            self._read_seconds += found.read_seconds
            self._reader = None
        if self._rt is not None:
            for allocation in self._allocations:
                self._rt.release_host(allocation)
        self._allocations = []
        self._buffers = []

    def close(self) -> None:
        """After restore (or a failed wrap): `stop`, and close the files."""
        self.stop()
        self.host.close()

    def reads(self) -> tuple[int, float, float, int]:
        """(bytes read from disk, seconds reading, seconds the copies waited for reads,
        copies whose reads were not staged ahead), so far."""
        found: DiskReadStats | None = self._reader.stats() if self._reader is not None else None
        ring = self._ring
        waited = self._waited + (ring.waited_seconds if ring is not None else 0.0)
        misses = self._misses + (ring.misses if ring is not None else 0)
        if found is None:
            return self._read_bytes, self._read_seconds, waited, misses
        return self._read_bytes + found.bytes_read, self._read_seconds + found.read_seconds, waited, misses
