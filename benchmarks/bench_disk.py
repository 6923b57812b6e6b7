"""Disk reads: `DiskReader` against a plain sequential ``O_DIRECT`` reader of the same files.

Files: ``--files`` files of ``--size-mib`` MiB of random (incompressible) bytes, written and
fsync'd in a fresh directory under ``--dir`` (default: the current directory, where a
model would live, rather than /tmp, which may be tmpfs) and removed afterwards. The output
names the filesystem they are on.

Sides, ``--repeat`` runs each, interleaved (the order turns every repeat), each run after
the files were evicted from the page cache (fsync, then ``POSIX_FADV_DONTNEED`` on each
whole file: best effort, the kernel may keep pages it cannot drop):

- ``plain``: the reference reader: one thread, ``O_DIRECT``, ``preadv`` of the files'
  consecutive 16 MiB pieces into one page-aligned 16 MiB buffer, file after file;
- ``plain-dest``: the same reads, into consecutive 16 MiB of the memory ``ours`` fills:
  the same reader with the same destination memory as ours (on a virtual machine the
  memory written decides as much as the reader; docs/disk.md has the measurements);
- ``ours``: `DiskReader` (``--threads`` threads, ``--chunk-mib`` chunks), one request per
  file, the whole file into a host buffer that starts 64 bytes past a page (as a tensor at
  an unaligned file offset): every chunk goes through the reader's staging buffers;
- ``ours-direct``: the same into a page-aligned buffer: the chunks go straight in.

The destination memory is faulted in by one untimed pass first. Per side it prints the
median GB/s (1e9 bytes per second, first submit to last byte) and each run's, then the
ratios of the medians to ``plain`` (target: at least 0.9) and to ``plain-dest``, and
whether the reader delivered the files' bytes (crc32 after the last repeat, untimed).

Run: ``python benchmarks/bench_disk.py`` (1 GiB, 3 repeats: about 20 s on the CPU machine;
needs host memory for one copy of the files). ``--quick`` is a 32 MiB smoke run;
``--strict`` exits 1 when a ratio to ``plain`` misses the target.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from offload.runtime.diskio import DiskReader
from offload.runtime.diskrate import evict

MIB = 1 << 20
GB = 1e9
PIECE = 16 * MIB  # the plain reader's read size
STAGED_SKEW = 64  # bytes past a page where the staged side's destination starts
TARGET = 0.9
SIDES = ("plain", "plain-dest", "ours", "ours-direct")
OURS = ("ours", "ours-direct")


def filesystem_of(path: Path) -> str:
    """The filesystem `path` is on, from /proc/mounts: ``type (device mounted at point)``."""
    target, best = str(path.resolve()), ("unknown", "?", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "an unknown filesystem (/proc/mounts unreadable)"
    for line in lines:
        device, point, kind, *_ = line.split()
        point = point.replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[2]):
            best = (kind, device, point)
    return f"{best[0]} ({best[1]} mounted at {best[2]})"


def write_files(directory: Path, count: int, nbytes: int) -> list[tuple[Path, int]]:
    """`count` files of `nbytes` random bytes each, fsync'd; each path with its crc32."""
    files = []
    for index in range(count):
        path, crc = directory / f"bench_disk-{index}.bin", 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, nbytes, PIECE):
                block = os.urandom(min(PIECE, nbytes - start))
                crc = zlib.crc32(block, crc)
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        files.append((path, crc))
    return files




