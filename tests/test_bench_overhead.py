"""Smoke test of `benchmarks/bench_overhead.py --quick`: the table is printed, every row
parses, peers that are absent say so. No timing assertions."""

from __future__ import annotations

import importlib.util
import math

import pytest

from benchmarks import bench_overhead

CONTENDERS = ("resident", "copies-only", "copies-merged", "prefetch-d1", "prefetch-d2", "prefetch-each",
              "prefetch-copy-off", "on-demand", "diffusers-leaf", "diffusers-block", "accelerate-cpu")
STACKS = ("linear32", "llama32")  # what --quick runs
MODES = ("inference_mode", "no_grad")


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_quick_run_prints_a_row_per_stack_mode_and_contender(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_overhead.main(["--quick", "--device", "cpu", "--seconds", "0.3", "--max-rounds", "20"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert bench_overhead.HEADER in lines
    table = lines[lines.index(bench_overhead.HEADER) + 1:]
    rows: dict[tuple[str, str, str], list[str]] = {}
    for line in table:
        if not line.strip():
            break
        stack, mode, contender, *rest = line.split()
        rows[(stack, mode, contender)] = rest
    assert set(rows) == {(s, m, c) for s in STACKS for m in MODES for c in CONTENDERS}
    absent = {"diffusers-leaf": not _installed("diffusers"), "diffusers-block": not _installed("diffusers"),
              "accelerate-cpu": not _installed("accelerate")}
    for (stack, mode, contender), rest in rows.items():
        if absent.get(contender, False):
            assert rest == ["not", "installed"], (stack, mode, contender, rest)
            continue
        median, over_median, over_min, d1, d2 = rest[:5]
        for value in (median, over_median, over_min):
            assert math.isfinite(float(value)), (stack, mode, contender, rest)
        for ratio in (d1, d2):
            assert ratio == "n/a" or math.isfinite(float(ratio)), (stack, mode, contender, rest)
        if contender == "resident":
            assert float(over_median) == 0.0 and float(over_min) == 0.0
    for stack in STACKS:
        for mode in MODES:
            assert any(line.startswith(f"{stack} {mode}: prefetch overhead") and "ratio to target" in line
                       and "in one copy (copies-merged)" in line and "(copies-only), beyond them prefetch-each" in line
                       and "with the copy switched off d1" in line
                       for line in lines), (stack, mode)
        assert f"{stack}: outputs of prefetch-d1, prefetch-d2, prefetch-each and on-demand equal the resident" in out
        # Every bench layer's weights are dense multiples of 256 bytes: with layer_blocks
        # "always" each layer is one copy; with "never" one per parameter.
        layers, per_layer = {"linear32": (32, 2), "llama32": (32, 9)}[stack]
        for name, copies in (("prefetch-d1", layers), ("prefetch-d2", layers), ("prefetch-each", layers * per_layer)):
            assert f"{stack}: {name}: {copies} copies per forward for {layers} offloaded layers" in out
        assert f"{stack}: on-demand: plan backend uva" in out
