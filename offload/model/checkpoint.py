"""Read a model's shapes from the headers of its safetensors files, never its weights.

For each file this reads the 8-byte header length and the JSON header, nothing more: a
70B checkpoint is planned in milliseconds without touching its 140 GB of data. The header
is read without readahead and its pages are dropped after, so that reading the headers
leaves nothing of the checkpoint in the page cache. The
parsing, the index checks and the grouping into layers are pure
(`offload.pure.spec.safetensors`); this module only finds the files and reads their first
bytes.

Which files: a directory's ``*.safetensors`` files, or, when the directory holds an index
(``*.safetensors.index.json``, e.g. ``model.safetensors.index.json``), exactly the shards
its ``weight_map`` names, each checked to hold exactly the tensors the index maps to it.
``.safetensors`` files the index does not name (leftovers, or Mistral's
``consolidated.safetensors`` beside its sharded copy) are not read, and a warning names
them: that is what loaders do, and an error would refuse real repositories. Every
``.safetensors`` entry that is not a regular file (a dangling symlink, a symlink loop, a
FIFO) is an error naming it, indexed or not, because it is the trace of a broken
download; a directory with such a name is not a shard and is skipped. File names are
shown as they are when printable, else as their ``repr``, so every message is one line.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
from collections.abc import Collection, Mapping, Sequence
from io import RawIOBase
from pathlib import Path
from typing import NoReturn

import attrs

from offload.errors import CheckpointError
from offload.logs import logger
from offload.pure.spec.extents import DiskExtent, FileIdentity, extent_of
from offload.pure.spec.safetensors import (
    SHARD_SUFFIX,
    TensorHeader,
    check_index,
    parse_safetensors_header,
    parse_safetensors_index,
    printable,
)
from offload.pure.spec.stacks import CheckpointSpec, spec_from_tensors
from offload.pure.spec.values import ModelSpec

__all__ = [
    "INDEX_SUFFIX",
    "MAX_HEADER_BYTES",
    "CheckpointExtents",
    "changed_files",
    "checkpoint_extents",
    "checkpoint_files",
    "file_identity",
    "read_checkpoint",
    "read_safetensors_header",
    "spec_from_checkpoint",
]

#: The largest header (and index) we read, in bytes (100 MiB, the limit the safetensors
#: library enforces too); a larger length field means a corrupt or foreign file.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: The name ending of a sharded checkpoint's index.
INDEX_SUFFIX = ".safetensors.index.json"

_SUFFIX = SHARD_SUFFIX
_LENGTH = struct.Struct("<Q")

log = logger("offload.load")

#: (the shards to read, the index path and its weight map when there is one)
_Layout = tuple[tuple[Path, ...], Path | None, Mapping[str, str] | None]


def _shown(path: Path | str) -> str:
    return printable(str(path))


def _fail(message: str, path: Path, value: object = None) -> NoReturn:
    raise CheckpointError(message, name=str(path), value=value)


def _os_error(path: Path, error: OSError) -> NoReturn:
    reason = error.strerror or type(error).__name__
    raise CheckpointError(f"{_shown(path)}: cannot read: {reason}", name=str(path), value=error.errno) from error


def _check_regular(path: Path) -> None:
    """Refuse `path` unless it is a regular file, or symlinks that end at one."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            _fail(f"{_shown(path)}: symlink loop", path)
        if error.errno == errno.ENOENT and path.is_symlink():
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            _fail(f"{_shown(path)}: dangling symlink to {_shown(target)}", path, target)
        _os_error(path, error)
    if not stat.S_ISREG(mode):
        _fail(f"{_shown(path)}: not a regular file", path, stat.S_IFMT(mode))


def _shards_in(folder: Path) -> list[Path]:
    """The ``.safetensors`` entries of `folder` that are not directories, each checked."""
    shards = sorted(child for child in folder.iterdir() if child.name.endswith(_SUFFIX) and not child.is_dir())
    for shard in shards:
        _check_regular(shard)
    return shards


def _indexed(index: Path, present: list[Path]) -> _Layout:
    """The shards `index` names, checked to exist as regular files; warns of the others."""
    _check_regular(index)
    if index.stat().st_size > MAX_HEADER_BYTES:
        _fail(f"{_shown(index)}: index is larger than {MAX_HEADER_BYTES} bytes (not an index, or corrupt)", index)
    try:
        raw = index.read_bytes()
    except OSError as error:
        _os_error(index, error)
    weight_map = parse_safetensors_index(raw, source=_shown(index))
    folder = index.parent
    names = sorted(set(weight_map.values()))
    files: list[Path] = []
    for name in names:
        shard = folder / name
        if not os.path.lexists(shard):
            _fail(f"{_shown(index)}: names shard {printable(name)}, which is not in {_shown(folder)}", shard)
        _check_regular(shard)
        files.append(shard)
    unnamed = [path.name for path in present if path.name not in set(names)]
    if unnamed:
        log.warning("%s: %d .safetensors files the index does not name are not read: %s",
                       _shown(index), len(unnamed), ", ".join(printable(name) for name in unnamed))
    return tuple(files), index, weight_map


