"""`offload_pretrained`: from a local checkpoint directory to a ready, offloaded model.

The weights are loaded by `transformers` (or `diffusers`, for a diffusers model) itself
(weight renaming, fused MoE experts, dtype rules), into host memory, never onto the
device; `offload_model` then moves each tensor to where the plan puts it, one at a time.
Host memory peaks at about the model's bytes plus its largest tensor; device memory at the
plan's resident bytes and buffers, the weights outside the layers, plus the largest tensor.

The class built is the one that was saved (``config.json``'s ``architectures`` or
``_class_name``), and a checkpoint whose weights do not all load into it is an error; the
exact rule is `load_on_host`'s.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from offload.errors import CheckpointError, ConfigError
from offload.hf.disk import DiskRequest, disk_request
from offload.hf.model import BudgetExperts, ModelOffloader, offload_model
from offload.logs import logger
from offload.protocols import Runtime
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.experts.values import RoutingProfile, RoutingTrace
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.spec.safetensors import printable, short_repr
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["load_on_host", "model_class_named", "offload_pretrained", "saved_class"]

log = logger("offload.load")

#: How many key names an error about unloaded weights shows, of each kind.
_KEYS_SHOWN = 3
_PASS_CLASS = "pass the class that was saved as model_class= (offload load: --class NAME)"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("offload_pretrained needs transformers: pip install 'offload[hf]'") from exc
    return transformers


def _library(name: str) -> Any:
    """The `transformers` or `diffusers` module (imported now); ImportError when not installed."""
    if name == "transformers":
        return _transformers()
    import diffusers

    return diffusers


def model_class_named(name: str, library: str) -> Any | None:
    """``transformers.<name>`` or ``diffusers.<name>`` (`library`) when it is a model class
    there (a `PreTrainedModel` or diffusers `ModelMixin` subclass, or an ``AutoModel...``
    class), else None. Imports `library`: ImportError when it is not installed."""
    module = _library(library)
    if not name.isidentifier():
        return None
    try:
        found = getattr(module, name)
    except AttributeError:
        return None
    base = module.PreTrainedModel if library == "transformers" else module.ModelMixin
    if not isinstance(found, type):
        return None
    auto = found.__name__.startswith("AutoModel") and callable(getattr(found, "from_pretrained", None))
    return found if issubclass(found, base) or auto else None


def _is_diffusers(model_class: Any) -> bool:
    """Whether `model_class` is a diffusers model (diffusers is not imported for this)."""
    diffusers = sys.modules.get("diffusers")
    return (diffusers is not None and isinstance(model_class, type)
            and issubclass(model_class, diffusers.ModelMixin))


def _read_config(path: Path) -> Mapping[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{printable(str(path))}: not a readable JSON file: {exc}", name=str(path),
                              value=None) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{printable(str(path))}: holds a {type(config).__name__}, not a JSON object",
                              name=str(path), value=short_repr(config))
    return config


def saved_class(path: Path) -> tuple[Any | None, str]:
    """The class ``config.json`` (`path`) names and where the name came from; None for no
    name at all (the Auto fallback). Raises CheckpointError when a name cannot be built."""
    config = _read_config(path)
    shown = printable(str(path))
    if "_class_name" in config:
        name = config["_class_name"]
        if not isinstance(name, str):
            raise CheckpointError(f"{shown}: _class_name is {short_repr(name)}, not a class name; {_PASS_CLASS}",
                                  name=str(path), value=name)
        try:
            found = model_class_named(name, "diffusers")
        except ImportError as exc:
            raise CheckpointError(f"{shown}: names the diffusers model {name!r} (_class_name), and diffusers is "
                                  f"not installed ({exc}): pip install diffusers, or {_PASS_CLASS}",
                                  name=str(path), value=name) from exc
        if found is None:
            raise CheckpointError(f"{shown}: names the diffusers model {name!r} (_class_name), which diffusers "
                                  f"{_library('diffusers').__version__} does not have; {_PASS_CLASS}",
                                  name=str(path), value=name)
        return found, "config.json _class_name"
    names = config.get("architectures")
    if names is None or names == []:
        return None, "config.json has no architectures"
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{shown}: architectures is {short_repr(names)}, not a list of class names; "
                              f"{_PASS_CLASS}", name=str(path), value=short_repr(names))
    distinct = list(dict.fromkeys(names))
    if len(distinct) > 1:
        raise CheckpointError(f"{shown}: architectures names {len(distinct)} classes ({', '.join(distinct)}): "
                              f"which was saved is not known; {_PASS_CLASS}", name=str(path), value=tuple(distinct))
    found = model_class_named(distinct[0], "transformers")
    if found is None:
        custom = " (custom code, see its auto_map)" if "auto_map" in config else ""
        raise CheckpointError(f"{shown}: architectures names {distinct[0]!r}{custom}, which transformers "
                              f"{_transformers().__version__} does not have; {_PASS_CLASS}",
                              name=str(path), value=distinct[0])
    return found, "config.json architectures"


def _from_pretrained(model_class: Any, root: Path, options: dict[str, Any]) -> tuple[Any, Mapping[str, Any]]:
    """`model_class.from_pretrained` with ``output_loading_info``: the model and its report."""
    result = model_class.from_pretrained(root, **options, output_loading_info=True)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        return result[0], result[1]
    kind = type(result).__name__
    del result  # not kept alive by the traceback
    raise CheckpointError(f"{getattr(model_class, '__name__', model_class)}.from_pretrained returned a {kind}, not "
                          "the model and its loading report (output_loading_info=True): load_on_host needs a "
                          "transformers or diffusers model class", name="model_class", value=model_class)


def _unloaded(info: Mapping[str, Any]) -> tuple[str, dict[str, tuple[str, ...]]] | None:
    """What the loading report says did not load (one phrase and the keys by kind), or None."""
    kinds = (("missing_keys", "missing from the checkpoint"),
             ("unexpected_keys", "in the checkpoint but not in the model"),
             ("mismatched_keys", "of another shape in the checkpoint"))
    phrases: list[str] = []
    found: dict[str, tuple[str, ...]] = {}
    for key, what in kinds:
        names = tuple(sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ()))
        if names:
            found[key] = names
            more = ", ..." if len(names) > _KEYS_SHOWN else ""
            phrases.append(f"{len(names)} {what} ({', '.join(names[:_KEYS_SHOWN])}{more})")
    return ("; ".join(phrases), found) if phrases else None


def load_on_host(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                 model_class: Any = None, **kwargs: Any) -> PreTrainedModel:
    """Load a local checkpoint into host memory as the class that was saved, in eval mode.

    The class built:

    1. `model_class`, when given, always.
    2. Else ``config.json``'s ``_class_name`` (a diffusers model): ``diffusers.<name>``;
       diffusers is imported only then. diffusers not installed, or without that model
       class: `CheckpointError`.
    3. Else its ``architectures``: ``transformers.<name>`` when it names one class (repeats
       count once). A class the installed transformers lacks (a newer model, custom
       code), or several different names: `CheckpointError` naming them.
    4. No ``architectures`` (absent, null or empty): ``AutoModelForCausalLM``, else
       ``AutoModel`` for configurations without a causal-LM head, logged at WARNING on
       ``offload.load`` naming the class built. This fallback is safe because of the
       check below: a class that does not take every weight is refused.

    Every error above says to pass `model_class`. Then every weight must load: keys the
    class expects and the checkpoint lacks (missing), keys the checkpoint holds and the
    class has no place for (unexpected) and keys of another shape (only reported under
    ``ignore_mismatched_sizes=True``) raise `CheckpointError` naming the first few of each
    with their counts, and the model is released. Keys the library leaves out on purpose
    do not count: transformers' ``_keys_to_ignore_on_load_missing``/``_unexpected`` and
    the tied weights it re-ties (a GPT-2 or Gemma head saved as its embedding), diffusers'
    ``_keys_to_ignore_on_load_unexpected``.

    Args:
        path: a directory with ``config.json`` and safetensors weights (nothing is
            downloaded).
        dtype: the parameters' dtype (default: as the library decides for the checkpoint);
            passed as ``dtype`` to transformers, ``torch_dtype`` to diffusers.
        model_class: the class to load with, a transformers or diffusers model class (or
            an Auto class); its ``from_pretrained`` must take ``output_loading_info``.
        kwargs: passed to ``from_pretrained`` (``output_loading_info`` is always True).

    Returns:
        The model, in host memory. It is typed as a `PreTrainedModel`; from a diffusers
        checkpoint it is the diffusers model (a ``ModelMixin``).

    Raises:
        CheckpointError: the directory, its config or its weights are missing or
            inconsistent, the saved class cannot be built, or not every weight loaded.
    """
    from offload.model.checkpoint import read_checkpoint

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory (offload_pretrained loads local checkpoints)",
                              name=str(root), value=None)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json", name=str(root / "config.json"), value=None)
    source = "given"
    if model_class is None:
        model_class, source = saved_class(root / "config.json")
    checkpoint = read_checkpoint(root)  # every shard present and consistent, before loading anything
    total = checkpoint.spec.nbytes + checkpoint.outside_bytes
    options: dict[str, Any] = {"local_files_only": True, **kwargs}
    options.pop("output_loading_info", None)
    if dtype is not None:
        options["torch_dtype" if _is_diffusers(model_class) else "dtype"] = dtype
    shown = "an Auto class" if model_class is None else getattr(model_class, "__name__", repr(model_class))
    log.info("loading %s (%s in the checkpoint) into host memory as %s (%s)", root, format_bytes(total), shown,
             source)
    start = time.monotonic()
    if model_class is not None:
        model, info = _from_pretrained(model_class, root, options)
    else:
        hf = _transformers()
        try:
            model, info = _from_pretrained(hf.AutoModelForCausalLM, root, options)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
            model, info = _from_pretrained(hf.AutoModel, root, options)
        log.warning("%s: config.json names no architectures; built %s (the Auto fallback), pass model_class= "
                    "to choose", root, type(model).__name__)
    unloaded = _unloaded(info)
    if unloaded is not None:
        built = type(model).__name__
        del model, info  # released: the traceback keeps this frame, not the weights
        gc.collect()
        raise CheckpointError(f"{printable(str(root))}: not every weight loaded into {built} ({source}): "
                              f"{unloaded[0]}; the checkpoint does not match the class: {_PASS_CLASS}",
                              name=str(root), value=unloaded[1])
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
    layers_path: str | Sequence[str] | None = None,
    model_class: Any = None,
    host_budget_bytes: int | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    disk_gbps: float | None = None,
    read_ahead: int = 2,
    expert_cache: bool = True,
    expert_slots: int | None = None,
    routing_profile: RoutingProfile | None = None,
    routing_trace: RoutingTrace | None = None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, ModelOffloader]:
    """Load a local checkpoint and offload it: `load_on_host`, then `offload_model`; with
    `host_budget_bytes`, streamed from the checkpoint instead (`offload.hf.streamed`), so
    that the layers that go to disk are never in host memory.

    The model is never materialised on the device: it is loaded into host memory and
    each tensor then goes to where the plan puts it. The class built is the one that was
    saved (``config.json``'s ``architectures``, or ``_class_name`` for diffusers), or
    `model_class` when given, and every weight of the checkpoint must load into it: the
    rule is `load_on_host`'s.

    Args:
        path: the checkpoint directory.
        config, device_budget_bytes, env, runtime, reserve_bytes, profile, workload,
            layers_path, expert_cache, expert_slots, routing_profile, routing_trace: as for
            `offload_model`.
        dtype, model_class, kwargs: as for `load_on_host`.
        host_budget_bytes, spill_dir, disk_gbps, read_ahead: the disk tier, as for
            `offload_model` (its `checkpoint` is `path`). The model is then built with
            its parameters on meta and its weights read by name from the checkpoint one
            tensor at a time, the disk layers' mapped where they lie; `kwargs` are
            refused, and so are checkpoints whose names or layouts transformers converts
            at load (see `offload.hf.streamed`).

    Returns:
        The model, in eval mode, and its offloader (ready: ``post_init`` has run).

    Raises:
        CheckpointError: the checkpoint is missing or inconsistent, its class cannot be
            built, or not every weight loaded (as for `load_on_host`).
        ConfigError, PlanError, ExecutionError: as for `offload_model`.
    """
    disk = disk_request(host_budget_bytes, spill_dir=spill_dir, disk_gbps=disk_gbps, read_ahead=read_ahead)
    experts = BudgetExperts(expert_cache=expert_cache, expert_slots=expert_slots, routing_profile=routing_profile,
                            routing_trace=routing_trace)
    if disk is not None:
        return _streamed(path, config, disk, device_budget_bytes=device_budget_bytes, env=env, dtype=dtype,
                         runtime=runtime, reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                         layers_path=layers_path, model_class=model_class, kwargs=kwargs, experts=experts)
    model = load_on_host(path, dtype=dtype, model_class=model_class, **kwargs)
    offloader = offload_model(model, config, device_budget_bytes=device_budget_bytes, env=env, runtime=runtime,
                              reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                              layers_path=layers_path, expert_cache=expert_cache, expert_slots=expert_slots,
                              routing_profile=routing_profile, routing_trace=routing_trace)
    return model, offloader


def _streamed(path: str | os.PathLike[str], config: OffloadConfig | None, disk: DiskRequest, *,
              device_budget_bytes: int | None, env: EnvSnapshot | None, dtype: torch.dtype | None,
              runtime: Runtime | None, reserve_bytes: int, profile: DeviceProfile | None, workload: Workload | None,
              layers_path: str | Sequence[str] | None, model_class: Any,
              kwargs: Mapping[str, Any], experts: BudgetExperts) -> tuple[PreTrainedModel, ModelOffloader]:
    """`offload_pretrained` with a host budget: `offload.hf.streamed.load_streamed`."""
    from offload.hf.streamed import load_streamed

    if kwargs:
        raise ConfigError(f"from_pretrained options ({', '.join(sorted(kwargs))}) are not taken with "
                          "host_budget_bytes: the weights are read from the checkpoint as they are stored",
                          name=sorted(kwargs)[0], value=None)
    root = Path(path)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root}: no config.json", name=str(root / "config.json"), value=None)
    source = "given"
    if model_class is None:
        model_class, source = saved_class(root / "config.json")
    if model_class is None:
        raise CheckpointError(f"{root}: config.json names no architectures ({source}): {_PASS_CLASS}",
                              name=str(root), value=None)
    if env is None:
        from offload.capture import capture_env

        env = capture_env()
    log.info("loading %s as %s (%s), streamed: host budget %s", root, getattr(model_class, "__name__", model_class),
             source, format_bytes(disk.host_budget_bytes))
    model, offloader = load_streamed(root, model_class, config, disk=disk,
                                     device_budget_bytes=device_budget_bytes, env=env, dtype=dtype, runtime=runtime,
                                     reserve_bytes=reserve_bytes, profile=profile, workload=workload,
                                     layers_path=layers_path, experts=experts,
                                     library="diffusers" if _is_diffusers(model_class) else "transformers")
    loaded: PreTrainedModel = model  # type: ignore[assignment]  # a transformers (or diffusers) model, built from its class
    return loaded, offloader
