"""Many short guarded DDP jobs, each ending as a user's script ends: ``exit_ranks.py OUT LAUNCHES WORLD
SCENARIO``; writes OUT/launches.json (per launch, per rank: its exit status and, if it did not exit
as the script said, the end of what it printed).

A rank's end is the interpreter's real exit (atexit handlers, module teardown, the C++ threads of
torch's and gloo's objects), which is where a guard that leaves a thread or a pending work behind
aborts the process (``terminate called without an active exception``, SIGABRT, exit 134). Starting
a fresh interpreter per rank costs seconds (importing torch), so this parent imports torch and the
guard once and forks each rank; a forked rank then leaves by raising SystemExit through the top of
this script, which is a normal interpreter exit (multiprocessing's workers would ``os._exit`` and
skip it). Nothing of torch runs in the parent before the forks: no thread exists to be forked.

Scenarios (every rank ends with ``dist.destroy_process_group()`` and a normal return, as
docs/guard/adopting.md tells users):
- ``alarm``: a NaN in rank 1's input at step 3 (once): check 1's alarm (GuardAlarm, exit 16 on
  every rank), the loop breaks out of it, the ranks leave;
- ``healthy``: 12 guarded steps with a weight check every 4, no alarm, exit 0;
- ``with``: ``alarm`` inside ``with Guard(...) as guard:`` (close() on the way out);
- ``rerun``: ``alarm`` with check 1's reruns and the failing step kept (``batch_for``, ``loss_fn``,
  ``model_factory``: audit_ranks.py's transient NaN);
- ``many``: twelve Guards on the same model, one after another, each for 12 healthy steps.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import audit_ranks  # this folder's sibling (the script's folder is on sys.path)
import torch
import torch._dynamo  # DDP's constructor imports it: 2 s a rank when each forked rank did
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard.audit import deterministic
from gpumon.guard.core import Guard, GuardAlarm

STEPS = 12
MANY = 12
NAN_AT = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(guard: Guard, model: DDP, opt: torch.optim.Optimizer, rank: int, scenario: str) -> int:
    for step in range(STEPS):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if scenario != "healthy" and (rank, step) == (1, NAN_AT):
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        try:
            guard.step(loss)
        except GuardAlarm as alarm:
            return alarm.exit_code
    return 0


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def rank_main(rank: int, world: int, port: int, out: Path, scenario: str) -> int:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, opt = build()
    kw: dict[str, Any] = {"weight_check_every": 4, "timeout_s": 60, "spool_dir": out / f"spool-r{rank}"}
    if scenario == "with":
        with Guard(model, opt, **kw) as guard:
            code = train(guard, model, opt, rank, scenario)
    elif scenario == "rerun":
        deterministic(threads=1)
        got = audit_ranks.nan_fault(rank, out, bad=world - 1, at=NAN_AT, kind="transient")
        code = max((a["exit_code"] for a in got["alarms"]), default=0)
    elif scenario == "many":
        # a Guard per phase of one job (as a test file runs scenarios): each with its own groups
        code = 0
        for _ in range(MANY):
            model, opt = build()
            code = max(code, train(Guard(model, opt, **kw), model, opt, rank, "healthy"))
    else:
        code = train(Guard(model, opt, **kw), model, opt, rank, scenario)
    dist.destroy_process_group()
    return code


def main() -> None:
    out, launches, world, scenario = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for launch in range(launches):
        port = _free_port()
        t0 = time.monotonic()
        kids: dict[int, int] = {}
        for rank in range(world):
            log = out / f"launch{launch}-rank{rank}.log"
            pid = os.fork()
            if pid == 0:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update({"NODE_NAME": f"node-{rank}", "LOCAL_RANK": "0"})
                # leaves through the top of the script: the interpreter's own exit
                raise SystemExit(rank_main(rank, world, port, out, scenario))
            kids[pid] = rank
        ranks: dict[int, dict[str, Any]] = {}
        for _ in range(world):
            pid, status = os.wait()
            rank = kids[pid]
            entry: dict[str, Any] = {"rank": rank}
            if os.WIFSIGNALED(status):
                entry["signal"] = os.WTERMSIG(status)
            else:
                entry["exit"] = os.WEXITSTATUS(status)
            text = (out / f"launch{launch}-rank{rank}.log").read_text(errors="replace")
            entry["aborted"] = "terminate called" in text or entry.get("signal") == 6
            if entry["aborted"] or entry.get("exit") not in (0, 16):
                entry["log"] = text[-3000:]
            ranks[rank] = entry
        results.append({"launch": launch, "seconds": round(time.monotonic() - t0, 3),
                        "ranks": [ranks[r] for r in range(world)]})
    (out / "launches.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
