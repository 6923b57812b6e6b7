"""``offload load``: a local Hugging Face checkpoint loaded offloaded, one forward, restored
and checked bit for bit."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from offload.cli._shared import UserError, capture, shown
from offload.cli.parser import (
    LOAD_PREFETCH,
    gib_bytes,
)
from offload.errors import ExecutionError, OffloadError
from offload.logs import logger
from offload.pure.config import OffloadConfig
from offload.pure.fit.profiles import (
    profile_by_name,
)
from offload.pure.plan.plan import OffloadPlan
from offload.pure.spec.safetensors import printable
from offload.pure.stats import OffloadStats
from offload.pure.units import format_bytes

if TYPE_CHECKING:
    from offload.cli.progress import ProgressLine


def _load_request(args: argparse.Namespace, has_cuda: bool) -> tuple[OffloadConfig | None, int | None, str]:
    """What `offload load` asks `offload_pretrained` for: a config, or a device budget to
    fit (None with CUDA: the device's memory), and one line saying which."""
    chosen = [flag for flag, value in (("--backend", args.backend), ("--group-size", args.group_size),
                                       ("--num-in-group", args.num_in_group), ("--prefetch-step", args.prefetch_step),
                                       ("--uva-gib", args.uva_gib)) if value is not None]
    fitting_flags = [flag for flag, value in (("--reserve-gib", args.reserve_gib), ("--profile", args.profile))
                     if value is not None]
    if args.fit_gib is not None:
        if args.filter:
            raise UserError("offload load: --filter applies to a given configuration, not to --fit-gib")
        if chosen:
            raise UserError(f"offload load: --fit-gib chooses the configuration itself; drop {', '.join(chosen)}")
        if args.fit_gib == 0:
            raise UserError("offload load: --fit-gib must be greater than 0")
        return None, gib_bytes(args.fit_gib), f"fit to {format_bytes(gib_bytes(args.fit_gib))} of device memory"
    if chosen or not has_cuda:
        if fitting_flags:
            verb = "applies" if len(fitting_flags) == 1 else "apply"
            raise UserError(f"offload load: {' and '.join(fitting_flags)} {verb} only when fitting; give --fit-gib"
                             + (f" instead of {', '.join(chosen)}" if chosen else ""))
        config = (OffloadConfig(backend=args.backend or "auto", group_size=args.group_size or 0,
                                num_in_group=args.num_in_group or 1, prefetch_step=args.prefetch_step or 1,
                                uva_max_bytes=0 if args.uva_gib is None else gib_bytes(args.uva_gib),
                                param_filter=tuple(args.filter))
                  if chosen else attrs.evolve(LOAD_PREFETCH, param_filter=tuple(args.filter)))
        return config, None, "as given" if chosen else (
            "default without CUDA (prefetch, group size 2, 1 offloaded layer per group, depth 2)")
    if args.filter:
        raise UserError("offload load: --filter applies to a given configuration (--group-size ... or --uva-gib); "
                         "with CUDA and no configuration flag, the default fits the device")
    return None, None, "fit to the device's memory (default with CUDA)"


def cmd_load(args: argparse.Namespace) -> int:
    import time

    env = capture()
    config, budget, how = _load_request(args, env.platform.has_cuda)
    experts: dict[str, Any] = {}
    if args.expert_slots is not None:  # on the config where one is given, else for the fit
        if config is not None:
            config = attrs.evolve(config, expert_slots=args.expert_slots)
        else:
            experts["expert_slots"] = args.expert_slots
    try:
        import torch
        import transformers.modeling_utils  # noqa: F401  (imported before the clock starts: 2 s, not loading)

        from offload.hf import offload_pretrained
    except ImportError as exc:  # transformers is the optional `hf` extra
        raise UserError(f"offload load needs transformers: pip install 'offload[hf]' ({exc})") from None
    model_class = None if args.model_class is None else _model_class(args.model_class)
    if args.spill_dir is not None and args.host_gib is None:
        raise UserError("offload load: --spill-dir needs --host-gib")
    disk: dict[str, Any] = {} if args.host_gib is None else {
        "host_budget_bytes": gib_bytes(args.host_gib), "spill_dir": args.spill_dir}
    start = time.monotonic()
    with _ProgressScope(sys.stderr):
        try:
            model, offloader = offload_pretrained(
                args.directory, config, device_budget_bytes=budget, env=env,
                dtype=None if args.dtype is None else getattr(torch, args.dtype),
                reserve_bytes=gib_bytes(args.reserve_gib or 0.0),
                profile=profile_by_name(args.profile) if args.profile else None, model_class=model_class, **disk,
                **experts)
        except OffloadError:
            raise
        except (OSError, ValueError, RuntimeError) as exc:  # transformers refusing the directory's contents
            if args.verbose >= 2:
                raise
            lines = str(exc).strip().splitlines()
            raise UserError(f"offload load: {printable(args.directory)}: loading failed: {type(exc).__name__}: "
                             f"{lines[0] if lines else ''} (-vv for the traceback)") from None
    seconds = time.monotonic() - start
    plan = offloader.plan
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model:    {type(model).__name__} from {printable(args.directory)}: {format_bytes(nbytes)}, loaded and offloaded "
          f"in {seconds:.2f} s ({nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s)")
    print(f"config:   {how}")
    print(f"plan:     {_plan_summary(plan, _outside_bytes(model))}")
    tier = offloader.disk_tier
    if tier is not None:
        print(f"disk:     {len(tier.disk_positions)} layers on disk ({format_bytes(tier.disk_bytes)}, "
              f"{format_bytes(tier.spill_bytes)} spilled); host {format_bytes(tier.host_tier_bytes)} + staging ring "
              f"{format_bytes(tier.staging_ring_bytes)} of the {format_bytes(tier.host_budget_bytes)} budget")
    if not env.platform.has_cuda:
        print("device:   no accelerator (the compute device is the CPU): the mechanics run for real, nothing is saved")
    start = time.monotonic()
    try:
        inputs, fed = _forward_inputs(model, args.tokens, torch.device(plan.compute_device))
        if inputs is not None:
            with torch.inference_mode():
                output = model(**inputs)[0]
    except Exception as exc:  # out of memory, a kernel refusing the input, a model that needs more than token ids
        offloader.restore()  # give the weights back before saying why
        if isinstance(exc, OffloadError) or (args.verbose >= 2 and not isinstance(exc, (RuntimeError, MemoryError))):
            raise
        lines = str(exc).strip().splitlines()
        needs = "" if isinstance(exc, (RuntimeError, MemoryError)) else (
            f" ({type(model).__name__} may need other inputs than token ids; -vv for the traceback)")
        raise ExecutionError(f"the forward of {args.tokens} tokens failed: {type(exc).__name__}: "
                             f"{lines[0] if lines else ''}{needs}", name="tokens", value=args.tokens) from exc
    if inputs is None:
        print(f"forward:  skipped: {type(model).__name__} takes neither token ids nor audio features (a diffusers "
              "model takes latents): the weights were loaded and offloaded, and are checked on restore below")
        print(f"stats:    {_stats_summary(offloader.stats())}")
        return _restore_and_check(model, offloader)
    print(f"forward:  {fed} in {time.monotonic() - start:.2f} s, output {tuple(output.shape)}, "
          f"{'finite' if bool(torch.isfinite(output).all()) else 'NOT FINITE'}")
    print(f"stats:    {_stats_summary(offloader.stats())}")
    return _restore_and_check(model, offloader)


