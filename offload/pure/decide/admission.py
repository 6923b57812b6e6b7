"""Host admission: does the host memory a plan takes fit what this machine allows?

A process that asks for more host memory than its container allows is killed by the
kernel's OOM killer ("Killed", no traceback). So before anything moves, the plan's host
memory is compared with what is really available:

- all new host memory (the host copies of weights not already in host memory, plus the
  static buffers when the compute device is the CPU) against ``MemAvailable`` and the
  cgroup's headroom (limit - usage + reclaimable file cache); the smaller binds;
- the pinned part against the locked-memory limit (``RLIMIT_MEMLOCK``, as the platform
  records it), advisory only: exceeding it never makes the verdict "does not fit". CUDA's
  page-locking is not known to be charged against it (pinned memory works in containers
  with the default 64 KiB-8 MiB limit), and where a pin fails, the copy falls back to
  pageable memory and is counted (`stats().pin_fallbacks`): nothing is killed. It is
  reported in the verdict's message and as the ``memlock_limit`` warning;
- the pinned part, on hardware-coherent unified memory (GH200) and integrated GPUs, where
  pinned host memory competes with device memory, against the device memory left after
  the plan's resident weights and buffers.

`make_plan` records the verdict in `OffloadPlan.host_admission`
(`offload.pure.plan.make.decide_host_admission` checks a saved plan against a machine); the
executors refuse a plan that does not fit before they move anything
(``OffloadConfig.host_check``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

import attrs

from offload.errors import PlanError
from offload.pure._checks import int_at_least, is_str, tuple_of
from offload.pure.decide.moves import WhereKind, where_kind
from offload.pure.env.snapshot import EnvSnapshot, Platform
from offload.pure.plan.values import ParamPlan
from offload.pure.units import format_bytes

__all__ = [
    "ADVISORY_LIMITS",
    "NOT_CHECKED",
    "HostAdmission",
    "HostDemand",
    "HostFit",
    "HostLimit",
    "LimitCheck",
    "assess_host_memory",
    "host_demand",
    "host_room",
    "over_text",
]


class HostFit(enum.Enum):
    """The verdict."""

    FITS = "fits"
    DOES_NOT_FIT = "does_not_fit"
    UNKNOWN = "unknown"  # neither MemAvailable nor the cgroup's headroom is known


class HostLimit(enum.Enum):
    """A limit the plan's host memory is held to."""

    HOST_AVAILABLE = "host_available"  # MemAvailable, /proc/meminfo
    CGROUP = "cgroup"  # the cgroup's memory limit, what the OOM killer enforces
    MEMLOCK = "memlock"  # RLIMIT_MEMLOCK (ulimit -l), for pinned memory
    DEVICE = "device"  # device memory, which pinned memory competes with on GH200 / integrated GPUs


_PINNED_LIMITS = frozenset({HostLimit.MEMLOCK, HostLimit.DEVICE})
#: Limits whose excess is reported but never refuses (see the module docstring).
ADVISORY_LIMITS = frozenset({HostLimit.MEMLOCK})
_HOST_LIMITS = frozenset({HostLimit.HOST_AVAILABLE, HostLimit.CGROUP})


def _optional_limit(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, HostLimit):
        raise PlanError(f"{attribute.name} must be None or a HostLimit, got {value!r}",
                        name=attribute.name, value=value)


def _enum_of(kind: type[enum.Enum]) -> Any:
    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, kind):
            raise PlanError(f"{attribute.name} must be a {kind.__name__}, got {value!r}",
                            name=attribute.name, value=value)

    return check


@attrs.frozen(kw_only=True)
class LimitCheck:
    """One limit, and what the plan needs of it.

    Attributes:
        limit: which limit.
        needed_bytes: bytes the plan needs of it: all new host memory for
            `HostLimit.HOST_AVAILABLE` and `HostLimit.CGROUP`, the pinned part for
            `HostLimit.MEMLOCK` and `HostLimit.DEVICE`.
        allowed_bytes: bytes the limit allows; None when unknown.
        source: where the limit comes from, for people
            (``cgroup v2 memory.max at /sys/fs/cgroup/x: limit 64.00 GiB, ...``).
    """

    limit: HostLimit = attrs.field(validator=_enum_of(HostLimit))
    needed_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    allowed_bytes: int | None = attrs.field(validator=int_at_least(0, PlanError, optional=True))
    source: str = attrs.field(validator=is_str(PlanError))

    @property
    def pinned(self) -> bool:
        """True when the check is about pinned memory (memlock, device)."""
        return self.limit in _PINNED_LIMITS

    @property
    def fits(self) -> bool | None:
        """Whether the need fits the limit; None when the limit is unknown."""
        return None if self.allowed_bytes is None else self.needed_bytes <= self.allowed_bytes

    @property
    def margin_bytes(self) -> int | None:
        """Allowed minus needed (negative when over); None when unknown."""
        return None if self.allowed_bytes is None else self.allowed_bytes - self.needed_bytes


