"""`checkpoint_buffers`: which tensors of a checkpoint the model holds as persistent
buffers, not parameters, read from the model class that was saved, built on meta.

A safetensors file does not say which of its tensors are buffers (DeepSeek-V3's
``mlp.gate.e_score_correction_bias``, a rotary table saved with the weights); a plan made
from the headers alone would plan them as offloaded parameters, while the live model keeps
buffers on the device. The class `config.json` names (`saved_class`) knows: it is built on
the meta device (no memory, no weights read) and its persistent buffers are listed, and
so are its layer stacks in the order they run (`find_stacks`), which a checkpoint's
names do not tell (`offload.pure.spec.stacks.match_stack_order`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from offload.errors import CheckpointError, PlanError
from offload.hf.layers import find_stacks
from offload.hf.pretrained import saved_class
from offload.logs import logger

__all__ = ["BufferNames", "checkpoint_buffers"]

log = logger("offload.plan")


@attrs.frozen(kw_only=True)
class BufferNames:
    """The persistent buffers of a checkpoint's model class, or why they are not known.

    Attributes:
        names: the buffers' names in the model's ``state_dict`` (empty: it has none);
            None when the class could not be built.
        source: the class built (``DeepseekV3ForCausalLM``), or why none was (``no
            config.json beside the weights``, ``transformers is not installed``, ...).
        stacks: its layer stacks as (module path, layers), in the order they run; empty
            when the class could not be built.
    """

    names: frozenset[str] | None
    source: str
    stacks: tuple[tuple[str, int], ...] = ()


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
    root = Path(path)
    if not root.is_dir():
        root = root.parent
    config = root / "config.json"
    if not config.is_file():
        return BufferNames(names=None, source="no config.json beside the weights")
    try:
        model_class, where = saved_class(config)
    except ImportError as exc:
        return BufferNames(names=None, source=f"the library that builds the model is not installed ({exc})")
    except CheckpointError as exc:
        return BufferNames(names=None, source=str(exc))
    if model_class is None:
        return BufferNames(names=None, source=where)
    try:
        model = _on_meta(model_class, root)
    except Exception as exc:  # any failure of a third-party constructor: the buffers are unknown
        log.debug("building %s on meta failed", model_class.__name__, exc_info=True)
        return BufferNames(names=None, source=f"{model_class.__name__} could not be built on meta "
                                              f"({type(exc).__name__}: {exc})")
    saved = set(model.state_dict(keep_vars=True))
    names = frozenset(name for name, _ in model.named_buffers(remove_duplicate=False) if name in saved)
    paths = {id(module): path for path, module in model.named_modules()}
    try:
        stacks = tuple((paths[id(stack)], len(stack)) for stack in find_stacks(model))
    except PlanError:
        stacks = ()
    log.debug("%s (%s): %d persistent buffers, stacks %s", model_class.__name__, where, len(names), stacks)
    return BufferNames(names=names, source=model_class.__name__, stacks=stacks)


def _on_meta(model_class: Any, root: Path) -> Any:
    """`model_class` built from the configuration in `root`, on the meta device."""
    if hasattr(model_class, "load_config"):  # a diffusers ModelMixin
        config = model_class.load_config(root)
        with torch.device("meta"):
            return model_class.from_config(config)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        return model_class._from_config(config)