def _forward_inputs(model: Any, tokens: int, device: Any) -> tuple[dict[str, Any] | None, str]:
    """What the smoke forward hands `model`, and a phrase saying what it is: `tokens` random
    token ids; for a model of audio features and decoder ids (Whisper), random features and
    `tokens` decoder ids; for a model whose forward takes ``pixel_values`` (a
    vision-language model), one random image of its vision config's size and channels
    (`_image_inputs`), else the token ids alone and why; None for a model that takes
    neither (a diffusers model)."""
    import inspect

    import torch

    config = getattr(model, "config", None)
    try:
        names = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        names = set()
    text = config.get_text_config() if config is not None and callable(getattr(config, "get_text_config", None)) \
        else config
    vocab = int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 2) or 2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
    said = f"{tokens} token{'' if tokens == 1 else 's'}"
    dtype = next(iter(model.parameters())).dtype
    if "input_features" in names and "decoder_input_ids" in names and config is not None:
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        features = torch.randn(1, int(getattr(config, "num_mel_bins", 80)), frames, generator=generator)
        return {"input_features": features.to(device=device, dtype=dtype), "decoder_input_ids": ids}, said
    if "pixel_values" in names and config is not None:
        return _image_inputs(model, config, ids, said, names, generator, device, dtype)
    if "input_ids" in names:
        return {"input_ids": ids}, said
    return None, ""