@attrs.frozen(kw_only=True)
class HostAdmission:
    """The admission verdict for a plan's host memory. The defaults are `NOT_CHECKED`.

    Attributes:
        verdict: fits, does not fit, or unknown.
        host_bytes: new host memory the plan takes, in bytes.
        pinned_bytes: bytes of the plan's host copies that are page-locked.
        checks: every limit that applies (unknown ones with ``allowed_bytes`` None);
            limits that are known to be unlimited are left out.
        binding: the limit that binds: the one most exceeded when the plan does not fit,
            else the one with the least room left; None when nothing was compared.
        message: the verdict for people, with the numbers and the limit that binds.
    """

    verdict: HostFit = attrs.field(default=HostFit.UNKNOWN, validator=_enum_of(HostFit))
    host_bytes: int = attrs.field(default=0, validator=int_at_least(0, PlanError))
    pinned_bytes: int = attrs.field(default=0, validator=int_at_least(0, PlanError))
    checks: tuple[LimitCheck, ...] = attrs.field(default=(), validator=tuple_of(LimitCheck, PlanError))
    binding: HostLimit | None = attrs.field(default=None, validator=_optional_limit)
    message: str = attrs.field(default="not checked (the plan was made without a host memory check)",
                               validator=is_str(PlanError))

    def __attrs_post_init__(self) -> None:
        if self.binding is not None and self.binding not in {c.limit for c in self.checks}:
            raise PlanError(f"binding limit {self.binding.value} is not one of the checks",
                            name="binding", value=self.binding.value)

    @property
    def binding_check(self) -> LimitCheck | None:
        """The check of the binding limit, or None."""
        return next((c for c in self.checks if c.limit is self.binding), None)

    @property
    def failed(self) -> tuple[LimitCheck, ...]:
        """The checks whose known limit the plan exceeds (advisory ones included)."""
        return tuple(c for c in self.checks if c.fits is False)


#: The verdict of a plan made before host memory was checked (read from older JSON).
NOT_CHECKED = HostAdmission()


@attrs.frozen(kw_only=True)
class HostDemand:
    """What a plan takes of host (and, for pinned memory, device) memory.

    Attributes:
        host_bytes: new host memory, in bytes: host copies of offloaded weights that are
            not in host memory already (those are adopted, or copied into page-locked
            memory and released at once), plus the static buffers when the compute device
            is the CPU.
        pinned_bytes: bytes of host copies that are page-locked (all of them when the plan
            pins, else 0).
        device_bytes: device memory the plan keeps on the compute device (resident weights
            and static buffers), in bytes; 0 when the compute device is the CPU.
    """

    host_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    pinned_bytes: int = attrs.field(validator=int_at_least(0, PlanError))
    device_bytes: int = attrs.field(validator=int_at_least(0, PlanError))


def _in_host_memory(device: str, compute_device: str) -> bool:
    kind = where_kind(device, compute_device)
    return kind is WhereKind.HOST or (kind is WhereKind.COMPUTE and compute_device == "cpu")


def host_demand(
    params: Sequence[ParamPlan],
    *,
    compute_device: str,
    host_bytes: int,
    buffer_bytes: int,
    resident_bytes: int,
    pin: bool,
    devices: Iterable[str] | None = None,
) -> HostDemand:
    """What the plan with these parts takes of host memory (see `HostDemand`).

    Args:
        params: the plan's parameters.
        compute_device: ``"cuda"`` or ``"cpu"``.
        host_bytes: the plan's host copies in bytes, each storage once (`OffloadPlan.host_bytes`).
        buffer_bytes: its static buffers in bytes.
        resident_bytes: weights kept on the compute device, in bytes.
        pin: whether host copies are pinned.
        devices: every device name in `params`, when the caller knows them (the planner
            does): if none or all of them are host memory, no parameter is looked at.
    """
    names = set(devices) if devices is not None else {p.param.device for p in params}
    on_host = {d for d in names if _in_host_memory(d, compute_device)}
    if not on_host:
        already = 0
    elif on_host == names:
        already = host_bytes
    else:
        already = sum(p.nbytes for p in params
                      if p.offloaded and p.tied_to is None and p.param.device in on_host)
    on_cpu = compute_device == "cpu"
    return HostDemand(
        host_bytes=max(0, host_bytes - already) + (buffer_bytes if on_cpu else 0),
        pinned_bytes=host_bytes if pin else 0,
        device_bytes=0 if on_cpu else resident_bytes + buffer_bytes,
    )


