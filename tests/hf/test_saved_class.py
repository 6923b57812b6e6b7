"""`load_on_host` and `offload_pretrained` build the class that was saved (``architectures``
of a transformers ``config.json``, ``_class_name`` of a diffusers one), or `model_class=`,
and refuse a checkpoint whose weights do not all load into it."""

from __future__ import annotations

import gc
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2LMHeadModel, LlamaForCausalLM, PreTrainedModel

from offload.errors import CheckpointError
from offload.hf import load_on_host, offload_pretrained
from offload.pure.config import OffloadConfig
from tests.hf.checkpoints import build, build_flux, build_llava, build_whisper, save_any

#: Name -> a random model of a class that is not what the Auto classes would build.
BUILDERS: dict[str, Callable[[], Any]] = {
    "whisper": build_whisper,  # AutoModelForCausalLM: WhisperForCausalLM, the encoder dropped
    "llava": build_llava,  # AutoModel: LlavaModel, without lm_head
    "llama": lambda: build("llama"),
    "gpt2": lambda: build("gpt2"),  # lm_head tied to the embedding: saved once
    "gemma": lambda: build("gemma"),  # likewise
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Name -> (the model saved, its directory), each in one safetensors file."""
    root = tmp_path_factory.mktemp("saved-class")
    out = {}
    for name, builder in BUILDERS.items():
        model = builder()
        out[name] = (model, save_any(model, root / name))
    return out


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A saved diffusers FluxTransformer2DModel (imports diffusers)."""
    model = build_flux()
    return model, save_any(model, tmp_path_factory.mktemp("saved-flux") / "flux")


def copy_of(directory: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    for file in directory.iterdir():
        (into / file.name).write_bytes(file.read_bytes())
    return into


def edit_config(directory: Path, **changes: Any) -> None:
    """Set keys of ``config.json``; a value of None removes the key."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Rewrite the directory's one safetensors file after `edit` changed its tensors."""
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def assert_same_weights(loaded: Any, saved: Any) -> None:
    """Same state_dict keys, and every tensor equal bit for bit with the same dtype."""
    want, got = saved.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    different = [key for key in want if got[key].dtype != want[key].dtype or not torch.equal(got[key], want[key])]
    assert different == []


def live(cls: type) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


# ---- the saved class, every weight -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_saved_class_comes_back_with_every_weight(saved: dict[str, tuple[Any, Path]], name: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    model, directory = saved[name]
    with caplog.at_level(logging.WARNING, logger="offload.load"):
        loaded = load_on_host(directory)
    assert type(loaded) is type(model)
    assert not loaded.training
    assert_same_weights(loaded, model)
    assert [r for r in caplog.records if r.name == "offload.load"] == []  # no fallback


def test_whisper_keeps_its_encoder_and_llava_its_head(saved: dict[str, tuple[Any, Path]]) -> None:
    whisper = load_on_host(saved["whisper"][1])
    assert type(whisper).__name__ == "WhisperForConditionalGeneration"
    assert any(name.startswith("model.encoder.layers.1.") for name, _ in whisper.named_parameters())
    llava = load_on_host(saved["llava"][1])
    assert type(llava).__name__ == "LlavaForConditionalGeneration"
    assert torch.equal(llava.get_parameter("lm_head.weight"), saved["llava"][0].get_parameter("lm_head.weight"))


def test_offload_pretrained_builds_the_saved_class(saved: dict[str, tuple[Any, Path]]) -> None:
    model_saved, directory = saved["whisper"]
    model, off = offload_pretrained(directory, OffloadConfig(backend="prefetch", group_size=2, num_in_group=1,
                                                             prefetch_step=2))
    assert type(model) is type(model_saved)
    assert off.plan.num_layers == 4  # both stacks: the encoder's 2 layers and the decoder's 2
    assert_same_weights(model, model_saved)  # state_dict: the true weights, from their host copies
    off.restore()
    assert_same_weights(model, model_saved)


def test_a_dtype_is_applied(saved: dict[str, tuple[Any, Path]]) -> None:
    loaded = load_on_host(saved["llava"][1], dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


# ---- diffusers ---------------------------------------------------------------------------


def test_a_diffusers_model_loads_as_its_class_name(flux: tuple[Any, Path]) -> None:
    model, directory = flux
    assert json.loads((directory / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
    loaded: Any = load_on_host(directory)
    assert type(loaded) is type(model)
    assert not loaded.training
    assert_same_weights(loaded, model)


def test_a_diffusers_dtype_is_applied(flux: tuple[Any, Path]) -> None:
    loaded: Any = load_on_host(flux[1], dtype=torch.bfloat16)  # diffusers' torch_dtype
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_a_diffusers_class_name_diffusers_lacks_is_an_error(flux: tuple[Any, Path], tmp_path: Path) -> None:
    directory = copy_of(flux[1], tmp_path / "c")
    edit_config(directory, _class_name="NoSuchTransformer3DModel")
    with pytest.raises(CheckpointError, match=r"diffusers model 'NoSuchTransformer3DModel' \(_class_name\), which "
                       r"diffusers 0\.\d+\.\d+ does not have; .*model_class=") as info:
        load_on_host(directory)
    assert info.value.value == "NoSuchTransformer3DModel"


def test_a_diffusers_model_without_diffusers_is_an_error(flux: tuple[Any, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    with pytest.raises(CheckpointError, match="'FluxTransformer2DModel'.*diffusers is not installed.*model_class="):
        load_on_host(flux[1])


def test_a_diffusers_unexpected_key_is_an_error(flux: tuple[Any, Path], tmp_path: Path) -> None:
    directory = copy_of(flux[1], tmp_path / "c")
    edit_weights(directory, lambda tensors: tensors.update({"extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"into FluxTransformer2DModel \(config\.json _class_name\): 1 in the checkpoint "
                       r"but not in the model \(extra\.weight\)"):
        load_on_host(directory)


# ---- which class: the rule's errors and fallback ------------------------------------------


def test_an_architecture_the_library_lacks_is_an_error_naming_it(saved: dict[str, tuple[Any, Path]],
                                                                 tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_config(directory, architectures=["NoSuchForCausalLM"])
    with pytest.raises(CheckpointError, match=r"architectures names 'NoSuchForCausalLM', which transformers "
                       r"\S+ does not have; pass the class that was saved as model_class=") as info:
        load_on_host(directory)
    assert info.value.value == "NoSuchForCausalLM"


def test_a_name_that_is_no_model_class_is_an_error(saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_config(directory, architectures=["LlamaConfig"])  # in transformers, but a config
    with pytest.raises(CheckpointError, match="'LlamaConfig', which transformers"):
        load_on_host(directory)


def test_several_architectures_are_an_error_naming_each(saved: dict[str, tuple[Any, Path]],
                                                        tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_config(directory, architectures=["LlamaForCausalLM", "LlamaModel", "LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match=r"architectures names 2 classes \(LlamaForCausalLM, LlamaModel\): "
                       r".*model_class=") as info:
        load_on_host(directory)
    assert info.value.value == ("LlamaForCausalLM", "LlamaModel")


def test_a_repeated_architecture_counts_once(saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_config(directory, architectures=["LlamaForCausalLM", "LlamaForCausalLM"])
    assert type(load_on_host(directory)) is LlamaForCausalLM


@pytest.mark.parametrize("architectures", ["LlamaForCausalLM", [3]])
def test_architectures_that_are_not_a_list_of_names_are_an_error(saved: dict[str, tuple[Any, Path]],
                                                                  tmp_path: Path, architectures: object) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_config(directory, architectures=architectures)
    with pytest.raises(CheckpointError, match="architectures is .*, not a list of class names"):
        load_on_host(directory)


def test_a_config_that_is_not_json_is_an_error(saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not a readable JSON file"):
        load_on_host(directory)


def test_model_class_wins_over_the_config(saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    model, source = saved["llama"]
    directory = copy_of(source, tmp_path / "c")
    edit_config(directory, architectures=["NoSuchForCausalLM", "LlamaModel"])
    loaded = load_on_host(directory, model_class=LlamaForCausalLM)
    assert type(loaded) is LlamaForCausalLM
    assert_same_weights(loaded, model)


def test_no_architectures_falls_back_to_auto_with_a_warning(saved: dict[str, tuple[Any, Path]], tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    model, source = saved["gpt2"]
    directory = copy_of(source, tmp_path / "c")
    edit_config(directory, architectures=None)
    with caplog.at_level(logging.WARNING, logger="offload.load"):
        loaded = load_on_host(directory)
    assert type(loaded) is GPT2LMHeadModel
    assert_same_weights(loaded, model)
    warnings = [r.getMessage() for r in caplog.records if r.name == "offload.load" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "config.json names no architectures; built GPT2LMHeadModel (the Auto fallback)" in warnings[0]


def test_the_auto_fallback_that_drops_weights_is_refused(saved: dict[str, tuple[Any, Path]],
                                                         tmp_path: Path) -> None:
    """The reported bug: a Whisper without architectures would come back as
    WhisperForCausalLM, its encoder silently dropped."""
    directory = copy_of(saved["whisper"][1], tmp_path / "c")
    edit_config(directory, architectures=None)
    with pytest.raises(CheckpointError, match=r"not every weight loaded into WhisperForCausalLM \(config\.json has no architectures\)"
                       r": \d+ in the checkpoint but not in the model \(model\.encoder\.") as info:
        load_on_host(directory)
    assert isinstance(info.value.value, dict)
    assert all(key.startswith("model.encoder.") for key in info.value.value["unexpected_keys"])


# ---- every weight must load --------------------------------------------------------------


def test_a_missing_key_is_an_error_and_the_model_is_released(saved: dict[str, tuple[Any, Path]],
                                                             tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_weights(directory, lambda tensors: tensors.pop("model.layers.0.mlp.up_proj.weight"))
    before = live(LlamaForCausalLM)
    with pytest.raises(CheckpointError, match=r"not every weight loaded into LlamaForCausalLM \(config\.json architectures\): "
                       r"1 missing from the checkpoint \(model\.layers\.0\.mlp\.up_proj\.weight\); the checkpoint "
                       r"does not match the class") as info:
        load_on_host(directory)
    assert info.value.value == {"missing_keys": ("model.layers.0.mlp.up_proj.weight",)}
    assert live(LlamaForCausalLM) == before  # nothing, not even the traceback, keeps it


def test_unexpected_keys_are_an_error_naming_the_first_few_and_the_count(saved: dict[str, tuple[Any, Path]],
                                                                         tmp_path: Path) -> None:
    directory = copy_of(saved["gemma"][1], tmp_path / "c")
    extra = {f"extra.{i}.weight": torch.zeros(2) for i in range(5)}
    edit_weights(directory, lambda tensors: tensors.update(extra))
    with pytest.raises(CheckpointError, match=r"GemmaForCausalLM \(config\.json architectures\): 5 in the checkpoint but not in "
                       r"the model \(extra\.0\.weight, extra\.1\.weight, extra\.2\.weight, \.\.\.\)") as info:
        load_on_host(directory)
    assert info.value.value == {"unexpected_keys": tuple(sorted(extra))}


def test_missing_and_unexpected_keys_are_both_named(saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    directory = copy_of(saved["llava"][1], tmp_path / "c")

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        # Saved under the checkpoint's own (older) name; transformers maps it, and reports
        # keys, in the model's names.
        tensors["language_model.lm_head.renamed"] = tensors.pop("language_model.lm_head.weight")

    edit_weights(directory, rename)
    with pytest.raises(CheckpointError, match=r"1 missing from the checkpoint \(lm_head\.weight\); 1 in the "
                       r"checkpoint but not in the model \(lm_head\.renamed\)"):
        load_on_host(directory)


def test_a_weight_of_another_shape_is_an_error_even_when_sizes_may_mismatch(
        saved: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    directory = copy_of(saved["llama"][1], tmp_path / "c")
    edit_weights(directory, lambda tensors: tensors.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"1 of another shape in the checkpoint \(model\.norm\.weight\)"):
        load_on_host(directory, ignore_mismatched_sizes=True)  # transformers would reinitialise it


def test_the_tied_head_is_not_counted_missing(saved: dict[str, tuple[Any, Path]]) -> None:
    model, directory = saved["gemma"]
    (file,) = directory.glob("*.safetensors")
    assert "lm_head.weight" not in load_file(file)  # saved once, as the embedding
    loaded: PreTrainedModel = load_on_host(directory)
    assert loaded.get_parameter("lm_head.weight") is loaded.get_parameter("model.embed_tokens.weight")
