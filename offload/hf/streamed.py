"""`offload_pretrained(path, ..., host_budget_bytes=)`: a checkpoint larger than host memory,
loaded without ever holding its disk tier there.

`load_on_host` has transformers (or diffusers) load every weight into host memory, which a
model larger than host memory cannot afford. With a host budget the model is loaded here
instead:

1. The saved class is built with its parameters on meta and its buffers real (rotary
   tables and the like are computed as the class computes them), weights tied as the
   class ties them: a transformers model from its config (``AutoConfig``), a diffusers
   model from its ``load_config`` with ``from_config``, as diffusers' ``from_pretrained``
   builds it (`_build`).
2. The plan and its disk tier are made from it (`plan_model`, `plan_model_disk`).
3. The weights outside the layers are read from the checkpoint, one tensor at a time.
4. The layers are wrapped: a disk parameter's host copy is its checkpoint bytes, mapped
   where they lie (nothing read); every other parameter gets host (or device) memory.
5. The other layer weights are read from the checkpoint into their copies, one tensor at
   a time (`load_weights`), and `post_init` runs.

Every tensor is read with ``O_DIRECT`` (`offload.runtime.diskio.DiskReader`; buffered with
its pages dropped where the filesystem refuses it) into one buffer of the largest tensor's
size, reused (`_TensorReads`): the load leaves nothing in the page cache, and host memory
peaks at the host tier, the staging ring, the weights outside the layers and that one
buffer (no allocation per tensor, whose freed memory the C allocator would keep).

The dtype: with `dtype`, every floating-point weight in it (diffusers: except the modules
its ``_keep_in_fp32_modules`` names, kept in float32, as diffusers keeps them). Without it,
a transformers model in the dtype most of the checkpoint's floating-point bytes are stored
in (transformers' per-module rules such as ``_keep_in_fp32_modules`` are not applied), a
diffusers model as diffusers builds it without ``torch_dtype`` (float32, the default).

Each weight is read from the stored tensors that make it (`offload.hf.conversions`): its
own, or those transformers' load-time conversions give it (renamed keys; MoE experts
stored one tensor per expert, each read into its rows of the fused tensor: into the host
copy, or, for a disk weight, written to the spill file piece by piece: `PieceSpill`). A
conversion operation not carried out there, a `dtype` other than the one stored for a
disk weight read where it lies, or quantisation at load are refused, naming the first
weight; load those without a host budget.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, final

import attrs
import torch
from torch import nn

from offload.errors import CheckpointError, ConfigError, ExecutionError, OffloadError
from offload.executors.common import torch_dtype
from offload.hf.conversions import LiveSource, Outside, live_sources, outside_sources, source_of
from offload.hf.disk import DiskRequest, PieceSpill, plan_model_disk
from offload.hf.layers import find_stacks
from offload.hf.model import NO_EXPERT_OPTIONS, BudgetExperts, plan_model
from offload.hf.offloader import ModelOffloader, outside_bytes, outside_tensors
from offload.logs import logger
from offload.model.checkpoint import checkpoint_extents
from offload.model.describe import describe_stacks
from offload.protocols import Runtime
from offload.pure.config import OffloadConfig
from offload.pure.disk.tier import DiskSource
from offload.pure.env.snapshot import EnvSnapshot
from offload.pure.fit.estimate import Workload
from offload.pure.fit.profiles import DeviceProfile
from offload.pure.spec.extents import DiskExtent
from offload.pure.spec.safetensors import TensorHeader
from offload.pure.units import format_bytes
from offload.runtime.diskio import BLOCK_BYTES, DiskReader

__all__ = ["build_on_meta", "load_streamed", "params_on_meta"]

log = logger("offload.load")


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While in it, every parameter a module registers is put on meta (its memory freed at
    once); buffers stay where they are made. Not thread-safe: it patches
    ``nn.Module.register_parameter`` for the time being."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]  # restored below
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]  # as it was


@final
class _TensorReads:
    """Checkpoint tensors read one at a time into one reused buffer.

    The buffer is an anonymous mapping (page-aligned; unmapped when the last view of it
    goes) of `nbytes` plus two blocks. Each tensor lands in it at its file offset modulo
    the block, so that `DiskReader` reads its whole blocks straight in with ``O_DIRECT``;
    only the partial blocks at its ends go through the reader's per-thread staging.

    Args:
        nbytes: the largest tensor to read, in bytes.
    """

    def __init__(self, nbytes: int) -> None:
        self._region: mmap.mmap | None = mmap.mmap(-1, nbytes + 2 * BLOCK_BYTES)
        self._buffer = torch.frombuffer(self._region, dtype=torch.uint8)
        self._reader = DiskReader()

    def read(self, extent: DiskExtent, header: TensorHeader) -> torch.Tensor:
        """The tensor `header` describes, read from its bytes (`extent`): a view of the
        buffer, valid until the next read (copy it to keep it).

        Raises:
            CheckpointError: the read failed or came up short (naming the file and tensor).
        """
        dtype = torch_dtype(header.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        start = extent.offset % BLOCK_BYTES
        start += -start % size  # a typed view starts on its element size (else: staged, not straight in)
        dest = self._buffer[start:start + extent.length]
        try:
            self._reader.submit(extent.path, extent.offset, extent.length, dest).wait()
        except ExecutionError as exc:
            raise CheckpointError(f"reading tensor {header.name!r} from {extent.path!r} failed: {exc}",
                                  name=extent.path, value=header.name) from exc
        return dest.view(dtype).view(header.shape)

    def close(self) -> None:
        """Join the reader's threads and let go of the buffer (idempotent)."""
        self._reader.close()
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._region = None  # unmapped once no view of it is left


