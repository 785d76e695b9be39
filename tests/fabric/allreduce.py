"""A tiny torch.distributed gloo all_reduce, one process per rank, for the fabric test harness.

Ranks come from the environment, whoever started them:

* by hand / a test: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
* torchrun: the same variables, set by its agent;
* Slurm ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``; ``MASTER_ADDR`` (if not given) is the
  first node of ``scontrol show hostnames $SLURM_JOB_NODELIST``, turned into an address by
  ``--master-from`` (``nodeaddr``: its ``NodeAddr`` from ``scontrol show node``; ``resolve``:
  the name itself, left to the resolver).

``--wait-stdin``: after the warm-up all_reduce (every pair connected), print ``{"ready": true}`` and
wait for a line on stdin before the timed one (a test cuts a link in between).

Each rank contributes ``rank + 1`` (times a tensor of ``--mib`` MiB when given) and prints one JSON
line: rank, world size, the sum it got, its hostname, and how long the timed all_reduce took. Exit
status 0 only when the sum is right.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time


def _slurm_master(how: str) -> str:
    nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, timeout=20, check=True).stdout.split()
    first = nodes[0]
    if how == "resolve":
        return first
    out = subprocess.run(["scontrol", "show", "node", "-o", first], capture_output=True, text=True,
                         timeout=20, check=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields["NodeAddr"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=0.0, help="size of the timed all_reduce (0: one number)")
    ap.add_argument("--timeout", type=float, default=30.0, help="gloo/store timeout, seconds")
    ap.add_argument("--wait-stdin", action="store_true",
                    help="after the warm-up, print a 'ready' line and wait for a line on stdin")
    ap.add_argument("--master-from", choices=("nodeaddr", "resolve"), default="nodeaddr")
    args = ap.parse_args(argv)

    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        os.environ["RANK"] = env["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = env["SLURM_NTASKS"]
        os.environ.setdefault("MASTER_ADDR", _slurm_master(args.master_from))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    try:
        warm = torch.tensor([float(rank + 1)])
        dist.all_reduce(warm)  # connects every pair: the timed one below moves data only
        if args.wait_stdin:
            print(json.dumps({"rank": rank, "ready": True}), flush=True)
            sys.stdin.readline()
        n = max(1, int(args.mib * 1024 * 1024 / 4))
        t = torch.full((n,), float(rank + 1))
        start = time.monotonic()
        dist.all_reduce(t)
        elapsed = time.monotonic() - start
        expected = world * (world + 1) / 2
        ok = bool(warm.item() == expected and torch.all(t == expected).item())
        print(json.dumps({"rank": rank, "world": world, "sum": warm.item(), "ok": ok,
                          "host": socket.gethostname(), "master": env.get("MASTER_ADDR"),
                          "elapsed_s": round(elapsed, 4), "mib": args.mib}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
