"""The command line: `offload env` and `offload plan`, through `main()` and as a process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from offload import Backend, OffloadPlan, Placement, capture_env, decide_pinning, decide_uva, make_plan
from offload.cli import DEFAULT_PREFETCH, main
from offload.pure import preset_spec
from offload.pure.decide.admission import NOT_CHECKED
from offload.pure.serialize import from_data
from offload.pure.spec.presets import preset_outside_bytes
from offload.pure.units import GIB

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "VLLM_"))}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "offload", *argv],
        capture_output=True, text=True, env=environ, cwd=ROOT, timeout=120, check=False,
    )


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A real safetensors file: 8-byte length, JSON header, zero-filled data."""
    itemsize = {"BF16": 2, "F32": 4, "I8": 1}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = itemsize[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


# ---- offload plan -------------------------------------------------------------------


def test_plan_default_is_prefetch_4_1_2_on_llama_70b(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--json")
    assert (code, err) == (0, "")
    plan = OffloadPlan.from_json(out)
    assert plan.config == DEFAULT_PREFETCH
    assert (plan.config.group_size, plan.config.num_in_group, plan.config.prefetch_step) == (4, 1, 2)
    assert plan.backend is Backend.PREFETCH
    # llama-70b has 80 layers; group 4, one per group: layers 3, 7, ..., 79.
    assert plan.offloaded_layers == tuple(range(3, 80, 4))
    expected = make_plan(preset_spec("llama-70b"), DEFAULT_PREFETCH, capture_env(os.environ))
    # Warning texts and the host memory check quote available host memory, which moves
    # between two captures.
    assert attrs.evolve(plan, warnings=(), host_admission=NOT_CHECKED) == attrs.evolve(
        expected, warnings=(), host_admission=NOT_CHECKED)
    assert plan.warning_codes() == expected.warning_codes()
    assert plan.host_admission.verdict is expected.host_admission.verdict


def test_plan_text_says_it_used_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan")
    assert code == 0
    assert "config:   default" in out
    assert "backend:  prefetch" in out
    code, out, _ = run(capsys, "plan", "--group-size", "8")
    assert code == 0
    assert "default" not in out.split("backend:")[0]


def test_plan_text_totals_match_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "llama-8b", "--device-gib", "24", "--group-size", "8", "--num-in-group", "2"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    code, out, _ = run(capsys, *argv)
    assert code == 0
    totals = {
        " ".join(line.split()[:-2]): line.split()[-2:]
        for line in out.splitlines()
        if line.startswith(("offloaded ", "device ", "host "))
    }
    for label, value in [
        ("offloaded", plan.offloaded_bytes),
        ("device freed", plan.device_bytes_freed),
        ("device buffers", plan.device_bytes_buffers),
        ("device saved (net)", plan.device_bytes_freed - plan.device_bytes_buffers),
        ("host", plan.host_bytes),
    ]:
        assert totals[label] == [str(value), f"{value / GIB:.2f}"], label
    assert "device:   planned CUDA device, 24.00 GiB" in out
    # Layers 6 and 7 of every 8 are offloaded, adjacent, and the depth is 1.
    assert "[prefetch_stalls]" in out


def test_plan_uva_with_filter_on_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "mixtral-8x7b", "--uva-gib", "10", "--device-gib", "80",
        "--filter", "experts.w2_weight", "--json",
    )
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert plan.backend is Backend.UVA
    offloaded = plan.offloaded_params
    assert offloaded and all(p.name.endswith("experts.w2_weight") for p in offloaded)
    assert all(p.placement is Placement.UVA for p in offloaded)
    largest = max(p.nbytes for p in offloaded)
    assert 10 * GIB <= plan.offloaded_bytes < 10 * GIB + largest
    assert plan.device_bytes_freed == plan.offloaded_bytes


def test_plan_per_param_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-8b", "--params", "--group-size", "4")
    assert code == 0
    spec = preset_spec("llama-8b")
    table_rows = [line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()
                  and len(line.split()) >= 6]
    assert len(table_rows) == spec.num_params


def test_plan_reads_a_checkpoint_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {
        "model.embed_tokens.weight": ("BF16", [64, 16]),
        "model.layers.0.mlp.up.weight": ("BF16", [32, 16]),
        "model.layers.1.mlp.up.weight": ("BF16", [32, 16]),
    })
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {
        "model.layers.2.mlp.up.weight": ("BF16", [32, 16]),
        "model.layers.3.mlp.up.weight": ("BF16", [32, 16]),
        "model.layers.3.mlp.scale": ("I8", [32]),
    })
    code, out, _ = run(capsys, "plan", str(tmp_path), "--group-size", "2", "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert plan.offloaded_layers == (1, 3)
    assert {(p.layer, p.name) for p in plan.offloaded_params} == {
        (1, "mlp.up.weight"), (3, "mlp.up.weight"), (3, "mlp.scale"),
    }
    assert plan.offloaded_bytes == 2 * 32 * 16 * 2 + 32
    code, out, _ = run(capsys, "plan", str(tmp_path), "--group-size", "2")
    assert code == 0
    assert "outside:  1 tensor outside the layers, 2.0 KiB, resident on the device" in out
    assert "stack:    model.layers: 4 layers (plan layers 0-3), 4.0 KiB" in out


def test_plan_prints_one_line_per_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_safetensors(tmp_path / "model.safetensors", {
        "shared.weight": ("BF16", [64, 16]),
        **{f"encoder.block.{i}.layer.0.SelfAttention.q.weight": ("BF16", [16, 16]) for i in range(3)},
        **{f"decoder.block.{i}.layer.0.SelfAttention.q.weight": ("BF16", [16, 16]) for i in range(2)},
    })
    code, out, _ = run(capsys, "plan", str(tmp_path), "--group-size", "2")
    assert code == 0
    stacks = [line for line in out.splitlines() if line.startswith("stack:")]
    assert stacks == ["stack:    decoder.block: 2 layers (plan layers 0-1), 1.0 KiB",
                      "stack:    encoder.block: 3 layers (plan layers 2-4), 1.5 KiB"]


def test_fit_counts_a_checkpoints_outside_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _small_checkpoint(tmp_path)  # 4 KiB of layers, a 2 KiB embedding
    argv = ["plan", str(folder), "--fit-gib", str(5 * 1024 / GIB), "--link-gbps", "25", "--tflops", "150"]
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    chosen = json.loads(out)["chosen"]
    assert chosen["outside_bytes"] == 64 * 16 * 2
    # 4 KiB of layers fit 5 KiB alone, not beside the embedding: some must leave.
    assert chosen["config"]["backend"] != "none"
    assert chosen["resident_bytes"] + chosen["buffer_bytes"] + chosen["outside_bytes"] <= 5 * 1024
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "+ outside layers 2.0 KiB +" in out


def _small_checkpoint(folder: Path) -> Path:
    write_safetensors(folder / "model.safetensors", {
        "model.embed_tokens.weight": ("BF16", [64, 16]),
        **{f"model.layers.{i}.{p}": ("BF16", [32, 16]) for i in range(4) for p in ("mlp.up.weight", "attn.q.weight")},
    })
    return folder


@pytest.mark.parametrize("order", ["source first", "source after the filter", "source after two segments"])
def test_a_source_after_filter_is_not_swallowed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                order: str) -> None:
    folder = str(_small_checkpoint(tmp_path))
    argv = {
        "source first": [folder, "--filter", "mlp"],
        "source after the filter": ["--filter", "mlp", folder],
        "source after two segments": ["--filter", "mlp", "up", folder],
    }[order]
    code, out, err = run(capsys, "plan", *argv, "--group-size", "2", "--json")
    assert (code, err) == (0, "")
    plan = OffloadPlan.from_json(out)
    assert len(plan.params) == 8  # the checkpoint's 4 layers, not a preset's
    assert {p.name for p in plan.offloaded_params} == {"mlp.up.weight"}
    assert plan.config.param_filter == (("mlp", "up") if order == "source after two segments" else ("mlp",))


