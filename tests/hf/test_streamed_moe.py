"""Streamed loads (`offload_pretrained(..., host_budget_bytes=)`) of the seven small MoE
models of `tests.hf.moe_models`, whose checkpoints store the experts one tensor per expert
(and Mixtral's under ``block_sparse_moe``) where transformers fuses them at load: each
stored tensor is read into its rows of the live fused tensor, in host memory, or written to
the spill file piece by piece for a disk-tier layer, and the logits are bit for bit those
of transformers' own ``from_pretrained``, every weight too; ``offload plan DIR`` plans the
live layers. And what is not carried out is refused, naming the weight and the operation.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.core_model_loading import Chunk, WeightConverter

from offload import CheckpointError, EnvSnapshot, OffloadConfig, OffloadPlan
from offload.cli import main
from offload.executors.experts import record_routing
from offload.hf import find_stacks, offload_pretrained, streamed
from offload.hf.conversions import LiveSource, Piece, live_sources, spill_runs
from offload.model.checkpoint import checkpoint_extents
from offload.model.describe import describe_layers
from offload.pure.disk.params import READ_BLOCK
from offload.pure.disk.tier import DiskSource, staging_layout
from offload.runtime.cpu import CpuRuntime
from tests.executors.disk_helpers import plan_tier, weights
from tests.hf.checkpoints import VOCAB
from tests.hf.moe_models import MOE_ARCHITECTURES, build_moe

#: Every layer offloaded, two copies ahead.
CONFIG = OffloadConfig(group_size=1, prefetch_step=2)
#: The architectures whose checkpoints transformers converts at load (gpt-oss and Llama 4
#: store their experts as the model holds them).
CONVERTED = {"mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "olmoe"}


def _save(name: str, folder: Path) -> tuple[Path, Any]:
    """A checkpoint of `name` with 4 layers in `folder`, and the model transformers loads from it."""
    checkpoint = folder / "checkpoint"
    model: Any = build_moe(name, 4)
    model.save_pretrained(checkpoint)
    reference: Any = AutoModelForCausalLM.from_pretrained(checkpoint)
    return checkpoint, reference.eval()


@pytest.fixture(scope="module", params=sorted(MOE_ARCHITECTURES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(the architecture, its checkpoint, the model transformers loads from it)."""
    name: str = request.param
    return (name, *_save(name, tmp_path_factory.mktemp(name)))


def _logits(model: Any) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        found: torch.Tensor = model(input_ids=ids).logits
    return found


def _same_weights(model: Any, reference: Any) -> None:
    got, want = weights(model), weights(reference)
    assert got.keys() == want.keys()
    assert [name for name, value in want.items() if not torch.equal(got[name], value)] == []


def test_a_disk_tier_load_is_bit_for_bit(saved: tuple[str, Path, Any], tmp_path: Path) -> None:
    name, checkpoint, reference = saved
    budget = plan_tier(reference, checkpoint, config=CONFIG)[0].host_bytes - 1
    model, offloader = offload_pretrained(checkpoint, CONFIG, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, spill_dir=tmp_path)
    tier = offloader.disk_tier
    assert tier is not None and tier.disk_positions
    assert len(tier.disk_layers) < len(find_stacks(model)[0])  # host layers too
    spilled = {p.name for p in tier.params if p.source is DiskSource.SPILL}
    if name in CONVERTED:  # the fused experts (and Mixtral's renamed router) from their pieces
        assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= spilled
        assert all(n.startswith("mlp.") for n in spilled), spilled
    else:
        assert not spilled
    assert torch.equal(_logits(model), _logits(reference))
    offloader.restore()  # every row, the experts no token was routed to included
    _same_weights(model, reference)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])  # renamed and fused; fused
def test_a_host_budget_that_holds_every_layer_is_bit_for_bit(name: str, tmp_path: Path) -> None:
    checkpoint, reference = _save(name, tmp_path)
    budget = 4 * plan_tier(reference, checkpoint, config=CONFIG)[0].host_bytes
    model, offloader = offload_pretrained(checkpoint, CONFIG, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget)
    assert offloader.disk_tier is None
    assert torch.equal(_logits(model), _logits(reference))
    offloader.restore()
    _same_weights(model, reference)


