"""`offload load DIR`: a local Hugging Face checkpoint loaded offloaded, one forward,
restore; its errors; and the progress line it shows while loading."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload import capture_env
from offload.cli import main
from offload.cli.load import _forward_inputs, _ProgressScope
from offload.cli.progress import ProgressLine
from offload.pure.units import format_bytes
from tests.hf.checkpoints import build, build_llava, build_whisper, save, save_any

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (4 layers) saved in several shards with an index."""
    return save(build("llama"), tmp_path_factory.mktemp("cli-load") / "llama", sharded=True)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def lines_by_label(out: str) -> dict[str, str]:
    """``label:   text`` lines as {label: text}."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        label, sep, text = line.partition(":")
        if sep and label.isalpha():
            found[label] = text.strip()
    return found


# ---- the command on a saved checkpoint ------------------------------------------------


def test_load_prints_the_summary_and_restores(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--group-size", "2", "--num-in-group", "1",
                         "--prefetch-step", "2", "--tokens", "5")
    assert code == 0, err
    shown = lines_by_label(out)
    assert shown["model"].startswith(f"LlamaForCausalLM from {checkpoint}: ")
    assert "GB/s" in shown["model"]
    assert shown["config"] == "as given"
    # 4 layers, every 2nd offloaded: layers 1 and 3.
    assert shown["plan"].startswith("prefetch, 2 of 4 layers offloaded; device ")
    assert "buffers" in shown["plan"] and "host " in shown["plan"]
    assert shown["forward"].startswith("5 tokens in ")
    assert shown["forward"].endswith("output (1, 5, 96), finite")
    assert shown["stats"].startswith("18 parameters offloaded, host ")  # 9 per Llama layer
    assert shown["restore"].startswith("done; 18 tensors of layers 1 and 3 equal bit for bit")
    # Not a terminal: progress from the offload.load logger comes as plain lines.
    progress = [line for line in err.splitlines() if line.startswith(("loading ", "loaded ", "offloading "))]
    assert progress[0].startswith(f"loading {checkpoint} (")
    assert any(line.startswith("loaded ") and "GB/s" in line for line in progress)
    assert "\r" not in "".join(progress)
    # The logger is left as it was found.
    load_log = logging.getLogger("offload.load")
    assert (load_log.handlers, load_log.propagate, load_log.level) == ([], True, logging.NOTSET)


def test_load_default_config(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint))
    assert code == 0, err
    shown = lines_by_label(out)
    if capture_env(os.environ).platform.has_cuda:
        assert shown["config"] == "fit to the device's memory (default with CUDA)"
        assert "device" not in shown
    else:
        assert shown["config"].startswith("default without CUDA (prefetch, group size 2, 1 offloaded layer")
        assert shown["plan"].startswith("prefetch, 2 of 4 layers offloaded")
        assert shown["device"].startswith("no accelerator")
        assert shown["forward"].startswith("8 tokens in ")
    assert shown["restore"].startswith("done; ")


def test_load_uva_in_bfloat16(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--uva-gib", "0.00001", "--dtype", "bfloat16")
    assert code == 0, err
    shown = lines_by_label(out)
    assert shown["plan"].startswith("uva, 1 of 4 layers offloaded")
    # float32 on disk, 4 bytes a parameter; loaded as bfloat16, 2.
    params = sum(p.numel() for p in build("llama").parameters())
    assert shown["model"].startswith(f"LlamaForCausalLM from {checkpoint}: {format_bytes(2 * params)}, ")
    assert shown["restore"].startswith("done; 9 tensors of layers 0 equal")


def test_load_offloading_nothing_still_runs_and_restores(capsys: pytest.CaptureFixture[str],
                                                          checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--backend", "none")
    assert code == 0, err
    shown = lines_by_label(out)
    assert shown["plan"].startswith("none, 0 of 4 layers offloaded")
    assert shown["restore"].startswith("done; 0 tensors of layers none")


def test_load_fits_a_budget(capsys: pytest.CaptureFixture[str], checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--fit-gib", "0.0001", "--profile", "h200-pcie5")
    assert code == 0, err
    shown = lines_by_label(out)
    assert shown["config"] == "fit to 104.9 KiB of device memory"
    assert shown["restore"].startswith("done; ")


def test_load_filter_offloads_only_matching_parameters(capsys: pytest.CaptureFixture[str],
                                                       checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--group-size", "2", "--filter", "mlp")
    assert code == 0, err
    # gate, up and down of layers 1 and 3.
    assert lines_by_label(out)["stats"].startswith("6 parameters offloaded, ")


# ---- the class built: the saved one, or --class ----------------------------------------------


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_any(build_llava(), tmp_path_factory.mktemp("cli-load-llava") / "llava")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_any(build_whisper(), tmp_path_factory.mktemp("cli-load-whisper") / "whisper")


def edited_copy(checkpoint: Path, into: Path, **config: object) -> Path:
    """A copy of `checkpoint` whose config.json has `config` set (None: removed)."""
    for file in checkpoint.iterdir():
        (into / file.name).write_bytes(file.read_bytes())
    saved = json.loads((into / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            saved.pop(key, None)
        else:
            saved[key] = value
    (into / "config.json").write_text(json.dumps(saved))
    return into


def test_load_builds_the_saved_class(capsys: pytest.CaptureFixture[str], llava: Path) -> None:
    code, out, err = run(capsys, "load", str(llava))
    assert code == 0, err
    shown = lines_by_label(out)
    assert shown["model"].startswith(f"LlavaForConditionalGeneration from {llava}: ")  # not LlavaModel
    assert shown["forward"].endswith("output (1, 12, 96), finite")  # the logits of its lm_head: 4 image tokens, 8 text
    assert shown["restore"].startswith("done; ")
    assert "as LlavaForConditionalGeneration (config.json architectures)" in err


def test_load_of_a_vision_language_model_runs_an_image_of_its_config(capsys: pytest.CaptureFixture[str],
                                                                      llava: Path) -> None:
    """A forward that takes pixel_values gets one random image of the vision config's size,
    after as many image tokens as the vision tower makes features: each patch of a CLIP
    tower (its class token dropped, Llava's default), and says so."""
    vision = json.loads((llava / "config.json").read_text())["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    code, out, err = run(capsys, "load", str(llava), "--tokens", "5")
    assert code == 0, err
    forward = lines_by_label(out)["forward"]
    channels, size = vision.get("num_channels", 3), vision["image_size"]
    assert forward.startswith(f"1 random image ({channels}x{size}x{size} pixel_values, {patches} image tokens) and "
                              "5 tokens in "), forward
    assert forward.endswith(f"output (1, {patches + 5}, 96), finite")  # the image's features took its tokens' places


class _Seeing(torch.nn.Module):
    """A forward that takes token ids and pixel_values, with a config as given."""

    def __init__(self, **config: object) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=16, **config)
        self.proj = torch.nn.Linear(2, 2)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj.weight


def test_an_image_that_cannot_be_built_leaves_the_text_alone_and_says_why() -> None:
    cpu = torch.device("cpu")
    inputs, said = _forward_inputs(_Seeing(vision_config=SimpleNamespace(num_channels=3)), 4, cpu)
    assert inputs is not None and set(inputs) == {"input_ids"}
    assert said == "4 tokens, text only: _Seeing takes pixel_values, but its config gives no image_size"
    inputs, said = _forward_inputs(_Seeing(vision_config=SimpleNamespace(image_size=[6, 4], num_channels=1)), 4, cpu)
    assert inputs is not None and set(inputs) == {"input_ids"}
    assert said == "4 tokens, text only: _Seeing takes pixel_values, but has no image_token_id to place an image with"


def test_load_of_whisper_offloads_both_stacks_and_runs_its_encoder_and_decoder(
        capsys: pytest.CaptureFixture[str], whisper: Path) -> None:
    code, out, _ = run(capsys, "load", str(whisper))
    assert code == 0
    shown = lines_by_label(out)
    assert shown["model"].startswith(f"WhisperForConditionalGeneration from {whisper}: ")
    assert "2 of 4 layers offloaded in 2 stacks, each prefetched on its own" in shown["plan"]  # every 2nd layer
    assert shown["forward"].endswith("output (1, 8, 96), finite")  # decoder logits over its 8 token ids
    assert shown["restore"].startswith("done; ")


def test_load_of_a_diffusers_model_skips_the_forward_and_still_checks_the_restore(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.hf.test_stacks import build_flux

    directory = save_any(build_flux(), tmp_path / "flux")
    code, out, _ = run(capsys, "load", str(directory))
    assert code == 0
    shown = lines_by_label(out)
    assert shown["model"].startswith(f"FluxTransformer2DModel from {directory}: ")
    assert "in 2 stacks" in shown["plan"]
    assert shown["forward"].startswith("skipped: FluxTransformer2DModel takes neither token ids nor audio features")
    assert shown["restore"].startswith("done; ")


def test_load_class_flag_wins_over_the_config(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                              tmp_path: Path) -> None:
    directory = edited_copy(checkpoint, tmp_path, architectures=["NoSuchForCausalLM"])
    code, out, err = run(capsys, "load", str(directory))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert "architectures names 'NoSuchForCausalLM', which transformers " in err and "--class NAME" in err
    code, out, err = run(capsys, "load", str(directory), "--class", "LlamaForCausalLM")
    assert code == 0, err
    assert lines_by_label(out)["model"].startswith(f"LlamaForCausalLM from {directory}: ")
    assert "as LlamaForCausalLM (given)" in err


def test_load_class_flag_that_drops_weights_exits_2_naming_them(capsys: pytest.CaptureFixture[str],
                                                                checkpoint: Path) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--class", "LlamaModel")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == (
        f"offload: error: {checkpoint}: not every weight loaded into LlamaModel (given): 1 in the checkpoint but "
        "not in the model (lm_head.weight); the checkpoint does not match the class: pass the class that was saved "
        "as model_class= (offload load: --class NAME)")


@pytest.mark.parametrize("name", ["NoSuchModel", "LlamaConfig", "not a name"])
def test_load_unknown_class_exits_2_naming_it(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                              name: str) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), "--class", name)
    assert (code, out) == (2, "")
    assert err == (f"offload load: --class {name!r}: no such model class in transformers or diffusers "
                   "(a class name such as LlamaForCausalLM or FluxTransformer2DModel)\n")


