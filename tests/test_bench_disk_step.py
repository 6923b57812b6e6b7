"""Smoke test of `benchmarks/bench_disk_step.py --quick`: the rate ``offload env --disk``
measures, the tier, each round's interleaved reader rates and steps, and the ratios to the
limit and to the prediction are printed as positive numbers, consistent with one another
(each median within its rounds' range, the one round's ratios those of its numbers), every
copy found its read started ahead, and the files are gone afterwards. No timing assertions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import bench_disk_step

NUMBER = r"([\d.]+)"


def spread(name: str, out: str) -> tuple[float, float, float]:
    """(median, least, most) of a ``NAME...: M (rounds A-B)`` line."""
    found = re.search(rf"{re.escape(name)}[^:;]*: {NUMBER} \(rounds {NUMBER}-{NUMBER}\)", out)
    assert found is not None, (name, out)
    median, least, most = (float(v) for v in found.groups())
    assert 0 < least <= median <= most
    return median, least, most


def test_quick_run_prints_the_limit_the_prediction_and_their_ratios(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_disk_step.main(["--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    env = re.search(rf"^offload env --disk before the steps: {NUMBER} GB/s \(DiskReader, 4 threads, ", out, re.M)
    tier = re.search(r"^tier: (\d+) of (\d+) layers on disk \(([\d.]+) GB per step\)", out, re.M)
    round_ = re.search(rf"^tokens 8: round 1: plain {NUMBER} GB/s, reader {NUMBER} GB/s; host-tier steps {NUMBER} "
                       rf"ms, while the disk reads {NUMBER} ms \(it reads at {NUMBER} GB/s\); steps {NUMBER} ms; "
                       rf"other processes {NUMBER} cores, {NUMBER} GB/s of disk reads$", out, re.M)
    assert env and tier and round_, out
    assert 0 < int(tier.group(1)) <= int(tier.group(2)) == 8
    plain, reader, host, reading, loaded, step = (float(v) for v in round_.groups()[:6])
    assert min(plain, reader, host, reading, loaded, step, float(env.group(1))) > 0
    # One round: each ratio is that round's, as printed (to 0.1 ms: a few percent of the quick run's ms).
    assert spread("reader/plain", out)[0] == pytest.approx(reader / plain, rel=0.01)
    limit = max(host / 1e3, float(tier.group(3)) / plain)  # seconds: the host-tier step, GB / (GB/s)
    assert spread("ratio step/limit", out)[0] == pytest.approx(step / 1e3 / limit, rel=0.1)
    assert "target at most 1.15" in out and "target 0.85 to 1.15" in out
    for name in ("ratio step/predicted", "from the plain rate", "offload env --disk's", "while the disk reads",
                 "the reader's rate while the host-tier model runs", "during the steps"):
        spread(name, out)
    assert re.search(r"^tokens 8: copies waited [\d.]+ ms per step, 0 reads not started ahead$", out, re.M), out
    assert list(tmp_path.iterdir()) == []
