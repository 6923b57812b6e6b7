"""`SharedOffloader`: an executor whose host copies lie in one segment per host, shared by
the members of a torch.distributed group that hold identical weights.

``create_offloader(plan, share_with=group)`` builds it (`offload.sharing.join`: the members
meet, mismatched weights are refused, and the job's host memory is judged). Then, per host,
through the store:

``wrap_modules``
    leader: create the segment (sparse), publish its name, wait until every follower
    has mapped it, unlink the name, reserve its pages, write every offloaded weight into
    it (the executor's own moves, with the `SharedHostSource`), say it is written.
    follower: map it read-only, wait until it is written, compare a sample of each of
    its weights that has data with its slot and tell the group (its verdict), then move:
    offloaded weights point at the read-only slots, or at private memory for weights
    still on meta (a loader fills those).
``post_init``
    leader: the executor's post_init (post-processed weights rewritten into their
    slots), then say the copy is final. follower: wait for that, compare the weights its
    loader filled likewise and tell the group, point them at their slots (the private
    memory is released by the executor's re-read), then the executor's post_init.
``restore``
    every member: the executor's restore, then weights that would come back as tensors
    over the segment get private copies, and the segment is let go. Its memory returns
    when the last process restores or exits.

Other values of the same shapes (tensor-parallel ranks put in one group) stop the whole
group: ``wrap_modules`` and ``post_init`` return on no member, on any host, before every
follower that compares (`SharingPlan.verifiers`, `ShareWith.verify`) has told what it
found (`Verdicts`), and where one differs every member raises at that call, naming the
ranks and the first weight: a follower moves nothing before the verdicts are in, the
leader (and a member alone on its host) puts back what its executor moved at a refused
wrap, and a refused post_init leaves the weights in host memory (``restore()`` works).

A member that fails tells the others in the key they wait on, so they raise at once (a
follower's failure takes the place of its verdict); one that dies makes them raise
`ExecutionError` when `ShareWith.timeout_s` runs out; nothing ever waits longer. A
follower's model is untouched until the leader's copy is complete and every verdict in.
"""


from __future__ import annotations

import time
from collections.abc import Sequence
from typing import final

import attrs
import torch
from torch import nn

from offload.errors import ExecutionError
from offload.executors.placement.unpack import has_wrappers
from offload.executors.reload import Weights
from offload.logs import logger
from offload.pure.check import LiveCheck
from offload.pure.sharing.admission import refusal_text
from offload.pure.sharing.memory import HostMemory
from offload.pure.stats import OffloadStats
from offload.runtime.copies import span_chunks
from offload.sharing.wrapping import SharedWrap

__all__ = ["SharedOffloader"]

log = logger("offload.sharing")


