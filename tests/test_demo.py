"""`offload demo` and `run_demo` on the CPU: mechanics verified, parity, restore."""

from __future__ import annotations

import pytest
import torch

from offload import Backend, ConfigError, EnvSnapshot, OffloadConfig
from offload.cli import main
from offload.cli.demo import build_demo_model, run_demo, summarize


def test_run_demo_on_the_cpu_is_bit_exact_and_restores() -> None:
    lines: list[str] = []
    result = run_demo(env=EnvSnapshot(), device="cpu", layers=7, hidden=64, tokens=4, steps=3, progress=lines.append)
    assert result.mechanics_only is True
    assert result.device == "cpu"
    assert result.outputs_equal is True
    assert result.restored_equal is True
    assert result.plan.backend is Backend.PREFETCH
    # Default: every 2nd layer of 7 -> layers 1, 3 and 5, at step 2: slot 0 for positions
    # 0 and 2, slot 1 for position 1 alone (loaded once and kept).
    assert result.plan.offloaded_layers == (1, 3, 5)
    assert result.device_bytes_freed_measured is None
    # One warm-up plus three steps; in each, positions 0 and 2 each issue one copy per
    # parameter of the next layer in their slot's chain; plus the initial copies of two.
    params_per_layer = len(list(build_demo_model(1, 64, device=torch.device("cpu"), dtype=torch.float32).parameters()))
    assert result.stats.copies_issued == params_per_layer * (2 + 4 * 2)
    assert len(lines) == 4 and lines[0].startswith("building 7 blocks")
    summary = summarize(result)
    assert summary["parity"] == "outputs equal bit for bit"
    assert "no memory saved" in summary["device"]
    assert result.stats.steps == 4  # the warm-up and the three timed steps
    assert result.check.ok and len(result.check.params) == len(result.plan.params)


def test_run_demo_honours_a_config() -> None:
    result = run_demo(env=EnvSnapshot(), device="cpu", layers=4, hidden=64, tokens=2, steps=1,
                      config=OffloadConfig(group_size=1, prefetch_step=3), progress=lambda _: None)
    assert result.plan.offloaded_layers == (0, 1, 2, 3)
    assert result.plan.schedule.num_slots == 3
    assert result.outputs_equal and result.restored_equal


@pytest.mark.parametrize(("layers", "hidden", "tokens", "name"),
                         [(2, 100, 2, "hidden"), (0, 64, 2, "layers"), (2, 64, 0, "tokens"), (2, 32, 2, "hidden")])
def test_run_demo_rejects_bad_sizes(layers: int, hidden: int, tokens: int, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        run_demo(env=EnvSnapshot(), device="cpu", layers=layers, hidden=hidden, tokens=tokens, progress=lambda _: None)
    assert info.value.name == name


def test_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--device", "cpu", "--layers", "3", "--hidden", "64", "--tokens", "2"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "parity:        outputs equal bit for bit" in out
    assert "restore:       every weight restored bit for bit" in out
    assert "verified" in out and "backend:  prefetch" in out
    assert "offloader stats (offloaded steps):" in out and "\ncopied per step" in out
    assert "live check: every planned parameter is where the plan says" in out


def test_demo_command_bad_width_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--device", "cpu", "--hidden", "100"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "hidden must be a multiple of 64, got 100" in err