def host_room(platform: Platform) -> tuple[int | None, str]:
    """New host memory this process may take: the smaller of MemAvailable and the cgroup's
    headroom, and where that comes from; (None, why) when neither is known."""
    available = platform.host_available_bytes
    headroom = platform.cgroup_memory.headroom_bytes
    if headroom is not None and (available is None or headroom < available):
        return headroom, _cgroup_source(platform)
    if available is not None:
        return available, "the host's MemAvailable"
    return None, "neither MemAvailable nor the cgroup's headroom is known"


def _cgroup_source(platform: Platform) -> str:
    cgroup = platform.cgroup_memory
    if cgroup.limit_bytes is None:
        return cgroup.source
    parts = [f"limit {format_bytes(cgroup.limit_bytes)}"]
    if cgroup.current_bytes is not None:
        parts.append(f"{format_bytes(cgroup.current_bytes)} in use")
    if cgroup.reclaimable_bytes:
        parts.append(f"{format_bytes(cgroup.reclaimable_bytes)} of it reclaimable cache")
    if cgroup.current_bytes is None:
        parts.append("usage unknown")
    return f"{cgroup.source}: {', '.join(parts)}"


def _checks(demand: HostDemand, platform: Platform) -> list[LimitCheck]:
    checks: list[LimitCheck] = []
    if demand.host_bytes > 0:
        checks.append(LimitCheck(limit=HostLimit.HOST_AVAILABLE, needed_bytes=demand.host_bytes,
                                 allowed_bytes=platform.host_available_bytes,
                                 source="the host's MemAvailable"))
        cgroup = platform.cgroup_memory
        if cgroup.state != "unlimited":
            allowed = cgroup.headroom_bytes
            if allowed is None and cgroup.limit_bytes is not None and demand.host_bytes > cgroup.limit_bytes:
                allowed = cgroup.limit_bytes  # usage unread, but the need exceeds the limit itself
            checks.append(LimitCheck(limit=HostLimit.CGROUP, needed_bytes=demand.host_bytes, allowed_bytes=allowed,
                                     source=_cgroup_source(platform)))
    if demand.pinned_bytes > 0:
        if platform.memlock_limit_bytes is not None:
            checks.append(LimitCheck(limit=HostLimit.MEMLOCK, needed_bytes=demand.pinned_bytes,
                                     allowed_bytes=platform.memlock_limit_bytes,
                                     source="RLIMIT_MEMLOCK, ulimit -l"))
        if platform.has_cuda and (platform.is_coherent_unified_memory or platform.is_integrated):
            kind = "hardware-coherent unified memory" if platform.is_coherent_unified_memory else "an integrated GPU"
            total = platform.device_total_bytes
            checks.append(LimitCheck(
                limit=HostLimit.DEVICE, needed_bytes=demand.pinned_bytes,
                allowed_bytes=max(0, total - demand.device_bytes),
                source=(f"{platform.device_name}, {kind}: pinned host memory counts against its "
                        f"{format_bytes(total)} of device memory, of which the plan keeps "
                        f"{format_bytes(demand.device_bytes)} for resident weights and buffers"),
            ))
    return checks


def _need_text(check: LimitCheck, pinned_bytes: int) -> str:
    if check.pinned:
        return f"needs {format_bytes(check.needed_bytes)} of pinned host memory"
    if pinned_bytes >= check.needed_bytes:
        pinned = ", all of it pinned"
    elif pinned_bytes:
        pinned = f" ({format_bytes(pinned_bytes)} of it pinned)"
    else:
        pinned = ""
    return f"needs {format_bytes(check.needed_bytes)} of new host memory{pinned}"


