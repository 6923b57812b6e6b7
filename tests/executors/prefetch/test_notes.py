"""The prefetch backend's ordering and capture rules are written once, as named notes in
the docstring of `offload.executors.prefetch`, and the code refers to them by name: every
reference names a note that exists, and every note is relied on somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import offload.executors.prefetch as prefetch

PACKAGE = Path(__file__).resolve().parents[3] / "offload"
DEFINITION = re.compile(r"^Note \[([a-z ]+)\]$", re.MULTILINE)
REFERENCE = re.compile(r"Note \[([a-z ]+)\]")


def _notes() -> dict[str, str]:
    """Each note of the package docstring: its name -> its text."""
    doc = prefetch.__doc__ or ""
    heads = list(DEFINITION.finditer(doc))
    return {m.group(1): doc[m.end():(heads[i + 1].start() if i + 1 < len(heads) else len(doc))].strip()
            for i, m in enumerate(heads)}


def _references() -> dict[str, set[str]]:
    """Each note referred to in `offload`'s source -> the files that refer to it (the
    definitions themselves left out)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path == Path(prefetch.__file__):
            text = DEFINITION.sub("", text)
        for name in REFERENCE.findall(text):
            out.setdefault(name, set()).add(path.relative_to(PACKAGE).as_posix())
    return out


def test_the_rules_are_written_as_notes_with_text() -> None:
    notes = _notes()
    assert {"ordering", "in flight", "kept position", "capture boundary", "realign"} <= set(notes)
    assert all(len(text.split()) >= 20 for text in notes.values()), notes


def test_every_reference_names_a_note_and_every_note_is_relied_on() -> None:
    notes, references = _notes(), _references()
    assert set(references) - set(notes) == set(), "references to notes that do not exist"
    assert set(notes) - set(references) == set(), "notes nothing refers to"


def test_the_copy_queue_refers_to_the_rules_it_keeps() -> None:
    references = _references()
    for name in ("ordering", "in flight", "kept position", "capture boundary", "realign"):
        assert "executors/prefetch/queue.py" in references[name], name