def _layout(path: str | os.PathLike[str]) -> _Layout:
    root = Path(path)
    try:
        if root.is_dir():
            shards = _shards_in(root)
            indexes = sorted(child for child in root.iterdir() if child.name.endswith(INDEX_SUFFIX))
            if len(indexes) > 1:
                names = [child.name for child in indexes]
                _fail(f"{_shown(root)}: {len(indexes)} indexes ({', '.join(printable(n) for n in names)}); "
                      "give the path of the one to read", root, names)
            if indexes:
                return _indexed(indexes[0], shards)
            if not shards:
                _fail(f"{_shown(root)}: no {_SUFFIX} files in this directory", root)
            return tuple(shards), None, None
        if root.name.endswith(INDEX_SUFFIX) and os.path.lexists(root):
            return _indexed(root, _shards_in(root.parent))
        if root.name.endswith(_SUFFIX) and os.path.lexists(root):
            _check_regular(root)
            return (root,), None, None
        if root.is_file():
            _fail(f"{_shown(root)}: not a {_SUFFIX} file, an index or a directory of them", root)
    except OSError as error:
        _os_error(root, error)
    if not os.path.lexists(root):
        _fail(f"{_shown(root)}: no such file or directory", root)
    _fail(f"{_shown(root)}: not a regular file or a directory", root)


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The safetensors files a checkpoint path names (see the module docstring).

    Args:
        path: a directory holding ``*.safetensors`` files (not searched recursively) and
            perhaps one index; an index file; or one ``.safetensors`` file.

    Returns:
        The files to read, sorted by name: the shards the index names when there is one,
        else every ``.safetensors`` file of the directory.

    Raises:
        CheckpointError: the path does not exist, is none of the above, cannot be listed,
            or holds no ``.safetensors`` file; a ``.safetensors`` entry is a dangling
            symlink, a symlink loop or not a regular file; the directory holds two
            indexes; the index is malformed or names a shard that is missing or broken.
    """
    return _layout(path)[0]


def _read_exactly(file: RawIOBase, size: int, path: Path, what: str) -> bytes:
    # Unbuffered reads, repeated over short reads: a buffered reader would pull kilobytes
    # of tensor data past the header into its buffer.
    data = bytearray()
    while len(data) < size:
        chunk = file.read(size - len(data))
        if not chunk:
            _fail(f"{_shown(path)}: truncated: the {what} needs {size} bytes, found {len(data)}", path, len(data))
        data += chunk
    return bytes(data)


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[TensorHeader, ...]:
    """Read and parse the header of one safetensors file, without reading its data.

    Args:
        path: the file.

    Returns:
        Its tensors, sorted by name, with byte ranges relative to its data section.

    Raises:
        CheckpointError: the file cannot be opened or read, is shorter than 8 bytes, its
            header length exceeds `MAX_HEADER_BYTES` or the bytes after the length field,
            or the header is not a valid safetensors header (see
            `offload.pure.spec.safetensors.parse_safetensors_header`).
    """
    return _read_header(Path(path))[0]


def _advise(fd: int, length: int, advice: int) -> None:
    """``posix_fadvise`` of `fd`'s first `length` bytes rounded up to whole pages (0: the
    whole file), best effort: a header is read once, and a model larger than host memory
    must not leave its checkpoint in the page cache."""
    page = mmap.PAGESIZE
    try:
        os.posix_fadvise(fd, 0, -(-length // page) * page, advice)
    except OSError:
        pass


def _identity(path: Path, info: os.stat_result) -> FileIdentity:
    return FileIdentity(path=os.fspath(path), size=info.st_size, mtime_ns=info.st_mtime_ns, inode=info.st_ino,
                        device=info.st_dev)


def _read_header(file_path: Path) -> tuple[tuple[TensorHeader, ...], int, FileIdentity]:
    """`read_safetensors_header`, with the header's length and the file's identity (its
    ``fstat`` when the header was read)."""
    try:
        with open(file_path, "rb", buffering=0) as file:
            info = os.fstat(file.fileno())
            file_bytes = info.st_size
            _advise(file.fileno(), 0, os.POSIX_FADV_RANDOM)  # no readahead into the data
            (header_bytes,) = _LENGTH.unpack(_read_exactly(file, _LENGTH.size, file_path, "header length"))
            if header_bytes > MAX_HEADER_BYTES:
                _fail(f"{_shown(file_path)}: header length {header_bytes} bytes exceeds the {MAX_HEADER_BYTES}-byte limit "
                      "(not a safetensors file, or corrupt)", file_path, header_bytes)
            if header_bytes > file_bytes - _LENGTH.size:
                _fail(f"{_shown(file_path)}: truncated: header length {header_bytes} bytes but only "
                      f"{file_bytes - _LENGTH.size} bytes follow the length field", file_path, header_bytes)
            header = _read_exactly(file, header_bytes, file_path, "header")
            _advise(file.fileno(), _LENGTH.size + header_bytes, os.POSIX_FADV_DONTNEED)  # the pages read, let go
    except OSError as error:
        _os_error(file_path, error)
    data_bytes = file_bytes - _LENGTH.size - header_bytes
    tensors = parse_safetensors_header(header, source=_shown(file_path), data_bytes=data_bytes)
    log.debug("%s: %d tensors, header %d bytes, data %d bytes", file_path, len(tensors), header_bytes, data_bytes)
    return tensors, header_bytes, _identity(file_path, info)


@attrs.frozen(kw_only=True)
class CheckpointExtents:
    """Where every tensor of a checkpoint lies, and what identifies its files.

    Attributes:
        files: each file read, as it was when its header was read.
        extents: each tensor's bytes, by its full name.
        tensors: each tensor's header, by its full name.
    """

    files: tuple[FileIdentity, ...]
    extents: Mapping[str, DiskExtent]
    tensors: Mapping[str, TensorHeader]


def checkpoint_extents(path: str | os.PathLike[str]) -> CheckpointExtents:
    """Read every header of a checkpoint (the files `checkpoint_files` names) and say
    where each tensor's bytes lie (`offload.pure.spec.extents`); no data is read.

    Raises:
        CheckpointError: as `read_checkpoint`, for the files and their headers; a tensor
            name in two files.
    """
    files, index, weight_map = _layout(path)
    identities: list[FileIdentity] = []
    extents: dict[str, DiskExtent] = {}
    tensors: dict[str, TensorHeader] = {}
    owner: dict[str, Path] = {}
    for file_path in files:
        found, header_bytes, identity = _read_header(file_path)
        identities.append(identity)
        for tensor in found:
            first = owner.setdefault(tensor.name, file_path)
            if first != file_path:
                raise CheckpointError(f"tensor {tensor.name!r} is in both {_shown(first)} and {_shown(file_path)}",
                                      name=tensor.name, value=(str(first), str(file_path)))
            extents[tensor.name] = extent_of(tensor, identity.path, header_bytes)
            tensors[tensor.name] = tensor
    if index is not None and weight_map is not None:
        check_index(weight_map, {name: file.name for name, file in owner.items()}, source=_shown(index))
    return CheckpointExtents(files=tuple(identities), extents=extents, tensors=tensors)


def changed_files(planned: Sequence[FileIdentity]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The files of `planned` that are not as they were planned: each path with the fields
    that differ (`FileIdentity.changes`), or ``("missing",)`` for one that cannot be read
    now; empty when every file is as planned. What a disk tier checks before it reads."""
    changed: list[tuple[str, tuple[str, ...]]] = []
    for identity in planned:
        try:
            now = file_identity(identity.path)
        except CheckpointError:
            changed.append((identity.path, ("missing",)))
            continue
        fields = identity.changes(now)
        if fields:
            changed.append((identity.path, fields))
    return tuple(changed)


