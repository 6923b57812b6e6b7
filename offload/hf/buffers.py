"""What the model class that was saved tells about its checkpoint, built on the meta
device from its ``config.json`` (no memory, no weights read): `saved_model` and
`checkpoint_buffers`.

A safetensors file does not say which of its tensors are buffers (DeepSeek-V3's
``mlp.gate.e_score_correction_bias``, a rotary table saved with the weights); a plan made
from the headers alone would plan them as offloaded parameters, while the live model keeps
buffers on the device. The class `config.json` names (`saved_class`) knows: its
persistent buffers are listed, and so are its layer stacks in the order they run
(`find_stacks`), which a checkpoint's names do not tell
(`offload.pure.spec.stacks.match_stack_order`). The same model gives the tensors
``save_pretrained`` would write (transformers' own tie removal and weight renaming, run on
meta), so that a model can be planned from its config before its weights are downloaded,
and the ``nn.Linear`` weights a load-time quantisation converts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from offload.errors import CheckpointError, PlanError
from offload.hf.layers import find_stacks
from offload.hf.pretrained import saved_class
from offload.logs import logger
from offload.pure.spec.safetensors import SAFETENSORS_DTYPES, TensorHeader

__all__ = ["BufferNames", "SavedModel", "checkpoint_buffers", "saved_model"]

log = logger("offload.plan")


@attrs.frozen(kw_only=True)
class BufferNames:
    """The persistent buffers of a checkpoint's model class, or why they are not known.

    Attributes:
        names: the buffers' names in the checkpoint (empty: it has none); None when the
            class could not be built.
        source: the class built (``DeepseekV3ForCausalLM``), or why none was (``no
            config.json beside the weights``, ``transformers is not installed``, ...).
        stacks: its layer stacks as (module path, layers), in the order they run; empty
            when the class could not be built.
    """

    names: frozenset[str] | None
    source: str
    stacks: tuple[tuple[str, int], ...] = ()


@attrs.frozen(kw_only=True)
class SavedModel:
    """A checkpoint's model class, built on meta from its config, as its checkpoint holds it.

    Attributes:
        source: the class built (``LlamaForCausalLM``).
        dtype: the dtype it was built in (``bfloat16``): the config's, or the one asked for.
        buffers: the persistent buffers, by their names in the checkpoint.
        stacks: its layer stacks as (module path, layers), in the order they run; empty
            when none is found.
        tensors: every tensor ``save_pretrained`` writes, by its name in the checkpoint,
            each storage once (a tied head is written as its embedding), with its dtype
            and shape; the byte ranges lay them end to end in this order, as one file would.
        linear_weights: the names (in the checkpoint) of the ``nn.Linear`` weights a
            transformers load-time quantisation converts: its default skips (the output
            head and what it is tied to, the class's ``_keep_in_fp32_modules``) and the
            config's ``modules_to_not_convert`` left out.
    """

    source: str
    dtype: str
    buffers: frozenset[str]
    stacks: tuple[tuple[str, int], ...]
    tensors: tuple[TensorHeader, ...]
    linear_weights: frozenset[str]


def checkpoint_buffers(path: str | os.PathLike[str]) -> BufferNames:
    """The persistent buffers of the model class a checkpoint was saved from.

    Args:
        path: the checkpoint directory (or a ``.safetensors`` file in it), with its
            ``config.json``.

    Returns:
        Their names, or None with the reason when the class cannot be known: no
        ``config.json``, no class named there, the library (transformers, or diffusers for
        a ``_class_name``) missing or without the class, or the class not buildable on
        meta from its config. Never raises for those: a plan from the headers alone is
        still a plan (the CLI says the buffers are not known).
    """
    try:
        saved = saved_model(path)
    except CheckpointError as exc:
        return BufferNames(names=None, source=exc.message)
    return BufferNames(names=saved.buffers, source=saved.source, stacks=saved.stacks)


def saved_model(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                skip: tuple[str, ...] = ()) -> SavedModel:
    """The model class a checkpoint (or its ``config.json`` alone) was saved from, built on
    meta, as its checkpoint holds it (`SavedModel`). Imports transformers (or diffusers).

    Args:
        path: the directory holding ``config.json`` (or a file in it).
        dtype: the dtype to build it in; None: the config's (``dtype``, ``torch_dtype``),
            which transformers applies; a diffusers config names none (float32).
        skip: module names a quantisation leaves out besides transformers' defaults (a
            ``quantization_config``'s ``modules_to_not_convert``).

    Raises:
        CheckpointError: no ``config.json``; no class named there; the library missing or
            without the class; the class not buildable on meta from the config; a tensor
            of a dtype safetensors does not have. The message says which.
    """
    root = Path(path)
    if not root.is_dir():
        root = root.parent
    config = root / "config.json"
    if not config.is_file():
        raise CheckpointError("no config.json beside the weights", name=str(config), value=None)
    try:
        model_class, where = saved_class(config)
    except ImportError as exc:
        raise CheckpointError(f"the library that builds the model is not installed ({exc})", name=str(config),
                              value=None) from exc
    if model_class is None:
        raise CheckpointError(where, name=str(config), value=None)
    try:
        model = _on_meta(model_class, root, dtype)
    except Exception as exc:  # any failure of a third-party constructor: the class is unknown
        log.debug("building %s on meta failed", model_class.__name__, exc_info=True)
        raise CheckpointError(f"{model_class.__name__} could not be built on meta ({type(exc).__name__}: {exc})",
                              name=str(config), value=model_class.__name__) from exc
    model_state = model.state_dict(keep_vars=True)
    saved = _as_saved(model, model_state)  # the tensors themselves, under the names they are saved as
    buffer_ids = {id(b) for name, b in model.named_buffers(remove_duplicate=False) if name in model_state}
    linear_ids = _linear_weights(model, skip)
    tensors: list[TensorHeader] = []
    begin = 0
    for name, tensor in saved.items():
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in SAFETENSORS_DTYPES.values():
            raise CheckpointError(f"{model_class.__name__}: tensor {name!r} is {dtype_name}, which safetensors "
                                  "does not store", name=name, value=dtype_name)
        nbytes = tensor.numel() * tensor.element_size()
        tensors.append(TensorHeader(name=name, dtype=dtype_name, shape=tuple(tensor.shape), begin=begin,
                                    end=begin + nbytes))
        begin += nbytes
    paths = {id(module): path for path, module in model.named_modules()}
    try:
        stacks = tuple((paths[id(stack)], len(stack)) for stack in find_stacks(model))
    except PlanError:
        stacks = ()
    found = SavedModel(
        source=model_class.__name__,
        dtype=str(next((t.dtype for t in model_state.values()), torch.float32)).removeprefix("torch."),
        buffers=frozenset(name for name, tensor in saved.items() if id(tensor) in buffer_ids),
        stacks=stacks, tensors=tuple(tensors),
        linear_weights=frozenset(name for name, tensor in saved.items() if id(tensor) in linear_ids))
    log.debug("%s (%s): %d tensors, %d persistent buffers, stacks %s", found.source, where, len(found.tensors),
              len(found.buffers), stacks)
    return found


def _as_saved(model: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as ``save_pretrained`` writes it: tied weights once, transformers' weight
    renaming and conversions (fused experts written one by one) undone, run on meta; for
    a model that is not a transformers one (diffusers), each storage once."""
    if _is_transformers(model):
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        reverted: dict[str, torch.Tensor] = revert_weight_conversion(
            model, remove_tied_weights_from_state_dict(dict(state), model))
        return reverted
    seen: set[int] = set()
    once: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            once[name] = tensor
    return once


def _is_transformers(model: Any) -> bool:
    """Whether `model` is a transformers `PreTrainedModel` (transformers is not imported for this)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _linear_weights(model: Any, skip: tuple[str, ...]) -> set[int]:
    """The ``nn.Linear`` weights of `model` (their ids) that a transformers load-time
    quantisation converts, by its own rule (`HfQuantizer.get_modules_to_not_convert`,
    `should_convert_module`); of a model that is not a transformers one, every Linear's
    but those `skip` names."""
    linears = [(f"{name}.weight", module.weight) for name, module in model.named_modules()
               if isinstance(module, nn.Linear)]
    if not _is_transformers(model):
        return {id(weight) for name, weight in linears if not any(name.startswith(f"{s}.") for s in skip)}
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = HfQuantizer.get_modules_to_not_convert(model, list(skip) or None,
                                                  getattr(model, "_keep_in_fp32_modules", None))
    return {id(weight) for name, weight in linears if should_convert_module(name, kept)}


def _on_meta(model_class: Any, root: Path, dtype: torch.dtype | None = None) -> Any:
    """`model_class` built from the configuration in `root`, on the meta device, in `dtype`
    (None: the config's)."""
    if hasattr(model_class, "load_config"):  # a diffusers ModelMixin
        config = model_class.load_config(root)
        with torch.device("meta"):
            model = model_class.from_config(config)
        return model if dtype is None else model.to(dtype)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        return model_class._from_config(config) if dtype is None else model_class._from_config(config, dtype=dtype)
