"""The core is pure: importing it (and `offload`) and planning never loads torch, and its
source reads no environment, files or clocks and does not log (DESIGN.md)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE = REPO / "offload" / "pure"

_PROBE = """
import json, pkgutil, sys, importlib
seen = {}
import offload.pure
seen["after offload.pure"] = "torch" in sys.modules
import offload.pure as pure
for info in pkgutil.walk_packages(pure.__path__, "offload.pure."):
    importlib.import_module(info.name)
seen["after every offload.pure module"] = "torch" in sys.modules
import offload
from offload import EnvSnapshot, OffloadConfig, OffloadPlan, make_plan, render_plan
from offload.pure import preset_spec
seen["after offload"] = "torch" in sys.modules
for config in (OffloadConfig(group_size=4, prefetch_step=2), OffloadConfig(uva_max_bytes=1 << 34)):
    plan = make_plan(preset_spec("mixtral-8x7b"), config, EnvSnapshot())
    assert OffloadPlan.from_json(plan.to_json()) == plan
    assert render_plan(plan)
seen["after make_plan"] = "torch" in sys.modules
CONTROL
seen["control"] = "torch" in sys.modules
print(json.dumps(seen))
"""


def _probe(control: str) -> dict[str, bool]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.replace("CONTROL", control)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return {str(k): bool(v) for k, v in result.items()}


def test_importing_and_planning_leave_torch_out_of_sys_modules() -> None:
    seen = _probe("pass")
    assert seen == {
        "after offload.pure": False,
        "after every offload.pure module": False,
        "after offload": False,
        "after make_plan": False,
        "control": False,
    }


def test_the_probe_would_notice_torch() -> None:
    # The same probe, with torch imported at the end: proves the check can fail.
    assert _probe("import torch")["control"] is True


# ---------------------------------------------------------------------------- source scan

FORBIDDEN: dict[str, re.Pattern[str]] = {
    "import torch": re.compile(r"\bimport\s+torch\b|\bfrom\s+torch\b"),
    "os.environ": re.compile(r"\bos\s*\.\s*(environ|getenv)\b|\bfrom\s+os\s+import\b[^\n]*\b(environ|getenv)\b"),
    "open(": re.compile(r"(?<![\w.])open\s*\("),
    "logging": re.compile(r"\blogging\b|\blogger\b"),
    "print(": re.compile(r"(?<![\w.])print\s*\("),
    "clock": re.compile(r"\btime\s*\.\s*(time|monotonic|perf_counter|sleep)\b|\bdatetime\s*\.\s*now\b"),
}


def code_only(source: str) -> str:
    """The source with every comment and string literal (docstrings too) blanked out."""
    lines = source.splitlines(keepends=True)
    blank = [list(line) for line in lines]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        (row, col), (end_row, end_col) = token.start, token.end
        for r in range(row, end_row + 1):
            chars = blank[r - 1]
            start = col if r == row else 0
            stop = end_col if r == end_row else len(chars)
            for c in range(start, stop):
                if chars[c] != "\n":
                    chars[c] = " "
    return "".join("".join(chars) for chars in blank)


def violations(source: str) -> list[str]:
    code = code_only(source)
    return [name for name, pattern in FORBIDDEN.items() if pattern.search(code)]


PURE_FILES = sorted(PURE.rglob("*.py"))


def test_there_is_source_to_scan() -> None:
    names = {p.relative_to(PURE).as_posix() for p in PURE_FILES}
    assert {"env/snapshot.py", "decide/pinning.py", "plan/make.py", "plan/plan.py", "plan/schedule.py",
            "sharing/plan.py", "stats.py", "check.py"} <= names


@pytest.mark.parametrize("path", PURE_FILES, ids=[p.relative_to(PURE).as_posix() for p in PURE_FILES])
def test_pure_source_has_no_effects(path: Path) -> None:
    assert violations(path.read_text()) == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import torch\n", ["import torch"]),
        ("from torch import nn\n", ["import torch"]),
        ("import os\nx = os.environ['A']\n", ["os.environ"]),
        ("import os\nx = os.getenv('A')\n", ["os.environ"]),
        ("from os import environ\n", ["os.environ"]),
        ("with open('f') as f:\n    pass\n", ["open("]),
        ("import logging\n", ["logging"]),
        ("print('x')\n", ["print("]),
        ("import time\nt = time.monotonic()\n", ["clock"]),
        # Mentions in docstrings and comments are fine; so are methods called open.
        ('"""Reads os.environ? No: capture_env passes os.environ; never import torch."""\n', []),
        ("x = 1  # open(the file) in the shell, not here; logging too\n", []),
        ("def f(s):\n    return s.open()\n", []),
        ("reopen = 1\n", []),
    ],
)
def test_the_scanner_finds_what_it_should(source: str, found: list[str]) -> None:
    assert violations(source) == found