def file_identity(path: str | os.PathLike[str]) -> FileIdentity:
    """What identifies `path` now (``os.stat``), to compare with the identity planned
    (`FileIdentity.changes`).

    Raises:
        CheckpointError: it cannot be read (gone, no permission).
    """
    file_path = Path(path)
    try:
        info = os.stat(file_path)
    except OSError as error:
        _os_error(file_path, error)
    return _identity(file_path, info)


def read_checkpoint(path: str | os.PathLike[str], *, buffers: Collection[str] = frozenset(),
                    running: Sequence[tuple[str, int]] = ()) -> CheckpointSpec:
    """Read every header of a checkpoint and group its tensors into layers.

    Args:
        path: a directory of ``*.safetensors`` files (with or without an index), an index
            file, or one ``.safetensors`` file.
        buffers: names of the tensors the model holds as persistent buffers, kept out of
            the layers (`spec_from_tensors`; `offload.hf.checkpoint_buffers` finds them
            for a Hugging Face checkpoint).
        running: the model's stacks, in the order it runs them (`spec_from_tensors`).

    Returns:
        The layers to plan with, the stacks they come from, and the tensors outside every
        layer (which the CLI reports, and counts as resident device bytes in a fit).

    Raises:
        CheckpointError: any reason `checkpoint_files` or `read_safetensors_header`
            gives; a tensor name in two files (names both); a tensor in another shard
            than the index says, in none, or in a shard but not in the index; no layer
            names; missing layers.
    """
    found = checkpoint_extents(path)
    result = spec_from_tensors(list(found.tensors.values()), buffers=buffers, running=running)
    log.debug("%s: %d files, %d layers, %d tensors outside layers, %d buffers (stacks: %s)",
                 _shown(os.fspath(path)), len(found.files), len(result.spec.layers), len(result.outside_layers),
                 len(result.buffers), ", ".join(stack.name for stack in result.stacks))
    return result


def spec_from_checkpoint(path: str | os.PathLike[str]) -> ModelSpec:
    """The `ModelSpec` of a safetensors checkpoint, read from its headers only.

    Args:
        path: a directory of ``*.safetensors`` files, or one such file.

    Returns:
        The layers (see `offload.pure.spec.stacks.spec_from_tensors`); tensors outside
        layers are dropped. `read_checkpoint` returns them too.

    Raises:
        CheckpointError: see `read_checkpoint`.
    """
    return read_checkpoint(path).spec
