"""The disk tier of a model being offloaded (`offload_model(..., host_budget_bytes=)`): the
plan's tier for a host budget, its layers read from the model's checkpoint where they lie
there (found by their names in the model: ``model.layers.3.mlp.up_proj.weight``), spilled
otherwise."""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
from torch import nn

from offload.errors import ConfigError
from offload.logs import logger
from offload.model.checkpoint import checkpoint_extents
from offload.pure.disk.tier import ASSUMED_DISK_GBPS, DiskTierPlan, plan_disk_tier
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.plan.plan import OffloadPlan
from offload.pure.units import format_bytes

__all__ = ["DiskRequest", "disk_request", "plan_model_disk"]

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
        ConfigError: a disk option without `host_budget_bytes`, naming it.
    """
    if host_budget_bytes is None:
        given = next((name for name, value in (("checkpoint", checkpoint), ("spill_dir", spill_dir),
                                               ("disk_gbps", disk_gbps)) if value is not None), None)
        if given is not None or read_ahead != 2:
            raise ConfigError(f"{given or 'read_ahead'} is a disk tier option: give host_budget_bytes too",
                              name=given or "read_ahead", value=host_budget_bytes)
        return None
    return DiskRequest(host_budget_bytes=host_budget_bytes, checkpoint=checkpoint, spill_dir=spill_dir,
                       disk_gbps=disk_gbps, read_ahead=read_ahead)


def plan_model_disk(model: nn.Module, layers: Sequence[nn.Module], plan: OffloadPlan, env: EnvSnapshot,
                    request: DiskRequest) -> DiskTierPlan | None:
    """The disk tier of `plan` for the request's host budget (`plan_disk_tier`), or None
    when the offloaded weights fit the budget in host memory.

    Args:
        model: the model; its module names are the checkpoint's tensor names' prefixes.
        layers: the offloaded stacks' layers, in plan order.
        plan: the model's plan (prefetch).
        env: its snapshot (for the tier's host admission).
        request: the budget, the checkpoint, the disk's rate and the read-ahead.

    Raises:
        PlanError: not a prefetch plan, or the budget cannot be met (`plan_disk_tier`).
        CheckpointError: the checkpoint cannot be read.
    """
    checkpoint, host_budget_bytes, disk_gbps = request.checkpoint, request.host_budget_bytes, request.disk_gbps
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
    log.info("disk tier: %d of %d offloaded layers on disk (%s, %s spilled), %s in host memory with a staging ring "
             "of %s", len(tier.disk_positions), len(plan.offloaded_layers), format_bytes(tier.disk_bytes),
             format_bytes(tier.spill_bytes), format_bytes(tier.host_tier_bytes),
             format_bytes(tier.staging_ring_bytes))
    return tier
