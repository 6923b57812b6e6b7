"""The lifecycle of an executor as one table: the states it goes through, which call each
state allows, and what each call leaves; `require` is the one check every call makes.

::

    NEW ──wrap_modules──▶ WRAPPED ──post_init──▶ READY ──(forwards, load_weights,
                            │  ▲ (a failed            │    sync_prev_onload, check)
                            │  └─ post_init stays)    │
                            └──────────restore────────┴──▶ RESTORING ──(restore finishes)──▶ RESTORED
                                                              └──(a failed restore stays; restore again)

A restore that stops part way leaves RESTORING: the model must not run (some weights are
back, some still offloaded) until `restore` is called again and finishes. The forward path
checks ``state is READY`` itself (one identity test per layer) and calls `require` only to
raise.
"""

from __future__ import annotations

import enum
from typing import NoReturn

from offload.errors import ExecutionError

__all__ = ["ALLOWED", "LEAVES", "Lifecycle", "refuse", "require", "unfinished_restore"]


class Lifecycle(enum.Enum):
    """Where an executor is: made, wrapped (weights in host memory), ready (post_init
    done), restoring (a restore began and did not finish: the model cannot run until
    `restore` is called again and finishes), or restored (done for good)."""

    NEW = "new"
    WRAPPED = "wrapped"
    READY = "ready"
    RESTORING = "restoring"
    RESTORED = "restored"


_NEW, _WRAPPED, _READY, _RESTORING = Lifecycle.NEW, Lifecycle.WRAPPED, Lifecycle.READY, Lifecycle.RESTORING

#: Each call, the states it is allowed in, and what it says elsewhere (the state follows).
ALLOWED: dict[str, tuple[frozenset[Lifecycle], str]] = {
    "wrap_modules": (frozenset({_NEW}), "wrap_modules was already called"),
    "post_init": (frozenset({_WRAPPED}), "post_init needs wrap_modules first and runs once"),
    "forward": (frozenset({_READY}), "an offloaded layer ran before post_init()"),
    "sync_prev_onload": (frozenset({_READY}), "sync_prev_onload needs post_init first"),
    "load_weights": (frozenset({_WRAPPED, _READY}), "load_weights needs a wrapped model"),
    "check": (frozenset({_WRAPPED, _READY}), "check needs a wrapped model"),
    "restore": (frozenset({_WRAPPED, _READY, _RESTORING}), "restore needs a wrapped model"),
}

#: The state each call leaves when it succeeds (a failed call leaves the state it found,
#: but for a restore that got under way: RESTORING).
LEAVES: dict[str, Lifecycle] = {
    "wrap_modules": _WRAPPED,
    "post_init": _READY,
    "restore": Lifecycle.RESTORED,
}


def unfinished_restore(what: str) -> ExecutionError:
    """The error a call that needs the offloaded model raises while a restore that stopped
    part way has not been finished (`Lifecycle.RESTORING`)."""
    return ExecutionError(
        f"{what}: restore() stopped part way and did not finish (some weights are back, the rest are still "
        "offloaded, and no buffer is held); call restore() again to finish, then run the restored model",
        name="state", value=_RESTORING.value)


def require(state: Lifecycle, call: str, what: str | None = None, *, subject: str | None = None) -> None:
    """Return when `call` is allowed in `state` (`ALLOWED`); else raise.

    Args:
        state: the executor's state.
        call: one of `ALLOWED`'s calls.
        what: the message to give instead of the table's, for a call that says more
            (the state is added).
        subject: what cannot run while a restore is unfinished ("layer 3"); the call's
            name by default.

    Raises:
        ExecutionError: `call` is not allowed in `state`; while a restore is unfinished, the
            error says so (`unfinished_restore`). ``name`` is "state", ``value`` the state.
    """
    allowed, message = ALLOWED[call]
    if state not in allowed:
        refuse(state, call, what if what is not None else message, subject=subject)


def refuse(state: Lifecycle, call: str, message: str, *, subject: str | None = None) -> NoReturn:
    """Raise the error `require` raises for `call` in `state`."""
    if state is _RESTORING and _RESTORING not in ALLOWED[call][0]:
        raise unfinished_restore(f"{subject or call} cannot run")
    raise ExecutionError(f"{message} (state {state.value})", name="state", value=state.value)
