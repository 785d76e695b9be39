"""One rank of the guard's multi-node tests (test_guard_netns.py), started by torchrun on a test host
in a network namespace: ``torchrun ... netns_ranks.py OUT SCENARIOS``.

Every host is its own node: its own network stack and host name (a UTS namespace), ``NODE_NAME`` as
Kubernetes' downward API sets it, its own guard spool (``$GPUMON_GUARD_DIR``, the one its gpumon
daemon reads) and its own simulated GPUs (the NVML injection library of that host's simulated node,
``LD_LIBRARY_PATH`` and ``$GPUMON_NVML_INJECT_STATE``). Which rank runs on which host is the
rendezvous' choice: the faults are placed by host (``GUARD_FAULT_HOSTS``), every rank learns the
others' hosts first.

Faults come from outside the guard: the SDC fault harness (gpumon.sdc.inject) entered by
``audit_ranks.loss_fn``/``backward`` (the functions the loop and the guard both call) or around one
rank's ``optimizer.step()``; the rank that dies during an audit is killed by the test (SIGKILL from
outside, see ``dies``); the straggler is slowed by a CPU quota (a cgroup, see ``pace``). Each rank
writes what it saw to OUT/rank<R>.json after every scenario.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import audit_ranks  # this folder's siblings (the script's folder is on sys.path)
import cpu_cgroup
import ddp_ranks
import pace_ranks
import torch
import torch.distributed as dist
from audit_ranks import LOW_BIT, NAN, Faults, batch_for, loss_fn, make_net
from torch.nn.parallel import DistributedDataParallel as DDP

import gpumon.guard.core
from gpumon.guard import Guard, GuardAlarm, deterministic, identity, save_checkpoint
from gpumon.guard.verdict import Identity
from gpumon.sdc.inject import FaultInjector, FaultSpec

# SGD's in-place update of one parameter: a low mantissa bit of one updated weight (finite, wrong)
FLIP = "dtype=fp32,ops=add_,bits=0:3,max_flips=1"


def save(path: Path, result: dict[str, Any]) -> None:
    """Atomically: the test reads these files while the ranks run."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def posed_identify(rank: int, world: int, device: Any) -> Identity:
    """The guard's ``identify`` for a CPU rank posing as the GPU ``$GUARD_POSED_GPU_UUID`` of its
    host (there is no CUDA here to report a device's UUID): everything else is the real
    ``identify`` (host name, NODE_NAME, LOCAL_RANK), and the GPU is named by the real
    ``resolve_gpu``, through NVML (this host's simulated node) by UUID, as for a CUDA device."""
    real = identity.identify(rank, world, device)
    gpu = identity.resolve_gpu(os.environ["GUARD_POSED_GPU_UUID"])
    return dataclasses.replace(real, gpu_uuid=gpu.uuid, gpu_pci_bus_id=gpu.pci_bus_id, gpu_index=gpu.index,
                               gpu_note=f"posed for {device} by the test: {gpu.note}")


def guard(model: DDP, opt: torch.optim.Optimizer, **kw: Any) -> Guard:
    # no spool_dir: the verdicts go to $GPUMON_GUARD_DIR, this host's daemon's spool
    opts: dict[str, Any] = {"weight_check_every": 0, "timeout_s": 20, "batch_for": batch_for,
                            "loss_fn": loss_fn, "backward": audit_ranks.backward, "seed": 7,
                            "model_factory": make_net, "model_kwargs": {"hidden": 32}, **kw}
    return Guard(model, opt, **opts)


def healthy(rank: int, steps: int) -> dict[str, Any]:
    """Every check on: the weights every 50 steps, the audit every 100, the reruns armed."""
    model, opt = audit_ranks.build()
    g = guard(model, opt, weight_check_every=50, audit_every=100)
    t0 = time.monotonic()
    result = audit_ranks.train(g, model, opt, rank, steps, set_to_none=False)
    report = g.check_weights()
    return {**result, "seconds": time.monotonic() - t0, "agree": report.agree if report else None,
            "identity": dataclasses.asdict(g.identity),
            "identities": [dataclasses.asdict(i) for i in g.identities]}


def nan(rank: int, bad: int, at: int) -> dict[str, Any]:
    """NaN in rank ``bad``'s forward at step ``at``, once (its live computation only)."""
    model, opt = audit_ranks.build()
    g = guard(model, opt)  # audit off: check 1, and its reruns (batch_for, loss_fn given)
    spec = FaultSpec.parse(f"worker={bad},{NAN}")
    injected: list[int] = []

    def maybe() -> FaultInjector | None:
        if rank != bad or g.steps != at or not Faults.live:
            return None
        injected.append(g.steps)
        return FaultInjector(spec)

    Faults.forward = staticmethod(maybe)  # type: ignore[assignment]
    try:
        result = audit_ranks.train(g, model, opt, rank, at + 2)
    finally:
        audit_ranks.reset()
    return {**result, "injected": len(injected)}


def audit(rank: int, bad: int, at: int) -> dict[str, Any]:
    """One low mantissa bit of one backward matmul output of rank ``bad`` at audit step ``at``, on
    every backward it runs at that step (a fresh harness each time: a persistent fault)."""
    model, opt = audit_ranks.build()
    g = guard(model, opt, audit_every=at)
    spec = FaultSpec.parse(f"worker={bad},{LOW_BIT}")
    injected: list[int] = []

    def maybe() -> FaultInjector | None:
        if rank != bad or g.steps != at:
            return None
        injected.append(g.steps)
        return FaultInjector(spec)

    Faults.backward = staticmethod(maybe)  # type: ignore[assignment]
    try:
        result = audit_ranks.train(g, model, opt, rank, at + 2)
    finally:
        audit_ranks.reset()
    return {**result, "injected": len(injected)}