def test_load_without_architectures_warns_on_a_line_of_its_own(capsys: pytest.CaptureFixture[str],
                                                                checkpoint: Path, tmp_path: Path) -> None:
    directory = edited_copy(checkpoint, tmp_path, architectures=None)
    code, out, err = run(capsys, "load", str(directory))
    assert code == 0, err
    assert lines_by_label(out)["model"].startswith("LlamaForCausalLM from ")
    warnings = [line for line in err.splitlines() if line.startswith("WARNING offload.load: ")]
    assert warnings == [f"WARNING offload.load: {directory}: config.json names no architectures; built "
                        "LlamaForCausalLM (the Auto fallback), pass model_class= to choose"]


def test_warning_line_finishes_the_progress_line_first() -> None:
    stream = FakeStream(tty=True)
    scope = _ProgressScope(stream)
    log = logging.getLogger("offload.load")
    with scope:
        log.info("loading x")
        log.warning("careful")
        log.info("loaded")
    assert stream.getvalue() == "\rloading x\nWARNING offload.load: careful\n\rloaded\n"


# ---- errors: one line, exit 2 ----------------------------------------------------------------


def test_load_unknown_architecture_exits_2(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                           tmp_path: Path) -> None:
    for file in checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    code, out, err = run(capsys, "load", str(tmp_path))
    assert (code, out) == (2, "")
    last = err.splitlines()[-1]
    assert last.startswith(f"offload load: {tmp_path}: loading failed: ValueError: ")
    assert last.endswith("(-vv for the traceback)")


