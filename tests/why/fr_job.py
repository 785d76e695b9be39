"""A gloo job in miniature that hangs the way a real one does, for the Flight Recorder tests.

Every rank runs ``--steps`` all_reduces; then rank ``--stall`` stops taking part (``--mode
stall``: it sleeps past the others' collective timeout, a rank stuck in compute or on a dead GPU;
``--mode mismatch``: it issues a broadcast where the others issue their next all_reduce, a desync).
The others block in their next all_reduce until gloo's timeout (``--timeout``) raises.

Flight Recorder is on by the job's environment (``TORCH_FR_BUFFER_SIZE``), as in a real job. In this
torch (2.13) ProcessGroupGloo *records* its collectives in the Flight Recorder, but only
ProcessGroupNCCL's watchdog *dumps* on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``): a gloo job has to
ask for the dump itself. So each rank, when its collective raises (and the stalled one when it wakes),
writes PyTorch's own dump (``torch._C._distributed_c10d._dump_fr_trace()``, the pickle the NCCL
watchdog writes) to ``$TORCH_FR_DUMP_TEMP_FILE<rank>``, the file name PyTorch's DebugInfoWriter uses.
``--no-dump-rank R``: that rank writes nothing (a rank whose process died without dumping).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time


def _dump(rank: int) -> None:
    import torch

    prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    data = torch._C._distributed_c10d._dump_fr_trace()
    with open(f"{prefix}{rank}.tmp", "wb") as fh:
        fh.write(data)
    os.replace(f"{prefix}{rank}.tmp", f"{prefix}{rank}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=2.0, help="gloo collective timeout, seconds")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stall", type=int, default=-1, help="this rank stops taking part")
    ap.add_argument("--mode", choices=("stall", "mismatch"), default="stall")
    ap.add_argument("--no-dump-rank", type=int, default=-1)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    t = torch.ones(64)
    for _ in range(args.steps):
        dist.all_reduce(t)
    try:
        if rank == args.stall and args.mode == "stall":
            time.sleep(args.timeout + 0.5)
        elif rank == args.stall:
            dist.broadcast(t, src=rank)
        else:
            dist.all_reduce(t)
        print(f"rank {rank}: collective completed", flush=True)
    except RuntimeError as exc:
        print(f"rank {rank}: {str(exc).splitlines()[0]}", flush=True)
    if rank != args.no_dump_rank:
        _dump(rank)
    sys.stdout.flush()
    # no teardown: the peers are gone, and gloo's destructor may block or abort on them
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
