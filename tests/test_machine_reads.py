"""Only `offload.capture` reads the machine: no other module of `offload` reads
``os.environ`` or names a path under ``/proc`` or ``/sys`` (read from the source, so a new
reader elsewhere fails here). The runtimes' own device calls are theirs, and are not
checked here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "offload"
CAPTURE = PACKAGE / "capture"
MACHINE_PATHS = ("/proc", "/sys")


def machine_reads(source: str) -> list[str]:
    """What `source` reads of the machine, as short descriptions with line numbers."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "putenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "environb", "getenv") for a in node.names):
            found.append((node.lineno, f"from os import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and any(node.value == p or node.value.startswith(p + "/") for p in MACHINE_PATHS):
            found.append((node.lineno, repr(node.value)))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_module_outside_capture_reads_the_machine() -> None:
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if CAPTURE in path.parents:
            continue
        reads = machine_reads(path.read_text(encoding="utf-8"))
        if reads:
            outside[str(path.relative_to(PACKAGE.parent))] = reads
    assert outside == {}


def test_capture_does_read_the_machine() -> None:
    reads = [r for path in sorted(CAPTURE.rglob("*.py")) for r in machine_reads(path.read_text(encoding="utf-8"))]
    assert any("os.environ" in r for r in reads)
    assert any("'/proc/" in r for r in reads)
    assert any("'/sys/" in r for r in reads)


def test_the_reader_finds_each_kind() -> None:
    source = ("import os\nfrom os import environ\nx = os.environ['A']\ny = os.getenv('B')\n"
              "z = open('/proc/self/limits')\nw = '/sys/fs/cgroup'\nv = '/process'\n")
    assert machine_reads(source) == [
        "line 2: from os import environ",
        "line 3: os.environ",
        "line 4: os.getenv",
        "line 5: '/proc/self/limits'",
        "line 6: '/sys/fs/cgroup'",
    ]