def test_a_preset_after_filter_is_the_source_and_segments_still_stack(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "--filter", "mlp", "self_attn", "llama-8b", "--group-size", "2", "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert len(plan.params) == preset_spec("llama-8b").num_params
    assert plan.config.param_filter == ("mlp", "self_attn")
    code, out, _ = run(capsys, "plan", "llama-8b", "--filter", "mlp", "--filter", "self_attn", "--json")
    assert code == 0
    assert OffloadPlan.from_json(out).config.param_filter == ("mlp", "self_attn")


def test_a_lone_filter_word_stays_a_segment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory in the working directory that happens to share a segment's name.
    (tmp_path / "mlp").mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "plan", "--filter", "mlp", "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert plan.config.param_filter == ("mlp",)
    assert len(plan.params) == preset_spec("llama-70b").num_params


# ---- user errors: exit 2, one line -------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--group-size", "abc"], "'abc'"),
        (["plan", "--group-size", "-3"], "'-3'"),
        (["plan", "--uva-gib", "nan"], "'nan'"),
        (["plan", "no-such-model"], "'no-such-model'"),
        (["plan", "--group-size", "4", "--num-in-group", "5"], "num_in_group (5)"),
        (["plan", "--backend", "uva"], "uva_max_bytes"),
        (["plan", "--backend", "fast"], "'fast'"),
        (["plan", "--filter", "a..b"], "'a..b'"),
        (["plan", "--device-gib", "0"], "--device-gib"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_user_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_missing_and_corrupt_checkpoints_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "plan", str(empty))
    assert code == 2 and str(empty) in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    code, _, err = run(capsys, "plan", str(bad))
    assert code == 2 and "model.safetensors" in err and len(err.strip().splitlines()) == 1


def test_junk_environment_variable_exits_2_without_traceback() -> None:
    result = run_process("plan", env={"OFFLOAD_DISABLE_PIN_MEMORY": "maybe"})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "OFFLOAD_DISABLE_PIN_MEMORY" in result.stderr and "'maybe'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_disagreeing_spellings_exit_2_naming_both() -> None:
    result = run_process("env", env={"OFFLOAD_DISABLE_UVA": "1", "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA": "0"})
    assert result.returncode == 2
    assert "OFFLOAD_DISABLE_UVA" in result.stderr and "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA" in result.stderr


def test_pin_switch_reaches_the_plan_through_the_process() -> None:
    result = run_process("plan", "llama-8b", "--device-gib", "16", "--json", env={"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": " Yes "})
    assert result.returncode == 0, result.stderr
    plan = OffloadPlan.from_json(result.stdout)
    assert plan.pin.pin is False
    assert plan.pin.reason.value == "disabled_by_env"
    assert "prefetch_unpinned" in {w.code.value for w in plan.warnings}


# ---- offload env ----------------------------------------------------------------------


def test_env_json_matches_the_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env", "--json")
    assert code == 0
    document = json.loads(out)
    snapshot = capture_env(os.environ)
    pin = decide_pinning(snapshot)
    assert document["fingerprint"] == snapshot.fingerprint()
    assert document["pin"] == {"pin": pin.pin, "reason": pin.reason.value, "method": pin.method.value}
    uva = decide_uva(snapshot, pin)
    assert document["uva"] == {"enabled": uva.enabled, "reason": uva.reason.value}
    assert document["snapshot"]["platform"]["has_cuda"] == snapshot.platform.has_cuda
    assert document["snapshot"]["platform"]["torch_version"] == snapshot.platform.torch_version


def test_env_text_shows_decisions_and_units(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env")
    assert code == 0
    snapshot = capture_env(os.environ)
    pin = decide_pinning(snapshot)
    assert f"pinning: {f'on ({pin.method_text})' if pin.pin else 'off'} [{pin.reason.value}]" in out
    assert "device_total_bytes" in out and "memlock_limit_bytes" in out
    assert snapshot.fingerprint() in out


def test_console_script_entry_point_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'offload = "offload.cli:main"' in text
    result = run_process("plan", "llama-8b", "--backend", "none", "--json")
    assert result.returncode == 0
    assert OffloadPlan.from_json(result.stdout).offloaded_params == ()


# ---- offload plan --fit-gib ------------------------------------------------


def test_fit_gib_prints_a_plan_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "llama-70b", "--fit-gib", "40", "--tokens", "1", "--profile", "h200-pcie5", "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    plan = from_data(OffloadPlan, document["plan"])
    assert document["budget_bytes"] == 40 * GIB
    assert plan.device_bytes_resident + plan.device_bytes_buffers <= 40 * GIB
    assert plan.backend is Backend.PREFETCH
    # 127.5 GiB of decoder weights cannot stay resident in 40 GiB: most must be offloaded.
    assert plan.offloaded_bytes >= preset_spec("llama-70b").nbytes - 40 * GIB
    chosen = document["chosen"]
    # Never below the limit, but for rounding in the sum of stalls (2e-14 s seen here).
    assert chosen["step_seconds"] >= chosen["limit_seconds"] * (1 - 1e-12) > 0
    assert chosen["resident_bytes"] + chosen["buffer_bytes"] == plan.device_bytes_resident + plan.device_bytes_buffers
    assert len(document["estimate"]["layers"]) == 80
    # The embedding, head and norm (3.9 GiB) stay on the device and are counted.
    assert chosen["outside_bytes"] == preset_outside_bytes("llama-70b")
    assert plan.device_bytes_resident + plan.device_bytes_buffers + chosen["outside_bytes"] <= 40 * GIB


def test_fit_gib_text_names_the_choice_and_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-70b", "--fit-gib", "40", "--profile", "h200-pcie5")
    assert code == 0
    assert "chosen:  prefetch:" in out
    assert "limit            = max(" in out
    assert "[model_fits_on_device]" not in out  # the device is the 40 GiB budget, not the whole H200
    assert "outside:  embeddings, output head and final norm, 3.91 GiB, resident on the device" in out
    assert "+ outside layers 3.91 GiB +" in out


def test_fit_gib_with_custom_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-8b", "--fit-gib", "8", "--link-gbps", "25", "--tflops", "150", "--json")
    assert code == 0
    document = json.loads(out)
    assert document["profile"]["pinned_h2d_bytes_per_s"] == 25e9
    assert document["profile"]["bf16_flops_per_s"] == 150e12


def test_plan_with_a_profile_prints_its_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-8b", "--group-size", "4", "--prefetch-step", "2", "--profile", "rtx4090", "--tokens", "512")
    assert code == 0
    assert "profile:  rtx4090 (" in out
    assert "estimate on rtx4090, 512 tokens per step" in out
    assert "predicted step   =" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--fit-gib", "40"], "--fit-gib needs --profile"),
        (["plan", "--fit-gib", "40", "--profile", "h200-pcie5", "--group-size", "2"], "drop --group-size"),
        (["plan", "--fit-gib", "1", "--reserve-gib", "2", "--profile", "h200-pcie5"], "bytes"),
        (["plan", "--profile", "tpu"], "'tpu'"),
        (["plan", "--link-gbps", "25"], "--link-gbps and --tflops"),
        (["plan", "--tokens", "0", "--profile", "h200-pcie5"], "'0'"),
    ],
)
def test_fit_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


