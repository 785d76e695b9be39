"""A training job in miniature for the post-mortem tests: gloo all_reduce in a loop over the test
hosts, one rank per Slurm node (started by ``srun``), with a short collective timeout so that a
collective that cannot complete kills the job in seconds rather than PyTorch's 10 minutes.

``MASTER_ADDR``/``MASTER_PORT`` come from the test (node 0's address); rank and world from Slurm.
After the first all_reduce (every pair connected) each rank prints ``{"ready": ..}`` with its job id
and pid. ``--raise-at N``: rank 0 raises an application error at step N (a bug of the job, not of
the node). Otherwise it runs until something kills it or its collective times out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=12.0, help="gloo collective timeout, seconds")
    ap.add_argument("--raise-at", type=int, default=-1, help="rank 0 raises at this step")
    args = ap.parse_args()
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    t = torch.ones(256)
    dist.all_reduce(t)
    print(json.dumps({"ready": rank, "job": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid(),
                      "host": socket.gethostname()}), flush=True)
    step = 0
    while True:
        step += 1
        if rank == 0 and step == args.raise_at:
            raise RuntimeError(f"loss is NaN at step {step} (the application's own bug)")
        dist.all_reduce(t)
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
