"""One rank of the audit's and the reruns' real-DDP tests (gloo, CPU):
``python audit_ranks.py RANK WORLD PORT OUT SCENARIOS``.

Like ``ddp_ranks.py``: scenarios one after another in one process group, each with a Guard of its
own; each rank writes what it saw to OUT/rank<R>.json. Faults come from outside the guard: the SDC
fault harness (gpumon.sdc.inject) entered by this file's ``loss_fn`` (around the forward) or
``backward`` (around the backward), the two functions the training loop and the guard both call.
A fresh FaultInjector per computation flips the same bits of the same computation every time (a
persistent fault); one only in the loop's own computation is an intermittent one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard import AuditError, Guard, GuardAlarm, deterministic
from gpumon.sdc.inject import FaultInjector, FaultSpec

Batch = dict[str, torch.Tensor]


class Faults:
    """Where this rank's faults are injected: ``forward``/``backward`` say, per computation, whether
    to enter a FaultInjector (None: no fault). ``live``: the loop's own computation is running."""

    forward: Callable[[], FaultInjector | None] = staticmethod(lambda: None)
    backward: Callable[[], FaultInjector | None] = staticmethod(lambda: None)
    live = False


def make_net(hidden: int = 32, dropout: float = 0.1) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(hidden, 4))


def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    inj = Faults.forward()
    if inj is None:
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    with inj:
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def backward(loss: torch.Tensor) -> None:
    inj = Faults.backward()
    if inj is None:
        loss.backward()  # type: ignore[no-untyped-call]
        return
    with inj:
        loss.backward()  # type: ignore[no-untyped-call]


def batch_for(rank: int, step: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(8, 16, generator=g) * 2, "y": torch.randn(8, 4, generator=g)}


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(make_net())
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def weights(model: DDP) -> list[str]:
    return [t.detach().numpy().tobytes().hex() for t in model.module.state_dict().values()]


def alarm_json(a: GuardAlarm) -> dict[str, Any]:
    return {"ranks": a.ranks, "exit_code": a.exit_code, "skipped": a.skipped,
            "verdicts": [v.to_json() for v in a.verdicts]}


def guard_for(model: DDP, opt: torch.optim.Optimizer, out: Path, name: str, rank: int,
              bf: Callable[[int, int], Batch] = batch_for, **kw: Any) -> Guard:
    kw.setdefault("weight_check_every", 0)
    return Guard(model, opt, spool_dir=out / f"spool-{name}-r{rank}", timeout_s=20,
                 batch_for=bf, loss_fn=loss_fn, backward=backward, seed=7, model_factory=make_net,
                 model_kwargs={"hidden": 32}, **kw)


def train(guard: Guard, model: DDP, opt: torch.optim.Optimizer, rank: int, steps: int,
          bf: Callable[[int, int], Batch] = batch_for, set_to_none: bool = True,
          after: Callable[[int], None] | None = None) -> dict[str, Any]:
    alarms = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        batch = bf(rank, step)
        guard.seed_step()
        Faults.live = True
        try:
            loss = loss_fn(model, batch)
            backward(loss)
        finally:
            Faults.live = False
        before = weights(model)
        try:
            applied = guard.step(loss, batch)
        except GuardAlarm as a:
            alarms.append({"step": step, "unchanged": weights(model) == before, "left_ns": time.time_ns(),
                           **alarm_json(a)})
            applied = False
        del applied
        if after is not None:
            after(step)
    return {"alarms": alarms, "disabled": guard.disabled, "steps": guard.steps, "audits": guard.audits,
            "files": sorted(str(p) for p in guard.verdict_files),
            "written_ns": [os.stat(p).st_mtime_ns for p in guard.verdict_files],
            "bundles": sorted(str(p) for p in guard.bundles), "final": weights(model)}


def reset() -> None:
    Faults.forward = staticmethod(lambda: None)  # type: ignore[assignment]
    Faults.backward = staticmethod(lambda: None)  # type: ignore[assignment]


