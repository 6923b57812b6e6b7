"""Process coordination for sharing host copies: torch.distributed, and nothing else.

- `ShareWith`: what the caller passes to ``create_offloader(..., share_with=...)``.
- `Membership`: this process's rank, the ranks of its sharing group and of its job, a
  way to gather one object from every member (a collective, at ``create_offloader``)
  and the store; `membership_of` builds the real one from a process group, tests build
  fakes (threads over one ``HashStore``).
- the barrier before every gather is `offload.sharing.arrival.arrive`.
- `Channel`: the per-host steps after that, as keys in the store. Every wait has a
  timeout (`ShareWith.timeout_s`) and ends in an `ExecutionError` naming the ranks not
  heard from, so a member that failed or died makes the others raise, never hang. A
  member that fails says so in the key the others wait on, so they raise at once.
- what the followers found comparing their values is `offload.sharing.verdicts.Verdicts`.
- `host_identity`: hostname, boot id and the shared-memory file system this process sees.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, final

import attrs
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from offload.capture.host import read_boot_id
from offload.errors import ConfigError, ExecutionError
from offload.logs import logger
from offload.pure.units import ranks_text
from offload.sharing.segment import SHM_DIR, shm_identity

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Channel",
    "Gather",
    "Membership",
    "ShareWith",
    "host_identity",
    "membership_of",
]

log = logger("offload.sharing")

#: Seconds one member waits for another at one step by default. The longest step is a
#: follower waiting for the leader to write every offloaded weight (at device-to-host
#: speed, a few GB/s) or to finish post_init after loading; 10 minutes covers a few
#: hundred GB. Pass `ShareWith(timeout_s=...)` for anything else.
DEFAULT_TIMEOUT_S = 600.0

#: Gathers one picklable object from every member, in rank order (every member calls it).
Gather = Callable[[object], list[Any]]


@attrs.frozen(kw_only=True)
class ShareWith:
    """How to share host copies: with whom, and how long to wait for them.

    Attributes:
        group: the torch.distributed group whose members hold identical offloaded
            weights (data-parallel replicas; never tensor-parallel ranks, which hold
            different shards); None for the default group. Its members on one host map
            one copy; each host has its own.
        timeout_s: the longest one member waits for another at one step, in seconds,
            the gathers of ``create_offloader`` included (a member that never calls it
            is named by the others when it runs out). A follower waits up to twice that
            for the leader's copy (the leader's wait for every follower to map it, then
            its writing), and every member as long for the followers' verdicts.
        verify: followers compare a sample of each of their weights with the shared
            copy and tell every member of the group what they found: one that differs
            stops the whole group at that call (`Verdicts`). Turn off only when
            followers do not load the weights themselves (the leader's suffice); a
            follower that does not compare tells nothing, and nobody waits for it.
        shm_dir: where segments are made (POSIX shared memory).
        job: the group of every process of the job whose host memory adds up on its
            host (tensor-parallel ranks, which share with different groups, included);
            None for the default group. Each of its processes calls ``create_offloader``
            with ``share_with`` (its own sharing group; a process that keeps a private copy
            passes a group of its own), and the host admission check sums what all of them
            on one host take (`offload.pure.sharing.admission`).
    """

    group: dist.ProcessGroup | None = None
    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S)
    verify: bool = True
    shm_dir: str = SHM_DIR
    job: dist.ProcessGroup | None = None

    @timeout_s.validator
    def _positive(self, attribute: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {value!r}",
                              name="timeout_s", value=value)


def _ranks(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(value)))


def _job_ranks(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else _ranks(value)


@attrs.frozen(kw_only=True)
class Membership:
    """This process in its sharing group.

    Attributes:
        rank: its global rank (what the store's keys and every message use).
        ranks: the global ranks of the sharing group (`gather`'s members, `rank`
            among them), ascending: who `arrive` waits for before each gather.
        gather: one object from every member (a collective over the group).
        store: the key-value store every member reaches (torch.distributed's default).
        host: (hostname, boot id, shared-memory file system id) to report; None: this
            process's own (`host_identity`). Tests give members other hosts.
        job_gather: one object from every process of the job (a collective over
            `ShareWith.job`), for the host admission check; None: the sharing group is
            the whole job (`gather`).
        job_ranks: the global ranks of the job (`job_gather`'s members), ascending;
            None: `ranks` (the sharing group is the whole job).

    Raises:
        ConfigError: `rank` is not among `ranks` or `job_ranks`.
    """

    rank: int
    ranks: tuple[int, ...] = attrs.field(converter=_ranks)
    gather: Gather
    store: Store
    host: tuple[str, str, str] | None = None
    job_gather: Gather | None = None
    job_ranks: tuple[int, ...] | None = attrs.field(default=None, converter=_job_ranks)

    def __attrs_post_init__(self) -> None:
        for what, ranks in (("ranks", self.ranks), ("job_ranks", self.job_ranks)):
            if ranks is not None and self.rank not in ranks:
                raise ConfigError(f"rank {self.rank} is not among the {what} of its membership ({ranks_text(ranks)})",
                                  name=what, value=self.rank)

    @property
    def job(self) -> tuple[int, ...]:
        """The global ranks of the job, ascending (`job_ranks`, else `ranks`)."""
        return self.job_ranks if self.job_ranks is not None else self.ranks


def _gather_over(group: dist.ProcessGroup | None) -> Gather:
    size = dist.get_world_size(group)

    def gather(obj: object) -> list[Any]:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def membership_of(group: dist.ProcessGroup | None, job: dist.ProcessGroup | None = None) -> Membership:
    """The real membership: ``all_gather_object`` over `group` (and over `job` for the
    host admission check; None: the default group), the ranks of both and the default
    store.

    Raises:
        ExecutionError: torch.distributed is not available or not initialised, or this
            process is not in `group` or in `job`.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ExecutionError("share_with needs torch.distributed initialised (init_process_group) in every member",
                             name="share_with", value=None)
    for what, members in (("share_with group", group), ("job group (ShareWith.job)", job)):
        if members is not None and dist.get_rank(members) < 0:
            raise ExecutionError(f"rank {dist.get_rank()} is not in the {what}", name="share_with",
                                 value=dist.get_rank())
    from torch.distributed.distributed_c10d import _get_default_store

    return Membership(rank=dist.get_rank(), ranks=dist.get_process_group_ranks(group), gather=_gather_over(group),
                      store=_get_default_store(), job_gather=_gather_over(job),
                      job_ranks=dist.get_process_group_ranks(job))  # None: the default group's


def host_identity(shm_dir: str = SHM_DIR) -> tuple[str, str, str]:
    """(hostname, boot id, shared-memory file system id) of this process: members with
    all three equal can map one segment."""
    return socket.gethostname(), read_boot_id(), shm_identity(shm_dir)


@final
class Channel:
    """One host's members of one sharing session, talking through store keys.

    Values are JSON objects; ``{"ok": false, "error": ...}`` says the writer failed.

    Args:
        store: the store every member reaches.
        prefix: this session and host's key prefix.
        rank: this process's global rank.
        timeout_s: the longest any `wait` blocks.
    """

    def __init__(self, store: Store, prefix: str, rank: int, timeout_s: float) -> None:
        self._store = PrefixStore(prefix, store)
        self._rank = rank
        self.timeout_s = timeout_s

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Set `key` to `value` (best effort for failure reports: those never raise).

        Raises:
            ExecutionError: the store failed (for a value that says ok).
        """
        try:
            self._store.set(key, json.dumps(value))
        except Exception as exc:  # the store raises plain RuntimeErrors
            if not value.get("ok", True):
                log.warning("could not tell the other members that rank %d failed: %s", self._rank, exc)
                return
            raise ExecutionError(f"rank {self._rank} could not write {key!r} to the torch.distributed store: {exc}",
                                 name="store", value=key) from exc

    def fail(self, key: str, error: BaseException | str) -> None:
        """Tell the members waiting on `key` that this rank failed (never raises)."""
        self.put(key, {"ok": False, "rank": self._rank, "error": str(error)})

    def wait(self, keys: Sequence[str], ranks: Sequence[int], what: str, *, steps: int = 1) -> list[dict[str, Any]]:
        """The values of `keys` (one per rank of `ranks`, for messages), waiting up to
        `steps` timeouts for all of them (a wait that spans that many of the other
        member's steps, each of which may take a timeout of its own).

        Returns:
            The values, in order; any may say ``ok: false``.

        Raises:
            ExecutionError: not every key was set in time (naming the ranks not heard
                from and `what` they did not do), or the store failed.
        """
        if not keys:
            return []
        start = time.monotonic()
        timeout = self.timeout_s * steps
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=timeout))
        except Exception as exc:  # timeouts, lost connections: RuntimeErrors
            missing = [r for k, r in zip(keys, ranks, strict=True) if not self._check(k)]
            waited = time.monotonic() - start
            who = f"rank{'s' if len(missing) != 1 else ''} {ranks_text(missing or list(ranks))}"
            raise ExecutionError(
                f"rank {self._rank} waited {waited:.1f} s (timeout {timeout:g} s) for {who} to {what}: "
                f"{exc}; the member may have failed or died", name="share_with", value=tuple(missing)) from exc
        try:
            values = [json.loads(self._store.get(k)) for k in keys]
        except Exception as exc:
            raise ExecutionError(f"rank {self._rank} could not read {list(keys)} from the store: {exc}",
                                 name="store", value=tuple(keys)) from exc
        return [v if isinstance(v, dict) else {"ok": False, "error": f"unreadable value {v!r}"} for v in values]

    def _check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:  # the store may be gone with its host
            return False
