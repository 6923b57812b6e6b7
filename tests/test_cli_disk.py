"""``offload plan --host-gib``: the disk tier of a checkpoint's plan, as text and as JSON
(both documents read back by their own readers), and the flags refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from offload import OffloadPlan
from offload.cli import main
from offload.pure.disk.tier import DiskSource, DiskTierPlan
from offload.pure.serialize import from_data
from offload.pure.units import GIB
from tests.hf.checkpoints import build, save


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build("llama"), tmp_path_factory.mktemp("disk"), sharded=True)


def test_a_host_budget_puts_the_last_layers_on_disk_read_from_the_checkpoint(
        capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = _run(capsys, "plan", str(checkpoint), "--group-size", "1", "--prefetch-step", "2", "--json",
                          "--host-gib", f"{140_000 / GIB}", "--disk-gbps", "1.6")
    assert code == 0, err
    document = json.loads(out)
    plan = OffloadPlan.from_json(json.dumps(document["plan"]))
    tier = DiskTierPlan.from_json(json.dumps(document["disk"]))
    assert tier.host_bytes <= 140_000 < plan.host_bytes
    assert tier.disk_layers == plan.offloaded_layers[len(plan.offloaded_layers) - len(tier.disk_layers):]
    assert tier.disk_gbps == 1.6 and tier.spill_bytes == 0
    assert {p.source for p in tier.params} == {DiskSource.CHECKPOINT}
    code, text, err = _run(capsys, "plan", str(checkpoint), "--group-size", "1", "--prefetch-step", "2",
                           "--host-gib", f"{140_000 / GIB}", "--disk-gbps", "1.6")
    assert code == 0, err
    assert f"disk:     {len(tier.disk_layers)} layers on disk" in text
    assert "from the checkpoint as it lies" in text and "at 1.6 GB/s a pass reads for at least" in text


def test_a_preset_has_no_checkpoint_and_spills_every_disk_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", "llama-8b", "--group-size", "2", "--host-gib", "4")
    assert code == 0, err
    assert "spill:    " in out and "parameters: no checkpoint" in out
    assert "at 1.5 GB/s" in out  # the default, assumed


@pytest.mark.parametrize(("argv", "message"), [
    (("--disk-gbps", "2"), "--disk-gbps needs --host-gib"),
    (("--read-ahead", "3"), "--read-ahead needs --host-gib"),
    (("--host-gib", "0"), "--host-gib must be greater than 0"),
    (("--host-gib", "1", "--disk-gbps", "0"), "--disk-gbps must be greater than 0"),
])
def test_disk_flags_are_refused_by_name(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                        message: str) -> None:
    code, _, err = _run(capsys, "plan", "llama-8b", *argv)
    assert code != 0 and message in err


def test_the_estimate_with_a_profile_counts_the_disk_reads(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", "llama-8b", "--group-size", "1", "--host-gib", "4", "--profile",
                          "h200-pcie5", "--disk-gbps", "2")
    assert code == 0, err
    assert "at 2 GB/s a pass reads for at least" in out  # the tier the estimate below reads
    found = re.search(r"^disk += ([\d.]+) (ms|s) of reads per step", out, re.M)
    predicted = re.search(r"^predicted step += .* = ([\d.]+) (ms|s), ", out, re.M)
    assert found is not None and predicted is not None, out
    seconds = {"ms": 1e-3, "s": 1.0}
    # No step beats reading the disk tier.
    assert float(predicted.group(1)) * seconds[predicted.group(2)] >= float(found.group(1)) * seconds[found.group(2)]


def test_a_fit_with_a_host_budget_puts_the_chosen_plans_last_layers_on_disk(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fit places the device's bytes; the host budget then puts the last offloaded
    layers of the plan it chose on disk, and the estimate counts their reads."""
    code, out, err = _run(capsys, "plan", "llama-8b", "--fit-gib", "8", "--profile", "h200-pcie5", "--host-gib", "4",
                          "--json")
    assert code == 0, err
    document = json.loads(out)
    plan = from_data(OffloadPlan, document["fit"]["plan"])
    tier = DiskTierPlan.from_json(json.dumps(document["disk"]))
    assert tier.host_bytes <= 4 * GIB < plan.host_bytes
    assert tier.disk_layers == plan.offloaded_layers[len(plan.offloaded_layers) - len(tier.disk_layers):]
    code, text, err = _run(capsys, "plan", "llama-8b", "--fit-gib", "8", "--profile", "h200-pcie5", "--host-gib", "4")
    assert code == 0, err
    assert f"disk:     {len(tier.disk_layers)} layers on disk" in text
    assert "at 1.5 GB/s a pass reads for at least" in text
    assert len([line for line in text.splitlines() if line.startswith("estimate on h200-pcie5")]) == 2  # fit, tier
    assert re.search(r"^disk += [\d.]+ (ms|s) of reads per step", text, re.M), text


def test_fit_with_both_budgets_where_the_device_budget_alone_picks_uva(capsys: pytest.CaptureFixture[str]) -> None:
    # 12 GiB of an H200 for llama-8b: the fit alone picks UVA, whose host copies a host
    # budget of 2 GiB cannot hold; with both budgets the fit picks the fastest plan that
    # the disk tier can run (it said "--host-gib needs a prefetch plan").
    code, alone, _ = _run(capsys, "plan", "llama-8b", "--fit-gib", "12", "--profile", "h200-pcie5")
    assert code == 0 and "chosen:  uva" in alone
    code, out, err = _run(capsys, "plan", "llama-8b", "--fit-gib", "12", "--profile", "h200-pcie5", "--host-gib", "2")
    assert code == 0, err
    assert "chosen:  prefetch" in out
    disk = re.search(r"host:     .* = ([0-9.]+) GiB \(budget 2\.00 GiB\)", out)
    assert disk is not None and float(disk.group(1)) <= 2.0, out
    document = json.loads(_run(capsys, "plan", "llama-8b", "--fit-gib", "12", "--profile", "h200-pcie5",
                               "--host-gib", "2", "--json")[1])
    tier = DiskTierPlan.from_json(json.dumps(document["disk"]))
    assert tier.host_bytes <= 2 * GIB and tier.disk_positions


def test_fit_with_budgets_no_plan_meets_exits_2_naming_the_least_that_work(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "plan", "llama-8b", "--fit-gib", "12", "--profile", "h200-pcie5", "--host-gib", "0.1")
    assert code == 2
    assert "no configuration fits both the device budget" in err
    least = re.search(r"the least host budget is [^(]*\((\d+) bytes", err)
    assert least is not None, err
    code, out, _ = _run(capsys, "plan", "llama-8b", "--fit-gib", "12", "--profile", "h200-pcie5",
                        "--host-gib", f"{int(least.group(1)) / GIB + 1e-6}")
    assert code == 0, out


def test_a_plan_bound_by_its_disk_reads_warns_of_the_disk_not_the_depth(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "llama-8b", "--group-size", "1", "--prefetch-step", "2",
                        "--profile", "h200-pcie5")
    assert code == 0 and "[prefetch_stalls]" in out  # without a disk tier: the depth is the advice
    code, out, _ = _run(capsys, "plan", "llama-8b", "--group-size", "1", "--prefetch-step", "2",
                        "--profile", "h200-pcie5", "--host-gib", "4", "--disk-gbps", "1.5")
    assert code == 0
    assert "[prefetch_stalls]" not in out
    assert "[disk_bound]" in out and "no prefetch depth helps" in out
    assert re.search(r"limit += max\(.*\) = .* \(compute, link, disk\)", out), out
