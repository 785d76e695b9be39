"""The documentation as a product: the docs site builds with ``mkdocs build --strict`` (broken links,
missing pages and pages left out of the navigation fail), the README is a front page, user docs say
what is true now, and nothing the README once said was lost on the way into the site.

``tests/data/readme-identifiers.txt`` holds every code span (a command, a flag, an option, a metric, a
path, a message) of the README as it was before the site existed: each must still be written somewhere
in the README, the site or the changelog.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# the pages that keep history and measurements, with their dates: the changelog and the benchmarks
HISTORY = {"benchmarks.md"}
# "issue 12", "(#34)": where the work came from, for the changelog, not the user docs
ISSUE = re.compile(r"\bissues? \d+\b|\(#\d+\)|#\d+ point", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose(text: str) -> str:
    """The text outside fenced code blocks (examples of output may carry dates)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def test_the_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (the test extra brings it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "operators" / "runbooks" / "index.html").is_file()


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert not ISSUE.search(text), ISSUE.search(text)
    assert not DATE.search(prose(text)), DATE.search(prose(text))
    # the two commands at the top, as they were
    head = "\n".join(text.splitlines()[:30])
    assert ("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/gpumon daemon --simulate "
            "faulty-8xh100") in head
    tests = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -q"
    assert tests in head


def test_user_docs_carry_no_issue_numbers_or_dates() -> None:
    found = []
    for page in pages():
        rel = page.relative_to(DOCS).as_posix()
        if rel in HISTORY or rel.startswith("reference/"):
            continue
        text = prose(page.read_text())
        for pattern in (ISSUE, DATE):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: {m.group(0)}")
    assert not found, "history belongs in CHANGELOG.md or docs/benchmarks.md:\n" + "\n".join(found[:60])


def test_nothing_the_readme_said_was_lost() -> None:
    written = " ".join([(ROOT / "README.md").read_text(), (ROOT / "CHANGELOG.md").read_text(),
                        *(p.read_text() for p in pages())])
    written = re.sub(r"\s+", " ", written)
    wanted = [w for w in (ROOT / "tests/data/readme-identifiers.txt").read_text().splitlines() if w]
    lost = [w for w in wanted if re.sub(r"\s+", " ", w) not in written]
    assert not lost, (f"{len(lost)} of the README's code spans are written nowhere now: "
                      + " | ".join(lost[:80]))
