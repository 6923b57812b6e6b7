"""The barrier before every gather of the sharing protocol (`arrive`).

A collective (``all_gather_object``) waits for a member that never comes as long as its
process group says (30 minutes on gloo) and then raises gloo's error; `arrive` waits
through the torch.distributed store at most `ShareWith.timeout_s`, then raises
`ExecutionError` naming the ranks that did not come, so a gather starts only once every
member is there, and either every member gathers or none does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Sequence

from torch.distributed.distributed_c10d import Store

from offload.errors import ExecutionError
from offload.pure.units import ranks_text

__all__ = ["arrive"]


#: Added to a meeting's count by the member that stops waiting first: every member that
#: comes to it later reads a count this large and knows that the others have left.
_GAVE_UP = 1 << 40


def arrive(store: Store, *, rank: int, ranks: Sequence[int], topic: str, doing: str, timeout_s: float) -> int:
    """Wait until every rank of `ranks` has come to this meeting, at most `timeout_s`.

    A rank's n-th call for `topic` with these `ranks` meets every other rank's n-th: each
    counts its own calls (in the store, per rank), so members that call again (a second
    ``create_offloader`` on one group, after a failure or not) meet afresh without
    telling each other anything first. The meeting is decided once for all, atomically
    in the store: by the last rank to come (everyone goes on to the gather) or by the
    first to stop waiting (everyone raises, those that come later at once), so that
    either every member gathers or none does.

    Args:
        store: the store every member reaches.
        rank: this process's global rank (one of `ranks`).
        ranks: the global ranks that meet (every member passes the same).
        topic: what they meet for: the gathers of one group do not mix.
        doing: what the others are waited for to do, for messages ("call
            create_offloader with share_with").
        timeout_s: the longest it waits, in seconds.

    Returns:
        The meeting's number: this rank's calls for `topic` with `ranks` (1 the first time).

    Raises:
        ExecutionError: not every rank came within `timeout_s`, or this one came after
            another stopped waiting (``value`` the ranks that did not come, ``name``
            "share_with"); `rank` is not one of `ranks` (``name`` "rank"); the store
            failed (``name`` "store").
    """
    members = sorted(set(ranks))
    if rank not in members:
        raise ExecutionError(f"rank {rank} is not one of ranks {ranks_text(members)} it meets", name="rank",
                             value=rank)
    group = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:16]
    base = f"offload-arrive/{topic}/{group}/"
    start = time.monotonic()
    late = ", before this rank came"
    try:
        number = store.add(f"{base}calls/{rank}", 1)
        meeting = f"{base}{number}/"
        store.set(f"{meeting}here/{rank}", "1")
        count = store.add(f"{meeting}count", 1)
        if count == len(members):
            store.set(f"{meeting}done", "1")  # the last to come: everyone goes on
            return number
        if count < len(members):
            late = ""
            try:
                store.wait([f"{meeting}done"], datetime.timedelta(seconds=timeout_s))
            except Exception:  # timed out (a store that is gone fails again below)
                missing = _give_up(store, meeting, members)
                if missing is not None:
                    who = f"rank{'s' if len(missing) != 1 else ''} {ranks_text(missing)}"
                    raise ExecutionError(
                        f"rank {rank} waited {time.monotonic() - start:.1f} s (timeout {timeout_s:g} s) for {who} "
                        f"to {doing}; nothing was gathered. Every member must call it, as often as the others (one "
                        "that failed before it, or is not started, makes the others raise here)",
                        name="share_with", value=tuple(missing)) from None
            if int(store.get(f"{meeting}count")) == len(members):
                return number
        # Another member gave up, before this one came or while it waited.
        store.wait([f"{meeting}done"], datetime.timedelta(seconds=timeout_s))  # set right after giving up
        missing = _missing(store, meeting)
    except ExecutionError:
        raise
    except Exception as exc:  # the store raises plain RuntimeErrors
        raise ExecutionError(f"rank {rank} could not meet ranks {ranks_text(members)} through the torch.distributed "
                             f"store to {doing}: {exc}", name="store", value=topic) from exc
    who = f"rank{'s' if len(missing) != 1 else ''} {ranks_text(missing)}"
    raise ExecutionError(f"rank {rank} stops: another member stopped waiting for {who} to {doing} (its "
                         f"ShareWith.timeout_s ran out{late}); nothing was gathered", name="share_with",
                         value=tuple(missing))


def _give_up(store: Store, meeting: str, members: Sequence[int]) -> list[int] | None:
    """Close `meeting` unless every member came meanwhile or another closed it first: the
    ranks that had not come when this member closed it, or None when it did not."""
    key = f"{meeting}count"
    while True:
        current = int(store.get(key))
        if current >= len(members):
            return None  # everyone came, or another gave up first
        after = int(store.compare_set(key, str(current), str(current + _GAVE_UP)))
        if after == current + _GAVE_UP:
            missing = [r for r in members if not store.check([f"{meeting}here/{r}"])]
            store.set(f"{meeting}missing", json.dumps(missing))
            store.set(f"{meeting}done", "1")  # the others stop waiting now
            return missing
        # someone came (or gave up) between the read and the swap: look again


def _missing(store: Store, meeting: str) -> list[int]:
    """The ranks that had not come when `meeting` was given up."""
    value = json.loads(store.get(f"{meeting}missing"))
    return [int(r) for r in value] if isinstance(value, list) else []