_ALLOWS = {
    HostLimit.HOST_AVAILABLE: "only {} is available",
    HostLimit.CGROUP: "the container allows {} more",
    HostLimit.MEMLOCK: "the locked-memory limit allows {}",
    HostLimit.DEVICE: "only {} of device memory is left for it",
}

_SHORT = {
    HostLimit.HOST_AVAILABLE: "MemAvailable",
    HostLimit.CGROUP: "the cgroup limit",
    HostLimit.MEMLOCK: "the locked-memory limit",
    HostLimit.DEVICE: "device memory",
}


def over_text(check: LimitCheck, pinned_bytes: int) -> str:
    """What `check` needs and what its limit allows, for people: ``"needs 97.50 GiB of new
    host memory, all of it pinned; the container allows 64.00 GiB more (cgroup v2
    memory.max at ...)"``.

    Args:
        check: one check.
        pinned_bytes: the plan's pinned bytes (said alongside a need of all new memory).
    """
    allowed = format_bytes(check.allowed_bytes or 0)
    return f"{_need_text(check, pinned_bytes)}; {_ALLOWS[check.limit].format(allowed)} ({check.source})"


class _Numbers(TypedDict):
    host_bytes: int
    pinned_bytes: int
    checks: tuple[LimitCheck, ...]


def _numbers(demand: HostDemand, checks: Sequence[LimitCheck]) -> _Numbers:
    return {"host_bytes": demand.host_bytes, "pinned_bytes": demand.pinned_bytes, "checks": tuple(checks)}


def assess_host_memory(demand: HostDemand, env: EnvSnapshot) -> HostAdmission:
    """The admission verdict for `demand` on `env`'s platform.

    Does not fit when any known limit but the advisory ones (`ADVISORY_LIMITS`, said in
    the message) is exceeded (the most exceeded one binds); fits
    when none is and the new host memory was compared with at least one of MemAvailable
    and the cgroup's headroom (or there is none), the limit with the least room binding;
    unknown when neither of those is known.

    Args:
        demand: what the plan takes (`host_demand`).
        env: the snapshot the plan is made for.

    Returns:
        The verdict, the numbers, the binding limit and a message naming them.
    """
    checks = _checks(demand, env.platform)
    advice = "".join(f"; over {_SHORT[c.limit]} (advisory: {over_text(c, demand.pinned_bytes)}; pinning may fail "
                     "and fall back to pageable memory)" for c in checks
                     if c.fits is False and c.limit in ADVISORY_LIMITS)
    checks_binding = [c for c in checks if c.limit not in ADVISORY_LIMITS]
    failed = [c for c in checks_binding if c.fits is False]
    if failed:
        worst = min(failed, key=lambda c: c.margin_bytes or 0)
        message = over_text(worst, demand.pinned_bytes)
        others = [_SHORT[c.limit] for c in failed if c is not worst]
        if others:
            message += f"; also over {' and '.join(others)}"
        return HostAdmission(verdict=HostFit.DOES_NOT_FIT, binding=worst.limit, message=message + advice,
                             **_numbers(demand, checks))
    known = [c for c in checks_binding if c.allowed_bytes is not None]
    unknown = [_SHORT[c.limit] for c in checks if c.allowed_bytes is None]
    if demand.host_bytes > 0 and not any(c.limit in _HOST_LIMITS for c in known):
        message = (f"unknown: the plan needs {format_bytes(demand.host_bytes)} of new host memory, but neither "
                   "MemAvailable nor the cgroup's memory limit could be read")
        return HostAdmission(verdict=HostFit.UNKNOWN, message=message + advice, **_numbers(demand, checks))
    if not known:
        pinned = (f", and no limit applies to the {format_bytes(demand.pinned_bytes)} it pins"
                  if demand.pinned_bytes else " and pins none")
        return HostAdmission(verdict=HostFit.FITS, message=f"fits: the plan takes no new host memory{pinned}{advice}",
                             **_numbers(demand, checks))
    tightest = min(known, key=lambda c: c.margin_bytes or 0)
    message = (f"fits: {_need_text(tightest, demand.pinned_bytes).removeprefix('needs ')}; the tightest limit, "
               f"{tightest.source}, allows {format_bytes(tightest.allowed_bytes or 0)}")
    if unknown:
        message += f" (not checked, unknown: {', '.join(unknown)})"
    return HostAdmission(verdict=HostFit.FITS, binding=tightest.limit, message=message + advice,
                         **_numbers(demand, checks))