def _build(model_class: Any, root: Path, dtype: torch.dtype | None, library: str,
           stored: Collection[str]) -> nn.Module:
    """The saved class from `root`'s config, parameters on meta, buffers real, in eval mode.

    Raises:
        ConfigError: a diffusers model and a `dtype` it is not built in (integer, float8).
        CheckpointError: the library failed building it (names `root` and the class).
    """
    shown = getattr(model_class, "__name__", repr(model_class))
    if library == "diffusers" and dtype is not None and (not dtype.is_floating_point or dtype.itemsize == 1):
        raise ConfigError(f"dtype {dtype} for the diffusers model {shown}: diffusers builds a model in a "
                          "floating-point dtype of 16 bits or more (float8: it casts the model after loading, "
                          "which a streamed load does not do; load without host_budget_bytes)", name="dtype",
                          value=str(dtype))
    try:
        model = (_build_diffusers(model_class, root, dtype, stored) if library == "diffusers"
                 else _build_transformers(model_class, root, dtype))
    except OffloadError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{root}: {library} could not build {shown} from its config.json with its "
                              f"parameters on meta: {type(exc).__name__}: {exc}", name=str(root),
                              value=shown) from exc
    model.eval()
    return model


def build_on_meta(model_class: Any, root: Path) -> nn.Module:
    """The transformers `model_class` from `root`'s config as a streamed load builds it
    (`_build`: parameters on meta, buffers real), to describe the live model unloaded.

    Raises:
        CheckpointError: transformers could not build it (naming `root` and the class).
    """
    return _build(model_class, root, None, "transformers", ())


def _build_transformers(model_class: Any, root: Path, dtype: torch.dtype | None) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with params_on_meta():
        model: nn.Module = model_class._from_config(config, dtype=dtype)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model


def _build_diffusers(model_class: Any, root: Path, dtype: torch.dtype | None, stored: Collection[str]) -> nn.Module:
    """As diffusers' ``from_pretrained`` builds it with ``low_cpu_mem_usage`` (accelerate's
    ``init_empty_weights``: parameters on meta, buffers real; init functions skipped),
    under ``torch_dtype`` = `dtype`; with `dtype`, every floating-point tensor the
    checkpoint holds (`stored`) is then in `dtype`, float32 in the modules
    ``_keep_in_fp32_modules`` names, as diffusers casts them at load."""
    from diffusers.models.modeling_utils import no_init_weights

    config = model_class.load_config(root, local_files_only=True)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype is not None else before)  # as _set_default_torch_dtype does
    try:
        with no_init_weights(), params_on_meta():
            model: nn.Module = model_class.from_config(config)
    finally:
        torch.set_default_dtype(before)
    if dtype is not None:
        _cast_as_diffusers(model, dtype, tuple(getattr(model_class, "_keep_in_fp32_modules", None) or ()), stored)
    register = getattr(model, "register_to_config", None)
    if callable(register):
        register(_name_or_path=root)  # as from_pretrained records it (load_on_host passes a Path)
    return model


