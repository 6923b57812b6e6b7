"""`find_layers`: the layer stack found by structure, for decoder-only models, the decoder
of an encoder-decoder model, an encoder, and models built by hand; clear errors naming the
candidates when the structure does not decide."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

from offload import PlanError
from offload.hf import find_layers, layer_stacks
from tests.hf.checkpoints import ARCHITECTURES, build

#: Where each architecture keeps its decoder layers (what a user would otherwise have to know).
EXPECTED_PATHS = {
    "llama": "model.layers",
    "qwen3": "model.layers",
    "gpt2": "transformer.h",
    "mixtral": "model.layers",
    "gemma": "model.layers",
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_decoder_only_models_give_their_decoder_layers(arch: str) -> None:
    model = build(arch)
    assert find_layers(model) is model.get_submodule(EXPECTED_PATHS[arch])
    assert [c.path for c in layer_stacks(model)] == [EXPECTED_PATHS[arch]]


def test_moe_experts_inside_a_layer_are_part_of_the_layer() -> None:
    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(8))  # a stack of its own, inside

    model = nn.Module()
    model.blocks = nn.ModuleList(Block() for _ in range(3))
    assert find_layers(model) is model.blocks
    assert [c.path for c in layer_stacks(model)] == ["blocks"]


def test_the_decoder_of_an_encoder_decoder_model_is_chosen() -> None:
    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4)
    model = T5ForConditionalGeneration(config)
    stacks = {c.path: c.nbytes for c in layer_stacks(model)}
    assert sorted(stacks) == ["decoder.block", "encoder.block"]
    assert stacks["decoder.block"] > stacks["encoder.block"]  # cross-attention
    assert find_layers(model) is model.decoder.block


def test_an_encoder_gives_its_encoder_layers() -> None:
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=32))
    assert find_layers(model) is model.encoder.layer


def _two_towers() -> nn.Module:
    model = nn.Module()
    model.left = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    model.right = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    return model


def test_two_equal_stacks_are_ambiguous_and_the_error_names_both() -> None:
    with pytest.raises(PlanError) as info:
        find_layers(_two_towers())
    assert info.value.value == ("left", "right")
    assert "left (3 x Linear" in str(info.value) and "right (3 x Linear" in str(info.value)
    assert "path=" in str(info.value)


def test_path_chooses_a_stack_explicitly() -> None:
    model = _two_towers()
    assert find_layers(model, "right") is model.right


@pytest.mark.parametrize(("path", "message"), [("middle", "no module 'middle'"), ("left.0", "not a non-empty")])
def test_a_bad_path_is_a_plan_error_naming_it(path: str, message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        find_layers(_two_towers(), path)
    assert info.value.value == path


@pytest.mark.parametrize("model", [
    pytest.param(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), id="no-module-list"),
    pytest.param(nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]), id="mixed-classes"),
    pytest.param(nn.ModuleList([nn.ReLU(), nn.ReLU()]), id="no-parameters"),
    pytest.param(nn.ModuleList([nn.Linear(4, 4)]), id="one-block"),
])
def test_no_stack_is_a_plan_error(model: nn.Module) -> None:
    with pytest.raises(PlanError, match="no layer stack found"):
        find_layers(model)
