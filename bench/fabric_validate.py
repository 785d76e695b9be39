"""Run the fabric probe on a GPU node (or a group of them) and time it against its 5-minute plan.

For the day a GPU machine is lent. On one node it starts ``torchrun --standalone`` with one rank per
GPU (NCCL over NVLink/NVSwitch: no pair rounds, one node), the default sweep 8 B .. 2 GiB; with
``--nnodes N --node-rank R --rdzv HOST:PORT`` run it once per node for the multi-node plan (2 nodes x
8 GPUs is the budget of issue 10). Prints the machine, the command, the wall time against the
300 s budget, every collective's p50/p95/busbw row and each node's verdict.

    .venv/bin/python bench/fabric_validate.py                       # one GPU node
    .venv/bin/python bench/fabric_validate.py --device cpu --nproc 2 --max-bytes 1048576   # no GPU
    .venv/bin/python bench/fabric_validate.py --nnodes 2 --node-rank 0 --rdzv gpu-a:29500  # on gpu-a
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import describe

BUDGET_S = 300.0  # issue 10: the whole 8 B - 2 GiB sweep on 2 nodes x 8 GPUs in <= 5 minutes


def _gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except ImportError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--nproc", type=int, help="ranks on this node (default: one per GPU)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--rdzv", metavar="HOST:PORT", help="c10d rendezvous (multi-node)")
    ap.add_argument("--max-bytes", type=int)
    ap.add_argument("--state-dir", type=Path, help="default: a temporary directory")
    args = ap.parse_args()
    nproc = args.nproc or max(1, _gpus())
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    gpumon = shutil.which("gpumon", path=str(Path(sys.executable).parent)) or "gpumon"
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="gpumon-fabric-"))
    config = state / "gpumon.yaml"
    config.write_text(f"state_dir: {state}\n")
    launch = ([f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={args.rdzv}"] if args.rdzv else ["--standalone", "--nnodes=1"])
    cmd = [torchrun, *launch, f"--nproc-per-node={nproc}", "--no-python", gpumon, "probe-fabric", "--json",
           "--device", args.device, "--config", str(config)]
    if args.max_bytes:
        cmd += ["--max-bytes", str(args.max_bytes)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - start
    print(f"machine: {describe()}; CUDA GPUs seen by torch: {_gpus()}")
    print(f"command: {' '.join(cmd)}")
    print(f"wall: {wall:.1f} s ({'within' if wall <= BUDGET_S else 'OVER'} the {BUDGET_S:.0f} s budget), "
          f"exit {proc.returncode}")
    if not proc.stdout.strip():
        print(f"no report on this node (not rank 0?):\n{proc.stderr[-3000:]}")
        return proc.returncode or 3
    doc = json.loads(proc.stdout)
    print(f"probe: {doc['status']} ({doc['outcome']}), {len(doc['nodes'])} node(s), {doc['ranks']} ranks, "
          f"{doc['seconds']} s inside the ranks")
    print(f"{'op':<15}{'bytes':>12}{'iter':>6}{'p50 us':>11}{'p95 us':>11}{'busbw GB/s':>12}{'wrong':>7}")
    for r in doc["collectives"]:
        print(f"{r['op']:<15}{r['nbytes']:>12}{r['iterations']:>6}{r['p50_us'] or 0:>11.1f}"
              f"{r['p95_us'] or 0:>11.1f}{r['busbw_gbps'] or 0:>12.3f}{r['wrong']:>7}")
    for node, f in sorted(doc["findings"].items()):
        print(f"{node}: {f['severity']} / {f['action']}: {f['message']}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
