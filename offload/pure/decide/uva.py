"""The UVA decision: whether UVA-planned weights are read in place through zero-copy
device views of pinned host memory (it follows the pin decision, `offload.pure.decide.pinning`),
made once and obeyed by the UVA backend."""

from __future__ import annotations

import enum

import attrs

from offload.pure.decide.pinning import PinDecision
from offload.pure.env.snapshot import ENV_VARIABLES, EnvSnapshot

__all__ = ["UvaDecision", "UvaReason", "decide_uva"]


class UvaReason(enum.Enum):
    """Why zero-copy (UVA) device views of host memory are, or are not, used."""

    ENABLED = "enabled"
    DISABLED_BY_ENV = "disabled_by_env"
    NO_ACCELERATOR = "no_accelerator"
    NO_HOST_MAPPING = "no_host_mapping"
    NOT_PINNED = "not_pinned"


_UVA_TEXT = {
    UvaReason.ENABLED: "the device reads pinned host memory in place through zero-copy views",
    UvaReason.DISABLED_BY_ENV: "the user turned UVA off ({} or {})".format(*ENV_VARIABLES["disable_uva"]),
    UvaReason.NO_ACCELERATOR: "no accelerator: there is no device to map host memory into",
    UvaReason.NO_HOST_MAPPING: "the device cannot map host memory (cudaDevAttrCanMapHostMemory is 0)",
    UvaReason.NOT_PINNED: "host copies are not pinned, and a zero-copy view needs pinned or registered memory",
}


@attrs.frozen(kw_only=True)
class UvaDecision:
    """Whether UVA-planned weights are read through zero-copy views, and why.

    Attributes:
        enabled: True for zero-copy views; False means the UVA backend falls back to
            copying weights on demand.
        reason: why.
    """

    enabled: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    reason: UvaReason = attrs.field(validator=attrs.validators.instance_of(UvaReason))

    @property
    def explanation(self) -> str:
        """One sentence a person can read."""
        return _UVA_TEXT[self.reason]


def decide_uva(env: EnvSnapshot, pin: PinDecision) -> UvaDecision:
    """Decide, once, whether zero-copy device views of host memory are used.

    UVA needs the user's consent, a CUDA device that can map host memory, and host
    copies that are pinned or registered (so it follows the pin decision).

    Args:
        env: the snapshot of switches and platform.
        pin: the decision from `decide_pinning` for the same snapshot.

    Returns:
        The decision the UVA backend obeys.
    """
    if env.flags.disable_uva:
        return UvaDecision(enabled=False, reason=UvaReason.DISABLED_BY_ENV)
    if not env.platform.has_cuda:
        return UvaDecision(enabled=False, reason=UvaReason.NO_ACCELERATOR)
    if not env.platform.can_map_host_memory:
        return UvaDecision(enabled=False, reason=UvaReason.NO_HOST_MAPPING)
    if not pin.pin:
        return UvaDecision(enabled=False, reason=UvaReason.NOT_PINNED)
    return UvaDecision(enabled=True, reason=UvaReason.ENABLED)
