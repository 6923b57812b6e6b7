"""`DiskHost`: the host copies of the disk tier's parameters, which lie in files.

A disk parameter (`offload.pure.disk.tier`) has no copy in host memory: the hot path reads
it from its file into a staging buffer each pass (`offload.executors.staging`). What the
cold paths read (restore, ``state_dict``, the live check, conversions) is its host copy in
the `HostStore` as for any other offloaded weight; for a disk parameter that copy is a
view over a private mapping of its file (`offload.runtime.spill.FileMap`): reading it
reads the file, it takes no host memory until read, and this process never writes the
file through it. Each file is mapped in few mappings (a checkpoint file whole, the spill
file in segments), each copy a view with a storage of its own, and each file is open
once here (a checkpoint file until post_init, the spill file's two fds until `close`):
not an fd per tensor. So `DiskHost` is the store's `HostSource` for the disk parameters:

- a parameter planned from the checkpoint (`DiskSource.CHECKPOINT`) is mapped where it
  lies, once its data is found to be the checkpoint's, byte for byte (a parameter whose
  data differs, changed after loading or by post-processing, is written to the spill
  file instead, and logged: the checkpoint would give the layer other weights);
- any other one is written once to the spill file and mapped from there.

The copies are not written in place, and not counted as host memory (`HostStore.nbytes`).
New weights for a disk parameter (`load_weights`) are written to the spill file, and that
copy replaces the old one (`new_copy`, then `HostStore.put`, which asks `copy`): the disk
reads come from there from then on. Without a spill directory they are refused, naming
the weight. The checkpoint is never written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import final

import torch

from offload.errors import ExecutionError
from offload.executors.common import Ref
from offload.logs import logger
from offload.pure.disk.tier import DiskParam, DiskSource, DiskTierPlan
from offload.runtime.diskio import Source
from offload.runtime.spill import FileMap, SpillFile, read_exact

__all__ = ["DiskHost"]

log = logger("offload.disk")

#: Spilled bytes written back to disk (and dropped from the page cache) at least this often.
FLUSH_BYTES = 256 << 20


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host `tensor`'s bytes, as a flat ``uint8`` view."""
    return tensor.reshape(-1).view(torch.uint8)


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`raw` bytes seen with `like`'s dtype, shape and strides."""
    return raw.view(like.dtype).as_strided(like.shape, like.stride())


