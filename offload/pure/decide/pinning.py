"""The pin decision: made once, here, and obeyed by every backend.

`decide_pinning` is the single source of truth for whether host copies of weights are
pinned (page-locked). The bug this project was born from was a backend that decided for
itself and ignored the user's "do not pin" switch, running unified-memory machines out of
memory. No other function in `offload` decides pinning; executors read ``plan.pin``.
"""

from __future__ import annotations

import enum

import attrs

from offload.errors import PlanError
from offload.pure.env.snapshot import ENV_VARIABLES, EnvSnapshot

__all__ = [
    "PinDecision",
    "PinMethod",
    "PinReason",
    "decide_pinning",
]


class PinReason(enum.Enum):
    """Why host copies are, or are not, pinned."""

    ENABLED = "enabled"
    DISABLED_BY_ENV = "disabled_by_env"
    NO_ACCELERATOR = "no_accelerator"
    WSL = "wsl"


_PIN_TEXT = {
    PinReason.ENABLED: "host copies are pinned: fast asynchronous copies, capturable in CUDA graphs",
    PinReason.DISABLED_BY_ENV: (
        "the user turned pinning off ({} or {}); the switch wins over everything".format(
            *ENV_VARIABLES["disable_pin_memory"]
        )
    ),
    PinReason.NO_ACCELERATOR: "no accelerator: there is no device to pin host memory for",
    PinReason.WSL: "WSL limits pinned memory, so it is not used there",
}


class PinMethod(enum.Enum):
    """How host copies are page-locked. Both take exactly the pages a copy spans: never
    PyTorch's pinned allocator, which rounds each request up to a power of two."""

    NONE = "none"
    """Not page-locked: ordinary pageable memory."""
    REGISTER = "register"
    """Pages mapped for the copy, then registered in place (``cudaHostRegister``)."""
    ALLOC = "alloc"
    """One page-locked allocation of the copy's size (``cudaHostAlloc``)."""


_METHOD_TEXT = {
    PinMethod.NONE: "pageable",
    PinMethod.REGISTER: "registered in place",
    PinMethod.ALLOC: "page-locked allocation",
}


def _default_method(decision: PinDecision) -> PinMethod:
    return PinMethod.REGISTER if decision.pin else PinMethod.NONE


def _method_matches_pin(decision: PinDecision, attribute: attrs.Attribute[PinMethod], method: PinMethod) -> None:
    if (method is not PinMethod.NONE) != decision.pin:
        raise PlanError(f"pin method {method.value!r} contradicts pin={decision.pin}",
                        name=attribute.name, value=method.value)


@attrs.frozen(kw_only=True)
class PinDecision:
    """Whether host copies of offloaded weights are pinned, how, and why.

    Attributes:
        pin: True to page-lock host copies; False to keep them pageable.
        reason: why.
        method: how: `PinMethod.NONE` exactly when `pin` is False; otherwise
            `PinMethod.REGISTER` (the default) or `PinMethod.ALLOC`.
    """

    pin: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    reason: PinReason = attrs.field(validator=attrs.validators.instance_of(PinReason))
    method: PinMethod = attrs.field(
        default=attrs.Factory(_default_method, takes_self=True),
        validator=[attrs.validators.instance_of(PinMethod), _method_matches_pin],
    )

    @property
    def explanation(self) -> str:
        """One sentence a person can read."""
        return _PIN_TEXT[self.reason]

    @property
    def method_text(self) -> str:
        """The method in a few words ("registered in place")."""
        return _METHOD_TEXT[self.method]


def decide_pinning(env: EnvSnapshot) -> PinDecision:
    """Decide, once, whether host copies of weights are pinned.

    The user's switch wins over everything; then a machine without an accelerator has
    nothing to pin for; then WSL, whose pinned memory is limited. Pinned copies are
    registered in place where the device supports that and reads registered memory at the
    host address (attributes 99 and 91: zero-copy views need the second); otherwise they
    are page-locked allocations of the exact size.

    Args:
        env: the snapshot of switches and platform.

    Returns:
        The decision every backend obeys.
    """
    if env.flags.disable_pin_memory:
        return PinDecision(pin=False, reason=PinReason.DISABLED_BY_ENV)
    if not env.platform.has_cuda:
        return PinDecision(pin=False, reason=PinReason.NO_ACCELERATOR)
    if env.platform.is_wsl:
        return PinDecision(pin=False, reason=PinReason.WSL)
    platform = env.platform
    registers = platform.can_register_host_memory and platform.host_pointer_for_registered_memory
    return PinDecision(pin=True, reason=PinReason.ENABLED, method=PinMethod.REGISTER if registers else PinMethod.ALLOC)