# a low mantissa bit of one element of one backward matmul's output: finite, wrong
LOW_BIT = "dtype=fp32,ops=mm,bits=0:2,max_flips=1,seed=3"
# the top exponent bit of a forward matmul output in [1, 2): Inf/NaN
NAN = "dtype=fp32,ops=addmm,range=1:1.99,bits=30:30,max_flips=1"


def audit_fault(rank: int, out: Path, bad: int, at: int, persistent: bool, name: str) -> dict[str, Any]:
    model, opt = build()
    guard = guard_for(model, opt, out, name, rank, audit_every=at)
    spec = FaultSpec.parse(f"worker={bad},{LOW_BIT}")
    injected: list[int] = []

    def maybe() -> FaultInjector | None:
        if rank != bad or guard.steps != at or not (persistent or Faults.live):
            return None
        injected.append(guard.steps)
        return FaultInjector(spec)  # fresh: the same flips in the same computation every time

    Faults.backward = staticmethod(maybe)  # type: ignore[assignment]
    try:
        result = train(guard, model, opt, rank, at + 2)
    finally:
        reset()
    result["injected"] = len(injected)
    return result


def nan_fault(rank: int, out: Path, bad: int, at: int, kind: str) -> dict[str, Any]:
    calls: list[int] = []

    def bf(r: int, step: int) -> Batch:
        b = batch_for(r, step)
        if kind == "application" and (r, step) == (bad, at):
            b["x"][0, 0] = float("inf")  # the data itself: NaN on any GPU
        if kind == "rerun-fails" and (r, step) == (bad, at):
            calls.append(step)
            if len(calls) > (1 if rank == bad else 0):  # the loop's own call works, a rebuild does not
                raise OSError("the data set's shard is gone")
        return b

    model, opt = build()
    guard = guard_for(model, opt, out, f"nan-{kind}", rank, bf=bf)  # audit off: check 1 and its reruns
    spec = FaultSpec.parse(f"worker={bad},{NAN}")

    def maybe() -> FaultInjector | None:
        if kind == "application" or rank != bad or guard.steps != at:
            return None
        return FaultInjector(spec) if (kind == "persistent" or Faults.live) else None  # rerun-fails: live

    Faults.forward = staticmethod(maybe)  # type: ignore[assignment]
    try:
        return train(guard, model, opt, rank, at + 2, bf=bf)
    finally:
        reset()


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """One bit of ``t``'s first element flipped in place (fp32), as a memory fault would."""
    with torch.no_grad():
        t.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)


# (audit_every, weight_check_every) of the optimizer-state scenarios: the weight check never, later
# than the audit, and at a period that is not a multiple of the audit's
DIVERGED = {"diverged-w0": (3, 0), "diverged-w5": (3, 5), "diverged-a2w3": (2, 3)}


