"""A checkpoint's persistent buffers are not parameters: the model class that was saved,
built on meta, names them (`checkpoint_buffers`); `read_checkpoint` and `offload plan DIR`
keep them out of the layers, as the live model keeps its buffers on the device; where the
class cannot be known the CLI says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

from offload import OffloadPlan, describe_layers
from offload.cli import main
from offload.hf import checkpoint_buffers, find_layers
from offload.model.checkpoint import read_checkpoint

VOCAB = 96
BIAS = "mlp.gate.e_score_correction_bias"


def _deepseek() -> PreTrainedModel:
    """A tiny DeepSeek-V3: layer 0 dense, layers 1-2 MoE, whose router holds a persistent
    buffer (``e_score_correction_bias``) that the checkpoint stores beside the weights."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1)
    torch.manual_seed(0)
    made: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model: PreTrainedModel = made.eval()
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    model = _deepseek()
    folder = tmp_path_factory.mktemp("deepseek")
    saver: Any = model
    saver.save_pretrained(folder)
    return model, folder


def test_the_saved_class_names_the_buffers_the_checkpoint_holds(deepseek: tuple[PreTrainedModel, Path]) -> None:
    model, folder = deepseek
    live = frozenset(name for name, _ in model.named_buffers() if name in model.state_dict())
    assert live == {f"model.layers.{i}.{BIAS}" for i in (1, 2)}  # the premise: persistent, saved
    known = checkpoint_buffers(folder)
    assert (known.names, known.source) == (live, "DeepseekV3ForCausalLM")
    assert checkpoint_buffers(folder / "model.safetensors").names == live  # a file in the directory


def test_a_plan_from_the_headers_has_the_live_models_parameters(deepseek: tuple[PreTrainedModel, Path]) -> None:
    model, folder = deepseek
    names = checkpoint_buffers(folder).names
    assert names is not None
    headers = read_checkpoint(folder, buffers=names)
    live = describe_layers(find_layers(model))
    # No buffer is planned; the dense layer's parameters are the live model's. (The MoE
    # layers' experts are saved one by one and fused by transformers when it loads them,
    # so their names differ by design.)
    assert not any(p.name == BIAS for layer in headers.spec.layers for p in layer.params)
    assert sorted(p.name for p in headers.spec.layers[0].params) == sorted(p.name for p in live.layers[0].params)
    assert [t.name for t in headers.buffers] == sorted(names)
    # Without the class the buffers are planned as parameters: what this fixes.
    blind = read_checkpoint(folder)
    assert sum(len(layer.params) for layer in blind.spec.layers) == \
        sum(len(layer.params) for layer in headers.spec.layers) + len(names)


def _plan(capsys: pytest.CaptureFixture[str], folder: Path, *flags: str) -> tuple[int, str]:
    code = main(["plan", str(folder), "--group-size", "1", *flags])
    out, _ = capsys.readouterr()
    return code, out


def test_offload_plan_keeps_the_buffers_on_the_device_and_says_so(deepseek: tuple[PreTrainedModel, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, folder = deepseek
    code, out = _plan(capsys, folder, "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert plan.offloaded_params and not any(p.name == BIAS for p in plan.offloaded_params)
    code, out = _plan(capsys, folder)
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("buffers:")]
    assert len(lines) == 1 and lines[0].startswith("buffers:  2 tensors DeepseekV3ForCausalLM holds as persistent "
                                                   "buffers"), lines


def test_without_the_class_the_cli_says_the_buffers_are_not_known(deepseek: tuple[PreTrainedModel, Path],
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, folder = deepseek
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    assert checkpoint_buffers(bare).names is None
    code, out = _plan(capsys, bare)
    assert code == 0
    assert "buffers:  not known (no config.json beside the weights): every tensor in a layer is planned as a " \
           "parameter" in out
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    known = checkpoint_buffers(unknown)
    assert known.names is None and "NoSuchModelForCausalLM" in known.source
    code, out = _plan(capsys, unknown)
    assert code == 0 and "buffers:  not known (" in out and "NoSuchModelForCausalLM" in out
