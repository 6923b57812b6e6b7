"""Where each weight goes when a plan is carried out, and how it gets there.

A plan places every weight of its layers wherever that weight is when the plan runs: on
the compute device, in host memory, or on the meta device (not loaded yet). Resident
weights end on the compute device; offloaded ones in exact-size host memory, pinned as
the plan's `PinDecision` says. `decide_move` is the one function that says how each
weight gets there; executors call it with the weight's live device and do what it says.
It also says what `restore` gives back (`restore_target`).
"""

from __future__ import annotations

import enum

from offload.pure.decide.pinning import PinMethod
from offload.pure.spec.values import COMPUTE_DEVICE

__all__ = ["Move", "WhereKind", "decide_move", "move_text", "restore_target", "where_kind"]


class WhereKind(enum.Enum):
    """Where a weight's data is, relative to a plan's compute device."""

    COMPUTE = "compute"  # on the compute device (or the not-yet-loaded placeholder for it)
    HOST = "host"  # in host memory, on a platform whose compute device is not the host
    META = "meta"  # no data yet
    OTHER = "other"  # another device (another GPU): not something a plan can place


class Move(enum.Enum):
    """How a weight reaches the place the plan gives it."""

    KEEP = "keep"
    """Already where the plan puts it: nothing is moved."""
    TO_DEVICE = "to_device"
    """Resident, in host memory: copied to the compute device, the host tensor released."""
    NEW_ON_DEVICE = "new_on_device"
    """Resident, on meta: uninitialised storage on the compute device, for a loader to fill."""
    TO_HOST = "to_host"
    """Offloaded, on the compute device: copied into exact-size host memory, pinned as planned."""
    ADOPT = "adopt"
    """Offloaded, already in pageable host memory and the plan does not pin: the tensor
    itself becomes the host copy (no copy, no extra memory)."""
    HOST_TO_PINNED = "host_to_pinned"
    """Offloaded, in pageable host memory and the plan pins: copied into exact-size
    page-locked memory, the pageable tensor released as soon as it is copied."""
    NEW_ON_HOST = "new_on_host"
    """Offloaded, on meta: uninitialised exact-size host memory, pinned as planned, for a
    loader to fill."""


_TEXT = {
    Move.KEEP: "stays where it is",
    Move.TO_DEVICE: "host -> device",
    Move.NEW_ON_DEVICE: "meta -> new on device",
    Move.TO_HOST: "device -> host copy",
    Move.ADOPT: "host, used in place",
    Move.HOST_TO_PINNED: "host -> page-locked copy",
    Move.NEW_ON_HOST: "meta -> new host memory",
}


def move_text(move: Move) -> str:
    """A few words for people (``"host -> device"``)."""
    return _TEXT[move]


def where_kind(device: str, compute_device: str) -> WhereKind:
    """Classify a device name (``cuda:0``, ``cpu``, ``meta``, `COMPUTE_DEVICE`) for a plan
    whose compute device is `compute_device` (``"cuda"`` or ``"cpu"``)."""
    if device in (COMPUTE_DEVICE, compute_device) or device.startswith(f"{compute_device}:"):
        return WhereKind.COMPUTE
    if device == "meta":
        return WhereKind.META
    if device == "cpu":
        return WhereKind.HOST
    return WhereKind.OTHER


def decide_move(where: WhereKind, *, offloaded: bool, pin: PinMethod, keep_host: bool, compute_is_host: bool) -> Move:
    """How a weight found at `where` reaches its planned place.

    Args:
        where: where its data is now (`where_kind`).
        offloaded: the plan offloads it (prefetch, uva or on demand).
        pin: the plan's pin method.
        keep_host: the config keeps resident weights that are in host memory there
            (`OffloadConfig.keep_host_params`).
        compute_is_host: the compute device is the host itself (no accelerator), so a
            weight on it is already in host memory.

    Returns:
        The move. A weight on another device is the caller's error to report; it gets
        `Move.KEEP` here.
    """
    if where is WhereKind.OTHER:
        return Move.KEEP
    if not offloaded:
        if where is WhereKind.HOST:
            return Move.KEEP if keep_host else Move.TO_DEVICE
        return Move.NEW_ON_DEVICE if where is WhereKind.META else Move.KEEP
    if where is WhereKind.META:
        return Move.NEW_ON_HOST
    if where is WhereKind.HOST or compute_is_host:  # (COMPUTE here: on the host when it computes)
        return Move.ADOPT if pin is PinMethod.NONE else Move.HOST_TO_PINNED
    return Move.TO_HOST


def restore_target(move: Move) -> WhereKind:
    """Where `restore` puts a weight that reached its place by `move`: back where it was,
    except that a weight that had no data (meta) keeps the place the plan gave it when
    resident, and comes back in host memory when offloaded (its values are real now, and
    the host is where an offloaded model fits)."""
    if move in (Move.TO_DEVICE, Move.ADOPT, Move.HOST_TO_PINNED, Move.NEW_ON_HOST):
        return WhereKind.HOST
    return WhereKind.COMPUTE