# ---- host memory ---------------------------------------------------


def test_env_text_shows_the_cgroup_limit_and_the_room_left(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env")
    assert code == 0
    cgroup = capture_env(os.environ).platform.cgroup_memory
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert f"{cgroup.state} (cgroup v{cgroup.version})" in lines["cgroup_memory.state"]
    limit = "unlimited" if cgroup.limit_bytes is None else str(cgroup.limit_bytes)
    assert lines["cgroup_memory.limit_bytes"].split()[1] == limit
    assert cgroup.limit_path in lines["cgroup_memory.limit_path"]
    room = [line for line in out.splitlines() if "host memory for new allocations" in line]
    assert len(room) == 1 and ("MemAvailable" in room[0] or "cgroup" in room[0])


def test_env_json_has_the_cgroup_and_the_host_memory_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env", "--json")
    assert code == 0
    document = json.loads(out)
    cgroup = capture_env(os.environ).platform.cgroup_memory
    written = document["snapshot"]["platform"]["cgroup_memory"]
    assert (written["version"], written["limit_bytes"], written["limit_path"]) == (
        cgroup.version, cgroup.limit_bytes, cgroup.limit_path)
    assert document["host_memory"]["cgroup_state"] == cgroup.state
    assert document["host_memory"]["available_bytes"] > 0


def test_plan_text_shows_the_host_memory_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-8b")
    assert code == 0
    (head,) = [line for line in out.splitlines() if line.startswith("host mem:")]
    assert head.startswith("host mem: fits:")  # this machine: the layers stay in host memory
    assert "the host's MemAvailable" in out
    # A hypothetical device knows nothing of the host it would run on.
    code, out, _ = run(capsys, "plan", "llama-8b", "--device-gib", "16")
    assert code == 0
    assert "host mem: unknown: the plan needs 3.25 GiB of new host memory" in out


def test_plan_json_carries_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "llama-8b", "--json")
    assert code == 0
    plan = OffloadPlan.from_json(out)
    assert plan.host_admission.verdict.value == json.loads(out)["plan"]["host_admission"]["verdict"] == "fits"
    assert plan.config.host_check == "refuse"
