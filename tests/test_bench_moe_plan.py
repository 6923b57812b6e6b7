"""`benchmarks/bench_moe_plan.py` on a small stack: every row parses, and the rows hold
what the planner promises (no step below its limit; the top-k bound no faster than the
trace, and at batch 1 much faster than the older worst case). No timing assertions."""

from __future__ import annotations

import pytest

from benchmarks import bench_moe_plan


def test_the_rows_parse_and_are_ordered_as_the_bounds_say(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_moe_plan.main(["--layers", "4", "--budget-gib", "12", "--trace-steps", "20",
                                "--batches", "1", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows: dict[tuple[int, str], tuple[float, float, float]] = {}
    for line in lines[lines.index(bench_moe_plan.HEADER) + 1:]:
        size, rest = line.split(maxsplit=1)
        way = next(w for w in bench_moe_plan.WAYS if rest.startswith(w))
        step, limit, ratio = (float(x) for x in rest[len(way):].split()[:3])
        rows[(int(size), way)] = (step, limit, ratio)
    assert set(rows) == {(b, w) for b in (1, 64) for w in bench_moe_plan.WAYS}
    for step, limit, ratio in rows.values():
        assert step >= limit * (1 - 1e-3) and ratio >= 0.999
    for batch in (1, 64):  # a trace of those tokens and top-k never costs more than the bound
        assert rows[(batch, "zipf")][0] <= rows[(batch, "bound")][0] * (1 + 1e-3)
    assert rows[(1, "bound")][0] * 2 < rows[(1, "no top-k")][0]  # 8 of 128 experts a call, not all


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench_moe_plan.main(["--budget-gib", "0"])
