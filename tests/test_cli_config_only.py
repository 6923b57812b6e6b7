"""``offload plan DIR`` of a directory holding only a ``config.json``: the model is built
on meta from the config, in its saved dtype, and planned as its checkpoint would be (the
tensors ``save_pretrained`` writes), with ``--fit-gib`` and ``--host-gib`` as for a
checkpoint, and the output says no weights were read.

Held to what ``accelerate estimate-memory`` does (an empty model from the config, its
tensors' bytes counted once each) and more: the plan equals, entry for entry, the plan of
the checkpoint saved from the same config (a Llama in bfloat16, Whisper's encoder and
decoder, Mixtral's experts saved one by one), and the total is accelerate's count of the
same model less its non-persistent buffers (which no checkpoint holds)."""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from offload import OffloadPlan
from offload.cli import main
from offload.pure.decide.admission import HostAdmission
from offload.pure.disk.tier import DiskTierPlan
from tests.hf.checkpoints import build, build_whisper, save, save_any

BUILDERS: dict[str, Callable[[], Any]] = {
    "llama-bf16": lambda: build("llama", dtype=torch.bfloat16),
    "whisper": build_whisper,
    "mixtral": lambda: build("mixtral"),
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """(the model, its checkpoint, a directory holding only its config.json)."""
    model = BUILDERS[request.param]()
    folder = tmp_path_factory.mktemp(request.param)
    checkpoint = save_any(model, folder / "checkpoint")
    config = folder / "config-only"
    config.mkdir()
    shutil.copy(checkpoint / "config.json", config / "config.json")
    return model, checkpoint, config


def _labelled(out: str, label: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"{label}:")]


def test_a_config_alone_plans_as_its_checkpoint(capsys: pytest.CaptureFixture[str],
                                                saved: tuple[Any, Path, Path]) -> None:
    _, checkpoint, config = saved
    code, out, err = _run(capsys, "plan", str(checkpoint), "--group-size", "2", "--json")
    assert code == 0, err
    from_weights = OffloadPlan.from_json(out)
    code, out, err = _run(capsys, "plan", str(config), "--group-size", "2", "--json")
    assert code == 0, err
    from_config = OffloadPlan.from_json(out)
    assert from_config.params == from_weights.params  # every entry: layer, name, shape, dtype, bytes, placement
    # The whole plan but the host reading, which moves between two runs.
    assert attrs.evolve(from_config, host_admission=HostAdmission()) == \
        attrs.evolve(from_weights, host_admission=HostAdmission())
    code, weights_text, err = _run(capsys, "plan", str(checkpoint), "--group-size", "2")
    assert code == 0, err
    code, config_text, err = _run(capsys, "plan", str(config), "--group-size", "2")
    assert code == 0, err
    for label in ("stack", "outside"):  # the same stacks, and the same bytes outside them
        assert _labelled(config_text, label) == _labelled(weights_text, label) != [], label
    model_line = _labelled(config_text, "model")[0]
    assert model_line.startswith(f"model:    config {config}: ")
    assert model_line.split(": ", 2)[2] == _labelled(weights_text, "model")[0].split(": ", 2)[2]  # counts, bytes
    [weights] = _labelled(config_text, "weights")
    assert weights.startswith("weights:  no weights were read: ")
    assert not _labelled(weights_text, "weights")


def test_the_total_is_accelerates_less_the_buffers_no_checkpoint_holds(capsys: pytest.CaptureFixture[str],
                                                                       saved: tuple[Any, Path, Path]) -> None:
    model, _, config = saved
    code, out, err = _run(capsys, "plan", str(config), "--backend", "none", "--json")
    assert code == 0, err
    plan = OffloadPlan.from_json(out)
    code, text, err = _run(capsys, "plan", str(config), "--backend", "none")
    assert code == 0, err
    [outside] = _labelled(text, "outside")
    tensors = int(outside.split()[1])
    assert tensors > 0
    state = model.state_dict(keep_vars=True)  # tied weights are one object
    transient = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name not in state)
    layers = sum(p.param.nbytes for p in plan.params)
    # accelerate counts every parameter once and every buffer; the checkpoint holds no
    # non-persistent buffer (Llama's rotary inv_freq).
    accelerate = int(importlib.import_module("accelerate.utils").compute_module_sizes(model)[""])  # untyped
    unique = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    assert accelerate - transient == unique
    outside_bytes = unique - layers
    assert outside_bytes > 0
    code, out, err = _run(capsys, "plan", str(config), "--fit-gib", "1", "--profile", "h200-pcie5", "--json")
    assert code == 0, err
    assert json.loads(out)["chosen"]["outside_bytes"] == outside_bytes  # the fit counts them on the device


