"""``offload env --disk DIR``: the disk tier's reader timed on a scratch file in DIR, the
rate printed with the ``offload plan --disk-gbps`` it is for (and in ``--json``), the file
removed; bad flags exit 2 in one line. No timing assertions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from offload.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_env_disk_prints_the_rate_for_plans(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "env", "--disk", str(tmp_path), "--disk-mib", "1")
    assert code == 0, err
    section = out[out.index("\ndisk:\n"):]
    rate = re.search(r"^  read rate  ([\d.]+) GB/s, the median of 3 reads of a 1\.0 MiB scratch file "
                     r"\(([\d.]+), ([\d.]+), ([\d.]+) GB/s\)$", section, re.M)
    assert rate is not None, section
    runs = sorted(float(v) for v in rate.groups()[1:])
    assert float(rate.group(1)) == pytest.approx(runs[1], abs=1e-3) and runs[0] > 0
    assert re.search(r"^  reader     the disk tier's: 4 threads, 16\.0 MiB chunks, 1\.0 MiB requests, 2 in flight, "
                     r"(O_DIRECT|buffered)", section, re.M), section
    # The rate to two decimals, rounded from the measured value (not from its three-decimal
    # print: 1.135 shown may be 1.1349... measured, printed 1.13 there).
    plans = re.search(r"^  for plans  offload plan SOURCE --host-gib X --disk-gbps (\d+\.\d\d)$", section, re.M)
    assert plans is not None, section
    assert abs(float(plans.group(1)) - float(rate.group(1))) <= 0.0051
    assert f"  directory  {tmp_path}" in section
    assert list(tmp_path.iterdir()) == []


def test_env_disk_json_has_the_rate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "env", "--json", "--disk", str(tmp_path), "--disk-mib", "1")
    assert code == 0, err
    disk = json.loads(out)["disk"]
    assert disk["directory"] == str(tmp_path) and disk["bytes"] == 1 << 20 and disk["threads"] == 4
    assert len(disk["runs_gbps"]) == 3 and min(disk["runs_gbps"]) <= disk["gbps"] <= max(disk["runs_gbps"])
    assert disk["mode"] in ("direct", "buffered")
    assert list(tmp_path.iterdir()) == []


def test_env_without_disk_measures_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env", "--json")
    assert code == 0 and "disk" not in json.loads(out)


@pytest.mark.parametrize(("argv", "says"), [
    (["--disk-mib", "8"], "offload env: --disk-mib needs --disk DIR"),
    (["--disk", "{missing}"], "is not a directory"),
    (["--disk", "{tmp}", "--disk-mib", "0"], "offload env: --disk-mib must be at least 1"),
    (["--disk", "{tmp}", "--disk-mib", str(1 << 40)], "less than the"),
])
def test_bad_disk_flags_exit_2_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
                                           says: str) -> None:
    given = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, "env", *given)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert list(tmp_path.iterdir()) == []
