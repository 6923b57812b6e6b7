"""Device profiles: how fast a machine's link, memory and tensor cores are, as values.

A `DeviceProfile` is what `estimate` and `fit` need to predict a step time without the
machine: host-to-device bandwidth from pinned and from pageable memory (bytes/s), the
fraction of the pinned rate a kernel reaches reading host memory through a zero-copy view,
dense bf16 throughput (FLOP/s), the rate a resident weight is read from device memory
(bytes/s), and device memory (bytes). Presets describe common parts; `profile_from_numbers`
builds one from measured numbers (``benchmarks/`` prints them) or command-line flags.

Rates are *achieved* rates, not peaks. Where a preset has no measurement behind a number
it scales the datasheet peak by the fractions below and says so in its comment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from offload.errors import ConfigError
from offload.pure._checks import Validator, fraction, int_at_least, is_str
from offload.pure.env.snapshot import EnvSnapshot, Platform
from offload.pure.units import gib_to_bytes

__all__ = [
    "GB",
    "MAX_RATE",
    "MIN_RATE",
    "PROFILES",
    "TFLOP",
    "DeviceProfile",
    "planning_env",
    "profile_by_name",
    "profile_for_device",
    "profile_from_numbers",
]

#: Bytes in a decimal gigabyte: link and memory rates are quoted in GB/s (10**9 bytes/s).
GB = 10**9
#: FLOP in a teraFLOP.
TFLOP = 10**12
#: The range of every rate a profile holds (bytes/s, FLOP/s), zero-copy reads included:
#: wide enough for any real machine (1e21 is a million times an H200's FLOP/s) and narrow
#: enough that every estimate from sizes up to 2**60 bytes is finite and non-zero.
MIN_RATE = 1e-3
MAX_RATE = 1e21


#: The smallest rate `profile_from_numbers` takes, per second: 1 byte/s or 1 FLOP/s, so
#: that the rates it derives (pageable x 0.15, zero-copy x 0.90) stay above `MIN_RATE`.
MIN_GIVEN_RATE = 1.0


def _check_rate(name: str, value: object, *, unit: float = 1.0, unit_name: str = "per second",
                minimum: float = MIN_RATE) -> None:
    """Raise `ConfigError` naming `name` unless ``value x unit`` is a number in
    [`minimum`, `MAX_RATE`] (bools are not numbers here)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not minimum <= value * unit <= MAX_RATE):
        raise ConfigError(f"{name} must be a number of {unit_name} from {minimum / unit:g} to {MAX_RATE / unit:g}, "
                          f"got {value!r}", name=name, value=value)


def _rate(*, optional: bool = False) -> Validator:
    """A validator accepting rates in [`MIN_RATE`, `MAX_RATE`] (and None when `optional`)."""

    def check(_instance: object, attribute: attrs.Attribute[object], value: object) -> None:
        if not (optional and value is None):
            _check_rate(attribute.name, value)

    return check

_GEN5 = 63.0  # PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b, per direction, GB/s (PCI-SIG)
_GEN4 = 31.5  # PCIe Gen4 x16: 16 GT/s x 16 lanes, 128b/130b, per direction, GB/s (PCI-SIG)

# Fractions applied to datasheet peaks where nothing was measured (all from FACTS.md's H200):
#: pinned host-to-device copies reached 55.4 GB/s of PCIe Gen5 x16's 63.0 GB/s per direction.
PCIE_ACHIEVED = 55.4 / _GEN5
#: pageable copies ran 6.6x slower than pinned ones (8.4 vs 55.4 GB/s).
PAGEABLE_RATIO = 8.4 / 55.4
#: a GEMM reading its weight through a zero-copy view ran at about 0.90 of the copy rate.
ZERO_COPY_FRACTION = 0.90
#: a decode-sized GEMM (4096x16384 fp16, 1-256 tokens) read its resident weight in
#: 0.066 ms: 134,217,728 B / 0.066 ms = 2.03e12 B/s, 0.42 of the H200's 4.8 TB/s.
WEIGHT_READ_ACHIEVED = 2.03 / 4.8
#: Assumed, not measured here: large bf16 GEMMs reach about 0.7 of the dense tensor peak.
GEMM_ACHIEVED = 0.7