def _cast_as_diffusers(model: nn.Module, dtype: torch.dtype, keep: Sequence[str], stored: Collection[str]) -> None:
    """Every floating-point parameter and buffer of `model` that the checkpoint holds
    (`stored`, by full name) in `dtype`, or float32 where a dotted part of its name is in
    `keep` (diffusers' ``load_model_dict_into_meta``); a tie stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for slots, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(slots.items()):
                full = f"{path}.{name}" if path else name
                if tensor is None or full not in stored or not tensor.is_floating_point():
                    continue
                want = torch.float32 if any(part in keep for part in full.split(".")) else dtype
                if id(tensor) in done:
                    slots[name] = done[id(tensor)]
                elif tensor.dtype != want:
                    new = (nn.Parameter(tensor.detach().to(want), requires_grad=tensor.requires_grad) if is_param
                           else tensor.to(want))
                    done[id(tensor)] = slots[name] = new


def _stored_dtype(tensors: Mapping[str, TensorHeader]) -> torch.dtype:
    """The dtype most of the checkpoint's floating-point bytes are stored in."""
    counts: dict[str, int] = {}
    for header in tensors.values():
        if torch_dtype(header.dtype).is_floating_point:
            counts[header.dtype] = counts.get(header.dtype, 0) + header.end - header.begin
    if not counts:
        raise CheckpointError("the checkpoint holds no floating-point tensor", name="dtype", value=None)
    return torch_dtype(max(counts, key=lambda name: counts[name]))


def _read_outside(found: Sequence[Outside], read: Callable[[str], torch.Tensor]) -> None:
    """Read each tensor of `found` into memory of its own (each stored tensor of it into its
    region), in the model's dtype, and put it in every place that holds it."""
    for where, source, tensor, is_param in found:
        data = torch.empty(tensor.shape, dtype=tensor.dtype)  # its own memory, not the read buffer
        for piece in source.pieces:
            piece.view(data).copy_(read(piece.stored))
        new = nn.Parameter(data, requires_grad=tensor.requires_grad) if is_param else data
        for module, name in where:
            if is_param:
                module._parameters[name] = new  # type: ignore[assignment]  # a Parameter
            else:
                module._buffers[name] = new