def open_direct(path: Path) -> tuple[int, bool]:
    """An fd of `path`, ``O_DIRECT`` where the filesystem takes it; and whether it is."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def read_plain(paths: Sequence[Path], buffers: Sequence[memoryview], *, direct: list[bool]) -> int:
    """Read every file sequentially in 16 MiB pieces, the n-th piece into ``buffers[n %
    len(buffers)]``; the bytes read. Appends whether each file was opened ``O_DIRECT``."""
    total = 0
    for path in paths:
        fd, is_direct = open_direct(path)
        direct.append(is_direct)
        try:
            position = 0
            while n := os.preadv(fd, [buffers[total // PIECE % len(buffers)]], position):
                position += n
                total += n
        finally:
            os.close(fd)
    return total


def merged_runs(runs: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """`runs` (path, file offset, bytes) sorted, with those that touch or overlap made one."""
    found: list[tuple[str, int, int]] = []
    for path, offset, length in sorted(runs):
        if found and found[-1][0] == path and found[-1][1] + found[-1][2] >= offset:
            last = found[-1]
            found[-1] = (path, last[1], max(last[1] + last[2], offset + length) - last[1])
        else:
            found.append((path, offset, length))
    return found


def read_plain_runs(runs: Sequence[tuple[str, int, int]], buffer: memoryview, *, direct: list[bool],
                    block: int = 4096) -> int:
    """The plain reader over byte ranges: each run's aligned span (whole `block`-byte
    blocks, as ``O_DIRECT`` wants) read in order, in pieces of ``len(buffer)`` into
    `buffer` (page-aligned), one thread; the bytes of the runs. Appends whether each file
    was opened ``O_DIRECT``."""
    total, fds = 0, {}
    try:
        for path, offset, length in runs:
            if path not in fds:
                fds[path], is_direct = open_direct(Path(path))
                direct.append(is_direct)
            position, end = offset // block * block, -(-(offset + length) // block) * block
            while position < end:
                n = os.preadv(fds[path], [buffer[:min(len(buffer), end - position)]], position)
                if n <= 0:
                    break
                position += n
            total += length
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


def read_ours(reader: DiskReader, files: Sequence[tuple[Path, int]], dests: Sequence[memoryview]) -> int:
    """Read every file whole into its destination, all submitted at once; the bytes read."""
    handles = [reader.submit(path, 0, len(dest), dest) for (path, _), dest in zip(files, dests, strict=True)]
    return sum(handle.wait() for handle in handles)


@attrs.frozen(kw_only=True)
class Usage:
    """This machine's busy CPU and disk reads at a moment, and this process's share."""

    wall: float  # seconds (perf_counter)
    busy: float  # CPU seconds every process has used (/proc/stat: not idle, not iowait)
    mine: float  # CPU seconds this process has used
    read: int  # bytes read from the disks (/proc/diskstats, whole disks)
    my_read: int  # bytes this process has read from storage (/proc/self/io)


def usage() -> Usage:
    """The counters now (`others`)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
    times = os.times()
    sectors = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and Path(f"/sys/block/{parts[2]}").exists():  # whole disks, not partitions
            sectors += int(parts[5])
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return Usage(wall=time.perf_counter(), busy=busy / os.sysconf("SC_CLK_TCK"), mine=times.user + times.system,
                 read=sectors * 512, my_read=int(io["read_bytes"]))


def others(since: Usage) -> tuple[float, float]:
    """(cores, disk GB/s) other processes used on average since `since`: another user's
    tests share this machine's two cores and its disk."""
    now = usage()
    wall = max(now.wall - since.wall, 1e-9)
    cores = max(0.0, (now.busy - since.busy) - (now.mine - since.mine)) / wall
    reads = max(0, (now.read - since.read) - (now.my_read - since.my_read)) / wall / GB
    return cores, reads


