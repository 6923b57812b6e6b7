"""The disk tier of a prefetch plan: which offloaded layers live on disk, where each of
their parameters' bytes is read from, and the ring of host staging buffers.

**Which layers.** Host memory holds the offloaded layers' copies (`OffloadPlan.host_bytes`);
with a host budget smaller than that, the last offloaded layers in execution order go to
disk, as few as make the host tier plus the staging ring fit. A kept position (the only
owner of its slot, loaded once: `PrefetchSchedule.kept_positions`) is never put on disk:
it is read once and then only for restore, so its host copy buys nothing back per step;
nor is a layer whose host copies another layer shares (a tie across layers).

**Where from.** A parameter whose bytes in the checkpoint are exactly what the model
holds (`offload.pure.spec.extents.unmappable` says None) is read from there
(`DiskSource.CHECKPOINT`, its `DiskExtent`); any other one (converted at load, renamed,
fused, no checkpoint tensor of its name, or a model that came from no checkpoint) is
written once to a spill file (`DiskSource.SPILL`, with the reason).

**The ring.** Disk layers are read into at most `read_ahead` host staging buffers of
`staging_bytes` each (the largest disk layer, each of its parameters congruent with
its file offset modulo `READ_BLOCK`, so that ``O_DIRECT`` reads go straight in:
`staging_layout`), in `read_order`: the order a pass issues
their device copies (`PrefetchSchedule.issued_after`). Each disk position has its own
buffer, the same every pass (`staging`: the ``k``-th read uses buffer ``k % read_ahead``),
so the device copy out of it is the same copy every pass, as the slot copies are (CUDA
graphs replay them). A read is issued once the device copy out of its buffer's previous
occupant (the nearest earlier read of that buffer, round the pass) has completed: a buffer
is never refilled while a copy reads it, and read ``k`` starts `DiskTierPlan.lead_of` ``k``
copies ahead of its own. `check_read_order` proves the reads go in the copies' order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, tuple_of, tuple_of_ints
from offload.pure.decide.admission import NOT_CHECKED, HostAdmission, assess_host_memory, host_demand
from offload.pure.disk.choose import (
    disk_candidates,
    first_reads_of,
    next_occupants_of,
    read_order_of,
    refuse_budget,
    tier_bytes,
    tier_positions,
)
from offload.pure.disk.params import (
    READ_BLOCK,
    STAGING_ALIGN,
    DiskParam,
    DiskSource,
    layout,
    residue,
    ring_bytes,
    staged,
)
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.values import served_refs
from offload.pure.plan.plan import Backend, OffloadPlan
from offload.pure.serialize import from_data, parse_json, short_repr, to_data
from offload.pure.spec.extents import DiskExtent, FileIdentity, unmappable
from offload.pure.spec.safetensors import TensorHeader
from offload.pure.spec.values import ParamSpec

__all__ = ["ASSUMED_DISK_GBPS", "DISK_FORMAT", "READ_BLOCK", "STAGING_ALIGN", "DiskParam", "DiskSource",
           "DiskTierPlan", "check_read_order", "disk_params_by_layer", "first_reads", "layer_bytes_of",
           "next_occupants", "plan_disk_tier", "residue", "staging_layout", "tied_layers", "tier_admission"]

#: The ``format`` tag of a serialised disk tier; bumped when the layout changes.
DISK_FORMAT = "offload-disk-tier/1"

#: The disk read rate assumed where none is given, GB/s: the plain ``O_DIRECT``
#: sequential read of this project's CI machine (docs/disk.md).
ASSUMED_DISK_GBPS = 1.5

def check_read_order(read_order: Sequence[int], issued: Sequence[int | None], disk: Sequence[int]) -> None:
    """Prove what the ring rests on: every disk position is read exactly once per pass, in
    the order the pass issues the device copies (so a read never waits on a copy that
    comes after its own).

    Args:
        read_order: the disk positions in read order.
        issued: `PrefetchSchedule.issued_after` (the copy each position's forward issues).
        disk: the disk positions.

    Raises:
        PlanError: a disk position read twice or never, a position read that is not on
            disk, or reads out of the copies' order.
    """
    if sorted(read_order) != sorted(set(disk)) or len(set(read_order)) != len(read_order):
        raise PlanError(f"read order {list(read_order)} does not read each disk position {sorted(set(disk))} "
                        "exactly once", name="read_order", value=tuple(read_order))
    copies = [target for target in issued if target is not None and target in set(disk)]
    if copies != list(read_order):
        raise PlanError(f"read order {list(read_order)} is not the order the pass copies its disk positions "
                        f"({copies})", name="read_order", value=tuple(read_order))


@attrs.frozen(kw_only=True)
class DiskTierPlan:
    """Which offloaded layers of a prefetch plan live on disk, and how they are read.

    Attributes:
        host_budget_bytes: host memory the offloaded weights and the staging ring may take.
        disk_gbps: the disk's read rate the estimate assumes, in GB/s (1e9 bytes).
        read_ahead: host staging buffers in the ring (reads in flight ahead of the copies).
        disk_positions: the schedule positions on disk, in execution order.
        disk_layers: their layer indices, in the same order.
        read_order: the disk positions in the order a pass reads (and copies) them.
        staging: ``staging[k]``: the staging buffer read ``k`` (of `read_order`) fills.
        params: every parameter of the disk layers.
        files: the checkpoint files read, as planned (compared before each run).
        staging_bytes: bytes of each staging buffer: the largest disk layer's parameters
            as `staging_layout` packs them (those read in place left out).
        host_tier_bytes: bytes of the offloaded layers kept in host memory.
        disk_bytes: bytes of the disk layers' parameters: what a pass reads, at most (the
            expert caches read only the experts they miss of those read in place).
        spill_bytes: bytes of the disk layers that go to a spill file.
        host_admission: whether the host memory the plan takes with this tier (the host
            tier, the staging ring, the buffers on a CPU) fits the machine, as
            `OffloadPlan.host_admission` says for the plan without it; not checked when
            planned without a snapshot. The executor obeys it in the plan's stead.
    """

    host_budget_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    disk_gbps: float = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(float),
                                                                   attrs.validators.gt(0.0)))
    read_ahead: int = attrs.field(validator=int_at_least(1, PlanError))
    disk_positions: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    disk_layers: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    read_order: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    staging: tuple[int, ...] = attrs.field(validator=tuple_of_ints(0, PlanError))
    params: tuple[DiskParam, ...] = attrs.field(validator=tuple_of(DiskParam, PlanError))
    files: tuple[FileIdentity, ...] = attrs.field(validator=tuple_of(FileIdentity, PlanError))
    staging_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    host_tier_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    disk_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    spill_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    host_admission: HostAdmission = attrs.field(default=NOT_CHECKED,
                                                validator=attrs.validators.instance_of(HostAdmission))

    def __attrs_post_init__(self) -> None:
        if len(self.disk_layers) != len(self.disk_positions):
            raise PlanError(f"{len(self.disk_positions)} disk positions but {len(self.disk_layers)} disk layers",
                            name="disk_layers", value=self.disk_layers)
        if sorted(self.read_order) != sorted(set(self.disk_positions)) or \
                len(set(self.disk_positions)) != len(self.disk_positions):
            raise PlanError(f"read order {list(self.read_order)} does not read each of the disk positions "
                            f"{list(self.disk_positions)} once", name="read_order", value=self.read_order)
        if self.staging != tuple(k % self.read_ahead for k in range(len(self.read_order))):
            raise PlanError(f"staging {list(self.staging)} is not read k's buffer k % {self.read_ahead} for each of "
                            f"the {len(self.read_order)} reads", name="staging", value=self.staging)
        layers = set(self.disk_layers)
        stray = next((p for p in self.params if p.layer not in layers), None)
        if stray is not None:
            raise PlanError(f"parameter {stray.name!r} of layer {stray.layer} is not in a disk layer",
                            name=stray.name, value=stray.layer)
        per_layer: dict[int, int] = {}
        for p in self.params:
            per_layer[p.layer] = per_layer.get(p.layer, 0) + p.nbytes
        if sum(per_layer.values()) != self.disk_bytes:
            raise PlanError(f"disk bytes {self.disk_bytes} are not the disk parameters' {sum(per_layer.values())}",
                            name="disk_bytes", value=self.disk_bytes)
        packed = max((end for _, end in staging_layout(self).values()), default=0)
        if packed > self.staging_bytes:
            raise PlanError(f"a disk layer packed in {packed} bytes does not fit a staging buffer of "
                            f"{self.staging_bytes}", name="staging_bytes", value=self.staging_bytes)
        spilled = sum(p.nbytes for p in self.params if p.source is DiskSource.SPILL)
        if spilled != self.spill_bytes:
            raise PlanError(f"spill bytes {self.spill_bytes} are not the spilled parameters' {spilled}",
                            name="spill_bytes", value=self.spill_bytes)
        known = {f.path for f in self.files}
        unknown = next((p for p in self.params if p.extent is not None and p.extent.path not in known), None)
        if unknown is not None and unknown.extent is not None:
            raise PlanError(f"parameter {unknown.name!r} of layer {unknown.layer} reads {unknown.extent.path!r}, "
                            "which the plan does not identify", name=unknown.name, value=unknown.extent.path)

    @property
    def buffers(self) -> int:
        """Staging buffers the ring takes: `read_ahead`, or fewer disk layers."""
        return min(self.read_ahead, len(self.disk_positions))

    @property
    def staging_ring_bytes(self) -> int:
        """Host bytes of the staging ring (0 without disk layers): each buffer one
        `READ_BLOCK` larger than `staging_bytes`, to start on a block wherever it lies."""
        return ring_bytes(self.buffers, self.staging_bytes)

    @property
    def host_bytes(self) -> int:
        """Host memory the offloaded weights take: the host tier and the staging ring."""
        return self.host_tier_bytes + self.staging_ring_bytes

    def lead_of(self, k: int) -> int:
        """How many device copies ahead of its own read ``k`` is issued: the distance, round
        the pass, back to the previous read of its buffer (whose copy it waits for)."""
        m = len(self.read_order)
        return next(d for d in range(1, m + 1) if self.staging[(k - d) % m] == self.staging[k])

    @property
    def lead(self) -> int:
        """The least `lead_of` over the reads (0 without disk layers)."""
        return min((self.lead_of(k) for k in range(len(self.read_order))), default=0)

    @property
    def read_seconds(self) -> float:
        """Seconds a pass spends reading the disk at `disk_gbps`: no step is faster."""
        return self.disk_bytes / (self.disk_gbps * 1e9)

    def to_json(self, *, indent: int | None = None) -> str:
        """Serialise without loss; `DiskTierPlan.from_json` reads it back equal."""
        return json.dumps({"format": DISK_FORMAT, "disk": to_data(self)}, indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> DiskTierPlan:
        """Read a disk tier written by `to_json` (untrusted text: every failure a `PlanError`).

        Raises:
            PlanError: not JSON of this format, or a value breaks a rule.
        """
        document = parse_json(text)
        if not isinstance(document, dict) or document.get("format") != DISK_FORMAT:
            found = document.get("format") if isinstance(document, dict) else type(document).__name__
            raise PlanError(f"not an {DISK_FORMAT} document (format is {short_repr(found)})", name="format",
                            value=found)
        return from_data(cls, document.get("disk"))


def next_occupants(tier: DiskTierPlan, cycle_of: Sequence[int] = (),
                   following: Mapping[int, int] | None = None) -> dict[int, int]:
    """Each disk position's buffer's next occupant: the next read of its buffer in read
    order, else the buffer's first read of the next pass (itself: the buffer is its alone,
    read once and kept). The read staged once the copy out of the position is done.

    With the schedule's cycles (`PrefetchSchedule.cycle_of`: several stacks, such as an
    encoder run once per request and a decoder once per token), a pass is a pass of the
    position's cycle: after a cycle's last read of the buffer, the next occupant is the
    buffer's first read in the cycle expected to run next (`following`: by default each
    cycle's own, so that a stack that repeats finds its reads ahead), as
    `offload.pure.disk.choose.next_occupants_of` says."""
    return next_occupants_of(tier.read_order, tier.staging, cycle_of, following)


def first_reads(tier: DiskTierPlan, initial: Sequence[int]) -> tuple[int, ...]:
    """The reads started before the first pass (post_init): a pass's first copies in the
    order they are issued (the schedule's `initial` ones, then the read order), one per
    buffer, the first that each buffer serves."""
    return first_reads_of(tier.read_order, tier.staging, initial)


def staging_layout(tier: DiskTierPlan) -> dict[int, tuple[tuple[int, ...], int]]:
    """Where each disk layer's parameters lie in its staging buffer: by layer, the offset
    of each of its `DiskTierPlan.params` the ring reads (`staged`: those not read in place
    by an expert cache), in their order, and the bytes they span
    (`offload.pure.disk.params.layout`: congruent with the files, runs as in the file)."""
    by_layer: dict[int, list[DiskParam]] = {}
    for p in staged(tier.params):
        by_layer.setdefault(p.layer, []).append(p)
    return {layer: layout(found) for layer, found in by_layer.items()}


def layer_bytes_of(plan: OffloadPlan) -> dict[int, int]:
    """Host bytes of each offloaded layer (each storage once: a tie's copy is its owner's)."""
    found: dict[int, int] = {}
    for p in plan.offloaded_params:
        if p.tied_to is None:
            found[p.layer] = found.get(p.layer, 0) + p.param.nbytes
    return found


def tied_layers(plan: OffloadPlan) -> set[int]:
    """The layers whose host copies another layer shares (a tie across layers): they stay
    in host memory."""
    return {layer for p in plan.offloaded_params if p.tied_to is not None and p.tied_to[0] != p.layer
            for layer in (p.layer, p.tied_to[0])}


def disk_params_by_layer(plan: OffloadPlan, layer_names: Sequence[str], tensors: Mapping[str, TensorHeader],
                         extents: Mapping[str, DiskExtent]) -> dict[int, list[DiskParam]]:
    """Where each offloaded layer's parameters would be read from, were the layer on disk
    (the checkpoint where its bytes lie as the model holds them, else a spill file), by
    layer, in plan order; an expert cache's parameters are read in place
    (`DiskParam.in_place`)."""
    in_place = served_refs(plan.experts)
    owned: dict[int, list[DiskParam]] = {}
    for p in plan.offloaded_params:
        if p.tied_to is None:
            full = f"{layer_names[p.layer]}.{p.param.name}" if layer_names else None
            found = _disk_param(p.layer, full, p.param, tensors, extents)
            if (p.layer, p.param.name) in in_place:
                found = attrs.evolve(found, in_place=True)
            owned.setdefault(p.layer, []).append(found)
    return owned


def _disk_param(layer: int, full: str | None, param: ParamSpec, tensors: Mapping[str, TensorHeader],
                extents: Mapping[str, DiskExtent]) -> DiskParam:
    """Where `param` (of `layer`, named `full` in the checkpoint, or None without one) is read from."""
    name, nbytes = param.name, param.nbytes
    header = tensors.get(full) if full is not None else None
    extent = extents.get(full) if full is not None else None
    if header is None or extent is None:
        why = "no checkpoint" if full is None else f"no checkpoint tensor named {full!r}"
        return DiskParam(layer=layer, name=name, nbytes=nbytes, source=DiskSource.SPILL, reason=why)
    reason = unmappable(param, header)
    if reason is not None:
        return DiskParam(layer=layer, name=name, nbytes=nbytes, source=DiskSource.SPILL, reason=reason)
    return DiskParam(layer=layer, name=name, nbytes=nbytes, source=DiskSource.CHECKPOINT, extent=extent)


def plan_disk_tier(plan: OffloadPlan, *, host_budget_bytes: int, disk_gbps: float, read_ahead: int = 2,
                   layer_names: Sequence[str] = (), tensors: Mapping[str, TensorHeader] | None = None,
                   extents: Mapping[str, DiskExtent] | None = None,
                   files: Sequence[FileIdentity] = (), env: EnvSnapshot | None = None) -> DiskTierPlan:
    """Put as few of `plan`'s offloaded layers on disk as make host memory fit
    `host_budget_bytes` (see the module docstring).

    Args:
        plan: a prefetch plan.
        host_budget_bytes: host memory the offloaded weights and the staging ring may take.
        disk_gbps: the disk's read rate, GB/s, for `DiskTierPlan.read_seconds`.
        read_ahead: staging buffers in the ring (at least 1).
        layer_names: each layer's name in the checkpoint (``model.layers.3``), which
            prefixes its parameters' names there; empty: the model came from no
            checkpoint, and every disk parameter is spilled.
        tensors, extents: the checkpoint's tensors and where they lie, by full name
            (`offload.model.checkpoint.checkpoint_extents`).
        files: the checkpoint's files, as they were read.
        env: the snapshot the plan was made for: the tier's host admission is decided
            for it (`DiskTierPlan.host_admission`); None: not checked.

    Raises:
        PlanError: the plan is not a prefetch plan; `read_ahead` is below 1 or `disk_gbps`
            not positive; `layer_names` does not name every layer; the budget does not fit
            even with every layer that can be on disk there (the numbers say by how much).
    """
    if plan.backend is not Backend.PREFETCH:
        raise PlanError(f"the disk tier streams through the prefetch backend's slots; this plan's backend is "
                        f"{plan.backend.value}", name="backend", value=plan.backend.value)
    if read_ahead < 1 or not disk_gbps > 0:
        raise PlanError(f"read_ahead must be at least 1 and disk_gbps positive, got {read_ahead} and {disk_gbps}",
                        name="read_ahead" if read_ahead < 1 else "disk_gbps",
                        value=read_ahead if read_ahead < 1 else disk_gbps)
    if layer_names and len(layer_names) != plan.num_layers:
        raise PlanError(f"{len(layer_names)} layer names for {plan.num_layers} layers", name="layer_names",
                        value=len(layer_names))
    layer_bytes = layer_bytes_of(plan)
    owned = disk_params_by_layer(plan, layer_names, tensors or {}, extents or {})
    staging = {layer: layout(staged(found))[1] for layer, found in owned.items()}  # a layer in a staging buffer
    positions = plan.offloaded_layers
    candidates = disk_candidates(len(positions), plan.schedule.kept_positions, tied_layers(plan), positions)
    chosen = tier_positions(positions, layer_bytes, staging, candidates, host_budget_bytes=host_budget_bytes,
                            read_ahead=read_ahead)
    if chosen is None:
        host, ring = tier_bytes(positions, layer_bytes, staging, candidates, read_ahead)
        raise refuse_budget(host_budget_bytes, host, ring, len(candidates), read_ahead)
    would = [d for found in owned.values() for d in found]
    total = sum(layer_bytes.get(layer, 0) for layer in positions)
    disk = tuple(chosen)
    disk_layers = tuple(positions[i] for i in disk)
    on = set(disk_layers)
    params = tuple(d for d in would if d.layer in on)
    read_order = read_order_of(plan.schedule.issued_after, set(disk))
    check_read_order(read_order, plan.schedule.issued_after, disk)
    used = {p.extent.path for p in params if p.extent is not None}
    disk_bytes = sum(p.nbytes for p in params)
    tier = DiskTierPlan(
        host_budget_bytes=host_budget_bytes, disk_gbps=float(disk_gbps), read_ahead=read_ahead,
        disk_positions=disk, disk_layers=disk_layers, read_order=read_order,
        staging=tuple(k % read_ahead for k in range(len(read_order))), params=params,
        files=tuple(f for f in files if f.path in used),
        staging_bytes=max((staging.get(layer, 0) for layer in disk_layers), default=0),
        host_tier_bytes=total - disk_bytes, disk_bytes=disk_bytes,
        spill_bytes=sum(p.nbytes for p in params if p.source is DiskSource.SPILL))
    if env is None:
        return tier
    return attrs.evolve(tier, host_admission=tier_admission(plan, tier, env))


def tier_admission(plan: OffloadPlan, tier: DiskTierPlan, env: EnvSnapshot) -> HostAdmission:
    """The host admission of `plan` run with `tier` on `env` (`assess_host_memory`): the
    host tier's copies (those not in host memory already), the staging ring, and on a CPU
    the static buffers are new host memory; the host tier and the ring are pinned as the
    plan pins. The disk layers' weights take none (they are read from their files)."""
    on = set(tier.disk_layers)
    kept = [p for p in plan.params if p.layer not in on or not p.offloaded]
    demand = host_demand(kept, compute_device=plan.compute_device, host_bytes=tier.host_tier_bytes,
                         buffer_bytes=plan.device_bytes_buffers, resident_bytes=plan.device_bytes_resident,
                         pin=plan.pin.pin)
    ring = tier.staging_ring_bytes
    demand = attrs.evolve(demand, host_bytes=demand.host_bytes + ring,
                          pinned_bytes=demand.pinned_bytes + (ring if plan.pin.pin else 0))
    return assess_host_memory(demand, env)
