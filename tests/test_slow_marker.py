"""The developers' inner loop (`pytest -m "not slow"`) leaves out what tests/conftest.py's SLOW names:
every name there is a test file, so that a renamed file does not fall silently into the inner loop."""

from __future__ import annotations

from pathlib import Path

from conftest import SLOW

ROOT = Path(__file__).resolve().parents[1]


def test_every_slow_file_exists_once() -> None:
    assert len(set(SLOW)) == len(SLOW)
    missing = [f for f in SLOW if not (ROOT / f).is_file()]
    assert not missing, f"tests/conftest.py SLOW names files that do not exist: {missing}"
