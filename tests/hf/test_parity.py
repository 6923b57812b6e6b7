"""`offload_pretrained` and `offload_model` on small random `transformers` models: logits
and greedy `generate` tokens bit for bit equal to the resident model, for prefetch and
on-demand plans, from one-file and sharded checkpoints; `restore` gives back every weight
bit for bit; `state_dict` and `save_pretrained` of an offloaded model give its real weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from offload import ExecutionError, OffloadConfig, Placement, PlanError
from offload.hf import ModelOffloader, find_layers, offload_model, offload_pretrained
from tests.executors.fakes import FakeRuntime
from tests.hf.checkpoints import ARCHITECTURES, VOCAB, build, save

CONFIGS = {
    "prefetch-every-2nd": OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1),
    "prefetch-all": OffloadConfig(group_size=1, prefetch_step=2),
    "on-demand": OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
}

STEPS = 4  # new tokens generated greedily


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def checkpoints(arch: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same random model saved as one file and as many shards with an index."""
    model = build(arch)
    root = tmp_path_factory.mktemp(arch)
    return {kind: save(model, root / kind, sharded=kind == "sharded") for kind in ("single", "sharded")}


def _inputs() -> torch.Tensor:
    return torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))


def _run(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _inputs()
    mask = torch.ones_like(ids)
    run: Any = model  # transformers' generate is not typed for mypy
    with torch.inference_mode():
        logits = run(input_ids=ids, attention_mask=mask).logits
        tokens = run.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                                min_new_tokens=STEPS, pad_token_id=0)
    return logits, tokens


def _weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def _resident(path: Path) -> PreTrainedModel:
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded.eval()  # unannotated in transformers
    model: PreTrainedModel = loaded
    return model


def _check_offloaded(model: PreTrainedModel, off: ModelOffloader, reference: PreTrainedModel, config: str) -> None:
    plan = off.plan
    assert plan.offloaded_params, "nothing was offloaded: the test would pass vacuously"
    layers = find_layers(model)
    assert plan.num_layers == len(layers)
    if config.startswith("prefetch"):
        assert {p.placement for p in plan.offloaded_params} == {Placement.PREFETCH}
        expected = list(range(1, len(layers), 2)) if config == "prefetch-every-2nd" else list(range(len(layers)))
        assert list(plan.offloaded_layers) == expected
    else:
        assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    want_logits, want_tokens = _run(reference)
    got_logits, got_tokens = _run(model)
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_tokens, want_tokens)
    assert got_tokens.shape[1] == _inputs().shape[1] + STEPS
    stats = off.stats()
    assert stats.params_offloaded == len(plan.offloaded_params)
    assert stats.host_bytes == plan.host_bytes
    if config.startswith("prefetch"):
        assert stats.bytes_copied > 0  # the weights really streamed through the slots


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_offload_pretrained_matches_the_resident_model_bit_for_bit(
    checkpoints: dict[str, Path], kind: str, config: str
) -> None:
    reference = _resident(checkpoints[kind])
    model, off = offload_pretrained(checkpoints[kind], CONFIGS[config])
    assert isinstance(off, ModelOffloader)
    _check_offloaded(model, off, reference, config)
    off.restore()
    restored = _weights(model)
    expected = _weights(reference)
    assert sorted(restored) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name
    assert find_layers(model)[0].__dict__.get("forward") is None  # no hook left
    assert torch.equal(_run(model)[1], _run(reference)[1])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_offload_model_matches_the_resident_model_and_restores_it(checkpoints: dict[str, Path], config: str) -> None:
    reference = _resident(checkpoints["sharded"])
    model = _resident(checkpoints["sharded"])
    before = {name: (p, p.data_ptr()) for name, p in model.named_parameters(remove_duplicate=False)}
    off = offload_model(model, CONFIGS[config])
    _check_offloaded(model, off, reference, config)
    off.restore()
    for name, p in model.named_parameters(remove_duplicate=False):
        was, pointer = before[name]
        assert p is was, name  # the same Parameter objects
        # On this machine the host is the compute device: pageable weights were adopted
        # as their own host copies, so they come back at the same address.
        assert p.data_ptr() == pointer, name
        assert torch.equal(p, reference.get_parameter(name)), name


@pytest.mark.parametrize("config", ["prefetch-all", "on-demand"])
def test_state_dict_and_save_pretrained_of_an_offloaded_model_hold_the_real_weights(
    checkpoints: dict[str, Path], config: str, tmp_path: Path
) -> None:
    reference = _resident(checkpoints["single"])
    model, off = offload_pretrained(checkpoints["single"], CONFIGS[config])
    _run(model)  # the slots now hold the last layers' weights
    state = model.state_dict()
    expected = reference.state_dict()
    assert sorted(state) == sorted(expected)
    different = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert different == []
    saver: Any = model  # save_pretrained's decorator hides its signature from mypy
    saver.save_pretrained(tmp_path / "saved")
    again = _resident(tmp_path / "saved")
    assert torch.equal(_run(again)[0], _run(reference)[0])
    off.restore()


def test_offloaded_slots_are_not_what_state_dict_returns(checkpoints: dict[str, Path]) -> None:
    """The parameters of a prefetch model point at shared slots; without the state_dict
    hook most entries would be another layer's weights (35 of 57 on a Llama)."""
    reference = _resident(checkpoints["single"])
    model, off = offload_pretrained(checkpoints["single"], CONFIGS["prefetch-all"])
    _run(model)
    expected = reference.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    stale = [k for k in expected if k in params and not torch.equal(params[k].detach(), expected[k])]
    assert stale, "the slots held every layer's own weights: the hook is not what makes state_dict right"
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in stale)
    off.restore()


def test_a_model_on_meta_is_refused_by_offload_model_and_left_as_it_was() -> None:
    model: nn.Module = nn.Module.to(build("llama"), "meta")  # PreTrainedModel.to is typed for devices only
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(PlanError, match="meta device") as info:
        offload_model(model, CONFIGS["prefetch-all"])
    assert "offload_pretrained" in str(info.value)
    assert {name: p for name, p in model.named_parameters()} == before
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_failed_post_init_restores_the_model() -> None:
    """offload_model is one call: if its post_init fails (here the first static buffer
    cannot be allocated), the model is given back as it was, and the error says so."""
    model = build("gpt2")
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters(remove_duplicate=False)}
    runtime = FakeRuntime(fail_device_empty_at=0)
    with pytest.raises(ExecutionError, match="post_init failed, model restored") as info:
        offload_model(model, CONFIGS["prefetch-all"], runtime=runtime)
    assert isinstance(info.value.__cause__, ExecutionError)
    assert runtime.device_empties == 1
    for name, p in model.named_parameters(remove_duplicate=False):
        was, value = before[name]
        assert p is was and torch.equal(p, value), name
    assert [i for i, layer in enumerate(find_layers(model)) if "forward" in layer.__dict__] == []
