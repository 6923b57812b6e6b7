"""The documentation holds together: the README is a front door (short, linking to
`docs/`), every relative link in it and in `docs/` resolves inside the repository, and
`docs/architecture.md` names every package of `offload` and no package that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A package as docs/architecture.md names it: `offload/pure/plan/`.
PACKAGE_NAME = re.compile(r"`(offload(?:/[a-z_]+)*)/`")


def _slugs(text: str) -> set[str]:
    """The anchors GitHub makes of a document's headings."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for needed in ("bash scripts/setup.sh && .venv/bin/offload demo", "bash scripts/check.sh", "docs/architecture.md"):
        assert needed in readme, needed


def test_every_relative_link_resolves_inside_the_repository() -> None:
    broken = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if ROOT not in resolved.parents and resolved != ROOT:
                broken.append(f"{doc.name}: {target} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _slugs(resolved.read_text(encoding="utf-8")):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []


def test_every_doc_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert {d.name for d in DOCS[1:]} <= set(re.findall(r"docs/([\w\-]+\.md)", readme))


def test_the_architecture_names_every_package_and_only_those() -> None:
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "offload").rglob("__init__.py")}
    named = set(PACKAGE_NAME.findall((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")))
    assert packages - named == set(), "packages docs/architecture.md does not name"
    assert named - packages == set(), "packages docs/architecture.md names that do not exist"


#: A module of `offload` longer than this says why in docs/architecture.md.
MODULE_LINES = 400


def test_every_module_over_the_mark_is_named_with_its_reason() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Modules over 400 lines, and why", 1)[1].split("\n## ", 1)[0]
    explained = set(re.findall(r"^- `([\w/]+\.py)`", section, re.MULTILINE))
    long = {path.relative_to(ROOT / "offload").as_posix() for path in (ROOT / "offload").rglob("*.py")
            if len(path.read_text(encoding="utf-8").splitlines()) > MODULE_LINES}
    assert long - explained == set(), "modules over 400 lines that docs/architecture.md does not explain"
    assert explained - long == set(), "modules docs/architecture.md explains that are not over 400 lines"


#: How a file would cite our tracker instead of saying what it means: the word "issue"
#: followed by a number (with or without "#"), or the word's possessive naming what it said
#: (other projects' issues, cited as owner/repo#N, are references).
ISSUE_CITATION = re.compile(r"\b[Ii]ssues? #?\d+|\b[Tt]he issue's\b")


def test_no_file_names_an_issue_of_ours() -> None:
    # The tracker is not part of the repository: a reader of the code cannot follow a
    # reference to it. This file is left out: it spells the pattern.
    paths = [*DOCS, *sorted((ROOT / "offload").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
             *sorted((ROOT / "benchmarks").rglob("*.py")), *sorted((ROOT / "scripts").glob("*")), ROOT / "CHANGELOG.md"]
    me = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in paths if path.is_file() and path != me
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if ISSUE_CITATION.search(line)]
    assert found == []
