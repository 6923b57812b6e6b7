"""Read a model's shapes from the headers of its safetensors files, never its weights.

For each file this reads the 8-byte header length and the JSON header, nothing more: a
70B checkpoint is planned in milliseconds without touching its 140 GB of data. The
parsing and the grouping into layers are pure (`offload.pure.safetensors`); this module
only finds the files and reads their first bytes.
"""

from __future__ import annotations

import logging
import os
import struct
from io import RawIOBase
from pathlib import Path
from typing import NoReturn

from offload.errors import CheckpointError
from offload.pure.safetensors import CheckpointSpec, TensorHeader, parse_safetensors_header, spec_from_tensors
from offload.pure.spec import ModelSpec

__all__ = [
    "MAX_HEADER_BYTES",
    "checkpoint_files",
    "read_checkpoint",
    "read_safetensors_header",
    "spec_from_checkpoint",
]

#: The largest header we read, in bytes (100 MiB, the limit the safetensors library
#: enforces too); a larger length field means a corrupt or foreign file.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_SUFFIX = ".safetensors"
_LENGTH = struct.Struct("<Q")

logger = logging.getLogger("offload.checkpoint")


def _fail(message: str, path: Path, value: object = None) -> NoReturn:
    raise CheckpointError(message, name=str(path), value=value)


def _os_error(path: Path, error: OSError) -> NoReturn:
    reason = error.strerror or type(error).__name__
    raise CheckpointError(f"{path}: cannot read: {reason}", name=str(path), value=error.errno) from error


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The safetensors files a checkpoint path names.

    Args:
        path: a directory holding ``*.safetensors`` files (not searched recursively), or
            one ``.safetensors`` file.

    Returns:
        The files, sorted by name.

    Raises:
        CheckpointError: the path does not exist, is neither a directory nor a
            ``.safetensors`` file, cannot be listed, or holds no ``.safetensors`` file.
    """
    root = Path(path)
    try:
        if root.is_dir():
            files = tuple(sorted(child for child in root.iterdir() if child.name.endswith(_SUFFIX) and child.is_file()))
            if not files:
                _fail(f"{root}: no {_SUFFIX} files in this directory", root)
            return files
        if root.is_file():
            if not root.name.endswith(_SUFFIX):
                _fail(f"{root}: not a {_SUFFIX} file or a directory of them", root)
            return (root,)
    except OSError as error:
        _os_error(root, error)
    if not os.path.lexists(root):
        _fail(f"{root}: no such file or directory", root)
    _fail(f"{root}: not a regular file or a directory", root)


def _read_exactly(file: RawIOBase, size: int, path: Path, what: str) -> bytes:
    # Unbuffered reads, repeated over short reads: a buffered reader would pull kilobytes
    # of tensor data past the header into its buffer.
    data = bytearray()
    while len(data) < size:
        chunk = file.read(size - len(data))
        if not chunk:
            _fail(f"{path}: truncated: the {what} needs {size} bytes, found {len(data)}", path, len(data))
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
            `offload.pure.safetensors.parse_safetensors_header`).
    """
    file_path = Path(path)
    try:
        with open(file_path, "rb", buffering=0) as file:
            file_bytes = os.fstat(file.fileno()).st_size
            (header_bytes,) = _LENGTH.unpack(_read_exactly(file, _LENGTH.size, file_path, "header length"))
            if header_bytes > MAX_HEADER_BYTES:
                _fail(f"{file_path}: header length {header_bytes} bytes exceeds the {MAX_HEADER_BYTES}-byte limit "
                      "(not a safetensors file, or corrupt)", file_path, header_bytes)
            if header_bytes > file_bytes - _LENGTH.size:
                _fail(f"{file_path}: truncated: header length {header_bytes} bytes but only "
                      f"{file_bytes - _LENGTH.size} bytes follow the length field", file_path, header_bytes)
            header = _read_exactly(file, header_bytes, file_path, "header")
    except OSError as error:
        _os_error(file_path, error)
    data_bytes = file_bytes - _LENGTH.size - header_bytes
    tensors = parse_safetensors_header(header, source=str(file_path), data_bytes=data_bytes)
    logger.debug("%s: %d tensors, header %d bytes, data %d bytes", file_path, len(tensors), header_bytes, data_bytes)
    return tensors


def read_checkpoint(path: str | os.PathLike[str]) -> CheckpointSpec:
    """Read every header of a checkpoint and group its tensors into layers.

    Args:
        path: a directory of ``*.safetensors`` files, or one such file.

    Returns:
        The layers to plan with and the tensors outside every layer (which the CLI
        reports as not offloaded).

    Raises:
        CheckpointError: any reason `checkpoint_files` or `read_safetensors_header`
            gives; a tensor name in two files (names both); no layer names; missing layers.
    """
    files = checkpoint_files(path)
    owner: dict[str, Path] = {}
    tensors: list[TensorHeader] = []
    for file_path in files:
        for tensor in read_safetensors_header(file_path):
            first = owner.setdefault(tensor.name, file_path)
            if first != file_path:
                raise CheckpointError(f"tensor {tensor.name!r} is in both {first} and {file_path}",
                                      name=tensor.name, value=(str(first), str(file_path)))
            tensors.append(tensor)
    result = spec_from_tensors(tensors)
    logger.debug("%s: %d files, %d layers, %d tensors outside layers",
                 path, len(files), len(result.spec.layers), len(result.outside_layers))
    return result


def spec_from_checkpoint(path: str | os.PathLike[str]) -> ModelSpec:
    """The `ModelSpec` of a safetensors checkpoint, read from its headers only.

    Args:
        path: a directory of ``*.safetensors`` files, or one such file.

    Returns:
        The layers (see `offload.pure.safetensors.spec_from_tensors`); tensors outside
        layers are dropped. `read_checkpoint` returns them too.

    Raises:
        CheckpointError: see `read_checkpoint`.
    """
    return read_checkpoint(path).spec