def test_a_host_budget_alone_takes_the_expert_options(tmp_path: Path) -> None:
    """No accelerator and no config: every layer offloaded (`CPU_TIER_CONFIG`) with the
    expert options given, streamed from the checkpoint, bit for bit."""
    checkpoint, reference = _save("qwen3_moe", tmp_path)
    budget = 4 * plan_tier(reference, checkpoint, config=CONFIG)[0].host_bytes
    model, offloader = offload_pretrained(checkpoint, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, expert_slots=3)
    assert len(offloader.plan.experts) == 4 and all(c.slots == 3 for c in offloader.plan.experts)
    assert torch.equal(_logits(model), _logits(reference))
    offloader.restore()
    model, offloader = offload_pretrained(checkpoint, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, expert_cache=False)
    assert offloader.plan.experts == ()
    assert torch.equal(_logits(model), _logits(reference))
    offloader.restore()


def test_a_routing_trace_a_host_budget_alone_does_not_search_is_said_unused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint, reference = _save("qwen3_moe", tmp_path)
    with record_routing(reference.model.layers) as record:
        _logits(reference)
    budget = 4 * plan_tier(reference, checkpoint, config=CONFIG)[0].host_bytes
    with caplog.at_level(logging.WARNING, logger="offload.plan"):
        model, offloader = offload_pretrained(checkpoint, env=EnvSnapshot(), runtime=CpuRuntime(),
                                              host_budget_bytes=budget, routing_trace=record.trace())
    assert any("the routing trace is not used" in r.getMessage() for r in caplog.records)
    assert offloader.plan.config.group_size == 1 and len(offloader.plan.experts) == 4  # CPU_TIER_CONFIG's
    assert torch.equal(_logits(model), _logits(reference))
    offloader.restore()