def _layer_weights(wanted: Sequence[tuple[int, str]], layer_names: Sequence[str], sources: Mapping[str, LiveSource],
                   read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer weight that is one stored tensor, as `load_weights` names it, read from
    the checkpoint as it is asked for into the read buffer (`load_weights` copies it into
    the weight, converting its dtype, before it asks for the next)."""
    for layer, name in wanted:
        whole = source_of(sources, f"{layer_names[layer]}.{name}").whole
        if whole is not None:
            yield f"{layer}.{name}", read(whole)


def _fill_pieces(wanted: Sequence[tuple[int, str]], layers: Sequence[nn.Module], layer_names: Sequence[str],
                 sources: Mapping[str, LiveSource], read: Callable[[str], torch.Tensor]) -> None:
    """Each layer weight made of several stored tensors (fused experts), written piece by
    piece into the memory it points at after ``wrap_modules`` (its host copy, or the
    device), one stored tensor in the read buffer at a time."""
    with torch.no_grad():
        for layer, name in wanted:
            source = source_of(sources, f"{layer_names[layer]}.{name}")
            if source.whole is None:
                data = layers[layer].get_parameter(name).data
                if tuple(data.shape) != source.shape:
                    raise CheckpointError(f"{source.name}: {source.shape} in the checkpoint, {tuple(data.shape)} in "
                                          "the model", name=source.name, value=source.shape)
                for piece in source.pieces:
                    piece.view(data).copy_(read(piece.stored))


def load_streamed(
    path: str | os.PathLike[str],
    model_class: Any,
    config: OffloadConfig | None,
    *,
    disk: DiskRequest,
    device_budget_bytes: int | None,
    env: EnvSnapshot,
    dtype: torch.dtype | None,
    runtime: Runtime | None,
    reserve_bytes: int,
    profile: DeviceProfile | None,
    workload: Workload | None,
    layers_path: str | Sequence[str] | None,
    library: str = "transformers",
    experts: BudgetExperts = NO_EXPERT_OPTIONS,
) -> tuple[nn.Module, ModelOffloader]:
    """`offload_pretrained` with a host budget (see the module docstring).

    Args:
        library: which library's class `model_class` is: ``"transformers"`` or
            ``"diffusers"`` (how it is built, and its dtype without `dtype`).
        The others: as for `offload_pretrained`.

    Raises:
        CheckpointError: the library could not build the class from the config; a weight
            is not in the checkpoint (under its name or one transformers' conversions give
            it), or of another shape, or transformers makes it with an operation not
            carried out here (`offload.hf.conversions`); a disk weight read where it lies
            would have to be converted (a `dtype` other than the stored one); a read failed.
        ConfigError, PlanError, ExecutionError: as for `offload_model`.
    """
    root = Path(path)
    found = checkpoint_extents(root)
    if library == "diffusers":
        chosen = dtype  # None: as diffusers builds it without torch_dtype
    else:
        chosen = dtype if dtype is not None else _stored_dtype(found.tensors)
    start = time.monotonic()
    model = _build(model_class, root, chosen, library, found.tensors.keys())
    stacks = find_stacks(model, layers_path)
    layers = [layer for stack in stacks for layer in stack]
    spec = describe_stacks(stacks)
    rest = outside_tensors(model, layers)
    names = {id(module): name for name, module in model.named_modules()}
    layer_names = [names[id(layer)] for layer in layers]
    plan = plan_model(spec, env, config=config, device_budget_bytes=device_budget_bytes,
                      outside_bytes=outside_bytes(rest), reserve_bytes=reserve_bytes, profile=profile,
                      workload=workload, disk=attrs.evolve(disk, checkpoint=root), layer_names=layer_names,
                      experts=experts)
    tier = plan_model_disk(model, layers, plan, env, attrs.evolve(disk, checkpoint=root))
    sources = live_sources(model, found.tensors)
    on_disk = {(p.layer, p.name): p for p in tier.params} if tier is not None else {}
    pieced = [(p, source_of(sources, f"{layer_names[p.layer]}.{p.name}")) for p in on_disk.values()
              if p.source is DiskSource.SPILL]
    spilled = next((p for p, source in pieced if source.as_stored), None)
    if spilled is not None:
        raise CheckpointError(f"layer {spilled.layer} parameter {spilled.name!r} would go to disk but cannot be read "
                              f"from the checkpoint as the model holds it ({spilled.reason}). Load with the dtype it "
                              "is stored in, or, where host memory holds the model while it loads, load it "
                              "(load_on_host) and offload it with offload_model(model, ..., host_budget_bytes=, "
                              "checkpoint=path, spill_dir=), which spills what the checkpoint does not hold as the "
                              "model does", name=spilled.name, value=spilled.layer)
    outside = outside_sources(model, layers, sources)
    wanted = [(p.layer, p.name) for p in plan.params if p.tied_to is None and (p.layer, p.name) not in on_disk]
    made = [s for _, s, _, _ in outside] + [s for _, s in pieced] + [
        source_of(sources, f"{layer_names[i]}.{n}") for i, n in wanted]
    largest = max((found.extents[piece.stored].length for s in made for piece in s.pieces), default=0)
    from offload.create import create_offloader, default_runtime
    from offload.executors.prefetch import PrefetchOffloader

    with contextlib.closing(_TensorReads(largest)) as reads:

        def read(stored: str) -> torch.Tensor:
            return reads.read(found.extents[stored], found.tensors[stored])

        _read_outside(outside, read)
        rt = runtime if runtime is not None else default_runtime(plan)
        spill = PieceSpill(read)
        for p, source in pieced:  # spilled at wrap_modules from their pieces (never whole in memory)
            spill.place(layers[p.layer], p.name, source)
        inner = (PrefetchOffloader(plan, rt, disk=tier, spill_dir=disk.spill_dir, disk_io=spill.io) if pieced
                 else create_offloader(plan, rt, disk=tier, spill_dir=disk.spill_dir))  # the same, but its spill file
        offloader = ModelOffloader(model, layers, inner, rt)
        offloader.wrap_modules(layers)
        try:
            spill.check()
            offloader.inner.load_weights(_layer_weights(wanted, layer_names, sources, read))
            _fill_pieces(wanted, layers, layer_names, sources, read)
        except BaseException as exc:
            _give_back(offloader, exc)
    try:
        offloader.post_init()  # the read buffer is gone: the ring and the buffers take its place
    except BaseException as exc:
        _give_back(offloader, exc)
    total = plan.host_bytes + plan.device_bytes_resident
    log.info("loaded %s (%d layers on disk) in %.2f s", format_bytes(total),
             len(tier.disk_positions) if tier is not None else 0, time.monotonic() - start)
    return model, offloader


def _give_back(offloader: ModelOffloader, exc: BaseException) -> None:
    """Restore the model (nothing kept) and raise `exc`: a CheckpointError or a
    BaseException that is not an Exception as it is, anything else as an ExecutionError."""
    offloader.restore()
    if not isinstance(exc, Exception) or isinstance(exc, CheckpointError):
        raise exc
    raise ExecutionError(f"loading the layers' weights failed, nothing kept: {exc}", name="load",
                         value=type(exc).__name__) from exc