def diverged(rank: int, out: Path, name: str, bad: int) -> dict[str, Any]:
    """A mantissa bit flips in rank ``bad``'s optimizer state (SGD's momentum of the first weight)
    after step 1: step 2's update leaves its replica's weights different from the others', on a GPU
    that computes correctly. Every alarm must be check 3's (the replica by majority, ``unknown``),
    never the audit's: the audit recomputing that rank's step from other weights would disagree on
    every GPU of the dispute and call its GPU persistent."""
    audit_every, weight_every = DIVERGED[name]
    torch.manual_seed(0)
    model = DDP(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = guard_for(model, opt, out, name, rank, audit_every=audit_every, weight_check_every=weight_every)
    first = next(iter(model.parameters()))

    def corrupt(step: int) -> None:
        if rank == bad and step == 1:
            flip_bit(opt.state[first]["momentum_buffer"], 20)

    return train(guard, model, opt, rank, 6, after=corrupt)


def nan_diverged(rank: int, out: Path, bad: int) -> dict[str, Any]:
    """Rank ``bad``'s weight storage gets one element of the last layer at 3e38 after step 1: its own
    forward overflows at step 2 (check 1: non-finite local gradients). Its rerun on its own GPU
    overflows again and a GPU of another node computes finite gradients from ITS weights, which
    would read as a persistent GPU fault; the weights are compared first and differ."""
    model, opt = build()
    guard = guard_for(model, opt, out, "nan-diverged", rank)  # audit off: check 1 and its reruns

    def corrupt(step: int) -> None:
        if rank == bad and step == 1:
            with torch.no_grad():
                model.module[3].weight.view(-1)[0] = 3e38

    return train(guard, model, opt, rank, 4, after=corrupt)


def healthy(rank: int, out: Path, steps: int, every: int) -> dict[str, Any]:
    model, opt = build()
    guard = guard_for(model, opt, out, "healthy", rank, audit_every=every)
    t0 = time.monotonic()
    # zero_grad(set_to_none=False): the loop's gradients accumulate into zeros, the audit's are fresh
    result = train(guard, model, opt, rank, steps, set_to_none=False)
    result["seconds"] = time.monotonic() - t0
    return result


def unseeded(rank: int, out: Path) -> dict[str, Any]:
    """The loop forgets guard.seed_step(): its dropout masks are not the ones the audit replays."""
    model, opt = build()
    guard = guard_for(model, opt, out, "unseeded", rank, audit_every=4)
    torch.manual_seed(100 + rank)
    batch = batch_for(rank, 0)
    loss = loss_fn(model, batch)
    backward(loss)
    try:
        guard.step(loss, batch)
    except GuardAlarm as a:
        return {"alarm": alarm_json(a), "files": sorted(str(p) for p in guard.verdict_files)}
    return {"alarm": None}


def refuse(rank: int, out: Path) -> dict[str, Any]:
    model, opt = build()
    torch._C._set_deterministic_algorithms(False, warn_only=False)  # as a loop that never asked
    try:
        guard_for(model, opt, out, "refuse", rank, audit_every=10)
    except AuditError as exc:
        return {"error": str(exc)}
    finally:
        deterministic()
    return {"error": None}


def shape(rank: int, out: Path) -> dict[str, Any]:
    """batch_for depends on who calls it (a sampler built for the calling rank): rank 1 rebuilds
    rank 2's micro-batch with 6 samples instead of 8."""
    def bf(r: int, step: int) -> Batch:
        b = batch_for(r, step)
        return {k: v[:6] for k, v in b.items()} if (rank, r) == (1, 2) else b

    model, opt = build()
    guard = guard_for(model, opt, out, "shape", rank, bf=bf, audit_every=3)
    try:
        train(guard, model, opt, rank, 2, bf=bf)
    except AuditError as exc:
        return {"error": str(exc), "steps": guard.steps}
    return {"error": None}


def contents(rank: int, out: Path) -> dict[str, Any]:
    """Rank 0 rebuilds rank 1's micro-batch with the right shape and other numbers (a sampler that
    shuffles with the calling rank's seed)."""
    def bf(r: int, step: int) -> Batch:
        return batch_for(r, step + 50) if (rank, r) == (0, 1) else batch_for(r, step)

    model, opt = build()
    guard = guard_for(model, opt, out, "contents", rank, bf=bf, audit_every=3)
    try:
        train(guard, model, opt, rank, 2, bf=bf)
    except AuditError as exc:
        return {"error": str(exc), "steps": guard.steps}
    return {"error": None}


def later_shape(rank: int, out: Path) -> dict[str, Any]:
    """The micro-batches rebuild right at step 0's audit and not at step 3's (rank 1 rebuilds rank
    2's with 6 samples from then on: one shard of the data read differently): not a setup mistake,
    so no AuditError into the training loop; the audit goes off and the run goes on."""
    def bf(r: int, step: int) -> Batch:
        b = batch_for(r, step)
        return {k: v[:6] for k, v in b.items()} if (rank, r, step >= 3) == (1, 2, True) else b

    model, opt = build()
    guard = guard_for(model, opt, out, "later-shape", rank, bf=bf, audit_every=3)
    return {**train(guard, model, opt, rank, 7, bf=bf), "audit_off": guard.audit_off}


def dies(rank: int, world: int, out: Path, at: int, result: dict[str, Any]) -> None:
    """Rank 1's own backward at audit step ``at`` is wrong (one low bit, once), and rank 2 exits
    while it settles that disagreement (called on to compute rank 1's micro-batch). The others must
    come back within the guard's timeout, skip the update (the gradients are disputed), name both
    GPUs of the dispute ``unknown``, switch the guard off and report it. Last of a launch: the
    default group has lost a rank, so every rank writes its results and exits here."""
    dying = world - 1
    spec = FaultSpec.parse(f"worker=1,{LOW_BIT}")

    def bf(r: int, step: int) -> Batch:
        if rank == dying and step == at and r == 1:
            result["dies"] = {"died_at": step}
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            os._exit(0)
        return batch_for(r, step)

    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0, spool_dir=out / f"spool-die-r{rank}", timeout_s=3,
                  batch_for=bf, loss_fn=loss_fn, backward=backward, audit_every=at)
    Faults.backward = staticmethod(  # type: ignore[assignment]
        lambda: FaultInjector(spec) if (rank, guard.steps, Faults.live) == (1, at, True) else None)
    before = weights(model)
    t0 = 0.0
    alarm = None
    for step in range(at + 1):
        opt.zero_grad()
        batch = batch_for(rank, step)
        guard.seed_step()
        Faults.live = True
        loss = loss_fn(model, batch)
        backward(loss)
        Faults.live = False
        if step == at:
            before, t0 = weights(model), time.monotonic()
        try:
            guard.step(loss, batch)
        except GuardAlarm as a:
            alarm = alarm_json(a)
    result["dies"] = {"disabled": guard.disabled, "steps": guard.steps, "seconds": time.monotonic() - t0,
                      "unchanged": weights(model) == before, "audits": guard.audits, "alarm": alarm}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no teardown collective can finish without the dead rank