def test_the_dtype_is_the_configs_unless_asked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    checkpoint = save(build("llama", dtype=torch.bfloat16), tmp_path / "llama", sharded=False)
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(checkpoint / "config.json", config / "config.json")
    sizes = {}
    for dtype in ("bfloat16", "float32"):
        code, out, err = _run(capsys, "plan", str(config), "--backend", "none", "--dtype", dtype, "--json")
        assert code == 0, err
        sizes[dtype] = sum(p.param.nbytes for p in OffloadPlan.from_json(out).params)
        assert {p.param.dtype for p in OffloadPlan.from_json(out).params} == {dtype}
    assert sizes["float32"] == 2 * sizes["bfloat16"]
    code, out, err = _run(capsys, "plan", str(config), "--backend", "none")
    assert code == 0, err
    assert "in bfloat16 (the config's)" in _labelled(out, "weights")[0]
    code, _, err = _run(capsys, "plan", str(checkpoint), "--dtype", "float32")
    assert code == 2 and "--dtype applies to a directory holding only a config.json" in err


def test_a_fit_and_a_host_budget_plan_from_a_config_alone(capsys: pytest.CaptureFixture[str],
                                                          saved: tuple[Any, Path, Path]) -> None:
    _, _, config = saved
    flags = ("plan", str(config), "--group-size", "1", "--prefetch-step", "2")
    code, out, err = _run(capsys, *flags, "--json")
    assert code == 0, err
    host = OffloadPlan.from_json(out).host_bytes
    tiers = []
    for share in (0.9, 0.8, 0.7, 0.6, 0.5):  # the staging ring of a tiny model can outweigh its layers
        code, out, err = _run(capsys, *flags, "--read-ahead", "1", "--host-gib", f"{int(host * share) / 2**30}",
                              "--json")
        assert code == 0 or (code == 2 and "does not fit the offloaded weights" in err), err
        if code == 0:
            tiers.append(DiskTierPlan.from_json(json.dumps(json.loads(out)["disk"])))
    found = [tier for tier in tiers if tier.disk_layers]
    if "whisper" not in str(config):  # its layers are smaller than a staging buffer of their tensors
        assert found
    for tier in found:
        assert tier.spill_bytes == tier.disk_bytes > 0  # no file to read from: every disk weight spilled
    code, out, err = _run(capsys, "plan", str(config), "--fit-gib", "0.0001", "--profile", "h200-pcie5")
    assert code == 0, err
    assert _labelled(out, "weights")[0].startswith("weights:  no weights were read")


def test_a_directory_with_neither_weights_nor_a_usable_config_is_a_clear_error(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("nothing here")
    code, out, err = _run(capsys, "plan", str(empty))
    assert (code, out) == (2, "")
    assert err == (f"offload plan: {empty}: no .safetensors files and no config.json: nothing to plan from (a "
                   "checkpoint directory, or its config.json alone to plan before downloading)\n")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    code, out, err = _run(capsys, "plan", str(unknown))
    assert (code, out) == (2, "")
    assert err.startswith(f"offload plan: {unknown} holds no .safetensors files, and its config.json cannot be "
                          "planned from: ") and "'NoSuchModelForCausalLM'" in err and err.count("\n") == 1
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{not json")
    code, out, err = _run(capsys, "plan", str(junk))
    assert code == 2 and "config.json cannot be planned from: " in err and "not a readable JSON file" in err


def test_a_config_with_its_index_but_no_shards_plans_from_the_config(capsys: pytest.CaptureFixture[str],
                                                                    tmp_path: Path) -> None:
    """What a download of the JSON files alone leaves: the config and the shards' index."""
    checkpoint = save(build("llama"), tmp_path / "llama", sharded=True)
    [index] = checkpoint.glob("*.safetensors.index.json")
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    for file in (checkpoint / "config.json", index):
        shutil.copy(file, metadata / file.name)
    code, out, err = _run(capsys, "plan", str(checkpoint), "--backend", "none", "--json")
    assert code == 0, err
    expected = OffloadPlan.from_json(out).params
    code, out, err = _run(capsys, "plan", str(metadata), "--backend", "none", "--json")
    assert code == 0, err
    assert OffloadPlan.from_json(out).params == expected
    code, out, err = _run(capsys, "plan", str(metadata / "config.json"), "--backend", "none")
    assert code == 0, err
    assert _labelled(out, "weights")[0].startswith("weights:  no weights were read")
