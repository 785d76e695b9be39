"""The one-machine recipe for ``gpumon probe-fabric``, run as written.

The commands are read from the command block of the "On one machine" section of
docs/operators/fabric-probe-launch.md and run one after the other with
``torchrun`` and ``gpumon`` of this environment first on PATH, stdout piped (as in ``| cat``, a log
or a health-check wrapper). Both nodes are simulated; the faulty one's fault is its GPU 1's device
model (``allreduce_corrupt``), carried out by the CPU rank standing in for that GPU: nothing tells
the probe what to find.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from gpumon.sim import nvml_inject

PAGE = Path(__file__).resolve().parents[2] / "docs" / "operators" / "fabric-probe-launch.md"


def _recipe() -> list[str]:
    text = PAGE.read_text()
    start = text.index("\n## On one machine\n")
    section = text[start:].split("\n## ", 2)[1]  # up to the next section
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, f"no command block in the 'On one machine' section of {PAGE}"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _env(state_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_", "PYTEST_", "GLOO_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "JOB_COMPLETION_INDEX", "LD_LIBRARY_PATH", "NOTIFY_SOCKET",
                         nvml_inject.STATE_ENV, "COLUMNS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_STATE_HOME"] = str(state_home)
    return env


def _node_row(out: str, node: str) -> str:
    rows = [line for line in out.splitlines() if line.startswith(f"│ {node} ")]
    assert len(rows) == 1, out
    return rows[0]


def test_the_documented_one_node_recipe_passes_a_healthy_node_and_fails_a_faulty_one(tmp_path: Path) -> None:
    # a deep state directory: the report's path is far longer than 80 columns
    state_home = tmp_path / "a-state-directory-deep-enough-that-no-path-fits-in-eighty-columns"
    env = _env(state_home)
    commands = _recipe()
    assert [shlex.split(c)[0] for c in commands] == ["torchrun", "gpumon", "torchrun", "gpumon"], commands
    runs = [subprocess.run(shlex.split(c), env=env, capture_output=True, text=True, timeout=180)
            for c in commands]
    probe_ok, status_ok, probe_bad, status_bad = runs
    logs = "\n".join(f"$ {c}\n-> {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
                     for c, r in zip(commands, runs, strict=True))

    # healthy: the probe passes on the simulated node, judged as CPU ranks (no H100 floor)
    assert probe_ok.returncode == 0, logs
    assert probe_ok.stdout.startswith("fabric probe: ok (completed)"), logs
    row = _node_row(probe_ok.stdout, "sim-healthy-8xh100")
    assert "│ ok " in row and "judged against: gloo on CPU" in row, row
    assert "330 GB/s" not in probe_ok.stdout and "below the profile" not in probe_ok.stdout
    assert status_ok.returncode == 0 and "node: healthy" in status_ok.stdout, logs

    # faulty: rank 0 fails the node (exit 2, which torchrun names, then exits 1), whose health state
    # then says unhealthy (exit 2)
    assert probe_bad.returncode == 1, logs
    assert "failed (exitcode: 2) local_rank: 0" in probe_bad.stderr, logs
    row = _node_row(probe_bad.stdout, "sim-fabric-faults-8xh100")
    assert "│ fail " in row and "│ inspect_hardware " in row, row
    # the words that name the fault, whole, on the node's one line
    assert "rank(s) 1 on sim-fabric-faults-8xh100 received wrong sums" in row, row
    assert status_bad.returncode == 2, logs
    assert "node: unhealthy (action inspect_hardware)" in status_bad.stdout, logs

    # piped: the report line holds the whole path, and it is the report rank 0 wrote
    for run, scenario in ((probe_ok, "healthy-8xh100"), (probe_bad, "fabric-faults-8xh100")):
        path = state_home / "gpumon" / "sim" / scenario / "state" / "fabric" / "group-latest.json"
        assert len(f"report: {path}") > 80
        assert f"report: {path}" in run.stdout.splitlines(), run.stdout
        report = json.loads(path.read_text())
        assert report["nodes"] == [f"sim-{scenario}"]
        assert report["status"] == ("ok" if run is probe_ok else "fail")
        finding = report["findings"][f"sim-{scenario}"]
        assert finding["evidence"]["device"] == "cpu"
        assert "never the GPU floors of profile h100-sxm" in finding["evidence"]["judged_against"]
