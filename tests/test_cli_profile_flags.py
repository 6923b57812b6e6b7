"""``offload plan --profile NAME`` with ``--link-gbps`` / ``--tflops``: the numbers given
change the estimate's compute and link terms, with and without a disk tier, and giving a
profile's own link rate changes nothing, also where the plan does not pin (the copies then
run at the pageable rate, which moves with the link at the profile's own ratio)."""

from __future__ import annotations

import re

import pytest

from offload.cli import main

#: The estimate's lines: the compute term, the link term's rate, the predicted step.
COMPUTE = re.compile(r"^resident compute = ([\d.]+) (ms|s)", re.M)
LINK = re.compile(r"^link +=.* / ([\d.]+) GB/s = ", re.M)
STEP = re.compile(r"^predicted step += .* = ([\d.]+) (ms|s), ", re.M)


def estimate_lines(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[float, float, float]:
    """(compute seconds, link GB/s, predicted step seconds) of ``offload plan ARGV``."""
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    found = [pattern.search(out) for pattern in (COMPUTE, LINK, STEP)]
    assert all(found), out
    compute, link, step = (m for m in found if m is not None)

    def seconds(match: re.Match[str]) -> float:
        return float(match.group(1)) * (1e-3 if match.group(2) == "ms" else 1.0)

    return seconds(compute), float(link.group(1)), seconds(step)


@pytest.mark.parametrize("disk", [[], ["--host-gib", "2"]])
def test_link_and_tflops_beside_a_profile_change_its_terms(capsys: pytest.CaptureFixture[str],
                                                           disk: list[str]) -> None:
    base = estimate_lines(capsys, "llama-8b", "--profile", "h200-pcie5", *disk)
    given = estimate_lines(capsys, "llama-8b", "--profile", "h200-pcie5", "--tflops", "0.05", "--link-gbps", "5",
                           *disk)
    assert given[0] > 10 * base[0]  # compute from 0.05 TFLOP/s, not the datasheet's
    assert (base[1], given[1]) == (55.4, 5.0)


@pytest.mark.parametrize("pin", ["0", "1"])
def test_a_profiles_own_link_rate_changes_nothing_pinned_or_not(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch, pin: str) -> None:
    # Unpinned, the copies run at the pageable rate: GH200's is half its pinned 375 GB/s;
    # --link-gbps 375 made it 375 x 8.4 / 55.4 (PCIe's ratio): the step 61.4 ms, not 18.6.
    monkeypatch.setenv("OFFLOAD_DISABLE_PIN_MEMORY", pin)
    base = estimate_lines(capsys, "llama-8b", "--profile", "gh200")
    same = estimate_lines(capsys, "llama-8b", "--profile", "gh200", "--link-gbps", "375")
    assert same == pytest.approx(base)
