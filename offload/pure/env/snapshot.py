"""The environment as values: the user's switches, the platform, and their snapshot.

Nothing here reads the environment. `parse_env` takes a mapping that the caller supplies
(`capture_env` passes the process environment; tests pass a dict), and `Platform` is filled in by
the shell (`offload.capture`) or written by hand in tests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import attrs

from offload.errors import EnvError, PlanError
from offload.pure._checks import VOLATILE, int_at_least, is_bool, is_str, tuple_of
from offload.pure.env.cgroup import CgroupMemory, cgroup_memory
from offload.pure.env.numa import NumaTopology, numa_topology

__all__ = [
    "ENV_VARIABLES",
    "VOLATILE",
    "EnvFlags",
    "EnvSnapshot",
    "Platform",
    "parse_env",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

#: Each flag of `EnvFlags` and the variables that set it: our own spelling first, then the
#: engine-compatible alias. Both are read; if both are set they must agree.
ENV_VARIABLES: Mapping[str, tuple[str, str]] = {
    "disable_pin_memory": (
        "OFFLOAD_DISABLE_PIN_MEMORY",
        "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY",
    ),
    "disable_uva": (
        "OFFLOAD_DISABLE_UVA",
        "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA",
    ),
}


@attrs.frozen(kw_only=True)
class EnvFlags:
    """The user's switches.

    Attributes:
        disable_pin_memory: never pin or register host memory (set this on unified-memory
            machines such as GH200, where pinned host memory competes with device memory).
        disable_uva: never read weights through zero-copy device views of host memory.
    """

    disable_pin_memory: bool = attrs.field(default=False, validator=is_bool(EnvError))
    disable_uva: bool = attrs.field(default=False, validator=is_bool(EnvError))


def _parse_bool(variable: str, raw: object) -> bool | None:
    # The mapping's type says str, but callers pass dicts of their own (a config file's
    # True, the bytes of the process's byte environment): refuse those by name instead of
    # failing on `.strip`.
    if not isinstance(raw, str):
        raise EnvError(
            f"{variable}={raw!r} is a {type(raw).__name__}, not a string; environment values "
            "are strings: use 1/0, true/false, yes/no or on/off",
            name=variable,
            value=raw,
        )
    value = raw.strip().lower()
    if value == "":
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(
        f"{variable}={raw!r} is not a switch value; use 1/0, true/false, yes/no or on/off",
        name=variable,
        value=raw,
    )


def parse_env(environ: Mapping[str, str]) -> EnvFlags:
    """Read the user's switches from an environment mapping.

    Args:
        environ: variable name to value, usually the process environment, passed by the shell.

    Returns:
        The flags; a variable that is unset or empty counts as not set (False).

    Raises:
        EnvError: a value is not a string, or not one of 1/0, true/false, yes/no, on/off
            (any case, surrounding space ignored), or both spellings of a switch are set
            and disagree.
    """
    values: dict[str, bool] = {}
    for flag, (primary, alias) in ENV_VARIABLES.items():
        ours = _parse_bool(primary, environ[primary]) if primary in environ else None
        theirs = _parse_bool(alias, environ[alias]) if alias in environ else None
        if ours is not None and theirs is not None and ours != theirs:
            raise EnvError(
                f"{primary}={environ[primary]!r} and {alias}={environ[alias]!r} disagree; "
                "unset one of them or make them equal",
                name=f"{primary}, {alias}",
                value=(environ[primary], environ[alias]),
            )
        values[flag] = bool(ours if ours is not None else theirs)
    return EnvFlags(**values)


# `VOLATILE` (from `offload.pure._checks`, re-exported here) marks a reading that changes
# from moment to moment (free memory, a cgroup's usage); such fields are left out of
# `EnvSnapshot.fingerprint`, in `Platform` and in the values it holds.


@attrs.frozen(kw_only=True)
class Platform:
    """What this machine can do. The defaults describe a machine without an accelerator.

    Attributes:
        has_cuda: a CUDA device is usable; the compute device is ``cuda:0``. Without it the
            compute device is the CPU.
        device_name: the compute device's name as the driver reports it.
        device_total_bytes: total memory of the compute device, in bytes (0 without CUDA).
        compute_capability: "major.minor", empty without CUDA.
        is_integrated: the GPU shares one memory pool with the host (Jetson, GB10), so
            offloading frees no physical memory.
        pageable_memory_access: the device can access pageable host memory
            (cudaDevAttrPageableMemoryAccess, attribute 88).
        pageable_uses_host_page_tables: it does so through the host's page tables, i.e.
            hardware-coherent unified memory such as GH200 (attribute 100).
        can_map_host_memory: host memory can be mapped into the device's address space,
            which zero-copy (UVA) views need (attribute 19).
        can_register_host_memory: existing host memory can be page-locked in place with
            cudaHostRegister (attribute 99).
        host_pointer_for_registered_memory: the device reads registered host memory at the
            host's own address (cudaDevAttrCanUseHostPointerForRegisteredMem, attribute 91),
            which zero-copy views of registered memory rely on.
        is_wsl: running under Windows Subsystem for Linux, where pinned memory is limited.
        memlock_limit_bytes: the soft RLIMIT_MEMLOCK in bytes; None means unlimited.
        host_total_bytes: host RAM in bytes; None when unknown.
        host_available_bytes: host RAM available for new allocations (MemAvailable), in
            bytes; None when unknown.
        torch_version: ``torch.__version__``, empty when torch was not consulted.
        probe_notes: what the probe could not read and assumed instead, one line each.
        numa: the host's NUMA nodes and the GPU's node (`NumaTopology`; unknown by default).
        cgroup_memory: the memory limit of this process's cgroup, which the OOM killer
            enforces (`CgroupMemory`: limit and usage in bytes; unlimited and unknown told
            apart; unknown by default).
    """

    has_cuda: bool = attrs.field(default=False, validator=is_bool(PlanError))
    device_name: str = attrs.field(default="cpu", validator=is_str(PlanError))
    device_total_bytes: int = attrs.field(default=0, validator=int_at_least(0, PlanError))
    compute_capability: str = attrs.field(default="", validator=is_str(PlanError))
    is_integrated: bool = attrs.field(default=False, validator=is_bool(PlanError))
    pageable_memory_access: bool = attrs.field(default=False, validator=is_bool(PlanError))
    pageable_uses_host_page_tables: bool = attrs.field(default=False, validator=is_bool(PlanError))
    can_map_host_memory: bool = attrs.field(default=False, validator=is_bool(PlanError))
    can_register_host_memory: bool = attrs.field(default=False, validator=is_bool(PlanError))
    host_pointer_for_registered_memory: bool = attrs.field(default=False, validator=is_bool(PlanError))
    is_wsl: bool = attrs.field(default=False, validator=is_bool(PlanError))
    memlock_limit_bytes: int | None = attrs.field(default=None, validator=int_at_least(0, PlanError, optional=True))
    host_total_bytes: int | None = attrs.field(default=None, validator=int_at_least(0, PlanError, optional=True))
    host_available_bytes: int | None = attrs.field(
        default=None, validator=int_at_least(0, PlanError, optional=True), metadata={VOLATILE: True}
    )
    torch_version: str = attrs.field(default="", validator=is_str(PlanError))
    probe_notes: tuple[str, ...] = attrs.field(default=(), validator=tuple_of(str, PlanError))
    numa: NumaTopology = attrs.field(factory=NumaTopology, validator=numa_topology(PlanError))
    cgroup_memory: CgroupMemory = attrs.field(factory=CgroupMemory, validator=cgroup_memory(PlanError))

    @property
    def is_coherent_unified_memory(self) -> bool:
        """True on hardware-coherent unified memory (GH200, GB200)."""
        return self.has_cuda and self.pageable_memory_access and self.pageable_uses_host_page_tables


@attrs.frozen(kw_only=True)
class EnvSnapshot:
    """Everything a plan depends on besides the model and the config.

    Attributes:
        flags: the user's switches.
        platform: what the machine can do.
    """

    flags: EnvFlags = attrs.field(factory=EnvFlags, validator=attrs.validators.instance_of(EnvFlags))
    platform: Platform = attrs.field(factory=Platform, validator=attrs.validators.instance_of(Platform))

    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of the switches and the platform's capabilities.

        Equal snapshots give equal fingerprints in every process and on every machine
        (no use of ``hash()``), so a saved plan can be checked against the machine it runs
        on. Readings that change from moment to moment (available host memory, marked
        `VOLATILE`) are left out, so two captures of one machine agree.
        """
        platform = attrs.asdict(
            self.platform, filter=lambda field, _value: not field.metadata.get(VOLATILE, False)
        )
        canonical = json.dumps(
            {"flags": attrs.asdict(self.flags), "platform": platform},
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