@attrs.frozen(kw_only=True)
class DeviceProfile:
    """How fast one accelerator and its host link are (achieved rates, not peaks).

    Attributes:
        name: the profile's name (``h200-pcie5``, or ``custom``).
        device_name: the device as a driver would report it, for the planning `Platform`.
        pinned_h2d_bytes_per_s: host-to-device copy rate from pinned memory, bytes/s.
        pageable_h2d_bytes_per_s: host-to-device copy rate from pageable memory, bytes/s.
        zero_copy_fraction: the fraction of the pinned rate a kernel reaches reading host
            memory through a zero-copy (UVA) view, in (0, 1].
        bf16_flops_per_s: dense bf16 matrix throughput, FLOP/s.
        weight_read_bytes_per_s: rate a kernel reads a resident weight from device memory,
            bytes/s; None to model compute from FLOPs alone.
        device_memory_bytes: device memory, bytes (0 when unknown).
        coherent_unified_memory: the host link is hardware-coherent (GH200's NVLink-C2C):
            the planning platform says so, and plans warn about pinned memory there.
        source: where the numbers come from, for people.
    """

    name: str = attrs.field(validator=is_str(ConfigError))
    device_name: str = attrs.field(validator=is_str(ConfigError))
    pinned_h2d_bytes_per_s: float = attrs.field(validator=_rate())
    pageable_h2d_bytes_per_s: float = attrs.field(validator=_rate())
    zero_copy_fraction: float = attrs.field(validator=fraction(ConfigError))
    bf16_flops_per_s: float = attrs.field(validator=_rate())
    weight_read_bytes_per_s: float | None = attrs.field(default=None, validator=_rate(optional=True))
    device_memory_bytes: int = attrs.field(default=0, validator=int_at_least(0, ConfigError))
    coherent_unified_memory: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    source: str = attrs.field(default="", validator=is_str(ConfigError))

    def __attrs_post_init__(self) -> None:
        # Each factor may be in range while their product is not (1e-3 B/s x 1e-300).
        if not MIN_RATE <= self.zero_copy_bytes_per_s:
            raise ConfigError(f"zero_copy_fraction {self.zero_copy_fraction!r} x pinned_h2d_bytes_per_s "
                              f"{self.pinned_h2d_bytes_per_s!r} is below {MIN_RATE:g} bytes/s",
                              name="zero_copy_fraction", value=self.zero_copy_fraction)

    @property
    def zero_copy_bytes_per_s(self) -> float:
        """Rate of reads through a zero-copy view, bytes/s: pinned rate x zero-copy fraction."""
        return self.pinned_h2d_bytes_per_s * self.zero_copy_fraction

    def h2d_bytes_per_s(self, *, pinned: bool) -> float:
        """Host-to-device copy rate in bytes/s from pinned (True) or pageable memory."""
        return self.pinned_h2d_bytes_per_s if pinned else self.pageable_h2d_bytes_per_s


def _pcie(gbps_per_direction: float) -> tuple[float, float]:
    """(pinned, pageable) bytes/s for a PCIe link, scaled by the fractions measured on Gen5."""
    pinned = gbps_per_direction * GB * PCIE_ACHIEVED
    return pinned, pinned * PAGEABLE_RATIO


