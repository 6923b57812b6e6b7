"""The loggers are named once (`offload.logs.LOGGERS`), every module logs on one of them,
and docs/observability.md lists exactly them: a user's logging configuration does not break
when a module moves."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from offload.logs import LOGGERS, logger

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "offload"


def _logger_calls() -> dict[str, set[str]]:
    """Module path -> the names it passes to `logger(...)`; a call whose argument is not a
    string literal is recorded as ``<not a literal>``."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "logger":
                arg = node.args[0] if node.args else None
                name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "<not a literal>"
                found.setdefault(str(path.relative_to(ROOT)), set()).add(name)
    return found


def test_no_module_makes_its_own_logger() -> None:
    offenders = [str(path.relative_to(ROOT)) for path in sorted(PACKAGE.rglob("*.py"))
                 if path.name != "logs.py" and "getLogger(" in path.read_text(encoding="utf-8")]
    assert offenders == []


def test_every_logger_a_module_takes_is_a_documented_name_and_every_name_is_used() -> None:
    calls = _logger_calls()
    used = {name for names in calls.values() for name in names}
    assert used - set(LOGGERS) == set(), {path: names - set(LOGGERS) for path, names in calls.items()}
    # The parent is for configuration; every other name has a module writing to it.
    assert set(LOGGERS) - used == {"offload"}


def test_every_name_is_under_the_offload_parent() -> None:
    assert all(name == "offload" or name.startswith("offload.") for name in LOGGERS)
    assert all(logger(name).name == name for name in LOGGERS)


def test_the_observability_page_lists_exactly_the_loggers_in_order() -> None:
    text = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    section = text.split("## Loggers", 1)[1]
    listed = re.findall(r"^\| `([a-z.]+)` \|", section, flags=re.MULTILINE)
    assert listed == list(LOGGERS)


def test_an_unknown_name_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'offload.nope' is not one of offload's loggers"):
        logger("offload.nope")


def test_the_stats_line_and_the_modules_log_under_the_names_not_the_modules(caplog: pytest.LogCaptureFixture) -> None:
    # A module that moved keeps its logger: the hoststore logs on offload.host wherever it lies.
    import offload.executors.hoststore as hoststore
    import offload.executors.telemetry as telemetry

    assert hoststore.log.name == "offload.host"
    assert telemetry.log.name == "offload.stats"
    with caplog.at_level(logging.INFO, logger="offload"):
        telemetry.log.info("probe")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("offload.stats", "probe")]