def wait_for_quiet(seconds: float, *, cores: float = 0.25, gbps: float = 0.02) -> None:
    """Wait (at most `seconds`) until, over half a second, other processes keep fewer than
    `cores` cores busy and read less than `gbps` from the disks."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        since = usage()
        time.sleep(0.5)
        used, read = others(since)
        if used < cores and read < gbps:
            return


def timed(run: Callable[[], int]) -> float:
    """GB/s of one `run` (which returns the bytes it read)."""
    start = time.perf_counter()
    nbytes = run()
    return nbytes / (time.perf_counter() - start) / GB


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=1024, help="size of each file in MiB (default 1024)")
    parser.add_argument("--files", type=int, default=1, help="number of files (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side (default 3)")
    parser.add_argument("--threads", type=int, default=4, help="the reader's worker threads (default 4)")
    parser.add_argument("--chunk-mib", type=int, default=16, help="the reader's chunk size in MiB (default 16)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: the current "
                        "directory; in a fresh subdirectory, removed afterwards)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one file of 32 MiB, one repeat")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a ratio to plain misses the target")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.files, args.repeat = 32, 1, 1
    if min(args.size_mib, args.files, args.repeat, args.threads, args.chunk_mib) < 1:
        parser.error("--size-mib, --files, --repeat, --threads and --chunk-mib must be at least 1")
    directory = Path(tempfile.mkdtemp(prefix=".bench_disk-", dir=args.dir if args.dir is not None else Path.cwd()))
    try:
        return run(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, directory: Path) -> int:
    """Write the files, measure every side, print; the exit status."""
    nbytes, total = args.size_mib * MIB, args.files * args.size_mib * MIB
    fs = filesystem_of(directory)
    print(f"bench_disk: {args.files} file(s) of {args.size_mib} MiB in {directory} on {fs}")
    if fs.startswith("tmpfs"):
        print("note: tmpfs holds files in memory: these are memory reads, not disk reads")
    start = time.perf_counter()
    files = write_files(directory, args.files, nbytes)
    paths = [path for path, _ in files]
    print(f"written and fsync'd in {time.perf_counter() - start:.2f} s")
    print("page cache: evicted before every run by fsync + POSIX_FADV_DONTNEED on each whole file "
          "(best effort: the kernel may keep pages it cannot drop)")

    plain_map = mmap.mmap(-1, PIECE)  # anonymous maps are page-aligned
    dest_map = mmap.mmap(-1, total + mmap.PAGESIZE)
    plain_buffer, whole = memoryview(plain_map), memoryview(dest_map)
    pieces = [whole[i:i + PIECE] for i in range(0, total, PIECE)]
    direct_dests = [whole[i * nbytes:(i + 1) * nbytes] for i in range(args.files)]
    staged_dests = [whole[STAGED_SKEW + i * nbytes:STAGED_SKEW + (i + 1) * nbytes] for i in range(args.files)]
    plain_modes: list[bool] = []  # per file the plain sides read: whether O_DIRECT
    read_plain(paths, pieces, direct=plain_modes)  # untimed: faults the destination memory in
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    exact = dict.fromkeys(OURS, False)
    with DiskReader(threads=args.threads, chunk_bytes=args.chunk_mib * MIB) as reader:
        for repeat in range(args.repeat):
            for side in SIDES[repeat % len(SIDES):] + SIDES[:repeat % len(SIDES)]:
                evict(paths)
                if side in OURS:
                    dests = staged_dests if side == "ours" else direct_dests
                    rates[side].append(timed(functools.partial(read_ours, reader, files, dests)))
                    exact[side] = all(zlib.crc32(dest) == crc for dest, (_, crc) in zip(dests, files, strict=True))
                else:
                    buffers = [plain_buffer] if side == "plain" else pieces
                    rates[side].append(timed(functools.partial(read_plain, paths, buffers, direct=plain_modes)))
        stats = reader.stats()
        modes = sorted({mode.value for mode in map(reader.mode_of, paths) if mode is not None})
    for view in (plain_buffer, whole, *pieces, *direct_dests, *staged_dests):
        view.release()
    plain_map.close()
    dest_map.close()

    how = "O_DIRECT" if all(plain_modes) else "buffered (the filesystem refuses O_DIRECT)"
    print(f"plain, plain-dest: 1 thread, {how}, {PIECE // MIB} MiB preadv, file after file")
    print(f"ours, ours-direct: DiskReader, {args.threads} threads, {args.chunk_mib} MiB chunks, one request per "
          f"file; files read {', '.join(modes)}; {stats.direct_chunks} direct chunks ({stats.staged_bytes / GB:.3f} "
          f"GB through staging), {stats.buffered_chunks} buffered")
    print(f"{'side':<12} {'GB/s':>6}  runs (GB/s; {total / GB:.3f} GB each)")
    medians = {side: statistics.median(rates[side]) for side in SIDES}
    for side in SIDES:
        print(f"{side:<12} {medians[side]:>6.3f}  {' '.join(f'{rate:.3f}' for rate in rates[side])}")
    ratios = {side: medians[side] / medians["plain"] for side in OURS}
    for side in OURS:
        print(f"ratio {side}/plain: {ratios[side]:.3f} (target >= {TARGET}); "
              f"{side}/plain-dest: {medians[side] / medians['plain-dest']:.3f}")
    print(f"ours read every byte exactly: {'yes' if all(exact.values()) else 'NO'}")
    if not all(exact.values()):
        return 1
    return 1 if args.strict and min(ratios.values()) < TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())