def _preset(name: str, device: str, *, link: tuple[float, float], zero_copy: float, tflops: float,
            memory_tbps: float | None, weight_read: float | None = None, memory_gb: float,
            coherent: bool = False, source: str) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        device_name=device,
        pinned_h2d_bytes_per_s=link[0],
        pageable_h2d_bytes_per_s=link[1],
        zero_copy_fraction=zero_copy,
        bf16_flops_per_s=tflops * TFLOP * GEMM_ACHIEVED,
        weight_read_bytes_per_s=weight_read if memory_tbps is None else memory_tbps * 1000 * GB * WEIGHT_READ_ACHIEVED,
        device_memory_bytes=int(memory_gb * GB),
        coherent_unified_memory=coherent,
        source=source,
    )


#: Built-in profiles by name. Compute: datasheet dense bf16 peak x GEMM_ACHIEVED (0.7,
#: assumed); weight reads: datasheet memory bandwidth x WEIGHT_READ_ACHIEVED (0.42,
#: measured on the H200); memory: the datasheet capacity in decimal GB.
PROFILES: Mapping[str, DeviceProfile] = {
    # Measured (FACTS.md): H200 on PCIe Gen5 x16: pinned 55.4 GB/s, pageable 8.4 GB/s,
    # zero-copy GEMM 0.90 of the copy rate, resident weight read 2.03e12 B/s. Datasheet
    # (H200 SXM): 989 TFLOPS dense bf16 (1,979 with sparsity), 141 GB HBM3e at 4.8 TB/s.
    "h200-pcie5": _preset("h200-pcie5", "NVIDIA H200", link=(55.4 * GB, 8.4 * GB), zero_copy=0.90,
                          tflops=989.0, memory_tbps=None, weight_read=2.03e12, memory_gb=141,
                          source="link and weight reads measured on an H200 (FACTS.md); compute from the datasheet"),
    # Datasheet (H100 PCIe): 756 TFLOPS dense bf16 (1,513 with sparsity), 80 GB HBM2e at
    # 2.0 TB/s. Link: the same PCIe Gen5 x16 as the H200 above, so its measured rates.
    "h100-pcie5": _preset("h100-pcie5", "NVIDIA H100 PCIe", link=(55.4 * GB, 8.4 * GB), zero_copy=0.90,
                          tflops=756.0, memory_tbps=2.0, memory_gb=80,
                          source="H100 PCIe datasheet; link as measured on an H200 over PCIe Gen5"),
    # Datasheet (A100 80GB PCIe): 312 TFLOPS dense bf16, 1,935 GB/s HBM2e, 80 GB. Link: PCIe
    # Gen4 x16 (31.5 GB/s per direction) at the fractions measured on Gen5.
    "a100-pcie4": _preset("a100-pcie4", "NVIDIA A100 80GB PCIe", link=_pcie(_GEN4), zero_copy=ZERO_COPY_FRACTION,
                          tflops=312.0, memory_tbps=1.935, memory_gb=80,
                          source="A100 datasheet; PCIe Gen4 peak scaled by the fractions measured on Gen5"),
    # Datasheet (L40S): 362 TFLOPS dense bf16 (733 with sparsity), 48 GB GDDR6 at 864 GB/s.
    # Link: PCIe Gen4 x16 at the fractions measured on Gen5.
    "l40s": _preset("l40s", "NVIDIA L40S", link=_pcie(_GEN4), zero_copy=ZERO_COPY_FRACTION,
                    tflops=362.0, memory_tbps=0.864, memory_gb=48,
                    source="L40S datasheet; PCIe Gen4 peak scaled by the fractions measured on Gen5"),
    # Ada whitepaper (RTX 4090): 165.2 TFLOPS dense bf16 with FP32 accumulate, 24 GB GDDR6X
    # at 1,008 GB/s. Link: PCIe Gen4 x16 at the fractions measured on Gen5.
    "rtx4090": _preset("rtx4090", "NVIDIA GeForce RTX 4090", link=_pcie(_GEN4), zero_copy=ZERO_COPY_FRACTION,
                       tflops=165.2, memory_tbps=1.008, memory_gb=24,
                       source="Ada whitepaper; PCIe Gen4 peak scaled by the fractions measured on Gen5"),
    # GH200 480GB (96 GB HBM3 at 4.0 TB/s, 989 TFLOPS dense bf16, datasheet). Link:
    # NVLink-C2C, 450 GB/s per direction on paper; 375 GB/s host-to-device measured on a
    # GH200 480GB in a 2024 university study of its memory system, as HPCwire reported it
    # (not re-measured here). Pageable rate and zero-copy fraction not measured: assumed
    # half the pinned rate (the GPU reads pageable memory through the host's page tables)
    # and 0.90 as on PCIe.
    "gh200": _preset("gh200", "NVIDIA GH200 480GB", link=(375.0 * GB, 187.5 * GB), zero_copy=ZERO_COPY_FRACTION,
                     tflops=989.0, memory_tbps=4.0, memory_gb=96, coherent=True,
                     source="GH200 datasheet; C2C rate as measured in a published study; pageable rate assumed"),
}


