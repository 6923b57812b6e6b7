"""New weights for a model with a disk tier (Note [new weights], Note [disk tier]): a disk
weight's new values go to the spill file (made then if the tier had none) and are read from
there from then on, so that ``load_weights`` (a mapping or pairs, before or after
post_init) and ``load_state_dict`` give outputs bit for bit equal to a resident model given
the same weights, forward after forward, and restore gives them back; without a spill
directory they are refused by name with nothing changed; a full spill disk leaves the old
weights, and the model runs on."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from offload import ExecutionError, OffloadPlan
from offload.executors.prefetch import PrefetchOffloader
from offload.executors.prefetch.disk import DiskIO
from offload.hf import ModelOffloader
from offload.pure.disk.tier import DiskSource, DiskTierPlan
from offload.runtime.cpu import CpuRuntime
from offload.runtime.spill import SpillFile
from tests.executors.disk_helpers import build_model, plan_tier, read_per_pass, weights, wrap
from tests.hf.checkpoints import save, step_logits


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _digest(directory: Path) -> str:
    found = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")):
        found.update(file.read_bytes())
    return found.hexdigest()


def _setup(tmp_path: Path, *, spill_before: bool) -> tuple[PreTrainedModel, Path, OffloadPlan, DiskTierPlan,
                                                          list[nn.Module]]:
    """A Llama whose three disk layers are read from its checkpoint where they lie, and,
    with `spill_before`, two of their weights changed after loading (so spilled at wrap)."""
    model = build_model("llama")
    checkpoint = save(model, tmp_path / "ckpt", sharded=False)
    plan, tier, layers = plan_tier(model, checkpoint, disk_layers=3)
    assert all(p.source is DiskSource.CHECKPOINT for p in tier.params)
    if spill_before:
        layer: Any = layers[tier.disk_layers[0]]
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(2.0)
            layer.self_attn.q_proj.weight.mul_(2.0)
    return model, checkpoint, plan, tier, layers


def _new_state(seed: int) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """A resident model of new weights, and its state dict (copies)."""
    reference = build_model("llama", seed=seed)
    return reference, {name: t.detach().clone() for name, t in reference.state_dict().items()}


@pytest.mark.parametrize("spill_before", [False, True])
@pytest.mark.parametrize("given", ["mapping", "pairs"])
@pytest.mark.parametrize("when", ["ready", "wrapped"])
def test_new_weights_for_disk_layers_compute_bit_for_bit(tmp_path: Path, spill_before: bool, given: str,
                                                         when: str) -> None:
    model, checkpoint, plan, tier, layers = _setup(tmp_path, spill_before=spill_before)
    digest = _digest(checkpoint)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), spill_dir, start=when == "ready")
    if when == "ready":
        step_logits(model)  # the ring holds (and has staged) the old bytes
    for seed in (1, 2):  # twice: the spill file grows after the first new weights
        reference, state = _new_state(seed)
        offloader.load_weights(state if given == "mapping" else iter(list(state.items())))
        if when == "wrapped" and seed == 1:
            offloader.post_init()
        read = offloader.stats().disk_bytes_read
        want = step_logits(reference)
        assert _equal(step_logits(model), want)
        assert _equal(step_logits(model), want)  # and again: every pass reads the new bytes
        assert offloader.stats().disk_bytes_read - read >= 2 * read_per_pass(tier)
    offloader.restore()
    assert all(torch.equal(p, weights(reference)[name]) for name, p in weights(model).items())
    assert _digest(checkpoint) == digest  # the checkpoint is never written
    assert list(spill_dir.iterdir()) == []


def test_load_state_dict_gives_disk_layers_new_weights(tmp_path: Path) -> None:
    model, checkpoint, plan, tier, layers = _setup(tmp_path, spill_before=True)
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path)
    step_logits(model)
    reference, state = _new_state(1)
    model.load_state_dict(state)
    want = step_logits(reference)
    assert _equal(step_logits(model), want) and _equal(step_logits(model), want)
    # A part of the model, strict=False: only the weights given change.
    other, more = _new_state(2)
    disk_layer = tier.disk_layers[1]
    part = {k[len(f"model.layers.{disk_layer}."):]: v for k, v in more.items()
            if k.startswith(f"model.layers.{disk_layer}.mlp.")}
    layer: Any = layers[disk_layer]
    layer.load_state_dict(part, strict=False)
    with torch.no_grad():
        for name, value in part.items():
            reference.model.layers[disk_layer].get_parameter(name).copy_(value)
    assert _equal(step_logits(model), step_logits(reference))
    offloader.restore()
    assert all(torch.equal(p, weights(reference)[name]) for name, p in weights(model).items())


def _without_spill_dir(model: PreTrainedModel, plan: OffloadPlan, tier: DiskTierPlan,
                       layers: list[nn.Module]) -> ModelOffloader:
    rt = CpuRuntime()
    offloader = ModelOffloader(model, layers, PrefetchOffloader(plan, rt, disk=tier), rt)
    offloader.wrap_modules(layers)
    offloader.post_init()
    return offloader


def test_without_a_spill_dir_new_disk_weights_are_refused_by_name_and_nothing_changes(tmp_path: Path) -> None:
    model, _, plan, tier, layers = _setup(tmp_path, spill_before=False)
    want = step_logits(model)
    before = weights(model)
    offloader = _without_spill_dir(model, plan, tier, layers)
    _, state = _new_state(1)
    disk_names = {f"model.layers.{p.layer}.{p.name}" for p in tier.params}
    disk_name = next(name for name in state if name in disk_names)  # the first the mapping gives
    with pytest.raises(ExecutionError, match=rf"'{disk_name}' .*cannot take new weights.*no spill_dir was given: "
                                             "pass spill_dir=") as caught:
        offloader.load_weights(state)  # host-tier and resident weights too: none of them is written
    assert caught.value.name == disk_name
    # load_state_dict is refused at the first disk weight it reaches (what torch copied
    # before that stays copied, as with any error part way): a disk layer's own, nothing.
    first = tier.disk_layers[0]
    part = {k[len(f"model.layers.{first}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{first}.")}
    disk_layer: Any = layers[first]
    with pytest.raises(ExecutionError, match=rf"load_state_dict: layer {first} parameter .* cannot take new "
                                             "weights.*spill_dir"):
        disk_layer.load_state_dict(part)
    assert _equal(step_logits(model), want)
    # A host-tier layer takes new weights as before.
    on_host = next(layer for layer in plan.offloaded_layers if layer not in set(tier.disk_layers))
    name = f"model.layers.{on_host}.mlp.up_proj.weight"
    offloader.load_weights({name: state[name]})
    offloader.restore()
    after = weights(model)
    assert torch.equal(after[name], state[name])
    assert all(torch.equal(p, before[n]) for n, p in after.items() if n != name)


@pytest.mark.parametrize("given", ["mapping", "pairs"])
def test_a_full_spill_disk_keeps_the_old_weights_and_the_model_runs_on(tmp_path: Path, given: str) -> None:
    model, _, plan, tier, layers = _setup(tmp_path, spill_before=True)
    want = step_logits(model)
    before = weights(model)
    full = [False]

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data, offset)

    io = DiskIO(spill=lambda directory: SpillFile(directory, pwrite=pwrite))
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, io)
    assert _equal(step_logits(model), want)
    reference, state = _new_state(1)
    full[0] = True
    disk_first: Iterable[tuple[str, torch.Tensor]] = sorted(
        state.items(), key=lambda item: not item[0].startswith(f"model.layers.{tier.disk_layers[0]}."))
    with pytest.raises(ExecutionError, match="No space left on device") as caught:
        offloader.load_weights(state if given == "mapping" else iter(disk_first))
    assert caught.value.value == "ENOSPC"
    assert _equal(step_logits(model), want) and _equal(step_logits(model), want)
    first = tier.disk_layers[0]  # load_state_dict of a disk layer: its holders' post-hooks spill
    part = {k[len(f"model.layers.{first}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{first}.")}
    disk_layer: Any = layers[first]
    with pytest.raises(ExecutionError, match="load_state_dict: the new values .* No space left on device"):
        disk_layer.load_state_dict(part)
    assert _equal(step_logits(model), want)
    full[0] = False
    offloader.load_weights(state)  # room again: it takes them
    assert _equal(step_logits(model), step_logits(reference))
    offloader.restore()
    assert all(torch.equal(p, weights(reference)[name]) for name, p in weights(model).items())
    assert any(not torch.equal(p, before[name]) for name, p in weights(model).items())
