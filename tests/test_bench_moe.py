"""`benchmarks/bench_moe.py` on the CPU with small arguments: every row parses, the outputs
are the resident model's bit for bit, the expert cache copies at most 1.05x what a decode
step needs at batch 1 and less than whole-layer streaming, the replay predicts the
executor's expert bytes, the Zipf table is ordered as the bounds say; the ``--gpu`` stack is
found and served exactly on the CPU, and ``--gpu`` skips without CUDA. No timing assertions."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks import bench_moe
from offload import describe_layers
from offload.pure.spec.experts import Routing

MODELS = ("qwen3_moe", "mixtral", "llama4")
BATCHES = (1, 4)
SMALL = bench_moe.StackShape(layers=4, experts=16, top_k=2, hidden=32, inter=8, dtype=torch.float32)


def _number(text: str) -> float | None:
    return None if text == "n/a" else float(text)


def test_a_small_run_meets_the_targets_row_by_row(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", *MODELS, "--batches", *map(str, BATCHES), "--layers", "3", "--zipf-steps", "60", "--strict"]
    assert bench_moe.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert bench_moe.HEADER in lines
    rows: dict[tuple[str, int], list[str]] = {}
    for line in lines[lines.index(bench_moe.HEADER) + 1:]:
        if not line.strip():
            break
        model, size, *rest = line.split()
        rows[(model, int(size))] = rest
    assert set(rows) == {(m, b) for m in MODELS for b in BATCHES}
    for (model, batch), (whole, cache, hits, best, estimate, parity, overhead, admit) in rows.items():
        where = (model, batch)
        assert parity == "true", where
        assert float(cache) < float(whole), where
        if batch == 1:
            assert float(cache) <= bench_moe.TARGET, where
        assert float(estimate) == pytest.approx(1.0, abs=bench_moe.ESTIMATE), where
        hit, optimum = _number(hits), _number(best)
        assert hit is not None and optimum is not None and 0 <= hit <= optimum <= 100, where
        assert float(overhead) > 0 and float(admit) > 0 and math.isfinite(float(overhead)), where
    assert any(line.startswith("targets (") and "every one of 6 rows met them" in line for line in lines)
    zipf = lines[lines.index(bench_moe.ZIPF_HEADER) + 1:][:len(bench_moe.ZIPF_EXPERTS) * len(bench_moe.ZIPF_SLOTS)]
    for line in zipf:
        _, _, policy, best_, static, *_ = (float(v) for v in line.split())
        assert 0 < policy <= best_ and static <= best_, line


def _resident(shape: bench_moe.StackShape) -> nn.ModuleList:
    """The stack with every weight in place, filled as the offloaded one is."""
    layers = nn.ModuleList([bench_moe.MoeLayer(shape) for _ in range(shape.layers)]).to(shape.dtype)
    bench_moe.fill_weights(list(layers), shape, torch.device("cpu"), zipf=1.0)  # type: ignore[arg-type]  # of MoeLayer
    return layers.requires_grad_(False)


def test_the_gpu_stack_is_found_and_served_exactly_on_the_cpu() -> None:
    groups = describe_layers(list(bench_moe.meta_stack(SMALL))).experts
    assert [(g.module, g.num_experts, g.routing, g.expert_bytes) for g in groups] == \
        [("experts", 16, Routing.INDICES, SMALL.expert_bytes)] * SMALL.layers
    rows = {cache: bench_moe.measure_stack(SMALL, torch.device("cpu"), cache=cache, batches=BATCHES, steps=2,
                                           zipf=1.0) for cache in (True, False)}
    resident = _resident(SMALL)
    whole_bytes = sum(p.numel() * p.element_size() for p in resident.parameters())
    for ours, whole in zip(rows[True], rows[False], strict=True):
        assert ours.batch == whole.batch
        x = torch.randn(ours.batch, 1, SMALL.hidden, generator=torch.Generator().manual_seed(ours.batch))
        with torch.inference_mode():
            for layer in resident:
                x = layer(x)
        assert torch.equal(ours.first_output, x) and torch.equal(whole.first_output, x)
        assert ours.needed == whole.needed <= whole_bytes
        assert whole.copied == whole_bytes  # no position kept: every layer copied whole each step
        assert ours.copied <= ours.needed and ours.hits is not None
        assert ours.tokens_per_second > 0 and whole.tokens_per_second > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --gpu would run")
def test_gpu_mode_skips_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_moe.main(["--gpu"]) == 0
    assert "bench_moe --gpu: skipped: CUDA is not available" in capsys.readouterr().out