def profile_for_device(device_name: str) -> DeviceProfile | None:
    """The built-in profile whose device name is `device_name` (as torch reports it, any
    case, surrounding space ignored), or None: how `offload plan` finds the profile of
    the machine it runs on."""
    wanted = device_name.strip().lower()
    matches = [p for p in PROFILES.values() if p.device_name.lower() == wanted]
    return matches[0] if matches else None


def profile_by_name(name: str) -> DeviceProfile:
    """The built-in profile called `name`.

    Raises:
        ConfigError: no profile has that name; the message lists the ones there are.
    """
    profile = PROFILES.get(name)
    if profile is None:
        raise ConfigError(f"no device profile named {name!r}; profiles: {', '.join(sorted(PROFILES))}",
                          name="profile", value=name)
    return profile


def profile_from_numbers(
    *,
    link_gbps: float | None = None,
    tflops: float | None = None,
    pageable_gbps: float | None = None,
    zero_copy_fraction: float | None = None,
    weight_read_gbps: float | None = None,
    device_gib: float | None = None,
    base: DeviceProfile | None = None,
    name: str = "custom",
) -> DeviceProfile:
    """A profile from measured (achieved) numbers in the units people quote.

    Every number not given is taken from `base`, except that a `link_gbps` given without
    `pageable_gbps` moves the pageable rate with it, at the base's ratio of pageable to
    pinned; without a base, `link_gbps` and `tflops` are required, the pageable rate
    defaults to the pinned rate x `PAGEABLE_RATIO` (the 6.6x gap measured on PCIe), the
    zero-copy fraction to 0.90, weight reads to None
    (compute from FLOPs alone) and device memory to 0 (unknown). Each rate given must be
    from 1 to `MAX_RATE` once in bytes/s or FLOP/s (``link_gbps`` from 1e-9 to 1e12).

    Args:
        link_gbps: pinned host-to-device copy rate, GB/s (10**9 bytes/s).
        tflops: achieved dense bf16 throughput, TFLOP/s (used as given, not scaled).
        pageable_gbps: pageable host-to-device copy rate, GB/s.
        zero_copy_fraction: fraction of the pinned rate zero-copy reads reach, (0, 1].
        weight_read_gbps: rate resident weights are read from device memory, GB/s.
        device_gib: device memory, GiB (2**30 bytes), from 1 byte to 2**60 bytes.
        base: a profile to take the numbers not given from.
        name: the new profile's name.

    Raises:
        ConfigError: a required number is missing, or a number is out of range; the error
            names the argument.
    """
    if base is None and (link_gbps is None or tflops is None):
        missing = "link_gbps" if link_gbps is None else "tflops"
        raise ConfigError(f"a profile from numbers needs both link_gbps and tflops (or a base profile); "
                          f"{missing} is missing", name=missing, value=None)
    for arg, value, unit, unit_name in (("link_gbps", link_gbps, GB, "GB/s"), ("tflops", tflops, TFLOP, "TFLOP/s"),
                                        ("pageable_gbps", pageable_gbps, GB, "GB/s"),
                                        ("weight_read_gbps", weight_read_gbps, GB, "GB/s")):
        if value is not None:
            _check_rate(arg, value, unit=unit, unit_name=unit_name, minimum=MIN_GIVEN_RATE)
    memory = None if device_gib is None else gib_to_bytes(device_gib, name="device_gib", allow_zero=False)
    pinned = link_gbps * GB if link_gbps is not None else base.pinned_h2d_bytes_per_s if base else 0.0
    if pageable_gbps is not None:
        pageable = pageable_gbps * GB
    elif base is not None and link_gbps is None:
        pageable = base.pageable_h2d_bytes_per_s
    elif base is not None:
        # The base's own ratio: a link measured faster or slower moves both rates (GH200's
        # pageable reads go through the host's page tables at half the pinned rate, not
        # at PCIe's 6.6x slower one), kept within the range a profile holds.
        ratio = base.pageable_h2d_bytes_per_s / base.pinned_h2d_bytes_per_s
        pageable = min(MAX_RATE, max(MIN_RATE, pinned * ratio))
    else:
        pageable = pinned * PAGEABLE_RATIO
    return DeviceProfile(
        name=name,
        device_name=base.device_name if base is not None else "custom device",
        pinned_h2d_bytes_per_s=pinned,
        pageable_h2d_bytes_per_s=pageable,
        zero_copy_fraction=(zero_copy_fraction if zero_copy_fraction is not None
                            else base.zero_copy_fraction if base is not None else ZERO_COPY_FRACTION),
        bf16_flops_per_s=tflops * TFLOP if tflops is not None else base.bf16_flops_per_s if base else 0.0,
        weight_read_bytes_per_s=(weight_read_gbps * GB if weight_read_gbps is not None
                                 else base.weight_read_bytes_per_s if base is not None else None),
        device_memory_bytes=(memory if memory is not None else base.device_memory_bytes if base is not None else 0),
        coherent_unified_memory=base.coherent_unified_memory if base is not None else False,
        source=f"measured numbers{f' over {base.name}' if base is not None else ''}",
    )


