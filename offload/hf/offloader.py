"""`ModelOffloader`: the `Offloader` of a whole model. Its inner executor runs the plan
on the layer stacks; every tensor outside them (embeddings, the output head, the final
norm, every buffer) goes to the compute device one tensor at a time when the model is
wrapped, and back where it was on `restore`. Made by `offload_model` (`offload.hf.model`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import final

import torch
from torch import nn

from offload.errors import ExecutionError, PlanError
from offload.executors.common import normal_tensors, raise_as_execution_error
from offload.logs import logger
from offload.model.describe import storage_key
from offload.model.wrappers import inner_tensors, is_wrapper
from offload.protocols import Offloader, Runtime
from offload.pure.check import LiveCheck
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.plan.plan import OffloadPlan
from offload.pure.stats import OffloadStats
from offload.pure.units import format_bytes

__all__ = ["ModelOffloader", "Slot", "outside_bytes", "outside_tensors"]

log = logger("offload.load")


#: Where a tensor outside the layers sits: (module, attribute name, is it a parameter).
Slot = tuple[nn.Module, str, bool]


def outside_tensors(model: nn.Module, layers: Sequence[nn.Module]) -> list[tuple[Slot, torch.Tensor]]:
    """Every tensor of `model` that the layers' plan does not place: parameters outside
    the layers and every buffer (inside the layers too), in module order."""
    inside = {id(module) for layer in layers for module in layer.modules()}
    found: list[tuple[Slot, torch.Tensor]] = []
    for module in model.modules():
        if id(module) not in inside:
            for name, param in module._parameters.items():
                if param is not None:
                    found.append(((module, name, True), param))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                found.append(((module, name, False), buffer))
    return found


def outside_bytes(tensors: Sequence[tuple[Slot, torch.Tensor]]) -> int:
    """Bytes of the tensors outside the layers, each storage once (a quantised weight's:
    its inner tensors')."""
    seen: set[object] = set()
    total = 0
    for _, outer in tensors:
        for tensor in inner_tensors(outer):
            key: object = storage_key(tensor) or id(tensor)
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total


@final
class ModelOffloader:
    """The `Offloader` of a whole model: `inner` runs the plan on the layer stack, and
    every other tensor of the model is put on the runtime's device (and back on restore).

    Create it with `offload_model`.

    Args:
        model: the whole model.
        layers: its layer stack, the layers `inner`'s plan describes.
        inner: the executor for the layers (`create_offloader`).
        runtime: the effects `inner` uses.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], inner: Offloader, runtime: Runtime) -> None:
        self._model = model
        self._layers = list(layers)
        self._inner = inner
        self._rt = runtime
        self._moved: list[tuple[Slot, torch.device]] = []  # what went to the device, and from where

    @property
    def model(self) -> nn.Module:
        """The model."""
        return self._model

    @property
    def inner(self) -> Offloader:
        """The executor that runs the plan on the layers."""
        return self._inner

    @property
    def plan(self) -> OffloadPlan:
        """The layers' plan (see `Offloader.plan`)."""
        return self._inner.plan

    @property
    def disk_tier(self) -> DiskTierPlan | None:
        """The layers' disk tier (`PrefetchOffloader.disk_tier`), or None."""
        from offload.executors.prefetch import PrefetchOffloader

        return self._inner.disk_tier if isinstance(self._inner, PrefetchOffloader) else None

    @normal_tensors
    def wrap_modules(self, layers: Sequence[nn.Module]) -> list[nn.Module]:
        """Offload the layers as the plan says, then put every other tensor of the model
        on the compute device. If anything fails, the model is left as it was.

        Args:
            layers: the layer stack this offloader was made for.

        Raises:
            PlanError: `layers` are not that stack (or, from the executor, do not match the plan).
            ExecutionError: a move failed (the cause attached); nothing stays moved.
        """
        given = list(layers)
        if len(given) != len(self._layers) or any(a is not b for a, b in zip(given, self._layers, strict=False)):
            raise PlanError("wrap_modules got other layers than the model's stack this offloader was made for",
                            name="layers", value=len(given))
        wrapped = self._inner.wrap_modules(given)
        try:
            self._place_rest()
        except BaseException as exc:
            self._give_back()
            self._inner.restore()
            raise_as_execution_error(exc, "moving the weights outside the layers to the device failed, model left "
                                     "as it was", "wrap_modules")
        return wrapped

    def _place_rest(self) -> None:
        device = self._rt.device
        done: dict[object, torch.Tensor] = {}
        tensors = outside_tensors(self._model, self._layers)
        for (module, name, is_param), tensor in tensors:
            if tensor.device == device:
                continue
            if tensor.device.type == "meta":
                raise PlanError(f"{type(module).__name__}.{name} is on the meta device: load the weights first",
                                name=name, value="meta")
            key: object = storage_key(tensor) or id(tensor)
            origin = tensor.device  # read first: for a parameter, _set changes `tensor` itself
            data = done.get(key)
            if data is None:
                data = done[key] = self._rt.copy_to(tensor, device)
            self._set((module, name, is_param), data)
            self._moved.append(((module, name, is_param), origin))
        if self._moved:
            log.info("moved %d tensors outside the layers (%s) to %s", len(self._moved),
                     format_bytes(sum(t.numel() * t.element_size() for t in done.values())), device)

    @staticmethod
    def _set(slot: Slot, data: torch.Tensor) -> None:
        module, name, is_param = slot
        if is_param:
            param = module._parameters[name]
            if param is not None:
                param.data = data
        else:
            module._buffers[name] = data

    @staticmethod
    def _get(slot: Slot) -> torch.Tensor | None:
        module, name, is_param = slot
        return module._parameters[name] if is_param else module._buffers[name]

    def _give_back(self) -> None:
        """Put every tensor moved to the device back where it was, one storage at a time."""
        back: dict[object, torch.Tensor] = {}
        while self._moved:
            slot, origin = self._moved[-1]
            tensor = self._get(slot)
            if tensor is not None:
                key: object = (storage_key(tensor) or id(tensor), str(origin))
                data = back.get(key)
                if data is None:
                    data = back[key] = self._rt.copy_to(tensor, origin)
                self._set(slot, data)
            self._moved.pop()

    @normal_tensors
    def post_init(self) -> None:
        """See `Offloader.post_init`."""
        self._inner.post_init()

    @normal_tensors
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                     prefix: str = "", skip_read_only: bool = False) -> None:
        """New weights for the whole model, without restoring it, named as the model's
        ``state_dict()`` names them (``"model.layers.3.mlp.up_proj.weight"``,
        ``"lm_head.weight"``): the layer stacks' weights go to the executor's
        `load_weights` (offloaded ones into their host copies), every other parameter and
        buffer is written in place on the device. A mapping is checked whole before
        anything is written; pairs are checked and written one at a time.

        Args:
            weights: a mapping of names to tensors (a state dict), or (name, tensor) pairs.
            prefix: what every name starts with, stripped first (``""``: the model's own names).
            skip_read_only: as for `Offloader.load_weights`.

        Raises:
            ExecutionError: the model is not wrapped and ready; a name that is not one of
                the model's parameters or buffers (or lacks `prefix`), a tensor of another
                shape, or not a tensor; a quantised weight outside the layers (not written
                in place); anything the executor's `load_weights` refuses. ``name`` is the
                name as given.
        """
        paths = self._layer_paths()
        outside = self._outside_by_name()
        back: dict[str, str] = {}  # the executor's name -> the caller's

        def route(name: object, tensor: object) -> tuple[str, torch.Tensor] | None:
            """The executor's (name, tensor) for a layer weight; None for one outside (checked)."""
            if not isinstance(name, str):
                raise ExecutionError(f"load_weights: a name must be a str, got {name!r}", name=str(name), value=name)
            if not name.startswith(prefix):
                raise ExecutionError(f"load_weights: {name!r} does not start with the prefix {prefix!r}", name=name,
                                     value=prefix)
            own = name[len(prefix):]
            for path, first, count in paths:
                if own.startswith(path):
                    index, _, rest = own[len(path):].partition(".")
                    if index.isdigit() and rest:
                        inner = f"{first + int(index)}.{rest}" if int(index) < count else own
                        back[inner] = name
                        return inner, tensor  # type: ignore[return-value]  # the executor checks the tensor
            slot = outside.get(own)
            if slot is None:
                raise ExecutionError(f"load_weights: {name!r} is not a parameter or buffer of the model (its layer "
                                     f"stacks are {', '.join(p.rstrip('.') for p, _, _ in paths)})", name=name,
                                     value=own)
            self._outside_target(name, slot, tensor)
            return None

        try:
            if isinstance(weights, Mapping):
                routed = [(name, tensor, route(name, tensor)) for name, tensor in weights.items()]
                self._inner.load_weights({pair[0]: pair[1] for _, _, pair in routed if pair is not None},
                                         skip_read_only=skip_read_only)
                for name, tensor, pair in routed:
                    if pair is None:
                        self._write_outside(outside[name[len(prefix):]], tensor)
            else:
                self._inner.load_weights(self._streamed(weights, route, outside, prefix),
                                         skip_read_only=skip_read_only)
        except ExecutionError as exc:
            given = back.get(exc.name or "")
            if given is None:
                raise
            raise ExecutionError(exc.message.replace(repr(exc.name), repr(given)), name=given,
                                 value=exc.value) from exc

    def _streamed(self, weights: Iterable[object],
                  route: Callable[[object, object], tuple[str, torch.Tensor] | None],
                  outside: Mapping[str, Slot], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The executor's pairs of `weights`, one at a time; the weights outside the
        layers are written as they come (after the executor's `load_weights` began)."""
        for index, item in enumerate(weights):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ExecutionError(f"load_weights takes a mapping or (name, tensor) pairs; item {index} is "
                                     f"{type(item).__name__}", name=f"item {index}", value=type(item).__name__)
            pair = route(item[0], item[1])
            if pair is None:
                self._write_outside(outside[item[0][len(prefix):]], item[1])
            else:
                yield pair

    def _layer_paths(self) -> list[tuple[str, int, int]]:
        """Each stack's path in the model with a trailing dot, its first layer's index in
        the executor's plan and its number of layers; longest path first (a stack inside a
        module named like another)."""
        names = {id(module): name for name, module in self._model.named_modules()}
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        for index, layer in enumerate(self._layers):
            path, _, _ = names.get(id(layer), "").rpartition(".")
            key = f"{path}." if path else ""
            first.setdefault(key, index)
            count[key] = count.get(key, 0) + 1
        return sorted(((key, first[key], count[key]) for key in first), key=lambda item: -len(item[0]))

    def _outside_by_name(self) -> dict[str, Slot]:
        """Every tensor outside the layers (and every buffer) by each of its names in the model."""
        names: dict[int, list[str]] = {}
        for name, module in self._model.named_modules(remove_duplicate=False):
            names.setdefault(id(module), []).append(name)
        found: dict[str, Slot] = {}
        for slot, _ in outside_tensors(self._model, self._layers):
            for path in names.get(id(slot[0]), []):
                found[f"{path}.{slot[1]}" if path else slot[1]] = slot
        return found

    def _outside_target(self, name: str, slot: Slot, tensor: object) -> torch.Tensor:
        """The tensor `slot` holds now, once `tensor` is found fit to be written into it."""
        dest = self._get(slot)
        if not isinstance(tensor, torch.Tensor):
            raise ExecutionError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a tensor", name=name,
                                 value=type(tensor).__name__)
        if dest is None:
            raise ExecutionError(f"load_weights: {name!r} is None in the model", name=name, value=None)
        if tensor.device.type == "meta":
            raise ExecutionError(f"load_weights: {name!r} is on the meta device: it has no values to load", name=name,
                                 value="meta")
        if is_wrapper(dest):
            raise ExecutionError(f"load_weights: {name!r} is a quantised weight ({type(dest).__qualname__}) outside "
                                 "the layer stacks: it is not written in place; restore() the model to change it",
                                 name=name, value=type(dest).__qualname__)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ExecutionError(f"load_weights: {name!r} is {tuple(tensor.shape)}, the model's is "
                                 f"{tuple(dest.shape)}", name=name, value=tuple(tensor.shape))
        return dest

    def _write_outside(self, slot: Slot, tensor: torch.Tensor) -> None:
        dest = self._get(slot)
        if dest is not None:
            with torch.no_grad():
                dest.copy_(tensor)

    def sync_prev_onload(self) -> None:
        """See `Offloader.sync_prev_onload`."""
        self._inner.sync_prev_onload()

    def join_after_forward(self) -> None:
        """See `Offloader.join_after_forward`."""
        self._inner.join_after_forward()

    @normal_tensors
    def restore(self) -> None:
        """Give every weight back where it was: the layers' (see the executor's
        `restore`), then the tensors outside them.

        Raises:
            ExecutionError: a copy back failed; `restore` can be called again to finish.
        """
        self._inner.restore()
        try:
            self._give_back()
        except BaseException as exc:
            raise_as_execution_error(exc, "giving back the tensors outside the layers stopped part way (call "
                                     "restore() again to finish)", "restore")

    def stats(self) -> OffloadStats:
        """The layers' executor's counters (see `Offloader.stats`)."""
        return self._inner.stats()

    def check(self) -> LiveCheck:
        """Where the layers' planned parameters are (see `Offloader.check`; the tensors
        outside the layers are resident on the device and not listed)."""
        return self._inner.check()
