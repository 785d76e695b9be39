"""Shared fixtures: the NVML injection library under the real nvidia-ml-py, host-root trees.

Nothing here patches pynvml or subprocess: in-process tests load the injection
library (pynvml then binds to it by soname) and drive it through a state file;
CLI tests run ``gpumon`` as a child process with LD_LIBRARY_PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from gpumon.sim import nvml_inject
from gpumon.sim.nvml_state import NvmlNodeState, write_state

DATA = Path(__file__).parent / "data"

# CI machines are slow and shared: no per-example deadline, and a fixed seed so
# that a red CI run is reproducible (a found failure is still a failure).
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def inject_lib_dir() -> Path:
    lib_dir = nvml_inject.build_library()
    nvml_inject.preload(lib_dir)
    return lib_dir


@pytest.fixture
def nvml_state(inject_lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Path of a state file the injection library reads; write it with write_state."""
    path = tmp_path / "nvml-state.txt"
    write_state(NvmlNodeState.hgx(8), path)
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(path))
    yield path


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", nvml_inject.STATE_ENV, "NOTIFY_SOCKET")}
    env.update(extra)
    return env


def run_gpumon(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True, text=True,
                          env=env if env is not None else clean_env(), timeout=timeout, cwd=cwd)
