"""How a member of a sharing group wraps its model: the leader creates the segment, waits
for every follower to map it, and writes every offloaded weight into it; a follower maps
it read-only, compares its values, and moves; at post_init a follower points the weights
its loader filled at their written slots (see `offload.sharing.offloader`)."""


from __future__ import annotations

import os
import time
from collections.abc import Sequence

from torch import nn

from offload.errors import ExecutionError
from offload.logs import logger
from offload.pure.units import format_bytes, ranks_text
from offload.sharing.coordinate import Channel
from offload.sharing.members import SharedMember, SharingTimes
from offload.sharing.segment import (
    SegmentMapping,
    check_room,
    create_segment,
    open_segment,
    reserve_segment,
    shm_free_bytes,
    unlink_segment,
)
from offload.sharing.source import SharedHostSource, slot_moves

__all__ = ["SharedWrap"]

log = logger("offload.sharing")


class SharedWrap(SharedMember):
    """The leader's wrap, the follower's, and the follower's slots at post_init."""

    def _lead_wrap(self, layers: Sequence[nn.Module], source: SharedHostSource, channel: Channel,
                   prefix: str) -> list[nn.Module]:
        followers = self._sharing.local.ranks[1:]
        total = self._layout.total_bytes
        start = time.monotonic()
        stage = f"{prefix}segment"  # the key the followers wait on now: a failure is reported there
        try:
            check_room(total, shm_free_bytes(self._shm_dir), self._shm_dir)
            mapping, fd = create_segment(total, self._shm_dir)
            try:
                channel.put(f"{prefix}segment", {"ok": True, "name": mapping.name, "bytes": total})
                stage = f"{prefix}wrapped"
                mapped_at = time.monotonic()
                try:
                    replies = channel.wait([f"{prefix}mapped/{r}" for r in followers], followers,
                                           "map the shared host copy")
                finally:
                    # Every member has mapped it, or never will: from here on a crash leaves nothing.
                    unlink_segment(mapping.name, self._shm_dir)
                waited = time.monotonic() - mapped_at
                failed = [(r, v) for r, v in zip(followers, replies, strict=True) if not v.get("ok")]
                if failed:
                    rank, reply = failed[0]
                    raise ExecutionError(f"rank {rank} could not map the shared host copy: {reply.get('error')}",
                                         name="share_with", value=tuple(r for r, _ in failed))
                self._place_numa(mapping)
                reserve_segment(fd, total, self._shm_dir)
            finally:
                os.close(fd)
            source.attach(mapping)
            written_at = time.monotonic()
            out = self._inner.wrap_modules(layers)
            write_s = time.monotonic() - written_at
        except BaseException as exc:
            channel.fail(stage, exc)
            source.close()
            raise
        self._layers = list(out)  # what restore() puts back, should the wrap be undone
        try:
            channel.put(f"{prefix}wrapped", {"ok": True, "unwritten": [list(r) for r in source.unwritten()]})
        except BaseException:
            self.restore()  # the followers cannot be told: leave the model as it was
            raise
        publish_s = time.monotonic() - start
        heard = self._hear(f"{prefix}checked", "wrap_modules", undo=True)  # the followers' verdicts
        self._times = SharingTimes(map_s=publish_s - waited - write_s, wait_s=waited + heard, write_s=write_s,
                                   publish_s=publish_s)
        log.info("shared host copy %s: %s written for ranks %s in %.2f s (%.2f s waiting for them to map it)",
                 mapping.name, format_bytes(total), ranks_text(self._sharing.local.ranks), publish_s, waited)
        return out

    def _place_numa(self, mapping: SegmentMapping) -> None:
        """Prefer the plan's NUMA node for the segment's pages, before they exist."""
        if self._numa_node is None:
            return
        from offload.runtime.numa import HostPlacer

        HostPlacer(self._numa_node).place(mapping.base, mapping.nbytes)

    def _follow_wrap(self, layers: Sequence[nn.Module], source: SharedHostSource, channel: Channel,
                     prefix: str) -> list[nn.Module]:
        leader, me = self._sharing.leader, self._sharing.rank
        call = f"{prefix}checked"
        start = time.monotonic()
        try:
            segment = channel.wait([f"{prefix}segment"], [leader], "create the shared host copy")[0]
            if not segment.get("ok"):
                raise ExecutionError(f"rank {leader}, the leader on this host, failed before publishing the shared "
                                     f"host copy: {segment.get('error')}; nothing was moved on rank {me}",
                                     name="share_with", value=leader)
            opened = time.monotonic()
            try:
                mapping = open_segment(str(segment["name"]), int(segment["bytes"]), self._shm_dir)
            except BaseException as exc:
                channel.fail(f"{prefix}mapped/{me}", exc)
                raise
            map_s = time.monotonic() - opened
            try:
                channel.put(f"{prefix}mapped/{me}", {"ok": True})
                # Two of the leader's steps: waiting for every follower to map, then writing.
                done = channel.wait([f"{prefix}wrapped"], [leader], "write the shared host copy", steps=2)[0]
                if not done.get("ok"):
                    raise ExecutionError(f"rank {leader}, the leader on this host, failed writing the shared host "
                                         f"copy: {done.get('error')}; nothing was moved on rank {me}",
                                         name="share_with", value=leader)
                waited = time.monotonic() - start - map_s
                source.attach(mapping)
                source.allow_except((int(r[0]), str(r[1])) for r in done.get("unwritten", ()))
                # Compared before the executor moves anything: a refusal leaves the model as it was.
                _, differ = slot_moves(self._inner.plan, layers, self._layout, source)
                waited += self._judge(call, "wrap_modules", differ)
                moved_at = time.monotonic()
                out = self._inner.wrap_modules(layers)
            except BaseException:
                source.close()
                raise
        except BaseException as exc:
            self._tell_failure(call, exc)
            raise
        self._times = SharingTimes(map_s=map_s, wait_s=waited, write_s=time.monotonic() - moved_at)
        log.info("rank %d maps the shared host copy %s (%s) written by rank %d", me, mapping.name,
                 format_bytes(mapping.nbytes), leader)
        return out

    def _point_at_slots(self, source: SharedHostSource, call: str) -> None:
        """Follower: point every offloaded weight that is not in the segment yet (its
        loader filled private memory, or replaced it) at its written slot, once every
        follower of the group has found its values equal (`_judge`); the executor's
        post_init then releases the private copies."""
        moves, differ = slot_moves(self._inner.plan, self._layers, self._layout, source)
        self._judge(call, "post_init", differ)
        for params, view in moves:
            for param in params:
                param.data = view
        if moves:
            log.info("rank %d: %d weights its loader wrote now point at the shared host copy", self._sharing.rank,
                     len(moves))
