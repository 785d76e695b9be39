"""One rank of the verified-checkpoint tests (real DDP, gloo, CPU):
``python ckpt_ranks.py RANK WORLD PORT OUT SCENARIOS``.

The weight fault is made here, outside the guard's code: one bit of one rank's parameter flipped
in place after ``optimizer.step()``. Each rank writes what it saw to OUT/ckpt-rank<R>.json.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard import Guard, GuardAlarm, save_checkpoint, weights_fingerprint


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(net)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(model: DDP, guard: Guard, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    guard.step()


def flip_bit(model: DDP, param: int = 2, element: int = 5, bit: int = 3) -> str:
    """Flip one low mantissa bit of one element of one parameter, in place: finite, wrong."""
    name, p = list(model.module.named_parameters())[param]
    with torch.no_grad():
        p.view(-1).view(torch.int32)[element] ^= 1 << bit
    return name


def run(rank: int, out: Path, name: str, bad: int | None, saves: list[int], flip_at: int | None,
        on_alarm: str = "raise", off: bool = False) -> dict[str, Any]:
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0, on_alarm=on_alarm, timeout_s=30,
                  spool_dir=out / f"spool-{name}-r{rank}")
    if off:  # as after an internal error of the guard (a timeout of its group, say)
        guard.disabled = "the weight check: RuntimeError: made up by the test"
    ckdir = out / name
    result: dict[str, Any] = {"saves": [], "alarms": []}
    for step in range(max(saves) + 1):
        if step in saves:
            path = ckdir / f"step_{guard.steps}.pt"
            try:
                att = save_checkpoint(guard, {"model": model.module.state_dict(), "step": guard.steps},
                                      path)
                result["saves"].append(att.to_json())
            except GuardAlarm as a:
                result["alarms"].append({"step": guard.steps, "ranks": a.ranks, "exit_code": a.exit_code})
                result["saves"].append({"raised": True, "exists": path.exists()})
        if step == max(saves):
            break
        train_step(model, guard, rank, step)
        if flip_at is not None and step == flip_at and rank == bad:
            result["flipped"] = flip_bit(model)
    result["fingerprint"] = weights_fingerprint(model.module)
    return result


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    logging.basicConfig(level=logging.CRITICAL)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for name in sys.argv[5].split(","):
        if name == "healthy":  # saves at 3 and 6 steps, verified
            result[name] = run(rank, out, name, None, [3, 6], None)
        elif name == "flip1":  # rank 1's weights flipped in step 7; the save at 9 is not verified
            result[name] = run(rank, out, name, 1, [3, 6, 9], 7)
        elif name == "flip0":  # rank 0 itself is the suspect: the majority's rank saves
            result[name] = run(rank, out, name, 0, [2], 1, on_alarm="skip")
        elif name == "off":  # the guard is off: saved, attested unchecked, never a resume point
            result[name] = run(rank, out, name, None, [2], None, off=True)
    (out / f"ckpt-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
