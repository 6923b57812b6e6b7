"""`offload demo --backend uva` and `run_demo(backend="uva")` on the CPU: half the model's
bytes offloaded, copied on demand (no GPU, so UVA is off), bit-exact, restored."""

from __future__ import annotations

import pytest
import torch

from offload import Backend, EnvSnapshot, OffloadConfig, Placement
from offload.cli import main
from offload.cli.demo import build_demo_model, run_demo, summarize
from offload.pure import UvaReason


def model_bytes(layers: int, hidden: int) -> int:
    model = build_demo_model(layers, hidden, device=torch.device("cpu"), dtype=torch.float32)
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_run_demo_uva_offloads_half_the_model_bit_exact() -> None:
    lines: list[str] = []
    result = run_demo(env=EnvSnapshot(), device="cpu", layers=4, hidden=64, tokens=3, steps=2,
                      backend="uva", progress=lines.append)
    plan = result.plan
    assert plan.backend is Backend.UVA
    total = model_bytes(4, 64)
    assert plan.config.uva_max_bytes == total // 2
    # Parameters are taken whole in layer order until the budget is reached.
    assert total // 2 <= plan.offloaded_bytes < total // 2 + 4 * 64 * 4 * 64 * 4
    assert (plan.uva.enabled, plan.uva.reason) == (False, UvaReason.NO_ACCELERATOR)
    assert {p.placement for p in plan.offloaded_params} == {Placement.ON_DEMAND}
    assert result.mechanics_only and result.outputs_equal and result.restored_equal
    # One warm-up and two timed steps; every offloaded storage is copied once per step
    # (the demo blocks have no tied weights).
    assert result.stats.copies_issued == 3 * len(plan.offloaded_params)
    assert result.stats.bytes_copied == 3 * plan.offloaded_bytes
    assert result.stats.host_bytes == plan.host_bytes
    assert result.stats.device_buffer_bytes == 0
    assert any(line.endswith("(uva)") for line in lines)
    summary = summarize(result)
    assert summary["plan"].startswith(f"{len(plan.offloaded_params)} parameters of 2 of 4 layers offloaded (on_demand)")
    assert summary["copies"] == f"{3 * len(plan.offloaded_params)} copies, {3 * plan.offloaded_bytes} bytes"


def test_run_demo_backend_only_picks_the_default_config() -> None:
    config = OffloadConfig(backend="uva", uva_max_bytes=1)
    result = run_demo(env=EnvSnapshot(), device="cpu", layers=2, hidden=64, tokens=2, steps=1,
                      config=config, backend="prefetch", progress=lambda _: None)
    assert result.plan.config == config
    assert len(result.plan.offloaded_params) == 1
    assert result.outputs_equal and result.restored_equal


def test_demo_command_with_backend_uva(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--device", "cpu", "--backend", "uva", "--layers", "3", "--hidden", "64", "--tokens", "2"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "backend:  uva" in out
    assert "parity:        outputs equal bit for bit" in out
    assert "restore:       every weight restored bit for bit" in out
    assert "(on_demand)" in out and "[on_demand_slow]" in out


def test_demo_command_rejects_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--device", "cpu", "--backend", "auto"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "invalid choice: 'auto'" in err