def _image_inputs(model: Any, config: Any, ids: Any, said: str, names: set[str], generator: Any, device: Any,
                  dtype: Any) -> tuple[dict[str, Any] | None, str]:
    """One random image for a model whose forward takes ``pixel_values``: of the vision
    config's (or the config's) ``image_size`` and ``num_channels``; with token ids, after
    as many image tokens (``image_token_id``) as the model makes features of that image
    (``get_image_features``, run once to count them). Token ids alone, saying why, when
    the image cannot be built so."""
    import torch

    vision = getattr(config, "vision_config", None) or config
    size, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", 3)
    height, width = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (list, tuple)) \
        and len(size) == 2 else (None, None)
    kind = type(model).__name__
    text_only = {"input_ids": ids} if "input_ids" in names else None
    if not (isinstance(height, int) and isinstance(width, int) and isinstance(channels, int)):
        return text_only, f"{said}, text only: {kind} takes pixel_values, but its config gives no image_size"
    pixels = torch.randn(1, channels, height, width, generator=generator).to(device=device, dtype=dtype)
    image = f"1 random image ({channels}x{height}x{width} pixel_values"
    if "input_ids" not in names:
        return {"pixel_values": pixels}, image + ")"
    token = next((value for value in (getattr(config, "image_token_id", None), getattr(config, "image_token_index", None))
                  if isinstance(value, int)), None)
    counter = getattr(model, "get_image_features", None)
    if token is None or not callable(counter):
        missing = "image_token_id" if token is None else "get_image_features"
        return text_only, f"{said}, text only: {kind} takes pixel_values, but has no {missing} to place an image with"
    try:
        with torch.inference_mode():
            count = _feature_count(counter(pixel_values=pixels))
    except Exception as exc:  # a model that needs more than pixels (image sizes, grids): the text alone
        lines = str(exc).strip().splitlines()
        return text_only, (f"{said}, text only: {kind}.get_image_features refused a {channels}x{height}x{width} "
                           f"image ({type(exc).__name__}: {lines[0] if lines else ''})")
    if not count:
        return text_only, f"{said}, text only: {kind}.get_image_features gave no features to count"
    vocab = max(int(ids.max()) + 1, token + 1)
    text = torch.where(ids == token, (ids + 1) % vocab, ids)  # no image token among the text
    image_ids = torch.full((1, count), token, dtype=ids.dtype, device=ids.device)
    return ({"input_ids": torch.cat([image_ids, text], dim=1), "pixel_values": pixels},
            f"{image}, {count} image tokens) and {said}")


def _feature_count(found: Any) -> int:
    """How many feature vectors `get_image_features` gave (the image tokens they fill): a
    tensor's rows but the last dimension, a list's summed, a model output's
    ``pooler_output`` (transformers 5) or ``image_embeds``; 0 when none is found."""
    import torch

    if isinstance(found, torch.Tensor):
        return found.shape[:-1].numel() if found.dim() >= 2 else 0
    if isinstance(found, (list, tuple)):
        return sum(_feature_count(item) for item in found)
    for name in ("pooler_output", "image_embeds"):
        inner = getattr(found, name, None)
        if inner is not None:
            return _feature_count(inner)
    return 0


def _model_class(name: str) -> Any:
    """The model class ``--class NAME`` names: transformers' first, else diffusers' (imported
    only then). UserError naming it when neither has it."""
    from offload.hf.pretrained import model_class_named

    found = model_class_named(name, "transformers")
    if found is None:
        try:
            found = model_class_named(name, "diffusers")
        except ImportError:
            found = None
    if found is None:
        raise UserError(f"offload load: --class {shown(name)}: no such model class in transformers "
                        "or diffusers (a class name such as LlamaForCausalLM or FluxTransformer2DModel)")
    return found


class _ProgressScope:
    """While entered, the ``offload.load`` logger's INFO records go to a `ProgressLine`
    on `stream` (and nowhere else), and its warnings to a line of their own there (the
    progress line is finished first, so that no later progress overwrites them); on exit
    the line is finished and the logger restored."""

    def __init__(self, stream: TextIO) -> None:
        from offload.cli.progress import ProgressLine

        self._handler = ProgressLine(stream)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._handler.addFilter(lambda record: record.levelno < logging.WARNING)
        self._warnings = _WarningLine(self._handler, stream)
        self._log = logger("offload.load")
        self._saved = (self._log.level, self._log.propagate)

    def __enter__(self) -> None:
        self._log.addHandler(self._handler)
        self._log.addHandler(self._warnings)
        self._log.setLevel(logging.INFO)
        self._log.propagate = False  # shown once, by the progress line

    def __exit__(self, *exc: object) -> None:
        self._handler.end()
        self._log.removeHandler(self._handler)
        self._log.removeHandler(self._warnings)
        self._log.setLevel(self._saved[0])
        self._log.propagate = self._saved[1]