def _private_copy(data: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own with `data`'s shape, strides, dtype and bits."""
    out = torch.empty_strided(tuple(data.shape), tuple(data.stride()), dtype=data.dtype, device="cpu")
    for dst, src in span_chunks(out, data):
        dst.copy_(src)
    return out



def _job_refusal(host: HostMemory) -> ExecutionError:
    """What every process of the job raises when `host` does not fit (named like `admit`'s)."""
    binding = host.binding
    name = binding.check.limit.value if binding is not None else "host_check"
    value = (binding.check.needed_bytes, binding.check.allowed_bytes) if binding is not None else None
    return ExecutionError(refusal_text(host), name=name, value=value)



@final
class SharedOffloader(SharedWrap):
    """An `Offloader` whose host copies are shared with the other members on its host.
    Create it with ``create_offloader(plan, share_with=group)``.

    Args:
        inner: the executor (its host copies come from `source`).
        sharing: what was decided (`SharingPlan`).
        layout: the segment's slots.
        source: this member's view of the segment; None when not shared.
        channel: this host's keys in the store; None when not shared.
        shm_dir: where the segment is made.
        numa_node: the NUMA node the leader places the segment's pages on; None: none.
        refused: the job's host whose memory does not fit and is refused
            (`JobMemory.refused`): `wrap_modules` raises, on every process of the job.
        verdicts: the group's followers' verdicts on their values, which every member
            waits for at `wrap_modules` and `post_init`; None when no follower compares.
        runtime: the executor's runtime (a follower waits for its device before the
            leader writes new weights, `load_weights`); None: it cannot wait.
    """

    # ---- lifecycle ------------------------------------------------------------------

    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """The executor's `wrap_modules`, with the host's one copy: the leader writes it,
        followers map it read-only (see the module docstring). It returns once every
        follower of the group that compares (`SharingPlan.verifiers`) found its values
        equal to its host's copy.

        Raises:
            ExecutionError: the host memory of the job's processes on some host does not
                fit and a process there refuses that (``host_check="refuse"``): raised on
                every process of the job, before anything moved, with the limit, the
                numbers and the ranks (``name`` the limit, ``value`` (bytes needed, bytes
                allowed)); some follower of the group, on any host, holds other values
                than its host's copy, or failed before it could compare: raised on every
                member of the group, naming those ranks (``value``) and the first weight
                that differs; another member failed or did not answer in time, or the
                segment could not be made or mapped. The model is left as it was (a
                follower moved nothing; the leader and a member alone on its host put
                back what the executor moved). Otherwise as the executor.
            PlanError: from the executor.
        """
        if self._refused is not None and not self._done:
            raise _job_refusal(self._refused)
        if has_wrappers(layers):  # every member holds the same model: each refuses alone, nothing shared yet
            raise ExecutionError("a sharing group cannot offload quantised weights (tensor subclasses unpacked into "
                                 "their inner tensors) yet: offload them without share_with, one host copy per process",
                                 name="share_with", value="quantised")
        source, channel = self._source, self._channel
        if self._done or ((source is None or channel is None) and self._verdicts is None):
            out = self._inner.wrap_modules(layers)  # nothing to share, or the executor refuses a second wrap
        else:
            # Keys per attempt: members that retry a failed wrap together meet afresh.
            prefix = f"wrap{self._attempts}/"
            self._attempts += 1
            if source is None or channel is None:  # alone on its host: hears the others' verdicts
                out = self._inner.wrap_modules(layers)
                self._layers = list(out)
                self._hear(f"{prefix}checked", "wrap_modules", undo=True)
            elif source.leader:
                out = self._lead_wrap(layers, source, channel, prefix)
            else:
                out = self._follow_wrap(layers, source, channel, prefix)
            self._prefix = prefix
        self._layers = list(out)
        self._wrapped = self._done = True
        return out

    def post_init(self) -> None:
        """The executor's `post_init`, with the copy final on every member: the leader
        says when it is; followers then point the weights their loader filled at it. It
        returns once every follower of the group that compares found its values equal.

        Raises:
            ExecutionError: the leader's post_init failed or did not end in time
                (weights left in host memory, as a failed post_init leaves them); some
                follower of the group, on any host, holds other values than its host's
                copy, or failed before it could compare: raised on every member of the
                group, naming those ranks (``value``) and the first weight that differs
                (weights left in host memory: a follower pointed none at the copy, and
                ``restore()`` gives every member its weights back). Otherwise as the
                executor.
        """
        source, channel = self._source, self._channel
        mapped = source is not None and channel is not None and source.mapping is not None
        if not self._wrapped or (not mapped and self._verdicts is None):
            self._inner.post_init()
            return
        key = f"{self._prefix}post_init/{self._post_inits}"
        self._post_inits += 1
        if source is None or channel is None or source.mapping is None:  # alone on its host
            self._inner.post_init()
            self._hear(key, "post_init", undo=False)
            return
        if source.leader:
            try:
                self._inner.post_init()
            except BaseException as exc:
                channel.fail(key, exc)
                raise
            source.loaded()
            channel.put(key, {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
            self._hear(key, "post_init", undo=False)
            return
        try:
            leader = self._sharing.leader
            start = time.monotonic()
            final = channel.wait([key], [leader], "finish post_init")[0]
            if not final.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed post_init: "
                                     f"{final.get('error')}; weights left in host memory on rank {self._sharing.rank}",
                                     name="share_with", value=leader)
            self._times = attrs.evolve(self._times, wait_s=self._times.wait_s + time.monotonic() - start)
            source.allow_except((int(r[0]), str(r[1])) for r in final.get("unwritten", ()))
            self._point_at_slots(source, key)
            self._inner.post_init()
        except BaseException as exc:
            self._tell_failure(key, exc)
            raise

    def load_weights(self, weights: Weights, *, prefix: str = "", skip_read_only: bool = False) -> None:
        """New weights for every member, without restoring (the executor's `load_weights`,
        coordinated on each host): every member of the group calls it, with the same
        weights (an engine's reload runs on every rank).

        The leader waits until every follower on its host has stopped reading the shared
        copy (their copies and kernels finished), writes the new weights into it and its
        own resident weights, refills its buffers, and says so; each follower then writes
        what is its own (resident weights, buffers, host copies not shared) and refills
        its buffers from the new shared copy. Without sharing it is the executor's.

        Args:
            weights: as the executor's: a mapping or (name, tensor) pairs.
            prefix: what every name starts with, stripped.
            skip_read_only: as the executor's (the followers here always skip the shared
                copies: their leader writes them).

        Raises:
            ExecutionError: as the executor's (on the leader, a bad name or shape is
                raised on every follower of its host too), or another member failed or
                did not answer within `ShareWith.timeout_s`.
        """
        source, channel = self._source, self._channel
        if source is None or channel is None or source.mapping is None:
            self._inner.load_weights(weights, prefix=prefix, skip_read_only=skip_read_only)
            return
        key = f"{self._prefix}load_weights/{self._reloads}/"
        self._reloads += 1
        if source.leader:
            followers = self._sharing.local.ranks[1:]
            try:
                replies = channel.wait([f"{key}quiet/{r}" for r in followers], followers,
                                       "stop reading the shared host copy (call load_weights)")
                failed = [r for r, v in zip(followers, replies, strict=True) if not v.get("ok")]
                if failed:
                    raise ExecutionError(f"rank {failed[0]} could not stop reading the shared host copy: "
                                         f"{replies[followers.index(failed[0])].get('error')}; nothing was written",
                                         name="share_with", value=tuple(failed))
                with source.writing():
                    self._inner.load_weights(weights, prefix=prefix)
            except BaseException as exc:
                channel.fail(f"{key}written", exc)
                raise
            channel.put(f"{key}written", {"ok": True})
            return
        leader, me = self._sharing.leader, self._sharing.rank
        try:
            if self._rt is not None:
                # Nothing of ours may read the shared copy while the leader writes it: the
                # device's work (copies, UVA kernels reading it in place) is all done.
                self._rt.synchronize()
        except BaseException as exc:
            channel.fail(f"{key}quiet/{me}", exc)
            raise
        channel.put(f"{key}quiet/{me}", {"ok": True})
        try:
            # Two of the leader's steps: waiting for every follower, then writing.
            done = channel.wait([f"{key}written"], [leader], "write the new weights into the shared host copy",
                                steps=2)[0]
            if not done.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed load_weights: {done.get('error')}",
                                     name="share_with", value=leader)
        except ExecutionError as exc:
            # The copy may hold some of the new weights: the buffers follow what it holds.
            self._refill_after(exc, prefix)
            raise ExecutionError(f"{exc}; rank {me} wrote nothing of its own and refilled its buffers from the shared "
                                 "copy, which may hold some of the new weights: call load_weights again on every member",
                                 name=exc.name, value=exc.value) from exc
        self._inner.load_weights(weights, prefix=prefix, skip_read_only=True)

    def _refill_after(self, failure: BaseException, prefix: str) -> None:
        """Follower: make the executor's buffers follow the shared copy after the leader's
        load_weights failed (an empty load: wait for the device, refill); never raises."""
        try:
            self._inner.load_weights({}, prefix=prefix, skip_read_only=True)
        except Exception:
            log.warning("rank %d: refilling the buffers after %s failed too", self._sharing.rank, failure,
                        exc_info=True)

    def sync_prev_onload(self) -> None:
        """The executor's."""
        self._inner.sync_prev_onload()

    def join_after_forward(self) -> None:
        """The executor's."""
        self._inner.join_after_forward()

    def restore(self) -> None:
        """The executor's `restore`; then every weight that would be a tensor over the
        segment gets a private copy (bit for bit, ties kept), and the segment is let go.

        Raises:
            ExecutionError: as the executor (call restore() again to finish).
        """
        self._inner.restore()
        source = self._source
        if source is None or source.mapping is None:
            return
        copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
        for layer in self._layers:
            for _, param in layer.named_parameters(remove_duplicate=False):
                data = param.data
                if not source.owns(data):
                    continue
                key = (data.data_ptr(), tuple(data.shape), tuple(data.stride()), data.dtype)
                private = copies.get(key)
                if private is None:
                    private = copies[key] = _private_copy(data)
                param.data = private
        source.close()
        self._wrapped = False
        log.info("rank %d restored its weights from the shared host copy (%d private copies)", self._sharing.rank,
                 len(copies))

    def check(self) -> LiveCheck:
        """The executor's."""
        return self._inner.check()

    def stats(self) -> OffloadStats:
        """The executor's (its ``host_bytes`` counts the segment's slots this process holds)."""
        return self._inner.stats()

    def __repr__(self) -> str:
        return f"SharedOffloader({self._sharing.role}, rank {self._sharing.rank}, {type(self._inner).__name__})"
