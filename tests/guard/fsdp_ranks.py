"""One rank of the guard's real FSDP/HSDP tests (gloo, CPU): ``python fsdp_ranks.py RANK WORLD PORT OUT
SCENARIOS``. 6 ranks: HSDP as 3 replicas x 2 shards (and 2 x 3), FSDP1 HYBRID_SHARD and FSDP2
``fully_shard`` on a 2-D mesh, pure sharding on all 6. Faults come from outside the guard: the SDC
fault harness around one rank's forward, or one bit of one rank's local shard flipped here after
``optimizer.step()``. Each rank writes what it saw to OUT/rank<R>.json.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from gpumon.guard import GuardAlarm, ShardedGuard
from gpumon.sdc.inject import FaultInjector, FaultSpec


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)  # every replica starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def fsdp2(mesh: DeviceMesh) -> torch.nn.Module:
    model = net()
    for sub in model:
        if isinstance(sub, torch.nn.Linear):
            fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp1(mesh: DeviceMesh | None, strategy: ShardingStrategy) -> torch.nn.Module:
    # nested: one FlatParameter per Linear, so the guard's names need each one's module prefix;
    # use_orig_params=False: model.parameters() are the flat shards, the names only FSDP knows
    return FSDP(net(), device_mesh=mesh, sharding_strategy=strategy, use_orig_params=False,
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu"))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g) * 2, torch.randn(8, 4, generator=g)


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def shards(model: torch.nn.Module) -> list[str]:
    return [local(p).detach().numpy().tobytes().hex() for p in model.parameters()]


def alarm_json(a: GuardAlarm) -> dict[str, Any]:
    return {"ranks": a.ranks, "exit_code": a.exit_code, "skipped": a.skipped,
            "verdicts": [v.to_json() for v in a.verdicts]}


def flip_bit(p: torch.Tensor, index: int) -> None:
    """One low mantissa bit of element ``index`` of this rank's local shard of ``p``."""
    with torch.no_grad():
        words = local(p).detach().view(torch.int32).reshape(-1)
        words[index] ^= 1


def train(model: torch.nn.Module, rank: int, out: Path, name: str, steps: int, *, mesh: Any = None,
          nan_at: tuple[int, int] | None = None, flip: tuple[int, int, int, int] | None = None,
          every: int = 1) -> dict[str, Any]:
    """``nan_at`` (rank, step): that rank's forward goes non-finite; ``flip`` (rank, step, parameter
    index, element): one bit of that rank's local shard flipped after the step's update."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = ShardedGuard(model, opt, mesh=mesh, weight_check_every=every, timeout_s=30,
                         spool_dir=out / f"spool-{name}-r{rank}")
    res: dict[str, Any] = {"alarms": [], "checks": guard.checks, "place": guard.place.__dict__,
                           "reports": []}
    # bit 30 is the top exponent bit of fp32: a value in [1, 2) becomes Inf/NaN
    spec = FaultSpec.parse(f"worker={rank},dtype=fp32,ops=addmm,range=1:1.99,bits=30:30,max_flips=1")
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        inj = FaultInjector(spec) if nan_at == (rank, step) else None
        if inj is not None:
            with inj:
                loss = torch.nn.functional.mse_loss(model(x), y)
            res["flips"] = len(inj.flips)
        else:
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        before = shards(model)
        try:
            applied = guard.before_step()
        except GuardAlarm as a:
            res["alarms"].append({"step": step, **alarm_json(a)})
            applied = False
        if applied:
            opt.step()
        if nan_at is not None and step == nan_at[1]:
            res["applied_at"], res["unchanged_at"] = applied, shards(model) == before
        if flip is not None and (rank, step) == flip[:2]:
            flip_bit(list(model.parameters())[flip[2]], flip[3])
        try:
            guard.after_step()
        except GuardAlarm as a:
            res["alarms"].append({"step": step, **alarm_json(a)})
            break
        report = guard.check_weights() if every == 0 else None
        if report is not None:
            res["reports"].append({"applicable": report.applicable, "agree": report.agree,
                                   "reason": report.reason})
    res["files"] = sorted(str(p) for p in guard.verdict_files)
    res["disabled"], res["steps"] = guard.disabled, guard.steps
    res["final"] = shards(model)
    return res


def rank_main(rank: int, world: int, port: int, out: Path, scenarios: str, started: float) -> None:
    logging.basicConfig(level=logging.ERROR, format=f"rank {rank}: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    hsdp = init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard"))
    result: dict[str, Any] = {"seconds": {"start": time.monotonic() - started}}
    for name in scenarios.split(","):
        t0 = time.monotonic()
        if name == "fsdp2-healthy":
            result[name] = train(fsdp2(hsdp), rank, out, name, 12)
        elif name == "fsdp2-flip":  # rank 3: replica 1, shard 1; parameter 2 is "2.weight"
            result[name] = train(fsdp2(hsdp), rank, out, name, 5, flip=(3, 2, 2, 5))
        elif name == "fsdp2-nan":
            result[name] = train(fsdp2(hsdp), rank, out, name, 4, nan_at=(4, 2), every=0)
        elif name == "fsdp2-two":  # 2 replicas x 3 shards: rank 4 is replica 1, shard 1
            mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("replicate", "shard"))
            result[name] = train(fsdp2(mesh), rank, out, name, 4, mesh=mesh, flip=(4, 1, 0, 3))
        elif name == "fsdp2-full":  # one replica: 6 shards; a flipped bit there is invisible to it
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            result[name] = train(fsdp2(mesh), rank, out, name, 3, flip=(1, 1, 0, 0), every=0)
        elif name == "fsdp1-flip":
            # rank 2: replica 1, shard 0 of the module "2" flat parameter (2.weight 128 + 2.bias 4 =
            # 132 elements, 66 per shard); shard 1 (rank 3) holds elements 66..131: its local
            # element 64 is element 130, "2.bias"[2]
            result[name] = train(fsdp1(hsdp, ShardingStrategy.HYBRID_SHARD), rank, out, name, 4,
                                 flip=(3, 1, 1, 64))
        elif name == "fsdp1-nan":
            result[name] = train(fsdp1(hsdp, ShardingStrategy.HYBRID_SHARD), rank, out, name, 3,
                                 nan_at=(4, 1), every=0)
        elif name == "fsdp1-full":
            result[name] = train(fsdp1(None, ShardingStrategy.FULL_SHARD), rank, out, name, 2, every=0)
        result["seconds"][name] = time.monotonic() - t0
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    """``fsdp_ranks.py WORLD PORT OUT SCENARIOS``: torch is imported once, here, and every rank is
    a forked child process of its own (no torch thread runs before the fork: the first op runs in
    the child). Six ranks importing torch and FSDP each cost ~45 s of a busy 2-core machine."""
    world, port, out, scenarios = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    started = time.monotonic()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update({"NODE_NAME": f"node-{rank}", "LOCAL_RANK": "0"})
            code = 0
            try:
                rank_main(rank, world, port, out, scenarios, started)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    failed = []
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(rank)
            for other in children:  # the others would wait on it in a collective
                os.kill(other, signal.SIGKILL)
    if failed:
        sys.exit(f"ranks {sorted(failed)} failed")


if __name__ == "__main__":
    main()
