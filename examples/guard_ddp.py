"""A small model trained with DDP under gpumon's in-job SDC guard, with verified checkpoints.

    torchrun --standalone --nproc_per_node 3 examples/guard_ddp.py --steps 200
    torchrun --standalone --nproc_per_node 3 examples/guard_ddp.py --steps 200 --demo-fault nan
    torchrun --standalone --nproc_per_node 3 examples/guard_ddp.py --steps 200 --demo-fault weight-flip
    gpumon guard checkpoints guard-demo/ckpt --verdicts guard-demo/spool

The model is a 3-layer MLP classifier; the data a deterministic synthetic set (a fixed random
teacher labels seeded Gaussian inputs) in a ``TensorDataset``, sharded by a seeded
``DistributedSampler``: every rank's micro-batch of every step is reproducible. The guard checks
every step's gradients for NaN/Inf before and after the all-reduce (check 1), the replicas' weight
fingerprints every ``--weight-check-every`` steps (check 3), and every ``--ckpt-every`` steps
``save_checkpoint`` writes a checkpoint and its attestation.

``--demo-fault`` uses gpumon's SDC fault harness (``gpumon.sdc.inject``) from outside the guard:

- ``nan``: the last rank's forward at ``--fault-step`` gets one exponent bit flipped in one output
  of a matmul (a value in [1, 2) becomes Inf, its gradients NaN). The guard names that rank before
  the update; no rank applies it; every rank exits 16 (torchrun may stop a rank still on its way
  out with SIGTERM once the first has exited; every verdict is written before any rank leaves).
- ``weight-flip``: rank 1's ``optimizer.step()`` at ``--fault-step`` gets one low mantissa bit of
  one updated weight flipped (finite, wrong). The next weight check names rank 1 and the parameter;
  every rank exits 16 (or SIGTERM from torchrun, as above).

Each rank that is named writes its verdict file into the node's guard spool (``$GPUMON_GUARD_DIR``,
else ``OUT/spool`` here; on a node with gpumon's daemon it is /var/lib/gpumon/guard, which the daemon
reads) and logs its path (``gpumon.guard: rank R: verdict written for this node's daemon: PATH``)
before any rank leaves the alarm. Rank 0 prints the alarm and the command that names the
checkpoint to resume from. Runs on CPU (gloo) or, when torch sees CUDA, one GPU per rank (NCCL).

Defaults scale with ``--steps``: a weight check and a checkpoint every ``steps // 4`` steps, the
fault at ``steps * 0.55`` (with 200 steps: checks and checkpoints at 50, 100, 150, 200, the fault
at step 110; resume from 100).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpumon.guard import Guard, GuardAlarm, save_checkpoint
from gpumon.sdc.inject import FaultInjector, FaultSpec

# the harness's fault specs (gpumon/sdc/inject.py): which kernels, which bits, how many flips
NAN_SPEC = "dtype=fp32,ops=addmm,range=1:1.99,bits=30:30,max_flips=1"  # bit 30: [1, 2) -> Inf
FLIP_SPEC = "dtype=fp32,ops=add_,bits=0:3,max_flips=1"  # SGD's in-place update: a low mantissa bit


def dataset(n: int = 4096, features: int = 32, classes: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def model(features: int = 32, classes: int = 8) -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights (DDP also broadcasts them)
    return nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, classes))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="micro-batch per rank")
    ap.add_argument("--weight-check-every", type=int, metavar="N", help="default: steps // 4")
    ap.add_argument("--ckpt-every", type=int, metavar="K", help="default: steps // 4")
    ap.add_argument("--out", type=Path, default=Path("guard-demo"),
                    help="checkpoints in OUT/ckpt, verdicts in OUT/spool unless $GPUMON_GUARD_DIR says")
    ap.add_argument("--demo-fault", choices=("nan", "weight-flip"))
    ap.add_argument("--fault-step", type=int, help="the step the fault hits (default: steps * 0.55)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return ap.parse_args()


def main() -> int:
    args = parse()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(1)  # several ranks share this machine's cores
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    spool = Path(os.environ.get("GPUMON_GUARD_DIR") or args.out / "spool")
    ckpt_dir = args.out / "ckpt"
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.55)
    every = max(args.steps // 4, 1)
    check_every = args.weight_check_every if args.weight_check_every is not None else every
    ckpt_every = args.ckpt_every if args.ckpt_every is not None else every

    net = DDP(model().to(device), device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    guard = Guard(net, opt, weight_check_every=check_every, spool_dir=spool)

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    per_epoch = len(sampler) // args.batch
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    try:
        while step < args.steps:
            sampler.set_epoch(step // per_epoch)  # a new, seeded order every epoch, the same on every rank
            for x, y in DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True):
                if step >= args.steps:
                    break
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                fault = args.demo_fault if step == fault_step else None
                if fault == "nan" and rank == world - 1:
                    with FaultInjector(FaultSpec.parse(f"worker={rank},{NAN_SPEC}")):
                        loss = loss_fn(net(x), y)
                else:
                    loss = loss_fn(net(x), y)
                loss.backward()
                if fault == "weight-flip" and rank == 1:
                    if guard.before_step():
                        with FaultInjector(FaultSpec.parse(f"worker={rank},{FLIP_SPEC}")):
                            opt.step()
                    guard.after_step()
                else:
                    guard.step()  # before_step, optimizer.step() unless an alarm stopped it, after_step
                step += 1
                if rank == 0 and step % 50 == 0:
                    print(f"step {step}: loss {loss.item():.4f}", flush=True)
                if step % ckpt_every == 0:
                    state = {"model": net.module.state_dict(), "optimizer": opt.state_dict(), "step": step}
                    att = save_checkpoint(guard, state, ckpt_dir / f"step_{step}.pt")
                    if rank == 0:
                        print(f"checkpoint step {step}: {att.verdict}", flush=True)
    except GuardAlarm as alarm:
        code = on_alarm(alarm, rank, args.out, spool)
    else:
        code = 0
        if rank == 0:
            print(f"done: {step} steps, no alarm; checkpoints in {ckpt_dir}", flush=True)
    # The end, alarm or not: the guard first (its collectives done, its own groups destroyed), then
    # the job's groups; then a normal exit, so that the job's own atexit handlers and buffered
    # writers still run (the ranks left the alarm together: every verdict is written).
    guard.close()
    dist.destroy_process_group()
    return code


def on_alarm(alarm: GuardAlarm, rank: int, out: Path, spool: Path) -> int:
    """What a training job does with an alarm: say it, and return the exit code a launcher reads
    (16: requeue from the last verified checkpoint without the named node)."""
    if rank == 0:
        print(f"GUARD ALARM: {alarm}", flush=True)
        print(f"ranks named: {alarm.ranks}; update skipped: {alarm.skipped}; exit code {alarm.exit_code}",
              flush=True)
        print(f"resume from: gpumon guard checkpoints {out / 'ckpt'} --verdicts {spool}", flush=True)
    return alarm.exit_code


if __name__ == "__main__":
    sys.exit(main())
