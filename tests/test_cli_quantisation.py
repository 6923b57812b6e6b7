"""``offload plan DIR --quantization int8`` plans the weights as torchao's int8
weight-only quantisation leaves them at load (int8 values, float32 row scales, int8 zero
points, each offloaded as an inner tensor, `offload.model.wrappers`): the planned layers
are, tensor for tensor and byte for byte, those of the model transformers loads with
``TorchAoConfig(Int8WeightOnlyConfig())``, described by `describe_layers`; so is a config
alone whose ``quantization_config`` says so; a checkpoint saved quantised is planned as
its headers hold it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torchao.quantization import Int8WeightOnlyConfig
from transformers import AutoModelForCausalLM, TorchAoConfig

from offload import OffloadPlan, describe_layers
from offload.cli import main
from offload.hf import find_layers
from offload.model.wrappers import inner_tensors
from offload.pure.units import format_bytes
from tests.hf.checkpoints import build, save

Rows = list[tuple[int, str, tuple[int, ...], str, int]]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build("llama", dtype=torch.bfloat16), tmp_path_factory.mktemp("quantised") / "llama", sharded=False)


@pytest.fixture(scope="module")
def quantised(checkpoint: Path) -> Any:
    """The checkpoint loaded as a load-time int8 weight-only quantisation leaves it, on the CPU."""
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), local_files_only=True)
    return loaded.eval()


def _live_rows(model: Any) -> Rows:
    """Every tensor of the model's layers once unpacked: layer, name, shape, dtype, bytes."""
    spec = describe_layers(find_layers(model))
    return sorted((layer.index, p.name, p.shape, p.dtype, p.nbytes) for layer in spec.layers for p in layer.params)


def _planned_rows(plan: OffloadPlan) -> Rows:
    return sorted((p.layer, p.param.name, p.param.shape, p.param.dtype, p.param.nbytes) for p in plan.params)


def _outside_bytes(model: Any) -> int:
    """Bytes of the tensors outside the layers (a quantised one by its inner tensors), each once."""
    inside = {id(p) for p in find_layers(model).parameters()}
    seen = {id(t): t for p in model.parameters() if id(p) not in inside for t in inner_tensors(p)}
    return sum(t.numel() * t.element_size() for t in seen.values())


def test_the_planned_layers_are_those_of_the_model_quantised_at_load(
        capsys: pytest.CaptureFixture[str], checkpoint: Path, quantised: Any) -> None:
    live = _live_rows(quantised)
    assert any(dtype == "int8" for *_, dtype, _ in live)  # the premise: the load quantised the layers
    code, out, err = _run(capsys, "plan", str(checkpoint), "--quantization", "int8", "--backend", "none", "--json")
    assert code == 0, err
    plan = OffloadPlan.from_json(out)
    assert _planned_rows(plan) == live
    code, out, err = _run(capsys, "plan", str(checkpoint), "--backend", "none", "--json")
    assert code == 0, err
    assert sum(p.param.nbytes for p in OffloadPlan.from_json(out).params) > sum(row[-1] for row in live)  # smaller
    code, text, err = _run(capsys, "plan", str(checkpoint), "--quantization", "int8", "--backend", "none")
    assert code == 0, err
    [outside] = [line for line in text.splitlines() if line.startswith("outside:")]
    assert f", {format_bytes(_outside_bytes(quantised))}, resident" in outside  # the head stays unquantised
    [line] = [line for line in text.splitlines() if line.startswith("quant:")]
    assert "int8 weight-only" in line and "28 nn.Linear weights" in line


def test_a_config_alone_with_its_quantization_config_plans_the_quantised_sizes(
        capsys: pytest.CaptureFixture[str], checkpoint: Path, quantised: Any, tmp_path: Path) -> None:
    saved = tmp_path / "saved-quantised"
    quantised.save_pretrained(saved)
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(saved / "config.json", config / "config.json")
    assert json.loads((config / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    code, out, err = _run(capsys, "plan", str(config), "--backend", "none", "--json")
    assert code == 0, err
    assert _planned_rows(OffloadPlan.from_json(out)) == _live_rows(quantised)
    code, out, err = _run(capsys, "plan", str(config), "--backend", "none", "--quantization", "none", "--json")
    assert code == 0, err
    assert {p.param.dtype for p in OffloadPlan.from_json(out).params} == {"bfloat16"}
    # A checkpoint saved quantised holds the quantised tensors already: planned as it lies.
    code, out, err = _run(capsys, "plan", str(saved), "--backend", "none", "--json")
    assert code == 0, err
    planned = OffloadPlan.from_json(out)
    assert sum(p.param.nbytes for p in planned.params) == sum(row[-1] for row in _live_rows(quantised))
    code, text, err = _run(capsys, "plan", str(saved), "--backend", "none")
    assert code == 0 and "quant:    as saved (torchao Int8WeightOnlyConfig" in text, err
    code, out, err = _run(capsys, "plan", str(saved), "--quantization", "int8")
    assert (code, out) == (2, "") and "was saved quantised" in err and "drop --quantization" in err


def test_a_quantization_config_that_cannot_be_sized_is_named(capsys: pytest.CaptureFixture[str],
                                                             checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    folder = tmp_path / "gptq"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq",
                                                                                       "bits": 4}}))
    code, out, err = _run(capsys, "plan", str(folder))
    assert (code, out) == (2, "")
    assert "its quantization_config is gptq, whose sizes cannot be told from a config" in err
    assert "--quantization none" in err
    code, out, err = _run(capsys, "plan", str(folder), "--quantization", "none", "--backend", "none", "--json")
    assert code == 0, err
    code, out, err = _run(capsys, "plan", "llama-8b", "--quantization", "int8")
    assert code == 2 and "--quantization applies to a checkpoint or a config, not to a preset" in err
