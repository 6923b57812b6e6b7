"""The command line under hostile input: every numeric flag of every command
accepts exactly the values that mean something and refuses the rest in one line naming
the flag and the value (exit 2); impossible demo sizes are refused up front and torch
failures become one line; Ctrl-C exits 130 with one line; names with newlines keep every
error on one line."""

from __future__ import annotations

import json
import math
import os
import resource
import selectors
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload import EnvSnapshot, OffloadPlan
from offload.cli import main
from offload.pure.units import GIB

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (4 layers) saved in several shards with an index."""
    from tests.hf.checkpoints import build, save

    return save(build("llama"), tmp_path_factory.mktemp("cli-hardening") / "llama", sharded=True)


def environ() -> dict[str, str]:
    found = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "VLLM_"))}
    found["HF_HUB_OFFLINE"] = "1"
    return found


def assert_one_line_naming(code: int, out: str, err: str, *needles: str) -> None:
    assert (code, out) == (2, ""), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


# ---- GiB flags: finite, at least 1 byte (or exactly 0 where 0 means something), at most 2**60 bytes ----


HUGE = "1e308"
TINY = "1e-12"  # 0.001 bytes: rounds to 0


@pytest.mark.parametrize(
    ("argv", "flag", "value"),
    [
        (["plan", "--uva-gib", HUGE], "--uva-gib", HUGE),
        (["plan", "--device-gib", HUGE], "--device-gib", HUGE),
        (["plan", "--fit-gib", HUGE, "--profile", "h200-pcie5"], "--fit-gib", HUGE),
        (["plan", "--fit-gib", "10", "--reserve-gib", HUGE, "--profile", "h200-pcie5"], "--reserve-gib", HUGE),
        (["plan", "--device-gib", TINY], "--device-gib", TINY),
        (["plan", "--uva-gib", TINY], "--uva-gib", TINY),
        (["plan", "--fit-gib", TINY, "--profile", "h200-pcie5"], "--fit-gib", TINY),
        (["plan", "--fit-gib", "10", "--reserve-gib", TINY, "--profile", "h200-pcie5"], "--reserve-gib", TINY),
        (["plan", "--device-gib", str(2**30 * 2)], "--device-gib", str(2**31)),
        (["plan", "--device-gib", "-1"], "--device-gib", "-1"),
        (["plan", "--device-gib", "inf"], "--device-gib", "inf"),
        (["plan", "--fit-gib", "0", "--profile", "h200-pcie5"], "--fit-gib", "0"),
        (["load", "DIR", "--uva-gib", HUGE], "--uva-gib", HUGE),
        (["load", "DIR", "--fit-gib", HUGE], "--fit-gib", HUGE),
        (["load", "DIR", "--fit-gib", "1", "--reserve-gib", HUGE], "--reserve-gib", HUGE),
        (["load", "DIR", "--fit-gib", TINY], "--fit-gib", TINY),
    ],
)
def test_gib_flags_out_of_range_exit_2_naming_flag_and_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], flag: str, value: str
) -> None:
    argv = [str(tmp_path) if word == "DIR" else word for word in argv]
    code, out, err = run(capsys, *argv)
    assert_one_line_naming(code, out, err, flag)
    assert value in err or repr(float(value)) in err, err


def test_gib_flags_accept_one_byte_and_two_to_the_sixty_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    one_byte = repr(1 / GIB)
    code, out, err = run(capsys, "plan", "--backend", "uva", "--uva-gib", one_byte, "--json")
    assert (code, err) == (0, "")
    assert OffloadPlan.from_json(out).config.uva_max_bytes == 1
    code, out, err = run(capsys, "plan", "llama-8b", "--device-gib", str(2**30))
    assert (code, err) == (0, "")
    assert f"device:   planned CUDA device, {2**60 / GIB:.2f} GiB" in out
    code, out, err = run(capsys, "plan", "--uva-gib", "0", "--json")  # 0: offload nothing through UVA
    assert (code, err) == (0, "")
    assert OffloadPlan.from_json(out).config.uva_max_bytes == 0


# ---- rates: positive, finite, and giving finite, non-zero estimates ----------------------------


@pytest.mark.parametrize("flag", ["--link-gbps", "--tflops"])
@pytest.mark.parametrize("value", ["1e-320", "1e308", "0", "-5", "nan", "inf", "abc"])
def test_rate_flags_out_of_range_exit_2_naming_flag_and_value(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = run(capsys, "plan", "llama-8b", "--profile", "h200-pcie5", flag, value)
    assert_one_line_naming(code, out, err, flag)
    assert value in err or repr(float(value)) in err, err


@pytest.mark.parametrize(("flag", "value"), [("--link-gbps", "9e-10"), ("--link-gbps", "1.1e12"),
                                             ("--tflops", "9e-13"), ("--tflops", "1.1e9")])
def test_rate_flags_just_outside_the_range_exit_2(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    code, out, err = run(capsys, "plan", "llama-8b", "--profile", "h200-pcie5", flag, value)
    assert_one_line_naming(code, out, err, flag)
    assert value in err or repr(float(value)) in err, err


@pytest.mark.parametrize(("flag", "value"), [("--link-gbps", "1e-9"), ("--link-gbps", "1e12"),
                                             ("--tflops", "1e-12"), ("--tflops", "1e9")])
def test_rate_flags_at_the_ends_of_the_range_give_finite_estimates(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = run(capsys, "plan", "llama-8b", "--profile", "h200-pcie5", flag, value)
    assert (code, err) == (0, "")
    line = next(line for line in out.splitlines() if line.startswith("predicted step"))
    ratio = float(line.rsplit(",", 1)[1].split("x")[0])
    assert math.isfinite(ratio) and ratio >= 1.0, line
    assert "inf" not in out and "nan" not in out


def test_fit_with_custom_rates_out_of_range_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "llama-8b", "--fit-gib", "8", "--link-gbps", "1e-320", "--tflops", "150")
    assert_one_line_naming(code, out, err, "--link-gbps", "1e-320")


# ---- tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["plan", "--profile", "h200-pcie5"], ["load", "DIR"]])
@pytest.mark.parametrize("value", ["99999999999999999999", "1" + "0" * 400])
def test_huge_token_counts_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str], value: str
) -> None:
    argv = [str(tmp_path) if word == "DIR" else word for word in command]
    code, out, err = run(capsys, *argv, "--tokens", value)
    assert_one_line_naming(code, out, err, "--tokens", value[:20])


# ---- demo sizes and failures ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--hidden", "1099511627776"), ("--tokens", "99999999999999999999"), ("--layers", "99999999999999999999"),
     ("--hidden", "0"), ("--tokens", "0"), ("--layers", "0")],
)
def test_demo_impossible_sizes_are_refused_up_front(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    start = time.monotonic()
    code, out, err = run(capsys, "demo", "--device", "cpu", flag, value)
    assert time.monotonic() - start < 30  # refused before building anything
    assert code == 2, err
    assert "building" not in out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert flag in err and value in err, err


def test_demo_size_beyond_the_hosts_memory_is_refused_naming_the_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from offload.cli.demo import run_demo
    from offload.errors import ConfigError
    from offload.pure.env.snapshot import Platform

    small_host = EnvSnapshot(platform=Platform(host_available_bytes=64 << 20))
    lines: list[str] = []
    with pytest.raises(ConfigError) as info:
        run_demo(env=small_host, device="cpu", layers=8, hidden=1024, tokens=8, progress=lines.append)
    assert lines == []  # nothing built
    assert info.value.name in ("layers", "hidden", "tokens")
    assert "1024" in info.value.message and "host memory" in info.value.message
    # The same sizes fit a host with room for them.
    roomy = EnvSnapshot(platform=Platform(host_available_bytes=64 << 30))
    assert run_demo(env=roomy, device="cpu", layers=2, hidden=64, tokens=2, steps=1,
                    progress=lines.append).outputs_equal


def test_demo_allocation_failure_is_one_line(tmp_path: Path) -> None:
    """A real allocation failure: the process may address 2 GiB; the model needs 3.2 GiB."""
    limit = 2 << 30

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    result = subprocess.run(
        [sys.executable, "-m", "offload", "demo", "--device", "cpu", "--layers", "4", "--hidden", "4096",
         "--tokens", "8"],
        capture_output=True, text=True, env=environ(), cwd=ROOT, timeout=120, check=False, preexec_fn=cap_memory,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("offload: error: ") and "allocate" in result.stderr


def test_load_forward_allocation_failure_is_one_line(capsys: pytest.CaptureFixture[str],
                                                                     checkpoint: Path) -> None:
    # 2**40 token ids are 8 TiB: torch cannot allocate them.
    code, out, err = run(capsys, "load", str(checkpoint), "--tokens", str(2**40))
    assert code == 2, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # after the loading progress lines
    assert last.startswith(f"offload: error: the forward of {2**40} tokens failed: RuntimeError: "), err
    assert err.count("offload: error") == 1
    assert "forward:" not in out and "model:" in out


# ---- Ctrl-C ---------------------------------------------------------------------------------------


def interrupt_when_busy(argv: list[str], ready: str, stream: str) -> subprocess.CompletedProcess[str]:
    """Start ``offload ARGV``, wait until `ready` appears on `stream` ("stdout" or
    "stderr"), send SIGINT, and return the finished process."""
    process = subprocess.Popen([sys.executable, "-m", "offload", *argv], cwd=ROOT, env=environ(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watched = process.stdout if stream == "stdout" else process.stderr
    assert watched is not None
    seen = b""
    deadline = time.monotonic() + 120
    with selectors.DefaultSelector() as selector:
        selector.register(watched, selectors.EVENT_READ)
        while ready.encode() not in seen:
            assert time.monotonic() < deadline and process.poll() is None, seen.decode(errors="replace")
            if selector.select(timeout=1):
                chunk = os.read(watched.fileno(), 65536)
                assert chunk, seen.decode(errors="replace")
                seen += chunk
    time.sleep(0.2)  # inside the busy part, not at the print
    process.send_signal(signal.SIGINT)
    try:
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    text_out = (seen if stream == "stdout" else b"") + out
    text_err = (seen if stream == "stderr" else b"") + err
    return subprocess.CompletedProcess(argv, process.returncode, text_out.decode(), text_err.decode())


def test_ctrl_c_during_demo_exits_130_with_one_line() -> None:
    # 8 blocks of width 1024 at 256 tokens take seconds on the CPU: the signal lands while it runs.
    result = interrupt_when_busy(["demo", "--device", "cpu", "--layers", "8", "--hidden", "1024", "--tokens", "256"],
                                 "running resident", "stdout")
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr == "offload: interrupted\n"
    assert "parity:" not in result.stdout  # it stopped


def test_ctrl_c_during_load_exits_130_with_one_line(checkpoint: Path) -> None:
    # A forward of many tokens keeps it busy after the model line is printed.
    result = interrupt_when_busy(["load", str(checkpoint), "--tokens", "100000"], "model:", "stdout")
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.endswith("offload: interrupted\n")
    assert "restore:" not in result.stdout


# ---- names with newlines: every error stays on one line -------------------------------------------


def corrupt(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")


def test_corrupt_file_named_with_a_newline_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    corrupt(folder / "a\nb.safetensors")
    code, out, err = run(capsys, "plan", str(folder))
    assert_one_line_naming(code, out, err, "a\\nb.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    code, out, err = run(capsys, "load", str(folder))
    assert_one_line_naming(code, out, err, "a\\nb.safetensors")


@pytest.mark.parametrize("command", ["plan", "load"])
def test_directories_named_with_a_newline_give_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        command: str) -> None:
    missing = tmp_path / "no\nsuch"
    code, out, err = run(capsys, command, str(missing))
    assert_one_line_naming(code, out, err, "no\\nsuch")
    empty = tmp_path / "em\npty"
    empty.mkdir()
    code, out, err = run(capsys, command, str(empty))
    assert_one_line_naming(code, out, err, "em\\npty")


def test_one_line_escapes_only_what_is_not_printable() -> None:
    from offload.cli import one_line

    assert one_line("a\nb\rc\x1bd\te") == "a\\nb\\rc\\x1bd\\te"
    assert one_line("llama-ü 8b") == "llama-ü 8b"


def test_control_characters_in_a_flag_value_stay_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", "--filter", "a\nb", "--filter", "c\rd")
    assert_one_line_naming(code, out, err)
    assert "\r" not in err
