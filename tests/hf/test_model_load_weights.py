"""`ModelOffloader.load_weights`: new weights for a whole model offloaded by `offload_model`,
named as its ``state_dict()`` names them, without a restore; the layer stacks' weights go
into their host copies, every weight outside them in place. The result computes exactly as
a resident model given the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from offload.errors import ExecutionError
from offload.hf import offload_model
from offload.pure.config import OffloadConfig
from offload.pure.env.snapshot import EnvSnapshot
from offload.runtime.cpu import CpuRuntime
from tests.hf.checkpoints import build, build_whisper, step_logits

EVERY_OTHER = OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _whisper_logits(model: Any) -> torch.Tensor:
    features = torch.randn(1, model.config.num_mel_bins, 2 * model.config.max_source_positions,
                           generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.inference_mode():
        logits: torch.Tensor = model(input_features=features, decoder_input_ids=ids).logits
    return logits


@pytest.mark.parametrize("form", ["mapping", "pairs"])
def test_a_whole_state_dict_gives_the_resident_models_logits_bit_for_bit(form: str) -> None:
    model = build("llama", seed=0)
    twin = build("llama", seed=1)  # the new weights, resident
    expected = step_logits(twin)
    offloader = offload_model(model, EVERY_OTHER, env=EnvSnapshot(), runtime=CpuRuntime())
    before = step_logits(model)
    assert not _same(before, expected)
    new = {name: tensor.clone() for name, tensor in twin.state_dict().items()}
    assert "model.embed_tokens.weight" in new and "lm_head.weight" in new  # outside the layers too
    offloader.load_weights(new if form == "mapping" else iter(new.items()))
    assert _same(step_logits(model), expected)
    assert _same(step_logits(model), expected)  # and stays so
    offloader.restore()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, new[name]), name


def test_several_stacks_take_their_own_layer_indices() -> None:
    # Whisper's decoder layers are 0.. in the model's names, after the encoder's in the plan.
    model, twin = build_whisper(seed=0), build_whisper(seed=1)
    expected = _whisper_logits(twin)
    offloader = offload_model(model, OffloadConfig(group_size=1, prefetch_step=1), env=EnvSnapshot(),
                              runtime=CpuRuntime())
    assert len(offloader.plan.offloaded_layers) == 4  # both stacks' layers
    offloader.load_weights(twin.state_dict())
    assert torch.equal(_whisper_logits(model), expected)
    offloader.restore()


def test_a_prefix_is_stripped_from_every_name() -> None:
    model, twin = build("llama", seed=0), build("llama", seed=1)
    expected = step_logits(twin)
    offloader = offload_model(model, EVERY_OTHER, env=EnvSnapshot(), runtime=CpuRuntime())
    offloader.load_weights({f"policy.{name}": t for name, t in twin.state_dict().items()}, prefix="policy.")
    assert _same(step_logits(model), expected)
    with pytest.raises(ExecutionError, match="does not start with the prefix 'policy.'") as caught:
        offloader.load_weights({"lm_head.weight": twin.lm_head.weight}, prefix="policy.")
    assert caught.value.name == "lm_head.weight"


@pytest.mark.parametrize("bad", ["unknown", "shape-outside", "shape-in-second-stack"])
def test_a_bad_entry_in_a_mapping_changes_nothing_and_is_named_as_given(bad: str) -> None:
    model, twin = build_whisper(seed=0), build_whisper(seed=1)
    offloader = offload_model(model, OffloadConfig(group_size=1, prefetch_step=1), env=EnvSnapshot(),
                              runtime=CpuRuntime())
    before = _whisper_logits(model)
    new = dict(twin.state_dict())
    name = {"unknown": "model.decoder.nope.weight", "shape-outside": "model.decoder.embed_tokens.weight",
            "shape-in-second-stack": "model.decoder.layers.1.fc1.weight"}[bad]
    new[name] = torch.zeros(3, 3)
    with pytest.raises(ExecutionError) as caught:
        offloader.load_weights(new)
    assert caught.value.name == name
    assert repr(name) in caught.value.message
    assert torch.equal(_whisper_logits(model), before)
    offloader.restore()


def test_pairs_are_written_as_they_come_and_a_bad_one_stops_there() -> None:
    model, twin = build("llama", seed=0), build("llama", seed=1)
    offloader = offload_model(model, EVERY_OTHER, env=EnvSnapshot(), runtime=CpuRuntime())
    pairs = [("lm_head.weight", twin.lm_head.weight), ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))]
    with pytest.raises(ExecutionError) as caught:
        offloader.load_weights(pairs)
    assert caught.value.name == "model.layers.9.mlp.up_proj.weight"  # no layer 9: named as given
    assert torch.equal(model.lm_head.weight, twin.lm_head.weight)  # the one before it was written


def test_load_weights_before_wrap_is_over_or_after_restore_is_refused() -> None:
    model, twin = build("llama", seed=0), build("llama", seed=1)
    offloader = offload_model(model, EVERY_OTHER, env=EnvSnapshot(), runtime=CpuRuntime())
    offloader.restore()
    kept = model.lm_head.weight.clone()
    with pytest.raises(ExecutionError):
        offloader.load_weights(twin.state_dict())
    assert torch.equal(model.lm_head.weight, kept)
