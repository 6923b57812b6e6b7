"""How fast a disk reads the way the disk tier reads it: the rate to plan a disk tier with.

The disk tier's reader (`offload.runtime.diskio.DiskReader`: `THREADS` worker threads,
`CHUNK_BYTES` chunks, ``O_DIRECT``) reads each disk layer as one request per run of its
tensors, into one of a few reused staging buffers, up to ``read_ahead`` layers ahead of
the copies. `read_like_the_tier` reads byte ranges that way (no compute, no copies), and
`measure_disk_rate` times it on a scratch file in a directory (``offload env --disk``).

Several threads keep several reads in flight: on a virtual disk that reads up to about
twice as fast as one thread reading 16 MiB at a time (docs/disk.md, "A step against the
prediction"), so a rate measured with one thread makes the step's estimate pessimistic.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from offload.runtime.diskio import BLOCK_BYTES, CHUNK_BYTES, THREADS, DiskReader, ReadHandle, ReadMode

__all__ = ["DEFAULT_SCRATCH_BYTES", "LAYER_BYTES", "DiskRate", "evict", "layer_bytes", "measure_disk_rate",
           "read_like_the_tier", "staging_buffers"]

#: A run of a file: (path, file offset, bytes).
Run = tuple[str, int, int]

#: The scratch file `measure_disk_rate` reads by default, bytes (1 GiB: several seconds of
#: reads on a disk of a few GB/s, long enough for a virtual disk's rate to show).
DEFAULT_SCRATCH_BYTES = 1 << 30
#: The request each "layer" of the scratch file makes, bytes: a layer of a 7B-class
#: float16 model (about 200 MiB) read in one request, as the staging ring reads one.
LAYER_BYTES = 256 << 20
_WRITE_PIECE = 16 << 20


@attrs.frozen(kw_only=True)
class DiskRate:
    """A disk's read rate as the disk tier's reader reaches it.

    Attributes:
        gbps: the median of `runs`, GB/s (1e9 bytes per second).
        runs: each run's rate, GB/s, from the first submit to the last byte.
        nbytes: bytes each run read.
        threads: the reader's worker threads.
        chunk_bytes: the reader's chunk, bytes.
        request_bytes: bytes of each layer-sized request (the largest).
        depth: requests in flight at most (the staging ring's buffers).
        mode: how the file was read: ``direct`` (``O_DIRECT``) or ``buffered`` (the
            filesystem refused ``O_DIRECT``).
    """

    gbps: float
    runs: tuple[float, ...]
    nbytes: int
    threads: int
    chunk_bytes: int
    request_bytes: int
    depth: int
    mode: str


def staging_buffers(nbytes: int, count: int) -> list[torch.Tensor]:
    """`count` host ``uint8`` tensors of `nbytes` from a block boundary on, their pages
    touched (as the staging ring's are after its first pass: on a virtual machine, reads
    into fresh memory run up to 1.8x slower, docs/disk.md)."""
    found = []
    for _ in range(count):
        raw = torch.zeros(nbytes + BLOCK_BYTES, dtype=torch.uint8)
        found.append(raw[(-raw.data_ptr()) % BLOCK_BYTES:][:nbytes])
    return found


def layer_bytes(layers: Sequence[Sequence[Run]]) -> int:
    """The bytes of the largest layer as `read_like_the_tier` lays it out in a buffer."""
    return max((_layout(runs)[1] for runs in layers), default=0)


def _layout(runs: Sequence[Run]) -> tuple[list[int], int]:
    """Where each run starts in its buffer (congruent with its file offset modulo the
    block, so that ``O_DIRECT`` reads go straight in, as `staging_layout` lays a layer
    out), and the bytes the buffer needs."""
    starts, at = [], 0
    for _, offset, length in runs:
        at += (offset - at) % BLOCK_BYTES
        starts.append(at)
        at += length
    return starts, at


def read_like_the_tier(reader: DiskReader, layers: Sequence[Sequence[Run]], *, depth: int = 2,
                       buffers: Sequence[torch.Tensor] | None = None) -> int:
    """Read every layer's runs as the staging ring does: one request per run, the layer
    into buffer ``k % depth`` laid out congruent with its files, at most `depth` layers in
    flight (layer ``k`` is submitted once layer ``k - depth`` has landed). The bytes read.

    Args:
        reader: the reader (its threads and chunks are the tier's by default).
        layers: per layer, its runs (path, file offset, bytes).
        depth: layers in flight at most: the ring's staging buffers (`read_ahead`).
        buffers: `depth` host ``uint8`` tensors that start on a block boundary and hold
            the largest layer (`staging_buffers` of `layer_bytes`); None allocates them
            (fresh memory: pass buffers to time the reads alone).

    Raises:
        ValueError: `depth` is below 1, or fewer buffers than `depth`.
        offload.errors.ExecutionError: a read failed.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    plans = [_layout(runs) for runs in layers]
    if buffers is None:
        buffers = staging_buffers(layer_bytes(layers), depth)
    if len(buffers) < depth:
        raise ValueError(f"{depth} layers in flight need {depth} buffers, got {len(buffers)}")
    pending: list[list[ReadHandle]] = []
    total = 0
    for k, (runs, (starts, _)) in enumerate(zip(layers, plans, strict=True)):
        if len(pending) >= depth:
            total += sum(handle.wait() for handle in pending.pop(0))
        buffer = buffers[k % depth]
        pending.append([reader.submit(path, offset, length, buffer[start:start + length])
                        for (path, offset, length), start in zip(runs, starts, strict=True)])
    for handles in pending:
        total += sum(handle.wait() for handle in handles)
    return total


def evict(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Ask the kernel to drop the files' pages (best effort): fsync, then
    ``POSIX_FADV_DONTNEED`` on each whole file."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_scratch(path: Path, nbytes: int) -> None:
    """`nbytes` of random (incompressible) bytes at `path`, fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for start in range(0, nbytes, _WRITE_PIECE):
            view = memoryview(os.urandom(min(_WRITE_PIECE, nbytes - start)))
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def measure_disk_rate(directory: str | os.PathLike[str], *, nbytes: int = DEFAULT_SCRATCH_BYTES,
                      request_bytes: int = LAYER_BYTES, depth: int = 2, repeat: int = 3, threads: int = THREADS,
                      chunk_bytes: int = CHUNK_BYTES,
                      reader: Callable[[], DiskReader] | None = None) -> DiskRate:
    """Time the disk tier's reader on a scratch file of `nbytes` written in `directory`
    (removed afterwards), read `repeat` times after eviction as `read_like_the_tier` reads
    layers of `request_bytes`.

    Args:
        directory: where the model's files (or the spill directory) would be: the disk measured.
        nbytes: the scratch file's size, bytes (at least 1).
        request_bytes: bytes per layer-sized request.
        depth: layers in flight (the tier's ``read_ahead``, 2 by default).
        repeat: timed runs (the median is `DiskRate.gbps`).
        threads, chunk_bytes: the reader's (the tier's defaults).
        reader: makes the reader (tests inject one); None: ``DiskReader(threads=,
            chunk_bytes=)``.

    Raises:
        ValueError: a size, depth or repeat below 1.
        OSError: the directory cannot take the file.
        offload.errors.ExecutionError: a read failed.
    """
    if min(nbytes, request_bytes, depth, repeat) < 1:
        raise ValueError(f"nbytes, request_bytes, depth and repeat must be at least 1, got {nbytes}, "
                         f"{request_bytes}, {depth} and {repeat}")
    path = Path(directory) / f".offload-disk-rate-{os.getpid()}-{time.monotonic_ns()}.bin"
    make = reader if reader is not None else (lambda: DiskReader(threads=threads, chunk_bytes=chunk_bytes))
    try:
        _write_scratch(path, nbytes)
        name = os.fspath(path)
        layers = [[(name, start, min(request_bytes, nbytes - start))] for start in range(0, nbytes, request_bytes)]
        buffers = staging_buffers(layer_bytes(layers), depth)
        runs = []
        with make() as timed:
            read_like_the_tier(timed, layers[:1], depth=depth, buffers=buffers)  # untimed: opens the file
            for _ in range(repeat):
                evict([path])
                start = time.perf_counter()
                read = read_like_the_tier(timed, layers, depth=depth, buffers=buffers)
                runs.append(read / (time.perf_counter() - start) / 1e9)
            mode = timed.mode_of(name)
    finally:
        path.unlink(missing_ok=True)
    return DiskRate(gbps=statistics.median(runs), runs=tuple(runs), nbytes=nbytes, threads=threads,
                    chunk_bytes=chunk_bytes, request_bytes=min(request_bytes, nbytes), depth=depth,
                    mode="direct" if mode is ReadMode.DIRECT else "buffered")
