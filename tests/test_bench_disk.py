"""Smoke test of `benchmarks/bench_disk.py --quick`: every side's row and both ratio lines
are printed and parse as positive numbers, the reader's bytes were checked, the filesystem
is named and the files are gone afterwards. No timing assertions."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from benchmarks import bench_disk


def test_quick_run_prints_every_side_and_positive_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_disk.main(["--quick", "--dir", str(tmp_path), "--threads", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("bench_disk: 1 file(s) of 32 MiB in ") and " on " in lines[0]
    assert "best effort" in out
    for side in bench_disk.SIDES:
        rows = re.findall(rf"^{re.escape(side)} +([\d.]+) +([\d.]+)$", out, re.M)  # the median, then the one run
        assert len(rows) == 1, (side, out)
        assert float(rows[0][0]) > 0 and float(rows[0][1]) == float(rows[0][0])
    for side in bench_disk.OURS:
        found = re.search(rf"^ratio {side}/plain: (\S+) \(target >= 0\.9\); {side}/plain-dest: (\S+)$", out, re.M)
        assert found is not None, side
        assert all(math.isfinite(float(value)) and float(value) > 0 for value in found.groups())
    assert "ours read every byte exactly: yes" in lines
    assert "2 threads, 16 MiB chunks" in out
    assert list(tmp_path.iterdir()) == []  # the files and their directory were removed


def test_the_filesystem_is_named_from_proc_mounts(tmp_path: Path) -> None:
    named = bench_disk.filesystem_of(tmp_path)
    kind, _, rest = named.partition(" (")
    assert kind and kind != "unknown" and " mounted at /" in rest
