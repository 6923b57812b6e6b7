"""``offload env``: what this machine can do, and the pin and UVA decisions with reasons."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import attrs

from offload.cli._shared import UserError, capture, shown
from offload.pure.decide.admission import host_room
from offload.pure.decide.pinning import decide_pinning
from offload.pure.decide.uva import decide_uva
from offload.pure.env.snapshot import ENV_VARIABLES, Platform
from offload.pure.serialize import to_data
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from offload.runtime.diskrate import DiskRate

#: ``--disk-mib`` when not given: the scratch file ``offload env --disk`` reads, MiB.
DEFAULT_DISK_MIB = 1024


def _cgroup_rows(platform: Platform) -> list[list[str]]:
    """`offload env`'s lines for the cgroup's memory limit and the host memory left."""
    cgroup = platform.cgroup_memory

    def shown(value: int | None, none: str) -> str:
        return none if value is None else f"{value} ({format_bytes(value)})"

    limit_none = "unlimited" if cgroup.state == "unlimited" else "unknown"
    version = f"v{cgroup.version}" if cgroup.version else "unknown"
    rows = [
        ["  cgroup_memory.state", f"{cgroup.state} (cgroup {version})"],
        ["  cgroup_memory.limit_bytes", shown(cgroup.limit_bytes, limit_none)],
        ["  cgroup_memory.current_bytes", shown(cgroup.current_bytes, "unknown")],
        ["  cgroup_memory.reclaimable_bytes", shown(cgroup.reclaimable_bytes, "unknown")],
        ["  cgroup_memory.headroom_bytes", shown(cgroup.headroom_bytes, limit_none)],
        ["  cgroup_memory.limit_path", cgroup.limit_path or "(none)"],
        ["  cgroup_memory.cgroup_path", cgroup.cgroup_path or "(unknown)"],
    ]
    room, source = host_room(platform)
    rows.append(["  host memory for new allocations", f"{shown(room, 'unknown')}: {source}"])
    return rows


def _host_memory_data(platform: Platform) -> dict[str, Any]:
    """`offload env --json`'s summary of the host memory a plan may take."""
    room, source = host_room(platform)
    return {
        "cgroup_state": platform.cgroup_memory.state,
        "cgroup_headroom_bytes": platform.cgroup_memory.headroom_bytes,
        "available_bytes": room,
        "available_source": source,
    }


def _disk_rate(args: argparse.Namespace) -> DiskRate | None:
    """``--disk DIR``: the disk tier's reader timed on a scratch file there (None without it)."""
    if args.disk is None:
        if args.disk_mib is not None:
            raise UserError("offload env: --disk-mib needs --disk DIR")
        return None
    mib = args.disk_mib if args.disk_mib is not None else DEFAULT_DISK_MIB
    if mib == 0:
        raise UserError("offload env: --disk-mib must be at least 1")
    if not os.path.isdir(args.disk):
        raise UserError(f"offload env: --disk: {shown(args.disk)} is not a directory")
    nbytes = mib << 20
    free = shutil.disk_usage(args.disk).free
    if free < nbytes:
        raise UserError(f"offload env: --disk: {shown(args.disk)} has {format_bytes(free)} free, less than the "
                        f"{format_bytes(nbytes)} scratch file (--disk-mib)")
    from offload.runtime.diskrate import measure_disk_rate  # imports torch: only when asked

    try:
        return measure_disk_rate(args.disk, nbytes=nbytes)
    except OSError as exc:
        raise UserError(f"offload env: --disk: cannot write or read a scratch file in {shown(args.disk)}: "
                        f"{exc.strerror or exc}") from None


def _disk_data(directory: str, rate: DiskRate) -> dict[str, Any]:
    """`offload env --json`'s ``disk`` entry."""
    return {"directory": directory, "gbps": rate.gbps, "runs_gbps": list(rate.runs), "bytes": rate.nbytes,
            "threads": rate.threads, "chunk_bytes": rate.chunk_bytes, "request_bytes": rate.request_bytes,
            "depth": rate.depth, "mode": rate.mode}


def _disk_rows(directory: str, rate: DiskRate) -> list[str]:
    """`offload env --disk`'s lines."""
    how = "O_DIRECT" if rate.mode == "direct" else "buffered (the filesystem refuses O_DIRECT)"
    return [
        "disk:",
        f"  directory  {directory}",
        f"  read rate  {rate.gbps:.3f} GB/s, the median of {len(rate.runs)} reads of a {format_bytes(rate.nbytes)} "
        f"scratch file ({', '.join(f'{r:.3f}' for r in rate.runs)} GB/s)",
        f"  reader     the disk tier's: {rate.threads} threads, {format_bytes(rate.chunk_bytes)} chunks, "
        f"{format_bytes(rate.request_bytes)} requests, {rate.depth} in flight, {how}",
        f"  for plans  offload plan SOURCE --host-gib X --disk-gbps {rate.gbps:.2f}",
    ]


def cmd_env(args: argparse.Namespace) -> int:
    disk = _disk_rate(args)
    snapshot = capture()
    pin = decide_pinning(snapshot)
    uva = decide_uva(snapshot, pin)
    if args.json:
        document = {
            "snapshot": to_data(snapshot),
            "fingerprint": snapshot.fingerprint(),
            "pin": to_data(pin),
            "uva": to_data(uva),
            "coherent_unified_memory": snapshot.platform.is_coherent_unified_memory,
            "host_memory": _host_memory_data(snapshot.platform),
        }
        if disk is not None:
            document["disk"] = _disk_data(args.disk, disk)
        print(json.dumps(document, indent=2))
        return 0
    flags = snapshot.flags
    print("switches:")
    for flag, names in ENV_VARIABLES.items():
        print(f"  {flag} = {getattr(flags, flag)}  (from {' or '.join(names)})")
    print("platform:")
    rows = []
    for field in attrs.fields(Platform):
        if field.name == "probe_notes":
            continue
        if field.name == "cgroup_memory":
            rows.extend(_cgroup_rows(snapshot.platform))
            continue
        value = getattr(snapshot.platform, field.name)
        if value is None:
            shown = "unlimited" if field.name == "memlock_limit_bytes" else "unknown"
        elif field.name.endswith("gib_bytes"):
            shown = f"{value} ({format_bytes(value)})"
        else:
            shown = str(value) or "(none)"
        rows.append([f"  {field.name}", shown])
    rows.append(["  coherent unified memory", str(snapshot.platform.is_coherent_unified_memory)])
    width = max(len(label) for label, _ in rows)
    for label, shown in rows:
        print(f"{label:<{width}}  {shown}")
    for note in snapshot.platform.probe_notes:
        print(f"  note: {note}")
    print("decisions:")
    print(f"  pinning: {f'on ({pin.method_text})' if pin.pin else 'off'} [{pin.reason.value}] {pin.explanation}")
    print(f"  uva:     {'on' if uva.enabled else 'off'} [{uva.reason.value}] {uva.explanation}")
    print(f"snapshot fingerprint: {snapshot.fingerprint()}")
    for line in _disk_rows(args.disk, disk) if disk is not None else ():
        print(line)
    return 0
