"""The disk tier's staging ring, as an executor drives it: each disk position's parameters
read from disk (the checkpoint where they lie, or a spill file) into its staging buffer,
ahead of the device copy out of it (`offload.pure.disk.tier` says which buffer, in which
order, and why no buffer is refilled while a copy reads it).

It decides nothing: the buffers are the tier's (allocated by the executor, pinned as the
plan's pin decision says), each position's buffer and layout are the tier's
(`staging_layout`), and a refill waits for what the caller passes (the event of the
device copy out of the buffer's previous occupant). The reads run on the `DiskReader`'s
threads; `ready` is where the Python thread waits for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import final

import torch

from offload.errors import ExecutionError
from offload.executors.common import Ref, torch_dtype
from offload.logs import logger
from offload.pure.disk.params import staged
from offload.pure.disk.tier import DiskTierPlan, next_occupants, staging_layout
from offload.pure.spec.values import ParamSpec
from offload.runtime.diskio import DiskReader, ReadHandle, Source

__all__ = ["StagingRing"]

log = logger("offload.disk")


@final
class StagingRing:
    """Reads disk positions into their staging buffers (see the module docstring).

    Args:
        tier: the disk tier.
        reader: the reader whose threads read.
        buffers: `DiskTierPlan.buffers` host ``uint8`` tensors of `staging_bytes` each
            (or more).
        sources: each disk parameter's (file, offset): a checkpoint path, or the spill
            file's fd, and the file offset of its first byte.
        specs: each disk parameter's shape, strides and dtype, for its view.
        cycle_of: the schedule's cycle of each position (`next_occupants`); empty: one.

    Raises:
        ExecutionError: the buffers are not the tier's, or a disk parameter has no source.
    """

    def __init__(self, tier: DiskTierPlan, reader: DiskReader, buffers: Sequence[torch.Tensor],
                 sources: Mapping[Ref, tuple[Source, int]], specs: Mapping[Ref, ParamSpec],
                 cycle_of: Sequence[int] = ()) -> None:
        if len(buffers) != tier.buffers or any(
                b.device.type != "cpu" or b.dtype != torch.uint8 or not b.is_contiguous()
                or b.numel() < tier.staging_bytes for b in buffers):
            raise ExecutionError(f"the staging ring takes {tier.buffers} contiguous host uint8 buffers of at least "
                                 f"{tier.staging_bytes} bytes, got {[(b.device.type, b.dtype, b.numel()) for b in buffers]}",
                                 name="buffers", value=len(buffers))
        missing = next(((p.layer, p.name) for p in tier.params if (p.layer, p.name) not in sources), None)
        if missing is not None:
            raise ExecutionError(f"disk parameter {missing[1]!r} of layer {missing[0]} has no file to read from",
                                 name=missing[1], value=missing[0])
        self._reader = reader
        self._buffers = list(buffers)
        self._layer_of = dict(zip(tier.disk_positions, tier.disk_layers, strict=True))
        self._buffer_of = {position: tier.staging[k] for k, position in enumerate(tier.read_order)}
        layout = staging_layout(tier)
        self._params: dict[int, list[tuple[Ref, Source, int, int, int]]] = {}  # position -> (ref, file, at, offset, n)
        self._reads: dict[int, list[tuple[Ref, Source, int, int, int]]] = {}  # the same, runs merged into one read
        self._position_of: dict[Ref, int] = {}  # each disk parameter's position
        self._views: dict[int, dict[Ref, torch.Tensor]] = {}
        for position, layer in self._layer_of.items():
            params = [p for p in staged(tier.params) if p.layer == layer]  # not those read in place
            offsets = layout.get(layer, ((), 0))[0]
            buffer = self._buffers[self._buffer_of[position]]
            reads: list[tuple[Ref, Source, int, int, int]] = []
            views: dict[Ref, torch.Tensor] = {}
            for p, offset in zip(params, offsets, strict=True):
                ref = (p.layer, p.name)
                source, at = sources[ref]
                reads.append((ref, source, at, offset, p.nbytes))
                spec = specs[ref]
                raw = buffer[offset:offset + p.nbytes]
                views[ref] = raw.view(torch_dtype(spec.dtype)).as_strided(spec.shape, spec.stride)
            self._params[position] = reads
            self._position_of.update((ref, position) for ref, *_ in reads)
            self._reads[position] = _merged(reads)
            self._views[position] = views
        self._holds: list[int | None] = [None] * len(self._buffers)  # the position each buffer holds (or is reading)
        self._pending: dict[int, list[ReadHandle]] = {}
        # Per buffer, what a refill waits for: the last device copy out of it (`copied`).
        self._after: list[Callable[[], object] | None] = [None] * len(self._buffers)
        # Each disk position's buffer's next occupant (itself: the buffer is its alone),
        # after a cycle's last read of a buffer the first read of it in the cycle expected
        # to run next: at first each stack's successor in run order, the last stack itself
        # (an encoder then its decoder, which repeats per token); then the cycle that did
        # followed it most often (`ran`).
        self._tier = tier
        self._cycle_of = tuple(cycle_of)
        cycles = sorted({self._cycle(p) for p in tier.read_order})
        self._following = {c: cycles[i + 1] if i + 1 < len(cycles) else c for i, c in enumerate(cycles)}
        self._next_of = next_occupants(tier, cycle_of, self._following)
        self._last: int | None = None  # the cycle whose run began last (`ran`)
        self._after_counts: dict[int, dict[int, tuple[int, int]]] = {}  # cycle -> next: (times, latest run)
        self._runs = 0
        self._waited_ns = 0
        self.misses = 0  # copies that found their position not staged (read then, not ahead)

    def _cycle(self, position: int) -> int:
        return self._cycle_of[position] if position < len(self._cycle_of) else 0

    def ran(self, cycle: int) -> None:
        """A run of `cycle` begins (its stack's first offloaded layer runs): the expected
        successor of the cycle that ran before it is the cycle that followed it most often
        (the latest of equals), and the next occupants follow: an encoder's is its decoder,
        a decoder's itself (it runs again per token, the encoder once per request)."""
        last, self._last = self._last, cycle
        if last is None:
            return
        self._runs += 1
        seen = self._after_counts.setdefault(last, {})
        seen[cycle] = (seen.get(cycle, (0, 0))[0] + 1, self._runs)
        expected = max(seen, key=lambda c: seen[c])
        if self._following.get(last) != expected:
            self._following[last] = expected
            self._next_of = next_occupants(self._tier, self._cycle_of, self._following)

    @property
    def following(self) -> Mapping[int, int]:
        """The cycle expected to run after each cycle (what the next occupants follow)."""
        return dict(self._following)

    def stages(self, ref: Ref) -> bool:
        """Whether the ring reads `ref` (a disk parameter not read in place)."""
        return ref in self._position_of

    def views(self, position: int) -> Mapping[Ref, torch.Tensor]:
        """Each parameter of disk `position`, as it lies in its staging buffer once
        `ready`: the source of its device copy (the same tensors every pass)."""
        return self._views[position]

    def holds(self, position: int) -> bool:
        """Whether `position`'s buffer holds it (read, or being read)."""
        return self._holds[self._buffer_of[position]] == position

    def on_disk(self, position: int) -> bool:
        """Whether `position` is a disk position (read through the ring)."""
        return position in self._views

    def stage(self, position: int, *, after: Callable[[], object] | None = None) -> None:
        """Start reading `position` into its buffer, unless the buffer holds it already.
        The reads wait for `after` first, by default for the last device copy out of the
        buffer (`copied`); reads of another position still filling the buffer are waited
        for before (their errors are that position's, and dropped with it).

        Raises:
            ExecutionError: a read could not be submitted (the reader is closed).
        """
        buffer = self._buffer_of[position]
        previous = self._holds[buffer]
        if previous == position:
            return
        if previous is not None:
            self._settle(self._pending.pop(previous, []))
        self._holds[buffer] = position
        wait = after if after is not None else self._after[buffer]
        submitted: list[ReadHandle] = []
        try:
            for _, source, at, offset, n in self._reads[position]:
                submitted.append(self._reader.submit(source, at, n, self._buffers[buffer][offset:offset + n],
                                                     before=wait))
        except ValueError as exc:
            self._settle(submitted)  # nothing of it may still write the buffer
            self._holds[buffer] = None
            raise ExecutionError(f"disk position {position}: its reads could not start: {exc}", name="reader",
                                 value=position) from exc
        self._pending[position] = submitted

    def move(self, moved: Mapping[Ref, tuple[Source, int]]) -> None:
        """Disk parameters whose bytes now lie elsewhere (new weights, written to the spill
        file): each is read from its new (file, offset) from now on, and a buffer that holds
        (or is reading) a position of one of them is read again, after the reads still in
        flight into it (call with no device copy out of it in flight).

        Raises:
            ExecutionError: a parameter is not a disk parameter here, or a read could not be
                submitted (the reader is closed).
        """
        touched: set[int] = set()
        for ref, (source, at) in moved.items():
            position = self._position_of.get(ref)
            if position is None:
                raise ExecutionError(f"disk parameter {ref[1]!r} of layer {ref[0]} is not in the staging ring",
                                     name=ref[1], value=ref[0])
            self._params[position] = [(r, source, at, offset, n) if r == ref else (r, file, was, offset, n)
                                      for r, file, was, offset, n in self._params[position]]
            touched.add(position)
        for position in sorted(touched):
            self._reads[position] = _merged(self._params[position])
            if self.holds(position):  # the old bytes: read it again
                self._settle(self._pending.pop(position, []))
                self._holds[self._buffer_of[position]] = None
                self.stage(position)

    def copied(self, position: int, wait: Callable[[], object]) -> None:
        """A device copy out of `position`'s buffer was issued; `wait` blocks until it is
        done. Its buffer's next occupant in read order is staged to be read after it."""
        self.note_copy(position, wait)
        self.stage(self._next_of[position])

    def note_copy(self, position: int, wait: Callable[[], object]) -> None:
        """A device copy out of `position`'s buffer was issued (in part, when it failed):
        the buffer's next refill waits for `wait`."""
        self._after[self._buffer_of[position]] = wait

    @property
    def waited_seconds(self) -> float:
        """Seconds `ready` blocked on reads."""
        return self._waited_ns / 1e9

    def drain(self) -> None:
        """Wait for every read in flight (their errors dropped); the buffers then hold
        nothing: nothing reads into them any more."""
        for position in list(self._pending):
            self._settle(self._pending.pop(position))
        self._holds = [None] * len(self._buffers)

    def ready(self, position: int) -> None:
        """Wait until `position` is in its buffer (staging it first if it is not).

        Raises:
            ExecutionError: a read failed (naming the file and offset); the buffer then
                holds nothing, and the next `stage` reads again.
        """
        if not self.holds(position):
            self.misses += 1
            self.stage(position)
        handles = self._pending.pop(position, [])
        start = time.perf_counter_ns()
        try:
            for handle in handles:
                handle.wait()
        except ExecutionError:
            self._settle(handles)  # let the others finish before the buffer is read again
            self._holds[self._buffer_of[position]] = None
            raise
        finally:
            self._waited_ns += time.perf_counter_ns() - start

    @staticmethod
    def _settle(handles: Sequence[ReadHandle]) -> None:
        """Wait for every one of `handles`, whatever they raise."""
        for handle in handles:
            try:
                handle.wait()
            except ExecutionError:
                pass


def _merged(reads: list[tuple[Ref, Source, int, int, int]]) -> list[tuple[Ref, Source, int, int, int]]:
    """`reads` with those that follow one another in the same file and in the buffer made
    one (a run of a layer's parameters, laid out as in its file: `staging_layout`)."""
    found: list[tuple[Ref, Source, int, int, int]] = []
    for ref, source, at, offset, n in sorted(reads, key=lambda r: (isinstance(r[1], int), str(r[1]), r[2])):
        if found:
            first, last_source, last_at, last_offset, last_n = found[-1]
            if last_source == source and last_at + last_n == at and last_offset + last_n == offset:
                found[-1] = (first, source, last_at, last_offset, last_n + n)
                continue
        found.append((ref, source, at, offset, n))
    return found
