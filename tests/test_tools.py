"""The external-tool runner, with real child processes (no subprocess patching)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpumon.errors import HwTimeout, ToolMissing
from gpumon.hw.tools import ToolRunner


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_runs_argv_without_a_shell(tmp_path: Path) -> None:
    _script(tmp_path, "echoargs", 'for a in "$@"; do echo "[$a]"; done\n')
    runner = ToolRunner(10, search_path=str(tmp_path))
    result = runner.run(["echoargs", "a b", "$(id)", ";ls"])
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["[a b]", "[$(id)]", "[;ls]"]


def test_missing_tool_is_tool_missing(tmp_path: Path) -> None:
    runner = ToolRunner(10, search_path=str(tmp_path))
    with pytest.raises(ToolMissing, match="dcgmi is not installed"):
        runner.run(["dcgmi", "diag", "-r", "2"])


def test_hung_tool_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "child-alive"
    # the child outlives its parent unless the whole process group is killed
    _script(tmp_path, "hang", f'echo started; (sleep 5; touch {marker}) & sleep 30\n')
    runner = ToolRunner(10, search_path=str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HwTimeout) as info:
        runner.run(["hang"], timeout=0.5)
    assert time.monotonic() - start < 3
    assert "did not finish within 0.5 s" in str(info.value) and "started" in str(info.value)
    time.sleep(5.5)
    assert not marker.exists()


def test_nonzero_exit_and_stderr_are_returned(tmp_path: Path) -> None:
    _script(tmp_path, "fails", "echo oops >&2; exit 4\n")
    result = ToolRunner(10, search_path=str(tmp_path)).run(["fails"])
    assert (result.returncode, result.stderr.strip()) == (4, "oops")