@final
class DiskHost:
    """The store's source for the disk parameters (see the module docstring).

    Args:
        tier: the disk tier.
        spill_dir: where the spill file goes; None: nowhere, and a parameter that must be
            spilled is refused (naming it).
        spill: makes the spill file (`SpillFile`; tests inject a failing one).

    Raises:
        ExecutionError: the tier spills parameters and no `spill_dir` is given.
    """

    def __init__(self, tier: DiskTierPlan, *, spill_dir: str | os.PathLike[str] | None,
                 spill: Callable[[str | os.PathLike[str]], SpillFile] = SpillFile) -> None:
        self._params: dict[Ref, DiskParam] = {(p.layer, p.name): p for p in tier.params}
        if tier.spill_bytes and spill_dir is None:
            first = next(p for p in tier.params if p.source is DiskSource.SPILL)
            raise ExecutionError(
                f"the disk tier spills {tier.spill_bytes} bytes (layer {first.layer} parameter {first.name!r}: "
                f"{first.reason}) and no spill_dir was given: pass a directory on a disk with room for them",
                name="spill_dir", value=tier.spill_bytes)
        self._spill_dir = spill_dir
        self._make_spill = spill
        self._spill: SpillFile | None = None
        self._unflushed = 0
        self._fds: dict[str, int] = {}  # checkpoint path -> fd open for reading and mapping
        self._maps: dict[str, tuple[FileMap, int]] = {}  # checkpoint path -> its mappings, the file's size
        self._sources: dict[Ref, tuple[Source, int]] = {}
        self._ours: set[int] = set()  # data pointers of the copies handed out
        self._spans: dict[Ref, tuple[torch.Tensor, int, int]] = {}  # ref -> its copy, where its bytes lie
        self._new: dict[int, tuple[Ref, torch.Tensor, tuple[Source, int]]] = {}  # data_ptr -> a copy `new_copy` made
        self.mapped_bytes = 0  # bytes mapped from the checkpoint
        self.spilled_bytes = 0  # bytes written to the spill file

    @property
    def sources(self) -> Mapping[Ref, tuple[Source, int]]:
        """Each disk parameter's file and the offset of its first byte (for `StagingRing`),
        once its copy is made."""
        return self._sources

    # ---- HostSource -------------------------------------------------------------------

    def claims(self, ref: Ref) -> bool:
        """Whether `ref` is a disk parameter."""
        return ref in self._params

    def copy(self, ref: Ref, tensor: torch.Tensor) -> torch.Tensor | None:
        """`ref`'s copy in its file (a disk parameter), else None.

        Raises:
            ExecutionError: the file cannot be opened or mapped, the spill write failed
                (ENOSPC), or `ref` must be spilled and no spill directory was given.
        """
        p = self._params.get(ref)
        if p is None:
            return None
        new = self._new.pop(tensor.data_ptr(), None) if tensor.numel() else None
        if new is not None:
            if new[0] == ref and new[1] is tensor:
                return self._keep(p, tensor, new[2])  # a copy `new_copy` made for it: taken as it is
            self._new[tensor.data_ptr()] = new
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        if p.source is DiskSource.CHECKPOINT and p.extent is not None:
            mapped = self._checkpoint_copy(p, data)
            if mapped is not None:
                return mapped
            reason = f"its data differs from the checkpoint's bytes at {p.extent.path}:{p.extent.offset}"
            log.info("layer %d parameter %r is spilled: %s", p.layer, p.name, reason)
        return self._spilled(p, data)

    def empty(self, ref: Ref, like: torch.Tensor) -> torch.Tensor | None:
        """A disk parameter on meta: its copy where it lies in the checkpoint (already
        holding its values: a loader must not write it); else None.

        Raises:
            ExecutionError: `ref` is spilled: it has no values anywhere to map.
        """
        p = self._params.get(ref)
        if p is None:
            return None
        if p.source is not DiskSource.CHECKPOINT or p.extent is None:
            raise ExecutionError(f"layer {p.layer} parameter {p.name!r} is on meta and goes to the spill file "
                                 f"({p.reason}): there are no values to write; load it first",
                                 name=p.name, value=p.layer)
        return self._keep(p, _typed(self._map(p.extent.path, p.extent.offset, p.nbytes), like),
                          (p.extent.path, p.extent.offset))

    def release(self, host: torch.Tensor) -> bool:
        """Take back a copy handed out here (its mapping goes with its last tensor)."""
        if host.numel() and host.data_ptr() in self._ours:
            self._ours.discard(host.data_ptr())
            return True
        return False

    def writable(self, host: torch.Tensor) -> bool:
        """A copy in a file is not (it would change what the cold paths read, not what
        the disk reads bring)."""
        return not (host.numel() and host.data_ptr() in self._ours)

    def read_only_reason(self, host: torch.Tensor) -> str:
        """A disk parameter's bytes are read from its file: new ones go to the spill file
        (`new_copy`), which needs a spill directory."""
        if self._spill_dir is not None:
            return "it is a disk-tier weight, read from its file at every step: give it new values with load_weights"
        return ("it is a disk-tier weight, read from its file at every step: its new values are written to the "
                "spill file, and no spill_dir was given (pass spill_dir= to offload_model, offload_pretrained or "
                "create_offloader)")

    # ---- new weights --------------------------------------------------------------------

    @property
    def takes_new_weights(self) -> bool:
        """Whether new values for a disk parameter can be written (a spill directory was given)."""
        return self._spill_dir is not None

    def new_copy(self, ref: Ref, values: torch.Tensor) -> torch.Tensor:
        """Disk parameter `ref`'s new `values` (a host tensor with its copy's dtype, shape
        and strides) written to the spill file (made now if the tier had none), as a copy
        over it that nothing uses yet: `HostStore.put` makes it `ref`'s copy (and
        `sources` then points at it), `drop_new` forgets it.

        Raises:
            ExecutionError: `ref` is not a disk parameter, no spill directory was given
                (naming `ref` and ``spill_dir``), or the write failed (a full disk:
                nothing of it is kept, the old copy and the spill file are as they were).
        """
        p = self._params.get(ref)
        if p is None:
            raise ExecutionError(f"layer {ref[0]} parameter {ref[1]!r} is not on the disk tier", name=ref[1],
                                 value=ref[0])
        if self._spill_dir is None:
            raise ExecutionError(f"layer {p.layer} parameter {p.name!r} cannot take new weights: "
                                 f"{self.read_only_reason(values)}", name=p.name, value=p.layer)
        if self._spill is None:
            self._spill = self._make_spill(self._spill_dir)
        spill = self._spill
        offset, length = spill.append(values)
        self.spilled_bytes += length
        self._unflushed += length
        host = _typed(spill.map(offset, length), values) if length else torch.empty_like(values)
        if host.numel():
            self._new[host.data_ptr()] = (ref, host, (spill.read_fd, offset))
        return host

    def drop_new(self, host: torch.Tensor) -> None:
        """Forget a copy `new_copy` made and nobody took (its bytes stay unused in the spill file)."""
        if host.numel():
            self._new.pop(host.data_ptr(), None)

    def flush(self) -> None:
        """The spill file's bytes written since the last flush written back, and out of the
        page cache.

        Raises:
            ExecutionError: the write-back failed (the spill file stays open).
        """
        self._flush()

    def counted(self, host: torch.Tensor) -> bool:
        """A copy in a file takes no host memory."""
        return not (host.numel() and host.data_ptr() in self._ours)

    # ---- lifecycle ----------------------------------------------------------------------

    def finish(self) -> None:
        """After the last copy of a wrap (at post_init): the spill file written back and
        out of the page cache, and the checkpoint files closed (their mappings stay; the
        reader opens its own fds; a later copy from a checkpoint opens it again).

        Raises:
            ExecutionError: the write-back failed (the spill file stays open).
        """
        self._flush()
        self._close_checkpoints()

    def _flush(self) -> None:
        """The spill file's bytes appended since the last flush written back."""
        if self._spill is not None and self._unflushed:
            self._spill.flush()
            self._unflushed = 0

    def _close_checkpoints(self) -> None:
        self._maps.clear()
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        """Close the files (the copies still mapped keep what they map). Idempotent; a
        later copy opens them afresh."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        self._close_checkpoints()
        self._sources.clear()
        self._spans.clear()
        self._new.clear()
        self._unflushed = 0

    # ---- helpers ------------------------------------------------------------------------

    def _checkpoint_copy(self, p: DiskParam, data: torch.Tensor) -> torch.Tensor | None:
        """`p`'s copy where it lies in the checkpoint, when `data` is its bytes there."""
        extent = p.extent
        if extent is None or not data.is_contiguous() or data.numel() * data.element_size() != p.nbytes:
            return None
        # Read into a buffer of its own, not through the mapping: the mapping's pages then
        # stay untouched (no host memory), and the page cache lets go of the range.
        same = torch.equal(_flat_bytes(data), self._read(extent.path, extent.offset, p.nbytes))
        if not same:
            return None
        self.mapped_bytes += p.nbytes
        return self._keep(p, _typed(self._map(extent.path, extent.offset, p.nbytes), data),
                          (extent.path, extent.offset))

    def _spilled(self, p: DiskParam, data: torch.Tensor) -> torch.Tensor:
        if self._spill_dir is None:
            raise ExecutionError(f"layer {p.layer} parameter {p.name!r} must go to the spill file (its data is not "
                                 "the checkpoint's) and no spill_dir was given", name=p.name, value=p.layer)
        if self._spill is None:
            self._spill = self._make_spill(self._spill_dir)
        spill = self._spill
        offset, length = spill.append(data)
        self.spilled_bytes += length
        self._unflushed += length
        host = _typed(spill.map(offset, length), data) if length else torch.empty_like(data)
        if self._unflushed >= FLUSH_BYTES:
            self._flush()
        return self._keep(p, host, (spill.read_fd, offset))

    def _keep(self, p: DiskParam, host: torch.Tensor, source: tuple[Source, int]) -> torch.Tensor:
        self._sources[(p.layer, p.name)] = source
        if host.numel():
            self._ours.add(host.data_ptr())
            self._spans[(p.layer, p.name)] = (host, host.data_ptr(), host.data_ptr() + p.nbytes)
        return host

    def spans(self) -> dict[Ref, tuple[torch.Tensor, int, int]]:
        """Each disk parameter's copy and the addresses its bytes take in its mapping."""
        return {ref: span for ref, span in self._spans.items() if span[1] in self._ours}

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ExecutionError(f"cannot open checkpoint file {path!r} for the disk tier: {exc}", name="path",
                                     value=path) from exc
            self._fds[path] = fd
        return fd

    def _read(self, path: str, offset: int, length: int) -> torch.Tensor:
        """`length` bytes of `path` from `offset`, read into a new host tensor (and let go
        of by the page cache).

        Raises:
            ExecutionError: the read failed or came up short.
        """
        out = torch.empty(length, dtype=torch.uint8)
        try:
            read_exact(self._fd(path), out, offset)
        except OSError as exc:
            raise ExecutionError(f"reading {length} bytes of checkpoint file {path!r} at offset {offset} failed: "
                                 f"{exc}", name="path", value=path) from exc
        return out

    def _map(self, path: str, offset: int, length: int) -> torch.Tensor:
        """`length` bytes of checkpoint file `path` from `offset`, as a view into the
        file's mapping (the whole file, mapped on first use)."""
        try:
            found = self._maps.get(path)
            if found is None:
                fd = self._fd(path)
                found = self._maps[path] = (FileMap(fd, path), os.fstat(fd).st_size)
            files, size = found
            return files.view(offset, length, covering=(0, size))
        except (ExecutionError, OSError) as exc:
            raise ExecutionError(f"{Path(path).name}: {exc}", name="path", value=path) from exc
