"""`offload_pretrained`: from a local checkpoint directory to a ready, offloaded model.

The weights are loaded by `transformers` itself (weight renaming, fused MoE experts,
dtype rules), into host memory, never onto the device; `offload_model` then moves each
tensor to where the plan puts it, one at a time. Host memory peaks at about the model's
bytes plus its largest tensor; device memory at the plan's resident bytes and buffers,
the weights outside the layers, plus the largest tensor.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from offload.errors import CheckpointError
from offload.hf.model import ModelOffloader, offload_model
from offload.protocols import Runtime
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["load_on_host", "offload_pretrained"]

log = logging.getLogger("offload.load")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("offload_pretrained needs transformers: pip install 'offload[hf]'") from exc
    return transformers


def load_on_host(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                 model_class: Any = None, **kwargs: Any) -> PreTrainedModel:
    """Load a local checkpoint into host memory with `transformers`, in eval mode.

    Args:
        path: a directory with ``config.json`` and safetensors weights (nothing is
            downloaded).
        dtype: the parameters' dtype (default: as `transformers` decides for the checkpoint).
        model_class: the class to load with (default ``AutoModelForCausalLM``, else
            ``AutoModel`` for configurations without a causal-LM head).
        kwargs: passed to ``from_pretrained``.

    Raises:
        CheckpointError: the directory or its weights are missing or inconsistent.
    """
    from offload.model.checkpoint import read_checkpoint

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (offload_pretrained loads local checkpoints)",
                              name=str(root), value=None)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json", name=str(root / "config.json"), value=None)
    checkpoint = read_checkpoint(root)  # every shard present and consistent, before loading anything
    total = checkpoint.spec.nbytes + checkpoint.outside_bytes
    hf = _transformers()
    options: dict[str, Any] = {"local_files_only": True, **kwargs}
    if dtype is not None:
        options["dtype"] = dtype
    log.info("loading %s (%s in the checkpoint) into host memory", root, format_bytes(total))
    start = time.monotonic()
    if model_class is not None:
        model = model_class.from_pretrained(root, **options)
    else:
        try:
            model = hf.AutoModelForCausalLM.from_pretrained(root, **options)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            model = hf.AutoModel.from_pretrained(root, **options)
    seconds = time.monotonic() - start
    log.info("loaded %s in %.2f s (%.2f GB/s)", format_bytes(total), seconds, total / max(seconds, 1e-9) / 1e9)
    model.eval()
    loaded: PreTrainedModel = model
    return loaded


def offload_pretrained(
    path: str | os.PathLike[str],
    config: OffloadConfig | None = None,
    *,
    device_budget_bytes: int | None = None,
    env: EnvSnapshot | None = None,
    dtype: torch.dtype | None = None,
    runtime: Runtime | None = None,
    reserve_bytes: int = 0,
    profile: DeviceProfile | None = None,
    workload: Workload | None = None,
    layers_path: str | None = None,
    model_class: Any = None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, ModelOffloader]:
    """Load a local checkpoint and offload it: `load_on_host`, then `offload_model`.

    The model is never materialised on the device: it is loaded into host memory and
    each tensor then goes to where the plan puts it.

    Args:
        path: the checkpoint directory.
        config, device_budget_bytes, env, runtime, reserve_bytes, profile, workload,
            layers_path: as for `offload_model`.
        dtype, model_class, kwargs: as for `load_on_host`.

    Returns:
        The model, in eval mode, and its offloader (ready: ``post_init`` has run).

    Raises:
        CheckpointError: the checkpoint is missing or inconsistent.
        ConfigError, PlanError, ExecutionError: as for `offload_model`.
    """
    model = load_on_host(path, dtype=dtype, model_class=model_class, **kwargs)
    offloader = offload_model(model, config, device_budget_bytes=device_budget_bytes, env=env, runtime=runtime,
                              reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                              layers_path=layers_path)
    return model, offloader