def test_load_missing_directory_exits_2_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    code, out, err = run(capsys, "load", str(missing))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert str(missing) in err and err.startswith("offload: error: ")


def test_load_directory_without_config_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "load", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"offload: error: {tmp_path}: no config.json\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fit-gib", "1", "--group-size", "2"],
         "offload load: --fit-gib chooses the configuration itself; drop --group-size\n"),
        (["--reserve-gib", "1", "--uva-gib", "1"],
         "offload load: --reserve-gib applies only when fitting; give --fit-gib instead of --uva-gib\n"),
        (["--fit-gib", "1", "--filter", "mlp"],
         "offload load: --filter applies to a given configuration, not to --fit-gib\n"),
        (["--fit-gib", "0"], "offload load: --fit-gib must be greater than 0\n"),
        (["--tokens", "0"], "offload load: argument --tokens: '0' is not at least 1 (see --help)\n"),
        (["--dtype", "int8"], None),
        (["--group-size", "2", "--num-in-group", "3"], None),  # ConfigError: more in a group than the group
    ],
)
def test_load_bad_flags_exit_2_in_one_line(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                           flags: list[str], message: str | None) -> None:
    code, out, err = run(capsys, "load", str(checkpoint), *flags)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    if message is not None:
        assert err == message
    assert "Loading weights" not in err  # refused before loading anything


# ---- the progress line ---------------------------------------------------------------------


class FakeStream(io.StringIO):
    """A text stream that says whether it is a terminal, and counts flushes."""

    def __init__(self, *, tty: bool) -> None:
        super().__init__()
        self._tty = tty
        self.flushes = 0

    def isatty(self) -> bool:
        return self._tty

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("offload.load", logging.INFO, __file__, 1, message, None, None)


