"""`offload_pretrained(diffusers_dir, ..., host_budget_bytes=)`: a diffusers model built from
its ``config.json`` (``_class_name``) with its parameters on meta, as diffusers'
``from_pretrained`` builds it, its weights read from the checkpoint by name and its disk
layers mapped where they lie. A Flux transformer (double and single blocks, disk layers in
both stacks) and a Wan transformer (one stack; ``_keep_in_fp32_modules``) run bit for bit
as the model `load_on_host` (diffusers' ``from_pretrained``) loads, with and without
``dtype``, every parameter and buffer in the dtype diffusers gives it; what the library
cannot build is a `CheckpointError` naming the directory and the class."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

from offload import CheckpointError, ConfigError, EnvSnapshot, OffloadConfig
from offload.hf import find_stacks, load_on_host, offload_pretrained
from offload.hf.disk import DiskRequest, plan_model_disk
from offload.hf.model import plan_model
from offload.model.describe import describe_stacks
from offload.pure.disk.tier import READ_BLOCK, DiskTierPlan
from offload.runtime.cpu import CpuRuntime

EVERY = OffloadConfig(group_size=1, prefetch_step=1)


def _flux() -> Any:
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                  pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))  # type: ignore[no-untyped-call]


def _flux_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 4, generator=g), "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
            "pooled_projections": torch.randn(1, 8, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3)}


def _wan() -> Any:
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=4,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32)  # type: ignore[no-untyped-call]


def _wan_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([3]),
            "encoder_hidden_states": torch.randn(1, 5, 16, generator=g)}


MODELS: dict[str, tuple[Callable[[], Any], Callable[[], dict[str, torch.Tensor]]]] = {
    "flux": (_flux, _flux_inputs), "wan": (_wan, _wan_inputs)}
#: Each model's stacks, in execution order.
STACKS = {"flux": ("transformer_blocks", "single_transformer_blocks"), "wan": ("blocks",)}


def _tier(model: Any, checkpoint: Path) -> DiskTierPlan:
    """The disk tier of the largest host budget (a block at a time) that puts a layer of
    every stack on disk and keeps one in host memory, one staging buffer."""
    stacks = find_stacks(model, None)
    layers = [layer for stack in stacks for layer in stack]
    plan = plan_model(describe_stacks(stacks), EnvSnapshot(), config=EVERY, device_budget_bytes=None, outside_bytes=0)
    firsts = [sum(len(stack) for stack in stacks[:i]) for i in range(len(stacks))]
    budget = plan.host_bytes - 1
    while budget > 0:
        tier = plan_model_disk(model, layers, plan, EnvSnapshot(), DiskRequest(
            host_budget_bytes=budget, checkpoint=checkpoint, read_ahead=1))
        if tier is not None and tier.host_tier_bytes and all(
                any(first <= layer < first + len(stack) for layer in tier.disk_layers)
                for first, stack in zip(firsts, stacks, strict=True)):
            return tier
        budget -= READ_BLOCK
    raise AssertionError("no host budget puts a layer of every stack on disk")


def _sample(model: Any, inputs: dict[str, torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """The model's output for `inputs` (floating ones cast to `dtype` when given)."""
    cast = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in inputs.items()}
    with torch.inference_mode():
        out: torch.Tensor = model(**cast).sample
    return out


def _dtypes(model: Any) -> dict[str, torch.dtype]:
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tensor.dtype for name, tensor in tensors}


def _save(name: str, root: Path, dtype: torch.dtype | None) -> Path:
    """The model saved as diffusers saves it; with `dtype`, as diffusers loads it in that
    dtype (its ``_keep_in_fp32_modules`` in float32) and saves it again, so that every
    weight is stored as the streamed model holds it."""
    first = root / "float32"
    MODELS[name][0]().save_pretrained(first)
    if dtype is None:
        return first
    again = root / str(dtype).removeprefix("torch.")
    load_on_host(first, dtype=dtype).save_pretrained(again)
    return again


@pytest.mark.parametrize(("name", "dtype"), [("flux", None), ("flux", torch.bfloat16), ("wan", None),
                                             ("wan", torch.bfloat16)])
def test_a_diffusers_model_loads_streamed_bit_for_bit(name: str, dtype: torch.dtype | None, tmp_path: Path) -> None:
    checkpoint = _save(name, tmp_path, dtype)
    reference = load_on_host(checkpoint, dtype=dtype)
    want = _sample(reference, MODELS[name][1](), dtype)
    tier = _tier(reference, checkpoint)
    budget = tier.host_tier_bytes + tier.staging_ring_bytes
    model, offloader = offload_pretrained(checkpoint, EVERY, env=EnvSnapshot(), runtime=CpuRuntime(), dtype=dtype,
                                          host_budget_bytes=budget, read_ahead=1)
    assert type(model) is type(reference)
    found = offloader.disk_tier
    assert found is not None and found.disk_layers == tier.disk_layers and found.spill_bytes == 0
    # Disk layers in every stack (Flux: the last double block and the single blocks).
    assert [list(stack) for stack in find_stacks(model, None)] == [list(getattr(model, n)) for n in STACKS[name]]
    assert _dtypes(model) == _dtypes(reference)
    if dtype is not None and name == "wan":  # _keep_in_fp32_modules kept in float32, the rest in dtype
        kinds = set(_dtypes(model).values())
        assert kinds == {torch.float32, dtype} and _dtypes(model)["blocks.0.scale_shift_table"] == torch.float32
    assert model.config == reference.config
    assert torch.equal(_sample(model, MODELS[name][1](), dtype), want)
    assert torch.equal(_sample(model, MODELS[name][1](), dtype), want)  # a second step reads the disk layers again
    offloader.restore()
    expected = reference.state_dict()
    assert all(torch.equal(model.state_dict()[key], value) for key, value in expected.items())


def test_a_diffusers_model_the_library_cannot_build_names_the_directory_and_class(tmp_path: Path) -> None:
    checkpoint = tmp_path / "flux"
    _flux().save_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "in_channels": -4}))
    with pytest.raises(CheckpointError, match=r"FluxTransformer2DModel") as caught:
        offload_pretrained(checkpoint, EVERY, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=1 << 20)
    assert caught.value.name == str(checkpoint) and caught.value.value == "FluxTransformer2DModel"
    assert str(checkpoint) in caught.value.message


def test_a_transformers_model_the_library_cannot_build_names_the_directory_and_class(tmp_path: Path) -> None:
    from tests.hf.checkpoints import build, save

    checkpoint = save(build("llama"), tmp_path / "llama", sharded=False)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    with pytest.raises(CheckpointError, match=r"LlamaForCausalLM") as caught:
        offload_pretrained(checkpoint, EVERY, env=EnvSnapshot(), runtime=CpuRuntime(), host_budget_bytes=1 << 20)
    assert caught.value.name == str(checkpoint) and caught.value.value == "LlamaForCausalLM"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_dtype_diffusers_does_not_build_in_is_refused(dtype: torch.dtype, tmp_path: Path) -> None:
    """Integers are not a model's dtype; diffusers builds a float8 model in float32 and
    casts it after loading, which a streamed load does not do."""
    checkpoint = tmp_path / "flux"
    _flux().save_pretrained(checkpoint)
    with pytest.raises(ConfigError, match="host_budget_bytes") as caught:
        offload_pretrained(checkpoint, EVERY, env=EnvSnapshot(), runtime=CpuRuntime(), dtype=dtype,
                           host_budget_bytes=1 << 20)
    assert caught.value.name == "dtype" and caught.value.value == str(dtype)
