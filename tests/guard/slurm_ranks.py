"""One rank of test_guard_slurm.py, started by ``srun`` on a test host's slurmd as a Slurm user's
batch script starts a torch job: ``RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS python ...`` with
``MASTER_ADDR``/``MASTER_PORT``, and nothing else of a launcher (no ``LOCAL_RANK``, no
``NODE_NAME``: Slurm's ``SLURMD_NODENAME`` and ``SLURM_LOCALID`` are what the guard has to go by).

``slurm_ranks.py OUT BAD_NODE``: the NaN scenario of the multi-node test (netns_ranks.nan) with the
fault in the forward of the rank that runs on Slurm node ``BAD_NODE`` with local id 1; each rank
writes OUT/rank<R>.json (its identity as the guard made it, and what it saw).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import netns_ranks  # this folder's siblings (the script's folder is on sys.path)
import torch.distributed as dist

from gpumon.guard import deterministic, identity


def main() -> None:
    out, bad_node = Path(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.ERROR, format=f"rank {os.environ.get('RANK')}: %(message)s")
    deterministic(threads=1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    me = identity.identify(rank, world, "cpu")
    where: list[Any] = [None] * world
    dist.all_gather_object(where, (me.node_name, me.local_rank))
    bad = where.index((bad_node, 1))
    result: dict[str, Any] = {"rank": rank, "where": where, "bad": bad,
                              "identity": dataclasses.asdict(me), "nan": netns_ranks.nan(rank, bad, at=3)}
    netns_ranks.save(out / f"rank{rank}.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
