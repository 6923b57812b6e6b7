"""SOURCE of ``offload plan``: what it plans, and the lines that say where it came from.

- A preset: shapes only.
- A checkpoint directory (or one of its files): the safetensors headers. The class that
  was saved is built on meta (which imports transformers, seconds) only when the headers
  leave a question the plan needs answered: the order of two or more stacks, or whether a
  tensor in the layers that is neither a ``weight`` nor a ``bias`` is a persistent buffer.
  A one-stack model of weights and biases (every Llama, Qwen, Mistral, Mixtral checkpoint)
  is planned from the headers alone, in the time it takes to import torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from offload.cli._shared import UserError, count_of
from offload.pure.spec.presets import PRESETS, preset_outside_bytes, preset_spec
from offload.pure.spec.safetensors import TensorHeader, printable
from offload.pure.spec.stacks import CheckpointSpec, spec_from_tensors
from offload.pure.spec.values import ModelSpec
from offload.pure.units import format_bytes

__all__ = ["Source", "plan_source"]

#: The last name segments of tensors that are parameters in every module we know
#: (``nn.Linear``, ``nn.Embedding``, the norms); any other may be a persistent buffer.
_PARAMETER_LEAVES = frozenset({"weight", "bias"})
_CONFIG = "config.json"


@attrs.frozen(kw_only=True)
class Source:
    """What SOURCE gives: the layers, where they came from, and what lies outside them.

    Attributes:
        spec: the layers to plan.
        origin: one line: ``preset llama-8b (...)``, ``checkpoint DIR``.
        outside_bytes: weights outside the layers (resident on the device), in bytes.
        details: lines to print under the model line: stacks, outside, class, buffers.
    """

    spec: ModelSpec
    origin: str
    outside_bytes: int
    details: tuple[str, ...]


def plan_source(name: str, *, counted: str) -> Source:
    """The spec for SOURCE `name` and the lines describing it (the module docstring).

    Args:
        name: a preset or a checkpoint path.
        counted: ends the line about the bytes outside the layers (whether the output
            below counts them).

    Raises:
        UserError: `name` is neither.
        CheckpointError: the checkpoint's files or headers are broken (as `read_checkpoint`).
    """
    if os.path.exists(name):
        return _from_checkpoint(name, counted=counted)
    if name in PRESETS:
        outside = preset_outside_bytes(name)
        return Source(spec=preset_spec(name), origin=f"preset {name} (decoder layers, bf16, shapes only)",
                      outside_bytes=outside,
                      details=(f"outside:  embeddings, output head and final norm, {format_bytes(outside)}, "
                               f"resident on the device; {counted}",))
    raise UserError(
        f"offload plan: {name!r} is neither an existing path nor a preset ({', '.join(sorted(PRESETS))})"
    )


def _root(name: str) -> Path:
    path = Path(name)
    return path if path.is_dir() else path.parent


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


def _from_checkpoint(name: str, *, counted: str) -> Source:
    from offload.model.checkpoint import checkpoint_extents

    tensors: Sequence[TensorHeader] = tuple(checkpoint_extents(name).tensors.values())
    result = spec_from_tensors(tensors)
    questions = _questions(result)
    details: list[str] = []
    if not questions:
        details.append("class:    not built: one stack of weights and biases, whose headers tell the plan all it "
                       "needs")
    else:
        known_names, source, stacks = _buffers(_root(name))
        if known_names is None:
            details.append(f"buffers:  not known ({printable(source)}): every tensor in a layer is planned as a "
                           "parameter, persistent buffers too")
        else:
            details.append(f"class:    {source} built on meta from {_CONFIG}, for {'; '.join(questions)}")
            result = spec_from_tensors(tensors, buffers=known_names, running=stacks)
            if result.buffers:
                details.append(_buffer_line(result, source, counted))
    return Source(spec=result.spec, origin=f"checkpoint {printable(name)}", outside_bytes=result.outside_bytes,
                  details=(*_stack_lines(result, counted), *details))


def _buffers(root: Path) -> tuple[frozenset[str] | None, str, tuple[tuple[str, int], ...]]:
    """The persistent buffers of the checkpoint's model class, the class, and its stacks in
    the order they run (`offload.hf.checkpoint_buffers`, which imports transformers), or
    None and why they are not known."""
    try:
        from offload.hf.buffers import checkpoint_buffers
    except ImportError as exc:
        return None, f"torch is needed to build the model class ({exc})", ()
    known = checkpoint_buffers(root)
    return known.names, known.source, known.stacks


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
