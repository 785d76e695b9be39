"""Running ``gpumon probe-fabric`` on test hosts: one node config per host, the ranks, the results.

Each host is a node with its own ``gpumon.yaml`` (node name, state directory, the probe's CPU-sized
options), as each node of a fleet has its own ``/etc/gpumon/gpumon.yaml``. Ranks talk over the
hosts' eth0 (``GLOO_SOCKET_IFNAME``); nothing here reaches beyond the test network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .netns import TestNet

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPUMON = str(BIN / "gpumon")
TORCHRUN = str(BIN / "torchrun")
FAULTY_RANK = str(Path(__file__).with_name("faulty_rank.py"))


def node_config(base: Path, name: str, **fabric: Any) -> Path:
    d = base / name
    (d / "state").mkdir(parents=True, exist_ok=True)
    opts = {"deadline_s": 60, "heartbeat_s": 0.5, "op_timeout_s": 30, **fabric}
    lines = [f"node_name: {name}", f"state_dir: {d / 'state'}", "profile: generic",
             "checks:", "  fabric:", *(f"    {k}: {json.dumps(v)}" for k, v in opts.items())]
    path = d / "gpumon.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_", "PYTEST_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "JOB_COMPLETION_INDEX")}
    env.update({"GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


@dataclass
class ProbeRun:
    net: TestNet
    base: Path
    procs: dict[int, subprocess.Popen[str]] = field(default_factory=dict)
    started: float = 0.0
    outs: dict[int, tuple[str, str]] = field(default_factory=dict)
    codes: dict[int, int | None] = field(default_factory=dict)
    ended: dict[int, float] = field(default_factory=dict)

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
        with self.out_path(i, "out").open("w") as out, self.out_path(i, "err").open("w") as err:
            return self.net.popen(i, argv, env=env, text=True, stdout=out, stderr=err)

    def config(self, i: int) -> Path:
        return self.base / self.net.hosts[i].name / "gpumon.yaml"

    def state(self, i: int) -> Path:
        return self.base / self.net.hosts[i].name / "state"

    def out_path(self, i: int, stream: str) -> Path:
        return self.base / self.net.hosts[i].name / f"rank{i}.{stream}"

    def stderr(self, i: int) -> str:
        return self.out_path(i, "err").read_text(errors="replace")

    def wait_for(self, i: int, text: str, timeout: float) -> bool:
        """Until rank ``i`` logs ``text`` (True) or ``timeout`` passes (False)."""
        limit = time.monotonic() + timeout
        while time.monotonic() < limit:
            if text in self.stderr(i):
                return True
            time.sleep(0.05)
        return False

    def wait(self, timeout: float) -> None:
        """Until every rank has exited (a rank still running then is killed: code None)."""
        limit = time.monotonic() + timeout
        pending = dict(self.procs)
        while pending and time.monotonic() < limit:
            for i, p in list(pending.items()):
                if p.poll() is not None:
                    self.codes[i] = p.returncode
                    self.ended[i] = time.monotonic()
                    del pending[i]
            time.sleep(0.05)
        for i, p in pending.items():
            p.kill()
            p.wait()
            self.codes[i] = None
            self.ended[i] = time.monotonic()
        for i in self.procs:
            self.outs[i] = (self.out_path(i, "out").read_text(errors="replace"), self.stderr(i))

    def report(self) -> dict[str, Any]:
        """Rank 0's JSON group report (``--json`` on stdout)."""
        out, err = self.outs[0]
        try:
            return dict(json.loads(out))
        except ValueError:
            raise AssertionError(f"rank 0 printed no JSON report:\n{out}\n{err[-3000:]}") from None

    def latest(self, i: int) -> dict[str, Any]:
        return dict(json.loads((self.state(i) / "fabric" / "latest.json").read_text()))

    def logs(self) -> str:
        return "\n".join(f"--- rank {i} rc={self.codes.get(i)}\n{o[-2000:]}\n{e[-4000:]}"
                         for i, (o, e) in sorted(self.outs.items()))


def start_static(net: TestNet, base: Path, port: int, args: Sequence[str] = (), *,
                 wrapper: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 sim_dirs: Mapping[int, Path] | None = None, **fabric: Any) -> ProbeRun:
    """One rank per host, rendezvous at host 0 (the env:// protocol torchrun and Kubernetes use).
    ``sim_dirs``: run each host as a simulated GPU node kept in that directory (its state there)."""
    run = ProbeRun(net, base)
    world = len(net.hosts)
    for h in net.hosts:
        node_config(base, h.name, **fabric)
    run.started = time.monotonic()
    for h in net.hosts:
        e = rank_env(RANK=str(h.index), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR=net.hosts[0].ip, MASTER_PORT=str(port), **(env or {}))
        sim = (["--simulate", "healthy-8xh100", "--sim-dir", str(sim_dirs[h.index])] if sim_dirs
               else ["--device", "cpu"])
        argv = [*(wrapper or [GPUMON]), "probe-fabric", "--json", *sim,
                "--config", str(run.config(h.index)), *args]
        run.procs[h.index] = run.popen(h.index, argv, e)
    return run


def stop(proc: subprocess.Popen[Any], grace: float = 15) -> None:
    """SIGTERM, then SIGKILL after ``grace`` s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_torchrun(net: TestNet, base: Path, port: int, args: Sequence[str] = (), **fabric: Any) -> ProbeRun:
    """One torchrun per host (c10d rendezvous on host 0), one rank each."""
    run = ProbeRun(net, base)
    world = len(net.hosts)
    for h in net.hosts:
        node_config(base, h.name, **fabric)
    run.started = time.monotonic()
    for h in net.hosts:
        argv = [TORCHRUN, f"--nnodes={world}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={net.hosts[0].ip}:{port}", "--rdzv-id=gpumon-fabric-test",
                # names do not resolve on the test hosts: host 0 hosts the rendezvous store by address
                f"--rdzv-conf=is_host={int(h.index == 0)}",
                f"--local-addr={h.ip}", "--max-restarts=0", "--monitor-interval=0.5", "--no-python",
                GPUMON, "probe-fabric", "--json", "--device", "cpu", "--config", str(run.config(h.index)),
                *args]
        run.procs[h.index] = run.popen(h.index, argv, rank_env())
    return run