class _WarningLine(logging.Handler):
    """WARNING and above as ``WARNING offload.load: message``, one line of their own after
    finishing `progress`'s line."""

    def __init__(self, progress: ProgressLine, stream: TextIO) -> None:
        super().__init__(logging.WARNING)
        self._progress = progress
        self._stream = stream
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._progress.end()
            self._stream.write(self.format(record).replace("\n", " ") + "\n")
            self._stream.flush()
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


def _outside_bytes(model: Any) -> int:
    """Bytes of the tensors outside the layer stacks (resident on the device), each storage once."""
    from offload.hf.model import outside_tensors
    from offload.model.describe import storage_key

    seen: dict[object, int] = {}
    for _, tensor in outside_tensors(model, _layers(model)):
        seen.setdefault(storage_key(tensor) or id(tensor), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def _layers(model: Any) -> list[Any]:
    """The layers `offload_pretrained` offloaded: every stack's, in order (`find_stacks`)."""
    from offload.hf.layers import find_stacks

    return [layer for stack in find_stacks(model) for layer in stack]


def _plan_summary(plan: OffloadPlan, outside_bytes: int) -> str:
    """One line: backend, layers offloaded, device and host bytes."""
    layers = len({p.layer for p in plan.params if p.offloaded})
    cycles = len(plan.schedule.cycles)
    stacks = f" in {cycles} stacks, each prefetched on its own" if cycles else ""
    slots = sorted({c.slots for c in plan.experts})
    experts = "" if not plan.experts else (
        f"; expert caches in {len(plan.experts)} layers, {'/'.join(map(str, slots))} slots each")
    return (f"{plan.backend.value}, {layers} of {plan.num_layers} layers offloaded{stacks}; device "
            f"{format_bytes(plan.device_bytes_resident)} resident + {format_bytes(plan.device_bytes_buffers)} "
            f"buffers + {format_bytes(outside_bytes)} outside the layers; host {format_bytes(plan.host_bytes)}"
            f"{experts}")


def _stats_summary(stats: OffloadStats) -> str:
    waited = "n/a" if stats.wait_seconds is None else f"{stats.wait_seconds:.3f} s"
    disk = "" if not stats.disk_layers else (
        f", {format_bytes(stats.disk_bytes_read)} read from disk"
        + ("" if stats.disk_gbps is None else f" at {stats.disk_gbps:.2f} GB/s"))
    experts = "" if not stats.experts else (
        f", experts {sum(c.hits for c in stats.experts)} hits and {sum(c.misses for c in stats.experts)} misses")
    return (f"{stats.params_offloaded} parameters offloaded, host {format_bytes(stats.host_bytes)}, device buffers "
            f"{format_bytes(stats.device_buffer_bytes)}, {stats.copies_issued} copies of "
            f"{format_bytes(stats.bytes_copied)}, waited {waited}, {stats.pin_fallbacks} pin fallbacks{disk}{experts}")


def _restore_and_check(model: Any, offloader: Any) -> int:
    """Restore, and compare the weights of the first and last offloaded layers with their
    true values from the offloaded model's ``state_dict()`` (its host copies), bit for
    bit; every parameter must be off the meta device. Returns the exit status."""
    import torch

    layers = _layers(model)
    hit = sorted({p.layer for p in offloader.plan.params if p.offloaded})
    chosen = list(dict.fromkeys(hit[:1] + hit[-1:]))

    def sample() -> dict[str, torch.Tensor]:
        return {f"layer {i} {name}": tensor.detach() for i in chosen for name, tensor in layers[i].state_dict().items()}

    before = {key: tensor.clone() for key, tensor in sample().items()}
    offloader.restore()
    after = sample()
    wrong = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    wrong += [key for key, want in before.items() if key not in after or not torch.equal(after[key].cpu(), want.cpu())]
    if wrong:
        print(f"restore:  FAILED: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''} not given back")
        return 1
    shown = " and ".join(f"{i}" for i in chosen) or "none"
    print(f"restore:  done; {len(before)} tensors of layers {shown} equal bit for bit to the offloaded model's "
          "state_dict (its host copies)")
    return 0
