"""What ``offload plan --host-gib X --profile P`` says: the host memory of this machine
(the profile replaces the device, not the host), the host admission of the plan as it
runs with its disk tier (host copies and staging, not the disk layers), and one heading
per estimate, plural only when right."""

from __future__ import annotations

import json

import attrs
import pytest

from offload import EnvFlags, EnvSnapshot, OffloadPlan, Platform, capture_env
from offload.cli import main
from offload.pure.disk.tier import DiskTierPlan
from offload.pure.env.cgroup import CgroupMemory
from offload.pure.fit.profiles import planning_env, profile_by_name
from offload.pure.units import GIB, format_bytes

TIER = ("plan", "llama-8b", "--group-size", "2", "--host-gib", "2", "--profile", "h200-pcie5")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_planning_for_a_profile_keeps_this_hosts_memory_readings() -> None:
    host = Platform(host_total_bytes=64 * GIB, host_available_bytes=40 * GIB, memlock_limit_bytes=8 * GIB,
                    is_wsl=True, cgroup_memory=CgroupMemory(version=2, limit_bytes=32 * GIB, current_bytes=GIB),
                    torch_version="2.9")
    planned = planning_env(EnvSnapshot(flags=EnvFlags(), platform=host), profile_by_name("h200-pcie5"))
    platform = planned.platform
    assert platform.has_cuda and platform.device_name != host.device_name  # the profile's device
    assert (platform.host_total_bytes, platform.host_available_bytes, platform.memlock_limit_bytes,
            platform.is_wsl, platform.cgroup_memory) == (64 * GIB, 40 * GIB, 8 * GIB, True, host.cgroup_memory)


def test_the_host_memory_line_reads_this_machine_with_a_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert capture_env().platform.host_available_bytes is not None  # the premise: MemAvailable is readable
    code, out, err = _run(capsys, *TIER)
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("host mem:")]
    assert "neither MemAvailable nor the cgroup" not in line and "unknown" not in line, line


def test_the_host_admission_line_is_the_tiers_not_the_plans(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *TIER, "--json")
    assert code == 0, err
    document = json.loads(out)
    plan = OffloadPlan.from_json(json.dumps(document["plan"]))
    tier = DiskTierPlan.from_json(json.dumps(document["disk"]))
    # The premise: the disk layers take host memory in the plan alone, not with the tier.
    assert tier.host_admission.host_bytes == tier.host_tier_bytes + tier.staging_ring_bytes
    assert tier.host_admission.host_bytes < plan.host_admission.host_bytes
    code, out, err = _run(capsys, *TIER)
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("host mem:")]
    assert format_bytes(tier.host_admission.host_bytes) in line, line
    assert format_bytes(plan.host_admission.host_bytes) not in line, line
    checks = [line for line in out.splitlines() if " host memory needed, " in line]
    assert len(checks) == len(tier.host_admission.checks) > 0
    assert all(f": {format_bytes(tier.host_admission.host_bytes)} " in check for check in checks), checks


def test_the_plan_without_a_tier_keeps_its_own_admission_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *TIER[:4], "--profile", "h200-pcie5", "--json")
    assert code == 0, err
    plan = OffloadPlan.from_json(out)
    code, out, err = _run(capsys, *TIER[:4], "--profile", "h200-pcie5")
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("host mem:")]
    assert format_bytes(plan.host_admission.host_bytes) in line, line


@pytest.mark.parametrize("tier", [(), ("--host-gib", "2")], ids=["no tier", "disk tier"])
@pytest.mark.parametrize(("tokens", "words"), [("1", "1 token per step"), ("4", "4 tokens per step")])
def test_one_estimate_has_one_heading(capsys: pytest.CaptureFixture[str], tier: tuple[str, ...], tokens: str,
                                      words: str) -> None:
    code, out, err = _run(capsys, *TIER[:4], "--profile", "h200-pcie5", "--tokens", tokens, *tier)
    assert code == 0, err
    headings = [line for line in out.splitlines() if line.startswith("estimate")]
    assert len(headings) == 1 and words in headings[0], headings
    assert "1 tokens" not in out


def test_a_fit_with_a_disk_tier_has_one_heading_per_estimate_and_the_tiers_admission(
        capsys: pytest.CaptureFixture[str]) -> None:
    fitting = ("plan", "llama-8b", "--fit-gib", "8", "--profile", "h200-pcie5", "--host-gib", "2")
    code, out, err = _run(capsys, *fitting, "--json")
    assert code == 0, err
    tier = DiskTierPlan.from_json(json.dumps(json.loads(out)["disk"]))
    code, out, err = _run(capsys, *fitting)
    assert code == 0, err
    lines = out.splitlines()
    [line] = [line for line in lines if line.startswith("host mem:")]
    assert f"{format_bytes(tier.host_admission.host_bytes)} of new host memory" in line, line
    headings = [i for i, line in enumerate(lines) if line.startswith("estimate")]
    # The fit's estimate, then the chosen plan's with the disk tier: each one heading, no
    # heading right under another.
    assert len(headings) == 2, [lines[i] for i in headings]
    assert headings[1] - headings[0] > 1
    assert "1 tokens" not in out


def test_planning_env_is_unchanged_with_cuda() -> None:
    env = EnvSnapshot(flags=EnvFlags(), platform=Platform(has_cuda=True, device_name="x", device_total_bytes=GIB))
    assert planning_env(env, profile_by_name("h200-pcie5")) is env
    assert attrs.evolve(env) == env