SCENARIOS = ("audit-healthy", "transient", "persistent", "nan-transient", "nan-persistent", "nan-application",
             "nan-rerun-fails", "nan-diverged", *DIVERGED, "unseeded", "refuse", "shape", "contents",
             "later-shape", "dies")


def run(name: str, rank: int, world: int, out: Path, result: dict[str, Any]) -> None:
    """One scenario of this file into ``result`` (``ddp_ranks.py`` hands its launch's names here)."""
    t0 = time.monotonic()
    if name == "audit-healthy":
        result[name] = healthy(rank, out, int(os.environ.get("GUARD_AUDIT_STEPS", "200")), every=5)
    elif name == "transient":
        result[name] = audit_fault(rank, out, bad=1, at=5, persistent=False, name=name)
    elif name == "persistent":
        result[name] = audit_fault(rank, out, bad=1, at=5, persistent=True, name=name)
    elif name in DIVERGED:
        result[name] = diverged(rank, out, name, bad=1)
    elif name == "nan-diverged":
        result[name] = nan_diverged(rank, out, bad=world - 1)
    elif name.startswith("nan-"):
        result[name] = nan_fault(rank, out, bad=world - 1, at=3, kind=name.removeprefix("nan-"))
    elif name == "refuse":
        result[name] = refuse(rank, out)
    elif name == "unseeded":
        result[name] = unseeded(rank, out)
    elif name == "shape":
        result[name] = shape(rank, out)
    elif name == "contents":
        result[name] = contents(rank, out)
    elif name == "later-shape":
        result[name] = later_shape(rank, out)
    elif name == "dies":
        dies(rank, world, out, 2, result)
    else:
        raise SystemExit(f"unknown scenario {name!r}")
    result[name]["wall_s"] = time.monotonic() - t0


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    logging.basicConfig(level=logging.ERROR, format=f"rank {rank}: %(message)s")
    deterministic(threads=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for name in sys.argv[5].split(","):
        run(name, rank, world, out, result)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
