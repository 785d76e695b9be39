"""One rank of the tests of check 1 in mode ``"after"`` (gloo, CPU):
``python after_ranks.py RANK WORLD PORT OUT SCENARIOS``.

Like ``ddp_ranks.py``: scenarios one after another in one process group, each with a Guard of its
own (``nonfinite="after"``: no comm hook, one pass over the reduced gradients in ``before_step``);
each rank writes what it saw to OUT/rank<R>.json. Faults come from outside the guard: the SDC fault
harness (gpumon.sdc.inject) entered by ``audit_ranks.loss_fn``/``backward`` (the functions the loop
and the guard's reruns both call), a corrupting transport under DDP, a comm hook of the loop's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import audit_ranks  # this folder's siblings (the script's folder is on sys.path)
import ddp_ranks
import torch
import torch.distributed as dist
from audit_ranks import Batch, Faults, batch_for, loss_fn, make_net, weights
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard import Guard, GuardAlarm, deterministic
from gpumon.sdc.inject import FaultInjector, FaultSpec


def build(dropout: float = 0.1) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(make_net(dropout=dropout))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train(guard: Guard, model: DDP, opt: torch.optim.Optimizer, rank: int, steps: int, *,
          pass_loss: bool, at: int = -1, bf: Any = batch_for) -> dict[str, Any]:
    """``steps`` guarded steps (the loss handed to ``step`` when ``pass_loss``); at step ``at`` whether
    the update was applied and the weights stayed bit for bit."""
    alarms = []
    result: dict[str, Any] = {}
    for step in range(steps):
        opt.zero_grad()
        batch = bf(rank, step)
        guard.seed_step()
        Faults.live = True
        try:
            loss = loss_fn(model, batch)
            audit_ranks.backward(loss)
        finally:
            Faults.live = False
        before = weights(model)
        try:
            applied = guard.step(loss if pass_loss else None, batch)
        except GuardAlarm as a:
            alarms.append({"step": step, **audit_ranks.alarm_json(a)})
            applied = False
        if step == at:
            result["applied_at"], result["unchanged_at"] = applied, weights(model) == before
    return {**result, "alarms": alarms, "disabled": guard.disabled, "steps": guard.steps,
            "audits": guard.audits, "files": sorted(str(p) for p in guard.verdict_files),
            "bundles": sorted(str(p) for p in guard.bundles), "final": weights(model)}


def same_as_plain(rank: int, out: Path, steps: int = 8) -> dict[str, Any]:
    """Plain DDP and a guarded one (mode "after") side by side: DDP's own all-reduce is untouched,
    so the weights are the same bits after every step; no comm hook is registered."""
    plain, plain_opt = build(dropout=0.0)
    guarded, guarded_opt = build(dropout=0.0)
    guard = Guard(guarded, guarded_opt, weight_check_every=0, timeout_s=30, write_verdicts=False,
                  pace_window=0, nonfinite="after")
    equal = []
    for step in range(steps):
        for model, opt in ((plain, plain_opt), (guarded, guarded_opt)):
            opt.zero_grad()
            ddp_ranks.forward_backward(model, rank, step)
        plain_opt.step()
        guard.step()
        equal.append(weights(plain) == weights(guarded))
    hook = guarded._get_ddp_logging_data().get("comm_hook")  # set by register_comm_hook only
    return {"equal": equal, "alarms": guard.skipped_steps, "comm_hook": hook, "disabled": guard.disabled,
            "changed": weights(guarded) != weights(build(dropout=0.0)[0])}


NAN = f"worker={{bad}},{audit_ranks.NAN}"


def nan(rank: int, out: Path, name: str, bad: int, at: int, *, reruns: bool, pass_loss: bool,
        kind: str = "transient") -> dict[str, Any]:
    """NaN/Inf in rank ``bad``'s forward at step ``at``: ``transient`` (the loop's own computation
    only), ``persistent`` (every computation on rank ``bad``'s GPU: its reruns too), ``application``
    (the micro-batch itself holds an Inf: NaN on any GPU)."""
    def bf(r: int, step: int) -> Batch:
        b = batch_for(r, step)
        if kind == "application" and (r, step) == (bad, at):
            b["x"][0, 0] = float("inf")
        return b

    model, opt = build()
    extra: dict[str, Any] = {"batch_for": bf, "loss_fn": loss_fn, "backward": audit_ranks.backward,
                             "seed": 7} if reruns else {}
    guard = Guard(model, opt, weight_check_every=0, spool_dir=out / f"spool-{name}-r{rank}", timeout_s=20,
                  nonfinite="after", **extra)
    spec = FaultSpec.parse(NAN.format(bad=bad))
    injected: list[int] = []

    def maybe() -> FaultInjector | None:
        if kind == "application" or rank != bad or guard.steps != at:
            return None
        if kind == "persistent" or Faults.live:
            injected.append(guard.steps)
            return FaultInjector(spec)
        return None

    Faults.forward = staticmethod(maybe)  # type: ignore[assignment]
    try:  # the loop trains on bf's micro-batches: the poisoned one too
        got = train(guard, model, opt, rank, at + 2, pass_loss=pass_loss, at=at, bf=bf)
    finally:
        audit_ranks.reset()
    return {**got, "injected": len(injected)}


def reduce_fault(rank: int, out: Path, name: str, at: int, bad: int | None) -> dict[str, Any]:
    """DDP's own all-reduce, its result given a NaN on the way in at step ``at``, on rank ``bad``
    only or on every rank (None), by a corrupting transport under DDP (``ddp_ranks``)."""
    state = {"step": -1}
    torch.manual_seed(0)
    model = DDP(make_net(), process_group=ddp_ranks.CorruptingTransport(dist.new_group(backend="gloo"), state,
                                                                       at, bad))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, weight_check_every=2, timeout_s=4, spool_dir=out / f"spool-{name}-r{rank}",
                  nonfinite="after")
    return ddp_ranks.train_through(guard, rank, state, at, at + 3, {"alarms": [], "disabled": None})


def scrubbing_hook(rank: int, out: Path, at: int, bad: int) -> dict[str, Any]:
    """What mode "after" misses: the loop's own comm hook replaces non-finite values in the
    all-reduce's result (``nan_to_num``), and rank ``bad``'s local gradients are NaN at step ``at``.
    Mode "hook" flags the bucket before the loop's hook; mode "after" reads what the hook left."""
    said: dict[str, Any] = {}
    for mode in ("hook", "after"):
        def scrub(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return default_hooks.allreduce_hook(state, bucket).then(lambda f: torch.nan_to_num(f.value()))

        # DDP compares a hook's annotations with the real objects (this file's are strings)
        scrub.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}

        model, opt = build()
        guard = Guard(model, opt, weight_check_every=0, timeout_s=20, comm_hook=scrub, nonfinite=mode,
                      spool_dir=out / f"spool-scrub-{mode}-r{rank}")
        spec = FaultSpec.parse(NAN.format(bad=bad))

        def maybe(g: Guard = guard, s: FaultSpec = spec) -> FaultInjector | None:
            return FaultInjector(s) if (rank, g.steps, Faults.live) == (bad, at, True) else None

        Faults.forward = staticmethod(maybe)  # type: ignore[assignment]
        try:
            said[mode] = train(guard, model, opt, rank, at + 2, pass_loss=False, at=at)
        finally:
            audit_ranks.reset()
    return said


def audit_transient(rank: int, out: Path, bad: int, at: int) -> dict[str, Any]:
    """The audit in mode "after" (its own result taken by post-accumulate-grad hooks, no comm hook):
    a low mantissa bit of rank ``bad``'s own backward at audit step ``at``, once."""
    model, opt = build()
    guard = audit_ranks.guard_for(model, opt, out, "after-audit", rank, audit_every=at, nonfinite="after")
    spec = FaultSpec.parse(f"worker={bad},{audit_ranks.LOW_BIT}")
    Faults.backward = staticmethod(  # type: ignore[assignment]
        lambda: FaultInjector(spec) if (rank, guard.steps, Faults.live) == (bad, at, True) else None)
    try:
        got: dict[str, Any] = audit_ranks.train(guard, model, opt, rank, at + 2)
        return got
    finally:
        audit_ranks.reset()


def audit_healthy(rank: int, out: Path, steps: int, every: int) -> dict[str, Any]:
    model, opt = build()
    guard = audit_ranks.guard_for(model, opt, out, "after-audit-healthy", rank, audit_every=every,
                                  nonfinite="after")
    got: dict[str, Any] = audit_ranks.train(guard, model, opt, rank, steps, set_to_none=False)
    return got


def pace(rank: int, out: Path, slow: int, steps: int = 12, window: int = 4) -> dict[str, Any]:
    """The straggler scores in mode "after" (the end of each rank's backward marked by an autograd
    callback, before DDP waits for the others): rank ``slow``'s forward sleeps 30 ms every step,
    so it alone is slow; the others' waiting for it is not their compute."""
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0, timeout_s=20, write_verdicts=False, nonfinite="after",
                  pace_window=window, pace_of_last=2, pace_need=1)
    if rank == slow:
        model.module.register_forward_hook(lambda *_: time.sleep(0.03))  # after the guard's: in the step
    windows = []
    for step in range(steps):
        opt.zero_grad()
        ddp_ranks.forward_backward(model, rank, step)
        guard.step()
        if guard.pace is not None and guard.pace.windows and guard.steps % window == 0:
            w = guard.pace.windows[-1]
            windows.append({"named": w.named, "pace": [s.pace for s in w.scores],
                            "compute_ms": [s.compute_s * 1e3 for s in w.scores]})
    return {"windows": windows, "disabled": guard.disabled}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    logging.basicConfig(level=logging.CRITICAL, format=f"rank {rank}: %(message)s")
    deterministic(threads=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bad = world - 1
    result: dict[str, Any] = {}
    for name in sys.argv[5].split(","):
        t0 = time.monotonic()
        if name == "same-bits":
            result[name] = same_as_plain(rank, out)
        elif name == "nan-bare":
            result[name] = nan(rank, out, name, bad, 3, reruns=False, pass_loss=False)
        elif name == "nan-loss":
            result[name] = nan(rank, out, name, bad, 3, reruns=False, pass_loss=True)
        elif name == "nan-transient":
            result[name] = nan(rank, out, name, bad, 3, reruns=True, pass_loss=False)
        elif name == "nan-transient-loss":
            result[name] = nan(rank, out, name, bad, 3, reruns=True, pass_loss=True)
        elif name == "nan-persistent":
            result[name] = nan(rank, out, name, bad, 3, reruns=True, pass_loss=False, kind="persistent")
        elif name == "nan-application":
            result[name] = nan(rank, out, name, bad, 3, reruns=True, pass_loss=False, kind="application")
        elif name == "reduce-one":
            result[name] = reduce_fault(rank, out, name, at=2, bad=1)
        elif name == "reduce-all":
            result[name] = reduce_fault(rank, out, name, at=2, bad=None)
        elif name == "scrub":
            result[name] = scrubbing_hook(rank, out, at=2, bad=bad)
        elif name == "audit-transient":
            result[name] = audit_transient(rank, out, bad=1, at=4)
        elif name == "audit-healthy":
            result[name] = audit_healthy(rank, out, 12, every=3)
        elif name == "pace":
            result[name] = pace(rank, out, slow=bad)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        result[name]["wall_s"] = time.monotonic() - t0
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # as ddp_ranks.py: many Guards in one process; how a job ends is test_guard_close.py's


if __name__ == "__main__":
    main()