def flip(rank: int, bad: int, at: int, saves: tuple[int, ...], ckpt: Path) -> dict[str, Any]:
    """Rank ``bad``'s ``optimizer.step()`` at step ``at`` gets one low bit of one updated weight
    flipped; a verified checkpoint is saved after every step in ``saves`` (the weight check runs
    before each save: that is where the flip is seen)."""
    model, opt = ddp_ranks.build()
    g = Guard(model, opt, weight_check_every=0, timeout_s=20)
    spec = FaultSpec.parse(f"worker={bad},{FLIP}")
    order = [n for n, _ in model.module.named_parameters()]
    result: dict[str, Any] = {"alarms": [], "saves": [], "order": order}
    for step in range(max(saves)):
        opt.zero_grad()
        ddp_ranks.forward_backward(model, rank, step)
        if g.before_step():
            if rank == bad and step == at:
                inj = FaultInjector(spec)
                with inj:
                    opt.step()
                result["flipped_call"] = inj.flips[0].call if inj.flips else None
            else:
                opt.step()
        g.after_step()
        if g.steps in saves:
            try:
                att = save_checkpoint(g, {"model": model.module.state_dict(), "step": g.steps},
                                      ckpt / f"step_{g.steps}.pt")
                result["saves"].append(att.to_json())
            except GuardAlarm as a:
                result["alarms"].append({"step": g.steps, **audit_ranks.alarm_json(a)})
                break
    result["files"] = sorted(str(p) for p in g.verdict_files)
    return result


def pace(rank: int, name: str, bad: int, out: Path) -> dict[str, Any]:
    """The straggler scenarios of pace_ranks.py across hosts, every rank capped at half a CPU in its
    host's cgroup under ``$GUARD_PACE_CGROUP`` (three ranks and three daemons share this machine's
    cores): ``load``, rank ``bad`` trains on micro-batches twice the others'; ``slow``, rank ``bad``
    runs in the ``slow`` cgroup (20 % of a CPU) for the scenario. Verdicts go to each host's spool."""
    groups = Path(os.environ["GUARD_PACE_CGROUP"])
    own = groups / os.environ["NODE_NAME"]
    cpu_cgroup.join(groups / "slow" if name == "slow" and rank == bad else own)
    try:
        batch_of = {bad: pace_ranks.BATCH * pace_ranks.LOAD} if name == "load" else {}
        return pace_ranks.run(rank, out, name, 6, batch_of, own_spool=False)
    finally:
        cpu_cgroup.join(own)


def dies(rank: int, victim: int, at: int, out: Path, result: dict[str, Any]) -> None:
    """Rank ``victim`` stops in the audit of step ``at`` while it rebuilds the micro-batch it audits
    (it says so in OUT/dying.json) and the test kills it there. The others must come back within
    the guard's timeout (3 s), log it and switch the guard off. Last of a launch: the default group
    has lost a rank; every survivor writes its results and exits."""
    def bf(r: int, step: int) -> audit_ranks.Batch:
        if rank == victim and step == at and r != rank:
            save(out / "rank-dying.json", {"rank": rank, "pid": os.getpid(), "step": step})
            while True:
                time.sleep(1)  # killed here
        return batch_for(r, step)

    model, opt = audit_ranks.build()
    g = guard(model, opt, batch_for=bf, audit_every=at, timeout_s=3)
    t0 = 0.0
    alarms = []
    for step in range(at + 1):
        opt.zero_grad()
        batch = bf(rank, step)
        g.seed_step()
        audit_ranks.backward(loss_fn(model, batch))
        if step == at:
            t0 = time.monotonic()
        try:
            g.step(None, batch)
        except GuardAlarm as a:
            alarms.append(audit_ranks.alarm_json(a))
    result["dies"] = {"disabled": g.disabled, "steps": g.steps, "audits": g.audits, "alarms": alarms,
                      "seconds": time.monotonic() - t0}
    save(out / f"rank{rank}.json", result)
    sys.stdout.flush()
    os._exit(0)  # no teardown collective can finish without the dead rank


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    logging.basicConfig(level=logging.ERROR, format=f"rank {os.environ.get('RANK')}: %(message)s")
    deterministic(threads=1)
    gpumon.guard.core.identify = posed_identify  # type: ignore[attr-defined]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, os.environ["NODE_NAME"])
    # scenario -> the host its fault is on -> the rank that runs there
    where = {k: nodes.index(v) for k, v in json.loads(os.environ["GUARD_FAULT_HOSTS"]).items()}
    result: dict[str, Any] = {"rank": rank, "nodes": nodes, "pid": os.getpid()}
    for name in scenarios:
        t0 = time.monotonic()
        if name == "healthy":
            result[name] = healthy(rank, int(os.environ.get("GUARD_HEALTHY_STEPS", "1000")))
        elif name == "nan":
            result[name] = nan(rank, where[name], at=3)
        elif name == "audit":
            result[name] = audit(rank, where[name], at=5)
        elif name == "flip":
            result[name] = flip(rank, where[name], at=7, saves=(3, 6, 9), ckpt=out / "ckpt")
        elif name in ("load", "slow"):
            result[name] = pace(rank, name, where[name], out)
        elif name == "dies":
            dies(rank, where[name], 2, out, result)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        result[name]["wall_s"] = time.monotonic() - t0
        save(out / f"rank{rank}.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