def test_progress_line_on_a_terminal_updates_one_line() -> None:
    stream = FakeStream(tty=True)
    handler = ProgressLine(stream)
    assert handler.tty
    first = "loading: 1.0 GiB of 4.0 GiB (2.00 GB/s)"  # 39 characters
    handler.emit(record(first))
    handler.emit(record("done"))  # shorter: spaces cover the rest of the longer line
    handler.emit(record("two\nlines"))  # one line, whatever the message
    assert stream.getvalue() == f"\r{first}\rdone{' ' * 35}\rtwo lines"
    assert stream.flushes == 3
    handler.end()
    handler.end()  # once finished, nothing more
    assert stream.getvalue() == f"\r{first}\rdone{' ' * 35}\rtwo lines\n"


def test_progress_line_elsewhere_writes_plain_lines() -> None:
    stream = FakeStream(tty=False)
    handler = ProgressLine(stream)
    assert not handler.tty
    handler.emit(record("loading: 1.0 GiB of 4.0 GiB (2.00 GB/s)"))
    handler.emit(record("done"))
    handler.end()
    assert stream.getvalue() == "loading: 1.0 GiB of 4.0 GiB (2.00 GB/s)\ndone\n"


def test_progress_line_end_without_records_writes_nothing() -> None:
    stream = FakeStream(tty=True)
    ProgressLine(stream).end()
    assert stream.getvalue() == ""


def test_progress_line_tty_flag_overrides_the_stream() -> None:
    stream = FakeStream(tty=False)
    handler = ProgressLine(stream, tty=True)
    handler.emit(record("x"))
    handler.end()
    assert stream.getvalue() == "\rx\n"


def test_progress_line_uses_the_formatter() -> None:
    stream = FakeStream(tty=False)
    handler = ProgressLine(stream)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    handler.emit(record("hello %s"))
    assert stream.getvalue() == "[offload.load] hello %s\n"


def test_load_on_a_terminal_shows_one_progress_line(checkpoint: Path) -> None:
    # The real command in a process whose stderr is a pseudo-terminal.
    leader, follower = pty.openpty()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "VLLM_"))}
    environ["HF_HUB_OFFLINE"] = "1"
    environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # only our line on the terminal
    process = subprocess.Popen([sys.executable, "-m", "offload", "load", str(checkpoint)], cwd=ROOT, env=environ,
                               stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, shown.decode(errors="replace")
    assert "restore:  done" in out
    text = shown.decode().replace("\r\n", "\n")  # the terminal turns \n into \r\n
    # Lines of other libraries imported on the way (torchao, when the quant extra is
    # installed, warns about its GPU kernels on import): not ours to count.
    text = re.sub(r"(?m)^(?:(?:WARNING|INFO|ERROR) (?!offload)[\w.]+: |[WIE]\d{4} \d\d:\d\d:\d\d\.\d+ ).*\n", "", text)
    assert text.startswith("\rloading ")
    assert text.count("\r") >= 3 and "\rloaded " in text
    assert text.endswith("\n") and text.count("\n") == 1


def test_load_with_a_host_budget_streams_the_last_layers_from_disk(capsys: pytest.CaptureFixture[str],
                                                                   checkpoint: Path) -> None:
    """``--host-gib``: the four layers offloaded, one staging buffer's worth of budget short
    of all of them in host memory: the last ones read from the checkpoint at every step."""
    layer_bytes = 37120  # one layer of the small Llama, float32
    budget = (3 * layer_bytes) / 2**30
    code, out, err = run(capsys, "load", str(checkpoint), "--group-size", "1", "--prefetch-step", "1",
                         "--host-gib", f"{budget}", "--tokens", "5")
    assert code == 0, err
    shown = lines_by_label(out)
    found = re.match(r"(\d+) layers on disk \(([\d.]+ KiB), 0 B spilled\)", shown["disk"])
    assert found is not None and int(found.group(1)) >= 2, shown["disk"]
    assert re.search(r"[\d.]+ (KiB|MiB) read from disk at [\d.]+ GB/s$", shown["stats"]), shown["stats"]
    assert shown["restore"].startswith("done; 18 tensors of layers 0 and 3 equal bit for bit"), shown["restore"]


def test_spill_dir_without_a_host_budget_is_refused(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                                                    tmp_path: Path) -> None:
    code, _, err = run(capsys, "load", str(checkpoint), "--group-size", "1", "--spill-dir", str(tmp_path))
    assert code != 0 and "--spill-dir needs --host-gib" in err
