"""Smoke test of `benchmarks/bench_disk_step.py --quick`: the plain rate, the tier, the
predicted and measured step and their ratio are printed as positive numbers, every copy
found its read started ahead, and the files are gone afterwards. No timing assertions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import bench_disk_step


def test_quick_run_prints_the_prediction_the_step_and_their_ratio(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_disk_step.main(["--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rate = re.search(r"^plain reader before the steps: ([\d.]+) GB/s", out, re.M)
    tier = re.search(r"^tier: (\d+) of (\d+) layers on disk", out, re.M)
    predicted = re.search(r"^predicted step \(estimate_with_tier: .*\): ([\d.]+) ms; ", out, re.M)
    measured = re.search(r"^measured step: ([\d.]+) ms \(median of 2: [\d. ]+\)$", out, re.M)
    ratio = re.search(r"^ratio step/predicted: ([\d.]+) \(target 0\.85 to 1\.15\)$", out, re.M)
    assert rate and tier and predicted and measured and ratio, out
    assert 0 < int(tier.group(1)) <= int(tier.group(2)) == 8
    assert float(rate.group(1)) > 0 and float(predicted.group(1)) > 0 and float(measured.group(1)) > 0
    # The ratio of the two times as printed (to 0.1 ms: a few percent on the quick run's ms).
    assert float(ratio.group(1)) == pytest.approx(float(measured.group(1)) / float(predicted.group(1)), rel=0.1)
    assert re.search(r", 0 not started ahead$", out, re.M), out
    assert list(tmp_path.iterdir()) == []
