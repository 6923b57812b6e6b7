"""SOURCE of ``offload plan``: what it plans, and the lines that say where it came from.

- A preset: shapes only.
- A checkpoint directory (or one of its files): the safetensors headers. The class that
  was saved is built on meta (which imports transformers, seconds) only when the headers
  leave a question the plan needs answered: the order of two or more stacks, whether a
  tensor in the layers that is neither a ``weight`` nor a ``bias`` is a persistent buffer,
  or which weights are ``nn.Linear`` ones for ``--quantization``, or how transformers
  makes the live layers of tensors stored one per module of a list in a layer (MoE
  experts, which it fuses at load: the plan is of the live layers, `_live`). A one-stack
  model of weights and biases (every Llama, Qwen, Mistral checkpoint) is planned from the
  headers alone, in the time it takes to import torch.
- A directory holding a ``config.json`` and no weights (or that file itself): the class
  built on meta in the config's dtype, its tensors as ``save_pretrained`` writes them
  (`offload.hf.buffers.saved_model`); no weights are read, and the output says so.

``--quantization int8`` (or a config's torchao int8 ``quantization_config``, for a config
alone) plans the weights as torchao's int8 weight-only quantisation leaves them
(`offload.cli.quantisation`); a checkpoint saved quantised is planned as its headers hold it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from offload.cli._shared import UserError, count_of
from offload.cli.experts import may_hold_experts, with_experts
from offload.cli.quantisation import INT8, int8_weight_only, saved_quantization
from offload.errors import CheckpointError
from offload.pure.spec.presets import PRESETS, preset_outside_bytes, preset_spec
from offload.pure.spec.safetensors import SHARD_SUFFIX, TensorHeader, printable
from offload.pure.spec.stacks import CheckpointSpec, spec_from_tensors
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from torch.nn import Module

    from offload.hf.buffers import SavedModel

__all__ = ["Source", "has_weights", "plan_source"]

#: The last name segments of tensors that are parameters in every module we know
#: (``nn.Linear``, ``nn.Embedding``, the norms); any other may be a persistent buffer.
_PARAMETER_LEAVES = frozenset({"weight", "bias"})
_CONFIG = "config.json"


@attrs.frozen(kw_only=True)
class Source:
    """What SOURCE gives: the layers, where they came from, and what lies outside them.

    Attributes:
        spec: the layers to plan.
        origin: one line: ``preset llama-8b (...)``, ``checkpoint DIR``, ``config DIR (...)``.
        outside_bytes: weights outside the layers (resident on the device), in bytes.
        details: lines to print under the model line: stacks, outside, class, buffers, quantisation.
    """

    spec: ModelSpec
    origin: str
    outside_bytes: int
    details: tuple[str, ...]


def has_weights(name: str) -> bool:
    """Whether SOURCE `name` is a checkpoint whose weights lie in files (the disk tier can
    read them there): an existing path that is not a config alone."""
    return os.path.exists(name) and _config_only(Path(name)) is None


def plan_source(name: str, *, counted: str, quantization: str | None = None, dtype: str | None = None) -> Source:
    """The spec for SOURCE `name` and the lines describing it (the module docstring).

    Args:
        name: a preset, a checkpoint path, or a directory holding a config alone.
        counted: ends the line about the bytes outside the layers (whether the output
            below counts them).
        quantization: ``--quantization`` (`INT8`, ``"none"``), or None: the config's.
        dtype: ``--dtype``, for a config alone (None: the config's).

    Raises:
        UserError: `name` is none of these; a directory with neither weights nor a config
            that builds; a quantisation that cannot be planned (named).
        CheckpointError: the checkpoint's files or headers are broken (as `read_checkpoint`).
    """
    if os.path.exists(name):
        config_dir = _config_only(Path(name))
        if dtype is not None and config_dir is None:
            raise UserError("offload plan: --dtype applies to a directory holding only a config.json (a "
                            "checkpoint's headers give its dtypes)")
        if config_dir is not None:
            return _from_config(name, config_dir, counted=counted, quantization=quantization, dtype=dtype)
        return _from_checkpoint(name, counted=counted, quantization=quantization)
    if dtype is not None:
        raise UserError("offload plan: --dtype applies to a directory holding only a config.json, not to a preset")
    if quantization is not None:
        raise UserError("offload plan: --quantization applies to a checkpoint or a config, not to a preset")
    if name in PRESETS:
        outside = preset_outside_bytes(name)
        return Source(spec=preset_spec(name), origin=f"preset {name} (decoder layers, bf16, shapes only)",
                      outside_bytes=outside,
                      details=(f"outside:  embeddings, output head and final norm, {format_bytes(outside)}, "
                               f"resident on the device; {counted}",))
    raise UserError(
        f"offload plan: {name!r} is neither an existing path nor a preset ({', '.join(sorted(PRESETS))})"
    )


def _config_only(path: Path) -> Path | None:
    """The directory to plan from its config alone: `path` when it is a directory with a
    ``config.json`` and no ``.safetensors`` entry, the folder of a ``config.json`` given
    itself; else None (a checkpoint, or nothing to plan from: `_from_checkpoint` says)."""
    if path.name == _CONFIG and path.is_file():
        return path.parent
    if not path.is_dir() or not (path / _CONFIG).is_file():
        return None
    try:
        weights = any(child.name.endswith(SHARD_SUFFIX) for child in path.iterdir())
    except OSError:
        return None  # the checkpoint reader says why it cannot be listed
    return None if weights else path  # an index without its shards: planned from the config


def _root(name: str) -> Path:
    path = Path(name)
    return path if path.is_dir() else path.parent


def _read_config(root: Path) -> Mapping[str, Any] | None:
    """``config.json`` of `root` as a mapping; None when absent or not a JSON object (the
    class, if it is built, says what is wrong with it)."""
    try:
        found = json.loads((root / _CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _saved_model(root: Path, *, dtype: str | None = None, skip: Sequence[str] = ()) -> SavedModel:
    """`offload.hf.buffers.saved_model` (imports transformers); CheckpointError as it
    raises, and for a library that is not installed."""
    try:
        import torch

        from offload.hf.buffers import saved_model
    except ImportError as exc:
        raise CheckpointError(f"the library that builds the model is not installed ({exc})", name=str(root),
                              value=None) from exc
    return saved_model(root, dtype=None if dtype is None else getattr(torch, dtype), skip=tuple(skip))


def _skipped(config: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A quantization_config's ``modules_to_not_convert``, when it names module names."""
    found = ((config or {}).get("quantization_config") or {})
    names = found.get("modules_to_not_convert") if isinstance(found, Mapping) else None
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()


def _questions(headers: CheckpointSpec) -> list[str]:
    """What the headers alone do not tell the plan (empty: nothing), one phrase each."""
    found: list[str] = []
    if len(headers.stacks) > 1:
        found.append(f"the order its {len(headers.stacks)} stacks run")
    odd = [f"{layer.name}.{p.name}" for layer in headers.spec.layers for p in layer.params
           if p.name.rsplit(".", 1)[-1] not in _PARAMETER_LEAVES]
    if odd:
        found.append(f"whether {count_of(len(odd), 'tensor')} in the layers that {'is' if len(odd) == 1 else 'are'} "
                     f"neither a weight nor a bias ({printable(odd[0])}{', ...' if len(odd) > 1 else ''}) "
                     f"{'is a persistent buffer' if len(odd) == 1 else 'are persistent buffers'}")
    return found


def _stored_apart(headers: CheckpointSpec) -> list[str]:
    """The layers' tensors stored one per module of a list in a layer
    (``mlp.experts.3.gate_proj.weight``), which transformers may fuse at load."""
    return [f"{layer.name}.{p.name}" for layer in headers.spec.layers for p in layer.params
            if any(part.isdigit() for part in p.name.split("."))]


def _live(root: Path, tensors: Sequence[TensorHeader], saved: SavedModel
          ) -> tuple[Sequence[TensorHeader], SavedModel, str, Module | None]:
    """`tensors` as the live model holds them, transformers' load-time conversions applied
    (`offload.hf.conversions`, on the class built as a streamed load builds it), `saved`'s
    names of buffers and ``nn.Linear`` weights as the live model's, a line saying so
    (empty when nothing is converted), and the class built on meta (for `_experts`); as
    they are, with the reason, when that fails."""
    from offload.hf.conversions import live_headers, live_sources
    from offload.hf.pretrained import saved_class
    from offload.hf.streamed import build_on_meta

    try:
        model_class, _ = saved_class(root / _CONFIG)
        if model_class is None or not hasattr(model_class, "_from_config"):
            return tensors, saved, "", None
        model = build_on_meta(model_class, root)
        sources = live_sources(model, {t.name: t for t in tensors})
    except CheckpointError as exc:
        return tensors, saved, f"layers:   as stored, not as transformers loads them: {printable(exc.message)}", None
    live = live_headers(sources, {t.name: t for t in tensors})
    converted = [s for s in sources.values() if not s.as_stored]
    if not converted:
        return tensors, saved, "", model
    renamed = {s.whole: s.name for s in converted if s.whole is not None}
    saved = attrs.evolve(saved, buffers=frozenset(renamed.get(n, n) for n in saved.buffers),
                         linear_weights=frozenset(renamed.get(n, n) for n in saved.linear_weights))
    return live, saved, (f"layers:   as transformers loads them: {count_of(len(tensors), 'tensor')} stored, "
                         f"{count_of(len(live), 'tensor')} live ({count_of(len(converted), 'tensor')} renamed or "
                         "fused at load)"), model


def _from_checkpoint(name: str, *, counted: str, quantization: str | None) -> Source:
    from offload.model.checkpoint import checkpoint_extents

    path, root = Path(name), _root(name)
    if path.is_dir() and not (root / _CONFIG).exists() and not _lists_weights(path):
        raise UserError(f"offload plan: {printable(name)}: no {SHARD_SUFFIX} files and no {_CONFIG}: nothing to plan "
                        f"from (a checkpoint directory, or its {_CONFIG} alone to plan before downloading)")
    config = _read_config(root)
    _, described = saved_quantization(config or {})
    if described != "none" and quantization == INT8:
        raise UserError(f"offload plan: --quantization int8: {printable(name)} was saved quantised ({described}, "
                        "config.json quantization_config): its headers hold the quantised tensors; drop --quantization")
    tensors: Sequence[TensorHeader] = tuple(checkpoint_extents(name).tensors.values())
    result = spec_from_tensors(tensors)
    questions = _questions(result)
    apart = _stored_apart(result)
    if apart:
        questions.append(f"how transformers makes the live layers of the {count_of(len(apart), 'tensor')} stored "
                         f"one per module of a list ({printable(apart[0])}, ...)")
    if quantization == INT8:
        questions.append("which weights are nn.Linear ones, for --quantization int8")
    details: list[str] = []
    quantised = ""
    meta: Module | None = None  # the class built on meta, where `_live` built it
    if not questions:
        details.append("class:    not built: one stack of weights and biases, whose headers tell the plan all it "
                       "needs")
    else:
        try:
            saved = _saved_model(root)
        except CheckpointError as exc:
            if quantization == INT8:
                raise UserError(f"offload plan: --quantization int8 needs the model class, to tell which weights are "
                                f"nn.Linear ones: {exc.message}") from None
            details.append(f"buffers:  not known ({printable(exc.message)}): every tensor in a layer is planned as a "
                           "parameter, persistent buffers too")
        else:
            details.append(f"class:    {saved.source} built on meta from {_CONFIG}, for {'; '.join(questions)}")
            if apart:
                tensors, saved, line, meta = _live(root, tensors, saved)
                details.extend([line] if line else [])
            if quantization == INT8:
                tensors, quantised = _quantised(tensors, saved.linear_weights)
            result = spec_from_tensors(tensors, buffers=saved.buffers, running=saved.stacks)
            if result.buffers:
                details.append(_buffer_line(result, saved.source, counted))
    if quantised:
        details.append(quantised)
    elif described != "none":
        details.append(f"quant:    as saved ({described}, config.json quantization_config): the headers hold the "
                       "quantised tensors")
    spec, line = _experts(root, config, result.spec, meta)
    return Source(spec=spec, origin=f"checkpoint {printable(name)}", outside_bytes=result.outside_bytes,
                  details=(*_stack_lines(result, counted), *details, *([line] if line else [])))


def _lists_weights(folder: Path) -> bool:
    """Whether `folder` has a ``.safetensors`` entry or an index (the reader checks them)."""
    try:
        return any(child.name.endswith((SHARD_SUFFIX, ".safetensors.index.json")) for child in folder.iterdir())
    except OSError:
        return True  # the checkpoint reader says why it cannot be listed


def _from_config(name: str, root: Path, *, counted: str, quantization: str | None, dtype: str | None) -> Source:
    config = _read_config(root)
    saved_kind, described = saved_quantization(config or {})
    if quantization is None and described != "none" and saved_kind is None:
        raise UserError(f"offload plan: {printable(str(root / _CONFIG))}: its quantization_config is {described}, "
                        "whose sizes cannot be told from a config; --quantization none plans the weights "
                        "unquantised, --quantization int8 as torchao's int8 weight-only quantisation")
    int8 = quantization == INT8 or (quantization is None and saved_kind == INT8)
    try:
        saved = _saved_model(root, dtype=dtype, skip=_skipped(config) if int8 else ())
    except CheckpointError as exc:
        raise UserError(f"offload plan: {printable(name)} holds no {SHARD_SUFFIX} files, and its {_CONFIG} cannot be "
                        f"planned from: {exc.message}") from None
    tensors: Sequence[TensorHeader] = saved.tensors
    try:
        apart = _stored_apart(spec_from_tensors(tensors))
    except CheckpointError:
        apart = []  # said below
    tensors, saved, live, meta = _live(root, tensors, saved) if apart else (tensors, saved, "", None)
    quantised = ""
    if int8:
        tensors, quantised = _quantised(tensors, saved.linear_weights)
    try:
        result = spec_from_tensors(tensors, buffers=saved.buffers, running=saved.stacks)
    except CheckpointError as exc:
        raise UserError(f"offload plan: {saved.source} built from {printable(str(root / _CONFIG))}: {exc.message}") \
            from None
    named = config is not None and any(key in config for key in ("dtype", "torch_dtype"))
    how = "as --dtype asks" if dtype is not None else "the config's" if named else \
        f"{_CONFIG} names none; --dtype to choose"
    details = [f"weights:  no weights were read: {saved.source} built on meta from {printable(str(root / _CONFIG))}, "
               f"in {saved.dtype} ({how}), its tensors as save_pretrained writes them", *_stack_lines(result, counted)]
    details.extend([live] if live else [])
    if quantised:
        details.append(quantised)
    if result.buffers:
        details.append(_buffer_line(result, saved.source, counted))
    spec, line = _experts(root, config, result.spec, meta)
    details.extend([line] if line else [])
    return Source(spec=spec, origin=f"config {printable(str(root))}", outside_bytes=result.outside_bytes,
                  details=tuple(details))


def _experts(root: Path, config: Mapping[str, Any] | None, spec: ModelSpec,
             meta: Module | None) -> tuple[ModelSpec, str]:
    """`spec` with its experts modules where it may hold some (`offload.cli.experts`; on
    `meta`, the class built on meta, where `_live` built it already), and the line saying
    so; a diffusers model (``_class_name``) has none."""
    if config is None or "_class_name" in config or not may_hold_experts(spec):
        return spec, ""
    return with_experts(root, spec, meta)


def _quantised(tensors: Sequence[TensorHeader], linear: frozenset[str]) -> tuple[tuple[TensorHeader, ...], str]:
    """`tensors` int8 weight-only quantised (`int8_weight_only`), and the line saying so."""
    converted = int8_weight_only(tensors, linear)
    count = sum(1 for t in tensors if t.name in linear and len(t.shape) == 2)
    before, after = sum(t.nbytes for t in tensors), sum(t.nbytes for t in converted)
    return converted, (f"quant:    int8 weight-only (torchao Int8WeightOnlyConfig, per row), as a load with it leaves "
                       f"them: {count_of(count, 'nn.Linear weight')} as int8 values, float32 row scales and int8 zero "
                       f"points; {format_bytes(before)} as saved, {format_bytes(after)} quantised")


def _stack_lines(result: CheckpointSpec, counted: str) -> list[str]:
    lines = [
        f"stack:    {printable(stack.name)}: {count_of(stack.num_layers, 'layer')} (plan layers "
        f"{stack.first_layer}-{stack.first_layer + stack.num_layers - 1}), {format_bytes(stack.nbytes)}"
        for stack in result.stacks
    ]
    if result.outside_layers:
        lines.append(f"outside:  {count_of(len(result.outside_layers), 'tensor')} outside the layers, "
                     f"{format_bytes(result.outside_bytes - result.buffer_bytes)}, resident on the device; {counted}")
    return lines


def _buffer_line(result: CheckpointSpec, source: str, counted: str) -> str:
    return (f"buffers:  {count_of(len(result.buffers), 'tensor')} {source} holds as persistent buffers, "
            f"{format_bytes(result.buffer_bytes)}, resident on the device, not planned; {counted}")
