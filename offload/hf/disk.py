"""The disk tier of a model being offloaded (`offload_model(..., host_budget_bytes=)`): the
plan's tier for a host budget, its layers read from the model's checkpoint where they lie
there (found by their names in the model: ``model.layers.3.mlp.up_proj.weight``), spilled
otherwise; and `PieceSpill`, which writes a spilled weight the checkpoint holds in pieces
(MoE experts stored one tensor per expert) from those pieces."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import final

import attrs
import torch
from torch import nn

from offload.errors import ConfigError, ExecutionError, PlanError
from offload.executors.prefetch.disk import DiskIO
from offload.hf.conversions import LiveSource, spill_runs
from offload.logs import logger
from offload.model.checkpoint import checkpoint_extents
from offload.pure.disk.tier import ASSUMED_DISK_GBPS, DiskSource, DiskTierPlan, plan_disk_tier
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.units import format_bytes
from offload.runtime.spill import SpillFile

__all__ = ["DiskRequest", "PieceSpill", "check_spill_dir", "disk_request", "plan_model_disk", "spill_room"]

log = logger("offload.plan")


@attrs.frozen(kw_only=True)
class DiskRequest:
    """What a caller asks of the disk tier (`offload_model(..., host_budget_bytes=, ...)`).

    Attributes:
        host_budget_bytes: host memory the offloaded weights and the staging ring may take.
        checkpoint: the checkpoint the model was loaded from (a directory, index or file),
            to read disk layers from where they lie; None: every disk weight is spilled.
        spill_dir: where the spill file goes.
        disk_gbps: the disk's read rate for the estimate (None: `ASSUMED_DISK_GBPS`).
        read_ahead: staging buffers in the ring.
    """

    host_budget_bytes: int
    checkpoint: str | os.PathLike[str] | None = None
    spill_dir: str | os.PathLike[str] | None = None
    disk_gbps: float | None = None
    read_ahead: int = 2


def disk_request(host_budget_bytes: int | None, *, checkpoint: str | os.PathLike[str] | None = None,
                 spill_dir: str | os.PathLike[str] | None = None, disk_gbps: float | None = None,
                 read_ahead: int = 2) -> DiskRequest | None:
    """The request the options make; None without a host budget.

    Raises:
        ConfigError: a disk option without `host_budget_bytes`, naming it; a `spill_dir`
            that is not a directory this process can make files in (`check_spill_dir`),
            whether or not the plan will spill.
    """
    if spill_dir is not None:
        check_spill_dir(spill_dir)
    if host_budget_bytes is None:
        given = next((name for name, value in (("checkpoint", checkpoint), ("spill_dir", spill_dir),
                                               ("disk_gbps", disk_gbps)) if value is not None), None)
        if given is not None or read_ahead != 2:
            raise ConfigError(f"{given or 'read_ahead'} is a disk tier option: give host_budget_bytes too",
                              name=given or "read_ahead", value=host_budget_bytes)
        return None
    return DiskRequest(host_budget_bytes=host_budget_bytes, checkpoint=checkpoint, spill_dir=spill_dir,
                       disk_gbps=disk_gbps, read_ahead=read_ahead)


def check_spill_dir(spill_dir: str | os.PathLike[str]) -> None:
    """Refuse, naming the path, a spill directory that does not exist, is not a directory,
    or in which this process cannot make a file (a read-only mount, no permission): found
    by making one and removing it at once, since permission bits do not tell for root or
    for a read-only filesystem.

    Raises:
        ConfigError: the directory cannot hold a spill file; ``name`` is ``spill_dir`` and
            ``value`` the path.
    """
    path = os.fspath(spill_dir)
    if not os.path.exists(path):
        raise ConfigError(f"spill_dir {path!r} does not exist", name="spill_dir", value=path)
    if not os.path.isdir(path):
        raise ConfigError(f"spill_dir {path!r} is not a directory", name="spill_dir", value=path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=path)
    except OSError as exc:
        raise ConfigError(f"spill_dir {path!r}: cannot make a file there ({exc.strerror or exc})", name="spill_dir",
                          value=path) from exc
    os.close(fd)
    os.unlink(probe)


#: Bytes a spilled parameter may take in the spill file beyond its own: it starts on a block.
_SPILL_ALIGN = 4096


def spill_room(tier: DiskTierPlan) -> int:
    """Bytes of disk the tier's spill file takes at most: each spilled parameter's bytes,
    rounded up to the block it starts on."""
    return sum(-(-p.nbytes // _SPILL_ALIGN) * _SPILL_ALIGN for p in tier.params if p.source is DiskSource.SPILL)


def _free_bytes(path: str | os.PathLike[str]) -> int:
    return shutil.disk_usage(path).free


def plan_model_disk(model: nn.Module, layers: Sequence[nn.Module], plan: OffloadPlan, env: EnvSnapshot,
                    request: DiskRequest, *,
                    free_bytes: Callable[[str | os.PathLike[str]], int] = _free_bytes) -> DiskTierPlan | None:
    """The disk tier of `plan` for the request's host budget (`plan_disk_tier`), or None
    when the offloaded weights fit the budget in host memory.

    Args:
        model: the model; its module names are the checkpoint's tensor names' prefixes.
        layers: the offloaded stacks' layers, in plan order.
        plan: the model's plan (prefetch).
        env: its snapshot (for the tier's host admission).
        request: the budget, the checkpoint, the disk's rate and the read-ahead.
        free_bytes: the free bytes of a directory's filesystem (``shutil.disk_usage``;
            tests pass their own).

    Raises:
        PlanError: not a prefetch plan and its host copies exceed the budget (the disk
            tier streams through prefetch slots), or the budget cannot be met
            (`plan_disk_tier`);
            the tier spills more than `request.spill_dir` has free, naming both.
        CheckpointError: the checkpoint cannot be read.
    """
    checkpoint, host_budget_bytes, disk_gbps = request.checkpoint, request.host_budget_bytes, request.disk_gbps
    if plan.backend is not Backend.PREFETCH and plan.host_bytes <= host_budget_bytes:
        log.info("host budget %s holds every offloaded weight of the %s plan (%s): no disk tier",
                 format_bytes(host_budget_bytes), plan.backend.value, format_bytes(plan.host_bytes))
        return None
    names = {id(module): name for name, module in model.named_modules()}
    layer_names = [names[id(layer)] for layer in layers] if checkpoint is not None else []
    found = checkpoint_extents(checkpoint) if checkpoint is not None else None
    tier = plan_disk_tier(plan, host_budget_bytes=host_budget_bytes,
                          disk_gbps=float(disk_gbps if disk_gbps is not None else ASSUMED_DISK_GBPS),
                          read_ahead=request.read_ahead, layer_names=layer_names,
                          tensors=found.tensors if found is not None else None,
                          extents=found.extents if found is not None else None,
                          files=found.files if found is not None else (), env=env)
    if not tier.disk_positions:
        log.info("host budget %s holds every offloaded weight (%s): no disk tier", format_bytes(host_budget_bytes),
                 format_bytes(plan.host_bytes))
        return None
    need = spill_room(tier)
    if need and request.spill_dir is not None:
        free = free_bytes(request.spill_dir)
        if free < need:
            shown = os.fspath(request.spill_dir)
            raise PlanError(f"spill_dir {shown!r} has {format_bytes(free)} free ({free} bytes); the disk tier spills "
                            f"{format_bytes(need)} ({need} bytes) there: free {need - free} bytes, or choose another "
                            "directory", name="spill_dir", value=shown)
    log.info("disk tier: %d of %d offloaded layers on disk (%s, %s spilled), %s in host memory with a staging ring "
             "of %s", len(tier.disk_positions), len(plan.offloaded_layers), format_bytes(tier.disk_bytes),
             format_bytes(tier.spill_bytes), format_bytes(tier.host_tier_bytes),
             format_bytes(tier.staging_ring_bytes))
    return tier


@final
class PieceSpill:
    """Spilled disk-tier weights that the checkpoint holds in pieces (a live tensor that
    transformers makes at load from several stored ones: `offload.hf.conversions`), written
    to the spill file piece by piece from the stored tensors, never whole in host memory.

    `placeholder` gives such a weight a host tensor of its shape and dtype, contiguous,
    that takes no host memory (a private anonymous mapping nothing writes; a read would see
    the zero page). The disk tier spills it at ``wrap_modules`` as it spills any weight not
    in the checkpoint as the model holds it (`offload.executors.diskhost.DiskHost`); the
    spill file it writes through (`io`, a `PrefetchOffloader`'s ``disk_io``) knows the
    placeholder's memory and writes the pieces in its stead, each read by `read` (one at a
    time) and converted to the weight's dtype, at its offset. `check` then says whether
    every placeholder was written so.

    Args:
        read: a stored tensor by its checkpoint name (a view valid until the next read).
    """

    def __init__(self, read: Callable[[str], torch.Tensor]) -> None:
        self._read = read
        # (address, bytes) of a placeholder -> its name, dtype, runs, and what keeps its memory
        self._pending: dict[tuple[int, int], tuple[str, torch.dtype, tuple[tuple[str, int], ...], object]] = {}

    @property
    def io(self) -> DiskIO:
        """The disk tier's I/O, its spill file writing the placeholders from their pieces."""
        return DiskIO(spill=lambda directory: SpillFile(directory, pwrite=self._pwrite))

    def place(self, layer: nn.Module, name: str, source: LiveSource) -> None:
        """Parameter `name` of `layer` (on meta) over a placeholder of `source`, under every
        name that holds it, of its class and with its attributes (as ``wrap_modules``
        replaces a meta Parameter).

        Raises:
            CheckpointError: a piece that is not one contiguous run of the weight.
        """
        old = layer.get_parameter(name)
        new = torch.Tensor._make_subclass(type(old), self.placeholder(source, old.dtype), old.requires_grad)
        new.__dict__.update(old.__dict__)
        for module in layer.modules():
            for leaf, param in list(module._parameters.items()):
                if param is old:
                    module._parameters[leaf] = new

    def placeholder(self, source: LiveSource, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of `source`'s shape in `dtype` that takes no host memory, whose
        spill write writes `source`'s pieces.

        Raises:
            CheckpointError: a piece that is not one contiguous run of the weight.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        runs = spill_runs(source, itemsize)
        nbytes = itemsize * int(torch.Size(source.shape).numel())
        if not nbytes:
            return torch.empty(source.shape, dtype=dtype)
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(source.shape)
        self._pending[(tensor.data_ptr(), nbytes)] = (source.name, dtype, runs, region)
        return tensor

    def check(self) -> None:
        """Refuse when a placeholder was not written from its pieces (the spill file would
        hold zeros for it).

        Raises:
            ExecutionError: naming the first such weight.
        """
        if self._pending:
            name = next(iter(self._pending.values()))[0]
            raise ExecutionError(f"{name}: the disk tier did not write it to the spill file from the checkpoint's "
                                 f"tensors that make it ({len(self._pending)} such weights): load without "
                                 "host_budget_bytes", name=name, value=len(self._pending))

    def _pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """``os.pwrite``, but a placeholder's bytes are its pieces, read and written in turn."""
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(data))
        except TypeError:  # read-only memory: not a placeholder
            address = -1
        entry = self._pending.pop((address, len(data)), None)
        if entry is None:
            return os.pwrite(fd, data, offset)
        _, dtype, runs, _ = entry
        for stored, start in runs:
            values = self._read(stored)
            if values.dtype != dtype:
                values = values.to(dtype)  # one piece converted at a time
            raw: memoryview = values.reshape(-1).view(torch.uint8).numpy().data
            raw = raw.cast("B")
            done = 0
            while done < len(raw):
                wrote = os.pwrite(fd, raw[done:], offset + start + done)
                if wrote <= 0:
                    raise OSError(errno.EIO, "write returned nothing")
                done += wrote
        return len(data)
