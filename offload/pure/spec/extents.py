"""Where a checkpoint's tensors lie on disk, and whether a parameter can be read from there
as it is: the values the disk tier plans with (issue: models larger than host memory).

A safetensors file is an 8-byte header length ``N``, ``N`` bytes of JSON, then the data:
tensor ``t`` lies at file offset ``8 + N + t.begin``, ``t.nbytes`` long (`extent_of`). A
parameter can be read from its checkpoint extent into its host staging buffer only when
those bytes are exactly what the model holds: the same dtype, the same shape, a
contiguous layout, no conversion at load (`unmappable`); the others go to a spill file
the offloader writes. What identifies a file (`FileIdentity`: size, modification time,
inode, device) is read by the shell and compared here as data: a file changed after
planning is refused, never read.

Pure: no file is opened here (`offload.model.checkpoint.checkpoint_extents` reads them).
"""

from __future__ import annotations

import attrs

from offload.errors import CheckpointError
from offload.pure._checks import int_at_least, non_empty_str
from offload.pure.spec.safetensors import TensorHeader
from offload.pure.spec.values import ParamSpec, contiguous_stride

__all__ = ["DiskExtent", "FileIdentity", "extent_of", "unmappable"]


@attrs.frozen(kw_only=True)
class FileIdentity:
    """What tells a file apart from a changed or replaced one, as ``os.stat`` gives it.

    Attributes:
        path: the file, as the plan names it.
        size: bytes.
        mtime_ns: last modification, in nanoseconds since the epoch.
        inode: the inode number (a file replaced by another of the same name has another).
        device: the device (filesystem) number holding it.
    """

    path: str = attrs.field(validator=non_empty_str(CheckpointError))
    size: int = attrs.field(validator=int_at_least(0, CheckpointError))
    mtime_ns: int = attrs.field(validator=int_at_least(0, CheckpointError))
    inode: int = attrs.field(validator=int_at_least(0, CheckpointError))
    device: int = attrs.field(validator=int_at_least(0, CheckpointError))

    def changes(self, now: FileIdentity) -> tuple[str, ...]:
        """The fields in which `now` (the file as it is) differs from this one (as
        planned): empty when it is the same file, unchanged."""
        return tuple(field for field in ("path", "size", "mtime_ns", "inode", "device")
                     if getattr(self, field) != getattr(now, field))


@attrs.frozen(kw_only=True)
class DiskExtent:
    """A tensor's bytes in a file.

    Attributes:
        path: the file.
        offset: its first byte, from the start of the file.
        length: its bytes.
    """

    path: str = attrs.field(validator=non_empty_str(CheckpointError))
    offset: int = attrs.field(validator=int_at_least(0, CheckpointError))
    length: int = attrs.field(validator=int_at_least(0, CheckpointError))

    @property
    def end(self) -> int:
        """One past its last byte."""
        return self.offset + self.length

    def aligned(self, block: int) -> tuple[int, int]:
        """(offset, length) of the smallest span of whole `block`-byte blocks that holds
        it: what an ``O_DIRECT`` read asks for (a safetensors tensor rarely starts on a
        block boundary).

        Raises:
            CheckpointError: `block` is not a positive power of two.
        """
        if block < 1 or block & (block - 1):
            raise CheckpointError(f"block size {block} is not a positive power of two", name="block", value=block)
        first = self.offset - self.offset % block
        stop = -(-self.end // block) * block
        return first, stop - first


def extent_of(tensor: TensorHeader, path: str, header_bytes: int) -> DiskExtent:
    """Where `tensor` lies in the safetensors file `path` whose JSON header is
    `header_bytes` long."""
    return DiskExtent(path=path, offset=8 + header_bytes + tensor.begin, length=tensor.nbytes)


def unmappable(param: ParamSpec, tensor: TensorHeader) -> str | None:
    """Why `param`'s bytes cannot be read as they lie in the checkpoint (`tensor`, the
    one its name loads from), or None when they can: the same dtype and shape, and a
    contiguous parameter, so that its bytes in the file are its bytes in memory.

    A reason is a short phrase for a plan's notes (``dtype bfloat16 in the checkpoint,
    float16 in the model``); such a parameter goes to a spill file instead.
    """
    if tensor.dtype != param.dtype:
        return f"dtype {tensor.dtype} in the checkpoint, {param.dtype} in the model"
    if tensor.shape != param.shape:
        return f"shape {list(tensor.shape)} in the checkpoint, {list(param.shape)} in the model"
    expected = contiguous_stride(param.shape)
    if any(size > 1 and step != want for size, step, want in zip(param.shape, param.stride, expected, strict=True)):
        return f"strides {list(param.stride)} in the model, not contiguous"
    return None
