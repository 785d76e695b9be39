"""The wheel of this checkout, built offline as a release would build it (``pip wheel``, no index, no
build isolation: the test interpreter's setuptools), from a copy of the sources so that the build's
build/ and egg-info never land in (or race in) the checkout. Shared by the tests that install it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a wheel build reads from the checkout (setup.py finds the packages; pyproject's package-dir
# maps checks/ and config/)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "gpumon", "checks", "config")


def copy_sources(src: Path) -> Path:
    src.mkdir(exist_ok=True)
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


def build_wheel(src: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("*.whl")
    return built
