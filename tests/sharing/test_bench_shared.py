"""Smoke test of `benchmarks/bench_shared.py --quick`: both modes run, the table parses,
the shared segment holds one copy. Memory ratios of so small a model are dominated by
each process's own overhead, so they are printed, not asserted, here (the multi-process
tests assert the segment's Pss)."""

from __future__ import annotations

import pytest

from benchmarks import bench_shared


def test_quick_run_prints_both_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_shared.main(["--quick", "--mib", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert bench_shared.HEADER in lines
    table = lines[lines.index(bench_shared.HEADER) + 1:][:2]
    private, shared = (line.split() for line in table)
    assert private[:2] == ["private", "2"] and shared[:2] == ["shared", "2"]
    assert private[2:4] == ["4.0", "MiB"] and private[7] == "-"  # no segment without sharing
    assert shared[7:9] == ["4.0", "MiB"]  # the segment's Pss over both ranks: one copy
    assert float(shared[9]) > 0 and float(shared[10]) > 0  # publish and map seconds
    assert any(line.startswith("host memory per host:") for line in lines)
