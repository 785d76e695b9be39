"""Importing gpumon.guard in a user's training process imports no torch and nothing heavy."""

from __future__ import annotations

import subprocess
import sys


def test_importing_gpumon_guard_imports_no_torch() -> None:
    code = ("import sys, gpumon.guard, gpumon.guard.verdict, gpumon.guard.identity\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'numpy', 'pynvml', 'kubernetes', 'prometheus_client', 'rich'))\n"
            "print(','.join(heavy))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_guard_itself_loads_on_first_use() -> None:
    code = "import sys, gpumon.guard as g\ng.Guard\nprint('torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
