"""`offload_pretrained` and `offload_model` on a played CUDA device (`FakeRuntime(device=
"cuda:0")`: every tensor stays on the CPU, but the executors see host and device apart), so
the GPU paths run here: resident weights and everything outside the layers go to the
device, offloaded ones to (played) page-locked host copies; the device never holds more
than the plan's resident bytes, buffers and outside weights plus the largest tensor; and
`restore` gives every weight back to the host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from offload import EnvFlags, EnvSnapshot, OffloadConfig
from offload.hf import find_layers, offload_pretrained
from offload.hf.model import outside_tensors
from tests.executors.fakes import FakeRuntime
from tests.executors.helpers import CUDA_LIKE
from tests.hf.checkpoints import VOCAB, build, save

CONFIGS = {
    "prefetch": OffloadConfig(group_size=2, num_in_group=1, prefetch_step=1),
    "uva": OffloadConfig(backend="uva", uva_max_bytes=1 << 40),
}


def _env(pin: bool) -> EnvSnapshot:
    return EnvSnapshot(flags=EnvFlags(disable_pin_memory=not pin), platform=CUDA_LIKE)


@pytest.fixture(scope="module", params=["llama", "gemma"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch: str = request.param
    return save(build(arch), tmp_path_factory.mktemp(arch), sharded=True)


def _resident(path: Path) -> PreTrainedModel:
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded.eval()
    model: PreTrainedModel = loaded
    return model


def _logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    run: Any = model
    with torch.inference_mode():
        logits: torch.Tensor = run(input_ids=ids).logits
    return logits


@pytest.mark.parametrize("pin", [True, False], ids=["pin-on", "pin-off"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_weights_go_where_the_plan_says_and_come_back(checkpoint: Path, config: str, pin: bool) -> None:
    reference = _resident(checkpoint)
    runtime = FakeRuntime(device="cuda:0")
    model, off = offload_pretrained(checkpoint, CONFIGS[config], env=_env(pin), runtime=runtime)
    plan = off.plan
    layers = list(find_layers(model))
    offloaded = {(p.layer, p.name) for p in plan.offloaded_params}
    assert offloaded and len(offloaded) < sum(len(list(layer.parameters())) for layer in layers) or config == "uva"
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            assert runtime.on_device(param) is ((index, name) not in offloaded or config == "prefetch"), (index, name)
    rest = outside_tensors(model, layers)
    assert rest and all(runtime.on_device(t) for _, t in rest)  # embeddings, head, norm, buffers
    del rest  # it holds the device buffers (restore replaces them in their modules)
    pinned = [e for e in runtime.log if type(e).__name__ == "HostCopy"]
    assert bool(pinned) is pin  # pinning on: copies into page-locked memory; off: adopted in place
    assert torch.equal(_logits(model), _logits(reference))

    off.restore()
    assert runtime.device_live_bytes == 0  # nothing left on the device
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        assert not runtime.on_device(param), name
        assert torch.equal(param, expected[name]), name
    assert all(not runtime.on_device(t) for _, t in outside_tensors(model, layers))


def test_the_device_never_holds_more_than_the_plan_says(checkpoint: Path) -> None:
    runtime = FakeRuntime(device="cuda:0")
    model, off = offload_pretrained(checkpoint, OffloadConfig(group_size=1, prefetch_step=2), env=_env(True),
                                    runtime=runtime)
    plan = off.plan
    layers = list(find_layers(model))
    outside = sum(t.numel() * t.element_size() for _, t in outside_tensors(model, layers))
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    bound = plan.device_bytes_resident + plan.device_bytes_buffers + outside + largest
    _logits(model)
    assert plan.offloaded_bytes > largest  # the bound is below the model: it means something
    assert bound < model_bytes
    assert 0 < runtime.device_peak_bytes <= bound
    off.restore()