def test_plan_of_the_checkpoint_plans_the_live_layers(saved: tuple[str, Path, Any], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    name, checkpoint, reference = saved
    built: list[Path] = []
    build = streamed.build_on_meta

    def counted(model_class: Any, root: Path) -> Any:
        built.append(root)
        return build(model_class, root)

    monkeypatch.setattr(streamed, "build_on_meta", counted)
    code = main(["plan", str(checkpoint), "--group-size", "1", "--prefetch-step", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(built) == 1  # once, for the live conversions and the experts alike
    plan = OffloadPlan.from_json(out)
    layers = find_stacks(reference)[0]
    live = {(i, n): (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    assert {(p.layer, p.name): (p.param.shape, p.param.dtype) for p in plan.params} == live
    assert len(plan.offloaded_params) == len(live)  # one copy per live parameter a step
    stored = len(checkpoint_extents(checkpoint).tensors)
    assert (stored > len(live) + 3) is (name in CONVERTED)
    # and the experts modules are the live model's: each gets the expert cache a load gives it
    groups = describe_layers(layers).experts
    assert len(groups) == 4
    assert tuple(c.group for c in plan.experts) == groups
    _, offloader = offload_pretrained(checkpoint, CONFIG, env=EnvSnapshot(), runtime=CpuRuntime())
    assert offloader.plan.experts == plan.experts
    offloader.restore()
    # planned before downloading (its config.json alone): the same caches
    alone = tmp_path / "config-only"
    alone.mkdir()
    (alone / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    built.clear()
    code = main(["plan", str(alone), "--group-size", "1", "--prefetch-step", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert OffloadPlan.from_json(out).experts == plan.experts
    assert len(built) == 1


class ChunkedLlama(LlamaForCausalLM):  # type: ignore[no-untyped-call]  # transformers: __init_subclass__ untyped
    """A Llama whose checkpoint holds each MLP's gate and up projections as one tensor,
    split at load (transformers' ``Chunk``), a conversion a streamed load refuses."""


def test_an_operation_not_carried_out_is_refused_naming_the_weight_and_operation() -> None:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    register_checkpoint_conversion_mapping(ChunkedLlama.__name__, [WeightConverter(
        source_patterns="mlp.gate_up.weight", target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        operations=[Chunk(dim=0)])], overwrite=True)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = ChunkedLlama(config)
    from offload.pure.spec.safetensors import TensorHeader

    headers = {"model.layers.0.mlp.gate_up.weight": TensorHeader(
        name="model.layers.0.mlp.gate_up.weight", dtype="float32", shape=(64, 16), begin=0, end=64 * 16 * 4)}
    with pytest.raises(CheckpointError, match=r"Chunk\(dim=0\)") as caught:
        live_sources(model, headers)
    assert caught.value.name == "model.layers.0.mlp.gate_proj.weight"
    assert caught.value.value == "Chunk(dim=0)"


def test_a_piece_that_is_no_contiguous_run_is_refused_for_the_spill_file() -> None:
    rows = LiveSource(name="w", shape=(2, 3, 4), pieces=(Piece(stored="a", index=(0, (0, 3), (0, 4))),
                                                         Piece(stored="b", index=(1, (0, 3), (0, 4)))), operations=("x",))
    assert spill_runs(rows, 2) == (("a", 0), ("b", 24))
    columns = LiveSource(name="w", shape=(3, 4), pieces=(Piece(stored="a", index=((0, 3), (0, 2))),
                                                         Piece(stored="b", index=((0, 3), (2, 4)))), operations=("x",))
    with pytest.raises(CheckpointError, match="contiguous") as caught:
        spill_runs(columns, 4)
    assert caught.value.name == "w" and caught.value.value == "a"


def _disk_moe(name: str, folder: Path, spill: Path) -> tuple[Any, Any, Any]:
    """(the model loaded with a disk tier, its offloader, the model transformers loads)."""
    checkpoint, reference = _save(name, folder)
    spill.mkdir()
    # Three of the four layers on disk, more than the ring's two buffers: each pass reads them.
    budget = plan_tier(reference, checkpoint, config=CONFIG, disk_layers=3)[1].host_budget_bytes
    model, offloader = offload_pretrained(checkpoint, CONFIG, env=EnvSnapshot(), runtime=CpuRuntime(),
                                          host_budget_bytes=budget, spill_dir=spill)
    return model, offloader, reference


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])  # fused at load and spilled; read from the checkpoint
def test_a_disk_tier_reads_the_experts_in_place_only_as_missed(name: str, tmp_path: Path) -> None:
    """The expert caches read their misses from the files; the staging ring reads only a
    disk layer's other weights, so a pass reads far fewer bytes than the layers hold."""
    model, offloader, reference = _disk_moe(name, tmp_path / "c", tmp_path / "s")
    tier = offloader.disk_tier
    plan = offloader.plan
    experts = {(c.layer, n) for c in plan.experts for n in c.group.params}
    on_disk = set(tier.disk_layers)
    assert {(p.layer, p.name) for p in tier.params if p.in_place} == {r for r in experts if r[0] in on_disk}
    staged = sum(p.nbytes for p in tier.params if not p.in_place)
    assert staged < tier.disk_bytes / 4  # the experts are most of a MoE layer
    spans = staging_layout(tier)
    assert tier.staging_bytes == max(spans[layer][1] for layer in on_disk)
    before = offloader.stats().disk_bytes_read
    passes = 3
    for _ in range(passes):
        assert torch.equal(_logits(model), _logits(reference))
    read = offloader.stats().disk_bytes_read - before
    slack = READ_BLOCK * len(tier.params)  # a read may start a block early
    assert 0 < read <= passes * (staged + slack) < passes * tier.disk_bytes
    offloader.restore()
    _same_weights(model, reference)


def test_new_weights_reach_the_disk_tiers_expert_caches(tmp_path: Path) -> None:
    """New weights for disk-tier MoE layers go to the spill file, and the caches read the
    experts they miss from there, not from the files they read before."""
    model, offloader, _ = _disk_moe("qwen3_moe", tmp_path / "c", tmp_path / "s")
    assert offloader.disk_tier.disk_layers and offloader.plan.experts
    twin: Any = build_moe("qwen3_moe", 4, seed=1)
    twin.eval()
    assert not torch.equal(_logits(model), _logits(twin))
    offloader.load_weights({name: t.clone() for name, t in twin.state_dict().items()})
    assert torch.equal(_logits(model), _logits(twin))
    offloader.restore()
    _same_weights(model, twin)
