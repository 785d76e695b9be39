"""One rank of the guard's straggler tests (gloo, CPU): ``python pace_ranks.py RANK WORLD PORT OUT``.

Scenarios, one after another in one process group, each with a Guard of its own:

- ``healthy``: every rank the same work, 12 windows of 8 steps;
- ``load``: rank 1 trains on micro-batches twice the others' (its step is slower because it does more);
- ``slow``: rank 2 moves itself from its own CPU cgroup under ``$PACE_CGROUP`` (half a CPU, like
  every rank's) into the ``slow`` one (20 %, a CFS quota the test set: a real limit on its CPU,
  outside the guard) for the scenario, then back;
- ``intermittent``: rank 2's forward takes ``SLOW_S`` longer on every third step only (a forward
  hook of the loop's that sleeps: its median step is the others', the job waits for it on a third
  of its steps). A sleep, not the cgroup: a quota switched per step slowed those steps only ~1.7x.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import cpu_cgroup  # this folder's sibling (the script's folder is on sys.path)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard import Guard, Verdict

WINDOW, OF_LAST, NEED = 8, 3, 2
BATCH = 864
# the intermittent scenario's extra time on a slow step: ~3x a step's own compute at half a CPU
# (pace ~0.55). At ~2x (60 ms, pace ~0.65) a CI run beside a CPU hog read it at 0.74 and 0.89: the
# healthy ranks' own steps varied by a quarter, and the median rank, the reference, was the slow one
SLOW_S = 0.1
LOAD = 2  # the load scenario's rank trains on LOAD x BATCH: pace ~0.5 per step, ~1 per unit of work


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # ~15 ms of CPU per step on one thread (2-core VM): ~15 of the cgroups' 2 ms periods at half a CPU,
    # so a quota slows every step evenly rather than a few by a whole period (cpu_cgroup.py)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
    model = DDP(net)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def run(rank: int, out: Path, name: str, windows: int, batch_of: dict[int, int],
        own_spool: bool = True, slow_every: int = 0) -> dict[str, Any]:
    """``own_spool``: the scenario's verdicts in a folder of their own under OUT; else in the
    guard's default spool (``$GPUMON_GUARD_DIR``: on a test host, the one its daemon reads)."""
    model, opt = build()
    named: list[list[Verdict]] = []
    spool = out / f"spool-{name}-r{rank}" if own_spool else None
    guard = Guard(model, opt, weight_check_every=0, spool_dir=spool,
                  pace_window=WINDOW, pace_of_last=OF_LAST, pace_need=NEED, on_straggler=named.append)
    if slow_every:
        def slow(*_: Any) -> None:
            if guard.steps % slow_every == 0:
                time.sleep(SLOW_S)

        model.module.register_forward_hook(slow)  # after the guard's: inside the step's compute
    n = batch_of.get(rank, BATCH)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(n, 256, generator=g), torch.randn(n, 256, generator=g)
    history = []
    t0 = time.monotonic()
    for _ in range(WINDOW * windows):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss, (x, y))
        if guard.pace is not None and guard.pace.windows and guard.steps % WINDOW == 0:
            w = guard.pace.windows[-1]
            history.append({"named": w.named, "load": w.load, "pace": [s.pace for s in w.scores],
                            "per_work": [s.pace_per_work for s in w.scores]})
    return {"windows": history, "named": [[v.to_json() for v in vs] for vs in named],
            "files": [str(p) for p in guard.verdict_files], "disabled": guard.disabled,
            "seconds": round(time.monotonic() - t0, 2)}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
    torch.set_num_threads(1)
    cgroups = Path(os.environ["PACE_CGROUP"])
    cpu_cgroup.join(cgroups / f"r{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    result["healthy"] = run(rank, out, "healthy", 12, {})
    result["load"] = run(rank, out, "load", 6, {1: BATCH * LOAD})
    if rank == 2:
        cpu_cgroup.join(cgroups / "slow")
    try:
        result["slow"] = run(rank, out, "slow", 6, {})
    finally:
        if rank == 2:
            cpu_cgroup.join(cgroups / f"r{rank}")
    result["intermittent"] = run(rank, out, "intermittent", 6, {}, slow_every=3 if rank == 2 else 0)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