def planning_env(env: EnvSnapshot, profile: DeviceProfile) -> EnvSnapshot:
    """The snapshot to plan against for the device `profile` describes.

    On a machine with CUDA, `env` describes the real device and is returned unchanged (the
    profile only supplies speeds). Without CUDA, `make_plan` would treat the CPU as the
    compute device and free no device memory, so the platform is replaced by a CUDA one
    built from the profile: its device name and memory, host mapping and registration
    available, coherent unified memory when the profile says so. The host readings
    (memory, the cgroup's limit, memlock, WSL) are kept: the profile names a device, and
    the host the weights are offloaded to is this machine, as a plan without a profile
    says (its NUMA topology is not: the GPU's node is the target's); the user's switches
    (`env.flags`) are kept.
    """
    if env.platform.has_cuda:
        return env
    host = env.platform
    platform = Platform(
        has_cuda=True,
        device_name=profile.device_name,
        device_total_bytes=profile.device_memory_bytes,
        can_map_host_memory=True,
        can_register_host_memory=True,
        host_pointer_for_registered_memory=True,
        pageable_memory_access=profile.coherent_unified_memory,
        pageable_uses_host_page_tables=profile.coherent_unified_memory,
        is_wsl=host.is_wsl,
        memlock_limit_bytes=host.memlock_limit_bytes,
        host_total_bytes=host.host_total_bytes,
        host_available_bytes=host.host_available_bytes,
        cgroup_memory=host.cgroup_memory,
        torch_version=host.torch_version,
        probe_notes=(f"planned for the {profile.name} profile: this machine has no CUDA device",),
    )
    return EnvSnapshot(flags=env.flags, platform=platform)
