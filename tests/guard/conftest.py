"""The real-DDP launch the guard's tests share: one launch of 3 ranks (and one of 2) runs every
scenario of ``ddp_ranks.py`` and ``audit_ranks.py`` (torch's import and DDP's first start cost ~15 s
per process on a busy 2-core machine: paid once)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

RANKS = Path(__file__).with_name("ddp_ranks.py")
# "dies" last: a rank exits in it, and the default group cannot be used after
THREE = ("healthy,same-bits,subgroup,syncbn,close,nan,nan-internal-error,reduce-nan,reduce-nan-all,"
         "reduce-nan-own,reduce-nan-own-all,flip,wedged,"
         "wedged-weights,audit-healthy,transient,persistent,nan-transient,nan-persistent,nan-application,"
         "nan-rerun-fails,nan-diverged,diverged-w0,diverged-w5,diverged-a2w3,unseeded,refuse,shape,contents,"
         "later-shape,dies")
TWO = "flip,transient"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, world: int, scenarios: str, timeout: float = 240,
           script: Path = RANKS) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "NODE_NAME": f"node-{rank}", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
        env.pop("SLURMD_NODENAME", None)
        procs.append(subprocess.Popen([sys.executable, str(script), str(rank), str(world), str(port),
                                       str(out), scenarios], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, logs, strict=True):
        assert p.returncode == 0, text
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="session")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("guard3")
    return out, launch(out, 3, THREE)


@pytest.fixture(scope="session")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("guard2")
    return out, launch(out, 2, TWO)


@pytest.fixture(scope="session")
def launch_ranks() -> Any:
    """``launch`` for a test module with a rank script of its own (``script=``)."""
    return launch
