"""``gpumon probe-fabric``: one rank of a multi-node fabric probe, started by an existing launcher.

Wires a rank to its node: the config and SKU profile (the ``fabric`` thresholds), the idle gate on
its GPU (NVML), its node's health state (where the node's finding is recorded, so the daemon exports
it and the remediator acts on it) and, on rank 0, the group report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon.atomic import write_atomic
from gpumon.check import Check
from gpumon.config import Config
from gpumon.errors import GpumonError, HwCondition, StartupError
from gpumon.fabric.judge import CHECK, Verdict
from gpumon.fabric.launch import Launch, detect
from gpumon.fabric.probe import Gate, RankRun, RankSetup
from gpumon.fabric.schedule import MAX_BYTES, Rotation, RotationError
from gpumon.fabric.settings import FabricConfig
from gpumon.idle import idle_gate
from gpumon.model import Finding

if TYPE_CHECKING:
    from gpumon.agent import Agent

LATEST = "latest.json"  # this node's last result, read by the fabric check
GROUP_LATEST = "group-latest.json"  # rank 0: the last group report
ROTATION = "rotation.json"  # the group's pair rotation, a copy on every node (gpumon.fabric.schedule)


def add_parser(sub: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "probe-fabric", parents=list(parents),
        help="one rank of a multi-node fabric probe (start it with torchrun, srun, mpirun or a "
             "Kubernetes Indexed Job)",
        description="One rank of a multi-node fabric probe: collectives 8 B .. 2 GiB across every rank, "
                    "send/recv between node pairs in rounds, a verdict per node. Start one per GPU "
                    "(one per host with --device cpu) with torchrun, srun, mpirun or a Kubernetes "
                    "Indexed Job; rank 0 prints the group report, every node records its finding "
                    "(check 'fabric') in its health state.")
    p.add_argument("--json", action="store_true", help="rank 0 prints the group report as JSON")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"),
                   help="auto (default: checks.fabric.device): NCCL on GPUs if torch sees CUDA, else gloo")
    p.add_argument("--max-bytes", type=int, metavar="BYTES",
                   help="largest message (default: checks.fabric.max_bytes, 2 GiB; cpu.max_bytes on CPU)")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help="end the probe by then, naming the ranks lost (default: checks.fabric.deadline_s)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="the data patterns and follow-up rounds of an earlier run (its report's 'seed'; "
                        "default: checks.fabric.seed, else a new one each run; the coverage rounds follow "
                        "the group's pair rotation, not the seed); rank 0's counts")
    p.add_argument("--port", type=int, help="rendezvous port (default: MASTER_PORT, else 29500)")
    p.add_argument("--master-addr", metavar="HOST", help="rendezvous host (default: from the launcher)")


def read_rotation(state_dir: Path) -> Rotation | None:
    """This node's copy of its group's pair rotation; None when there is none yet. A copy that cannot
    be used raises ``RotationError`` naming the file and why (the probe reports it and goes on from
    another node's copy or a fresh rotation; the file is replaced after the run, nothing else is
    touched)."""
    path = state_dir / "fabric" / ROTATION
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RotationError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        return Rotation.loads(raw)
    except RotationError as exc:
        raise RotationError(f"{path}: {exc}") from None


def write_rotation(state_dir: Path, text: str) -> None:
    write_atomic(state_dir / "fabric" / ROTATION, text)


def _options(config: Config, checks: dict[str, type[Check]]) -> FabricConfig:
    cls = checks.get(CHECK)
    options = config.settings(cls).options if cls is not None else None
    return options if isinstance(options, FabricConfig) else FabricConfig()


def main(args: argparse.Namespace, agent: Agent) -> int:
    """One rank, on the node ``agent`` was started on (``Agent.start(require_nvml=False)``: a rank
    of a CPU probe runs where there is no NVML)."""
    hw, inventory, profile, config = agent.hw, agent.inventory, agent.profile, agent.config
    nvml_error = None if hw.nvml.initialized else inventory.nvml_error
    state_dir = agent.state_dir
    settings = _options(config, agent.checks)
    if args.max_bytes is not None and args.max_bytes < settings.min_bytes:
        raise StartupError(f"--max-bytes {args.max_bytes} is below checks.fabric.min_bytes "
                           f"{settings.min_bytes}")
    if args.deadline is not None and not (math.isfinite(args.deadline) and args.deadline > 0):
        raise StartupError(f"--deadline {args.deadline} is not a positive number of seconds")

    def run_tool(argv: list[str]) -> str:
        try:
            res = hw.tools.run(argv, timeout=30.0)
        except (HwCondition, GpumonError) as exc:
            raise StartupError(f"{' '.join(argv)}: {exc}") from None
        if res.returncode != 0:
            raise StartupError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()[:200]}")
        return res.stdout

    launch = detect(os.environ, port=args.port, master_addr=args.master_addr, run_tool=run_tool)
    # a machine with a name of its own (Machine.node_name) is that node, as every other command
    # names it, whatever the host running it is called
    node = config.node_name or agent.machine.node_name() or _node_name(launch)
    # a node whose GPUs CPU workers stand in for never runs on the machine's own GPUs
    device = hw.devices.only_device or args.device or settings.device
    stand_ins = {s.index for s in hw.devices.stand_ins(inventory)}

    def enter_device(index: int) -> None:
        """This CPU rank stands in for GPU ``index`` (``ComputeDevices.stand_ins``): it carries out
        that GPU's device faults (``Placement.faults``: e.g. a GPU that corrupts the all-reduce results
        it receives), as the compute checks' workers standing in for GPUs do."""
        if index not in stand_ins:
            return
        faults = hw.devices.place(inventory, 1).faults
        if faults is not None:
            faults.install(index)

    def gate(index: int) -> Gate:
        if nvml_error:
            return Gate(None, {"idle_gate": f"NVML unavailable ({nvml_error}): GPUs not checked for work"})
        if index >= len(inventory.gpus):
            return Gate(None, {"idle_gate": f"no GPU {index} on this node"})
        try:
            g = idle_gate(hw, index, settings.idle_max_utilization_pct)
        except HwCondition as cond:
            return Gate(f"GPU {index}: cannot tell whether it is idle ({cond})", {"idle_gate": str(cond)})
        return Gate(g.busy, {"idle_gate": g.evidence, "gpu": index})

    def record(finding: Finding, summary: dict[str, Any]) -> None:
        from gpumon.health import Health

        doc = {"time": time.time(), "node": node, "finding": finding.to_json(), "group": summary}
        write_atomic(state_dir / "fabric" / LATEST, json.dumps(doc, indent=2) + "\n")
        health = Health.open(state_dir, boot_id=hw.fs.boot_id())
        try:
            health.record_findings(CHECK, [finding], complete=True)
        finally:
            health.close()

    def report(doc: dict[str, Any], verdict: Verdict | None) -> None:
        full = {**doc, "node": node, "profile": profile.name,
                "collectives": [r.to_json() for r in verdict.rows] if verdict else []}
        text = json.dumps(full, indent=2) + "\n"
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        try:
            write_atomic(state_dir / "fabric" / f"group-{stamp}.json", text)
            write_atomic(state_dir / "fabric" / GROUP_LATEST, text)
            where = str(state_dir / "fabric" / GROUP_LATEST)
        except OSError as exc:
            where = f"not written ({exc})"
        if args.json:
            print(text, end="", flush=True)
        else:
            from gpumon.fabric.report import print_report

            print_report(full, verdict, where)

    setup = RankSetup(launch=launch, settings=settings, node=node, device=device,
                      deadline_s=args.deadline or settings.deadline_s, gate=gate, record=record,
                      report=report, max_bytes=args.max_bytes, enter_device=enter_device,
                      profile=profile.name, seed=args.seed,
                      load_rotation=lambda: read_rotation(state_dir),
                      save_rotation=lambda text: write_rotation(state_dir, text))
    try:
        return RankRun(setup).run()
    finally:
        hw.nvml.shutdown()


def _node_name(launch: Launch) -> str:
    if launch.launcher == "slurm" and os.environ.get("SLURMD_NODENAME"):
        return os.environ["SLURMD_NODENAME"]
    return socket.gethostname()
