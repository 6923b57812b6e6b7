"""The command line starts fast: ``offload plan DIR`` of a one-stack checkpoint of weights
and biases reads its headers without importing transformers, torchao or diffusers (no
model class is built: the headers tell the plan all it needs), nor torch on a machine
without a GPU device file (the machine probe finds no GPU without it), and prints nothing
on stderr; so do ``offload plan PRESET`` and ``offload env``. Each runs in a fresh
interpreter, timed against the same command in a process that also imports transformers'
model class (what building the class cost every plan before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from offload.capture.device import gpu_may_be_present
from tests.hf.checkpoints import build, save

ROOT = Path(__file__).resolve().parents[1]

#: Runs ``main(argv)`` in a fresh interpreter, optionally after importing transformers'
#: Llama class, and prints the exit status, the seconds from the first import to the end,
#: and which of the heavy libraries are in ``sys.modules``.
WRAPPER = """
import contextlib, io, json, sys, time
start = time.monotonic()
if sys.argv[1] == "transformers":
    from transformers import LlamaForCausalLM
from offload.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[2:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torchao", "diffusers", "torch"))
print(json.dumps({"code": code, "seconds": time.monotonic() - start, "heavy": heavy, "out": out.getvalue()}))
"""

#: The plan of a checkpoint on headers takes at most this share of the same plan in a
#: process that imports transformers' model class (about 0.4 measured on a loaded 2-core
#: machine, where importing torch alone takes 2 s; 0.9 or more before).
RATIO = 0.7
#: And at most this many seconds, from the first import to the end (2.4-2.9 s measured on
#: that machine where the machine probe imports torch: on a machine with a GPU).
SECONDS = 4.5
#: Where no GPU device file exists the probe does not import torch: at most this many
#: seconds (0.27-0.4 s measured on the loaded 2-core machine).
SECONDS_WITHOUT_TORCH = 1.5
NO_GPU = not gpu_may_be_present()


@attrs.frozen
class Ran:
    """What the wrapper printed: the exit status, the seconds, the heavy modules, stdout."""

    code: int
    seconds: float
    heavy: list[str]
    out: str


def _run(*argv: str, first: str = "none") -> tuple[Ran, str]:
    done = subprocess.run([sys.executable, "-c", WRAPPER, first, *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    return Ran(code=found["code"], seconds=found["seconds"], heavy=found["heavy"], out=found["out"]), done.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build("llama"), tmp_path_factory.mktemp("startup") / "llama", sharded=False)


def test_plan_of_a_checkpoint_reads_headers_without_transformers(checkpoint: Path) -> None:
    fast, err = _run("plan", str(checkpoint))
    assert fast.code == 0
    assert [m for m in fast.heavy if m.split(".")[0] != "torch"] == [], fast.heavy
    assert ("torch" in fast.heavy) is not NO_GPU  # the probe imports torch only where a GPU may be
    assert err == ""  # no torchao "Failed to load", no pytree deprecation
    assert "class:    not built" in fast.out
    slow, _ = _run("plan", str(checkpoint), first="transformers")
    assert slow.code == 0 and "transformers" in slow.heavy  # the premise: the comparison imports it
    assert fast.seconds < RATIO * slow.seconds, (fast.seconds, slow.seconds)
    assert fast.seconds < (SECONDS_WITHOUT_TORCH if NO_GPU else SECONDS), fast.seconds


@pytest.mark.parametrize("argv", [("plan", "llama-8b"), ("env",)], ids=["preset", "env"])
def test_a_preset_plan_and_env_import_no_model_library(argv: tuple[str, ...]) -> None:
    found, err = _run(*argv)
    assert found.code == 0
    assert [m for m in found.heavy if m.split(".")[0] != "torch"] == [], found.heavy
    assert err == ""
    if NO_GPU and argv[0] == "plan":
        assert found.heavy == [] and found.seconds < SECONDS_WITHOUT_TORCH, found
    assert found.seconds < SECONDS
