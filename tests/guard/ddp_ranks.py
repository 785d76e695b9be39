"""One rank of the guard's real-DDP tests (gloo, CPU): ``python ddp_ranks.py RANK WORLD PORT OUT``.

Scenarios run one after another in one process group (each with a Guard of its own); each rank
writes what it saw to OUT/rank<R>.json. Faults come from outside the guard: the SDC fault harness
(gpumon.sdc.inject) wrapped around this rank's forward or optimizer step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import audit_ranks  # this folder's sibling (the script's folder is on sys.path)
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpumon.guard import Guard, GuardAlarm, deterministic
from gpumon.sdc.inject import FaultInjector, FaultSpec


def build(seed: int = 0) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # every replica starts from the same weights
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(net)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g) * 2, torch.randn(8, 4, generator=g)


def weights(model: DDP) -> list[str]:
    return [t.detach().numpy().tobytes().hex() for t in model.module.state_dict().values()]


def alarm_json(a: GuardAlarm) -> dict[str, Any]:
    return {"ranks": a.ranks, "exit_code": a.exit_code, "skipped": a.skipped,
            "verdicts": [v.to_json() for v in a.verdicts]}


def guarded_step(guard: Guard, step: int, result: dict[str, Any]) -> bool:
    """``guard.step()``; an alarm is kept in ``result["alarms"]`` with its step. True: applied."""
    try:
        return guard.step()
    except GuardAlarm as a:
        result["alarms"].append({"step": step, **alarm_json(a)})
        return False


def forward_backward(model: DDP, rank: int, step: int, inject: FaultInjector | None = None) -> None:
    x, y = batch(rank, step)
    if inject is not None:
        with inject:
            out = model(x)
    else:
        out = model(x)
    torch.nn.functional.mse_loss(out, y).backward()


def healthy(rank: int, world: int, out: Path, steps: int) -> dict[str, Any]:
    model, opt = build()
    calls = [0]

    def user_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    guard = Guard(model, opt, weight_check_every=10, spool_dir=out / f"spool-r{rank}",
                  comm_hook=user_hook, timeout_s=30)
    alarms = []
    for step in range(steps):
        opt.zero_grad()
        forward_backward(model, rank, step)
        try:
            guard.step()
        except GuardAlarm as a:
            alarms.append(alarm_json(a))
    report = guard.check_weights()
    return {"alarms": alarms, "user_hook_calls": calls[0], "disabled": guard.disabled,
            "agree": report.agree if report else None, "steps": guard.steps,
            "identity": guard.identity.__dict__}


def nan_forward(rank: int, world: int, out: Path, at: int, bad: int) -> dict[str, Any]:
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0, spool_dir=out / f"spool-r{rank}", timeout_s=30)
    # bit 30 is the top exponent bit of fp32: a value in [1, 2) becomes Inf/NaN
    spec = FaultSpec.parse(f"worker={bad},dtype=fp32,ops=addmm,range=1:1.99,bits=30:30,max_flips=1")
    result: dict[str, Any] = {"alarms": []}
    for step in range(at + 3):
        opt.zero_grad()
        inj = FaultInjector(spec) if (rank == bad and step == at) else None
        forward_backward(model, rank, step, inj)
        if inj is not None:
            result["flips"] = len(inj.flips)
        before = weights(model)
        applied = guarded_step(guard, step, result)
        if step == at:
            result["applied_at"] = applied
            result["unchanged_at"] = weights(model) == before
            result["before_at"], result["after_at"] = before[0][:64], weights(model)[0][:64]
    result["files"] = sorted(str(p) for p in guard.verdict_files)
    result["final"] = weights(model)
    return result


def nan_then_internal_error(rank: int, world: int, out: Path, at: int, bad: int) -> dict[str, Any]:
    """NaN in rank ``bad``'s forward at step ``at``, and the guard's own look at that rank's
    gradients then fails (as an out-of-memory of its per-element test would): an internal error
    after the step was judged bad. Injected into the guard's code on that rank only, since no input
    makes that look fail on a CPU."""
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0, spool_dir=out / f"spool-ie-r{rank}", timeout_s=2)
    if rank == bad:
        def fails(*args: Any, **kwargs: Any) -> list[str]:
            raise RuntimeError("out of memory (injected into the guard's look at the gradients)")

        guard._bad_params = fails  # type: ignore[method-assign]
    spec = FaultSpec.parse(f"worker={bad},dtype=fp32,ops=addmm,range=1:1.99,bits=30:30,max_flips=1")
    result: dict[str, Any] = {"alarms": []}
    for step in range(at + 2):
        opt.zero_grad()
        forward_backward(model, rank, step, FaultInjector(spec) if (rank == bad and step == at) else None)
        before = weights(model)
        applied = guarded_step(guard, step, result)
        if step == at:
            result["applied_at"] = applied
            result["unchanged_at"] = weights(model) == before
    result["skipped"] = guard.skipped_steps
    result["disabled"] = guard.disabled
    result["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result["final"] = weights(model)
    return result


def weight_flip(rank: int, world: int, out: Path, at: int, bad: int) -> dict[str, Any]:
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=1, spool_dir=out / f"spool-w-r{rank}", timeout_s=30)
    # a low mantissa bit of one output of the optimizer's in-place update on one rank: finite, wrong
    spec = FaultSpec.parse(f"worker={bad},dtype=fp32,ops=add_,bits=0:3,max_flips=1")
    order = [n for n, p in model.module.named_parameters()]
    result: dict[str, Any] = {"alarms": [], "order": order}
    for step in range(at + 2):
        opt.zero_grad()
        forward_backward(model, rank, step)
        if guard.before_step():
            if rank == bad and step == at:
                inj = FaultInjector(spec)
                with inj:
                    opt.step()
                result["flipped_call"] = inj.flips[0].call if inj.flips else None
            else:
                opt.step()
        try:
            guard.after_step()
        except GuardAlarm as a:
            result["alarms"].append({"step": step, **alarm_json(a)})
            break
    result["files"] = sorted(str(p) for p in guard.verdict_files)
    return result


def wedged_peer(rank: int, world: int, out: Path, at: int, late: int, timeout_s: float,
                *, user_hook: bool) -> dict[str, Any]:
    """Rank ``late`` reaches the guard's collective long after the others (a wedged step).
    ``user_hook``: the loop gave its own comm hook, so check 1 exchanges its flags on the guard's
    group every step; otherwise the flags ride the gradients and the guard's collective that waits
    is the weight check, due right after step ``at``."""
    model, opt = build()
    guard = Guard(model, opt, weight_check_every=0 if user_hook else at + 1,
                  spool_dir=out / f"spool-t-r{rank}", timeout_s=timeout_s,
                  comm_hook=default_hooks.allreduce_hook if user_hook else None)
    t0 = time.monotonic()
    for step in range(at + 3):
        opt.zero_grad()
        forward_backward(model, rank, step)
        if rank == late and step == at:
            time.sleep(timeout_s * 2.5)
        guard.step()
    return {"disabled": guard.disabled, "steps": guard.steps, "seconds": time.monotonic() - t0,
            "final": weights(model)}


def train_through(guard: Guard, rank: int, now: dict[str, int], at: int, steps: int,
                  result: dict[str, Any]) -> dict[str, Any]:
    """``steps`` guarded steps (``now["step"]`` tells the fault which), the update at step ``at``
    (applied, weights unchanged), the verdict files and the final weights in ``result``."""
    model = guard.model
    for step in range(steps):
        now["step"] = step
        guard.optimizer.zero_grad()
        forward_backward(model, rank, step)
        before = weights(model)
        applied = guarded_step(guard, step, result)
        if step == at:
            result["applied_at"], result["unchanged_at"] = applied, weights(model) == before
    result["disabled"] = guard.disabled
    result["files"] = sorted(str(p) for p in guard.verdict_files)
    result["final"] = weights(model)
    return result


def reduce_nan(rank: int, world: int, out: Path, at: int, bad: int | None) -> dict[str, Any]:
    """Every rank's local gradients finite, the all-reduce's result NaN: on rank ``bad`` only (its
    copy of the result corrupted on the way in), or on every rank (``bad`` None: the reduce itself).
    The fault is the loop's own comm hook (``comm_hook=``, the guard wraps it), DDP's default
    all-reduce followed, at step ``at``, by a NaN written into the reduced bucket: from outside the
    guard's code, as a corrupting transport would."""
    model, opt = build()
    calls = {"step": 0}

    def corrupting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = default_hooks.allreduce_hook(state, bucket)
        if calls["step"] != at or (bad is not None and rank != bad) or not bucket.is_last():
            return fut

        def poison(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            out = done.value()
            out[0] = float("nan")
            return out

        return fut.then(poison)

    told: list[int] = []  # the loop's callback= sees every alarm, with its step
    guard = Guard(model, opt, weight_check_every=0, timeout_s=30, comm_hook=corrupting,
                  spool_dir=out / f"spool-reduce-{'all' if bad is None else bad}-r{rank}",
                  callback=lambda a: told.append(a.verdicts[0].step))
    return train_through(guard, rank, calls, at, at + 2, {"alarms": [], "told": told})


class CorruptingTransport(dist.ProcessGroup):
    """The DDP model's process group: gloo's, with rank ``bad``'s copy of every all-reduce result
    of step ``at`` (``state["step"]``) given a NaN on the way in, as a NIC or PCIe path corrupting
    incoming data would. The fault sits below the guard, in the transport its own all-reduce uses."""

    def __init__(self, inner: dist.ProcessGroup, state: dict[str, int], at: int, bad: int | None) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner, self.state, self.at, self.bad = inner, state, at, bad

    def getBackendName(self) -> str:
        return "corrupting-gloo"

    def allreduce(self, tensors: list[torch.Tensor], *opts: Any) -> Any:
        work = self.inner.allreduce(tensors, *opts)
        if self.state["step"] == self.at and self.bad in (None, self.rank()):
            work.wait()
            tensors[0].view(-1)[0] = float("nan")
        return work

    # what DDP's construction and the guard use besides (the options passed on as they came)
    def broadcast(self, tensors: list[torch.Tensor], *opts: Any) -> Any:
        return self.inner.broadcast(tensors, *opts)

    def allgather(self, out: list[list[torch.Tensor]], tensors: list[torch.Tensor], *opts: Any) -> Any:
        return self.inner.allgather(out, tensors, *opts)

    def barrier(self, *opts: Any) -> Any:
        return self.inner.barrier(*opts)


def reduce_nan_own(rank: int, world: int, out: Path, at: int, bad: int | None) -> dict[str, Any]:
    """The guard's own all-reduce (no comm hook of the loop's: the flags ride the last bucket), its
    result NaN at step ``at`` on rank ``bad`` only, or on every rank (``bad`` None), through a
    corrupting transport under DDP. On one rank, only that rank knows: it skips the update the
    others apply, and the weight check after step ``at + 1`` must name its replica."""
    state = {"step": -1}
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(net, process_group=CorruptingTransport(dist.new_group(backend="gloo"), state, at, bad))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # weight check after every second step: not the step of the fault, the next one
    guard = Guard(model, opt, weight_check_every=2, timeout_s=4,
                  spool_dir=out / f"spool-own-{'all' if bad is None else bad}-r{rank}")
    return train_through(guard, rank, state, at, at + 3, {"alarms": [], "disabled": None})


def same_bits(rank: int, world: int, out: Path, steps: int = 6) -> dict[str, Any]:
    """Plain DDP (its built-in all-reduce) and a guarded DDP (the guard's own all-reduce, the flags
    riding the last bucket) trained side by side from the same weights on the same micro-batches.
    The sums are the same up to their order (gloo cuts a buffer of another size into other chunks,
    and the guard divides before the sum as DDP's Python hook does): the largest difference of a
    weight after each step, and the guarded weights' bits to compare across ranks."""
    def wide() -> tuple[DDP, torch.optim.Optimizer]:
        # 1.4 MB of gradients: more than DDP's first bucket (1 MiB) holds, so more than one bucket
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 600), torch.nn.Tanh(), torch.nn.Linear(600, 600),
                                  torch.nn.Tanh(), torch.nn.Linear(600, 4))
        model = DDP(net, bucket_cap_mb=0.5)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    plain, plain_opt = wide()
    guarded, guarded_opt = wide()
    guard = Guard(guarded, guarded_opt, weight_check_every=0, timeout_s=30, write_verdicts=False,
                  pace_window=0)
    worst: list[float] = []
    buckets: list[int] = []
    for step in range(steps):
        for model, opt in ((plain, plain_opt), (guarded, guarded_opt)):
            opt.zero_grad()
            forward_backward(model, rank, step)
        plain_opt.step()
        buckets.append(len(guard._flags))  # one per bucket the hook saw
        guard.step()
        worst.append(max(float((a - b).abs().max()) for a, b in zip(
            plain.module.state_dict().values(), guarded.module.state_dict().values(), strict=True)))
    return {"worst": worst, "weights": weights(guarded), "alarms": guard.skipped_steps,
            "buckets": buckets, "changed": weights(guarded) != weights(wide()[0])}


def subgroup(rank: int, world: int, out: Path) -> dict[str, Any]:
    """DDP over a data-parallel group smaller than the job (ranks 0-1, and rank 2 alone): refused."""
    groups = [dist.new_group([0, 1]), dist.new_group(list(range(2, world)))]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(net, process_group=groups[0 if rank < 2 else 1])
    try:
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), timeout_s=30, write_verdicts=False)
    except ValueError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


def close(rank: int, world: int, out: Path) -> dict[str, Any]:
    """``close()`` in the middle of a run, and the ``with`` form: the guard's state before and after,
    the process groups torch still has registered, training after close (the comm hook only does
    DDP's all-reduce then: the replicas stay equal), a second close."""
    from dataclasses import asdict

    from torch.distributed import distributed_c10d

    def registered() -> int:
        return len(distributed_c10d._world.pg_names)

    model, opt = build()
    before = registered()
    guard = Guard(model, opt, weight_check_every=2, timeout_s=30, spool_dir=out / f"spool-close-r{rank}")
    made = registered() - before
    said: dict[str, Any] = {"groups_made": made, "on": asdict(guard.state)}
    for step in range(2):
        opt.zero_grad()
        forward_backward(model, rank, step)
        guard.step()
    guard.close()
    said["closed"] = asdict(guard.state)
    said["groups_left"] = registered() - before
    said["held"] = [guard._group is None, guard._reduce_group is None, guard._payload is None]
    said["applied_after"] = []
    for step in range(2, 5):
        opt.zero_grad()
        forward_backward(model, rank, step)
        said["applied_after"].append(guard.step())
    said["weight_check_after"] = guard.check_weights()
    guard.close()  # twice: nothing
    said["weights"] = weights(model)
    model, opt = build()
    with Guard(model, opt, weight_check_every=0, timeout_s=30, write_verdicts=False, strict=True) as g:
        opt.zero_grad()
        forward_backward(model, rank, 0)
        said["with_applied"] = g.step()
        said["with_on"] = asdict(g.state)
    said["with_closed"] = asdict(g.state)
    said["with_groups_left"] = registered() - before
    said["with_strict_after"] = g.step()  # closed is not an internal error: no GuardError
    return said


def sync_batchnorm(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A model with SyncBatchNorm: its forward all-gathers, so the guard's recomputations (which
    some ranks run and others do not) are refused; checks 1 and 3 still are the guard's. DDP
    refuses SyncBatchNorm on a CPU module, so the layer is put in after wrapping (the guard looks
    at the module tree only; nothing here runs a forward)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4))
    model = DDP(net)
    net[1] = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    said: dict[str, Any] = {}
    try:
        Guard(model, opt, timeout_s=30, write_verdicts=False, audit_every=10, batch_for=batch,
              loss_fn=loss_fn)
        said["refused"] = None
    except ValueError as exc:
        said["refused"] = str(exc)
    plain = Guard(model, opt, timeout_s=30, write_verdicts=False)  # no recomputation: guarded
    said["plain_on"] = plain.disabled is None
    return said


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    scenarios = sys.argv[5].split(",")
    logging.basicConfig(level=logging.ERROR, format=f"rank {rank}: %(message)s")
    torch.set_num_threads(1)
    # the audit's scenarios (audit_ranks.py) need a deterministic process; the others do not mind
    deterministic(threads=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    for name in scenarios:
        if name in audit_ranks.SCENARIOS:  # in this launch: torch and DDP's first start cost once
            audit_ranks.run(name, rank, world, out, result)
        elif name == "healthy":
            result[name] = healthy(rank, world, out, int(os.environ.get("GUARD_HEALTHY_STEPS", "200")))
        elif name == "nan":
            result[name] = nan_forward(rank, world, out, at=5, bad=world - 1)
        elif name == "nan-internal-error":
            result[name] = nan_then_internal_error(rank, world, out, at=3, bad=world - 1)
        elif name == "close":
            result[name] = close(rank, world, out)
        elif name == "syncbn":
            result[name] = sync_batchnorm(rank, world, out)
        elif name == "flip":
            result[name] = weight_flip(rank, world, out, at=4, bad=1)
        elif name == "reduce-nan":
            result[name] = reduce_nan(rank, world, out, at=3, bad=1)
        elif name == "reduce-nan-all":
            result[name] = reduce_nan(rank, world, out, at=3, bad=None)
        elif name == "reduce-nan-own":
            result[name] = reduce_nan_own(rank, world, out, at=2, bad=1)
        elif name == "reduce-nan-own-all":
            result[name] = reduce_nan_own(rank, world, out, at=2, bad=None)
        elif name == "same-bits":
            result[name] = same_bits(rank, world, out)
        elif name == "subgroup":
            result[name] = subgroup(rank, world, out)
        elif name == "wedged":
            result[name] = wedged_peer(rank, world, out, at=2, late=world - 1, timeout_s=1.5, user_hook=True)
        elif name == "wedged-weights":
            result[name] = wedged_peer(rank, world, out, at=2, late=world - 1, timeout_s=1.5, user_hook=False)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # What the tests judge is written above; this launch leaves without its teardown (a dozen
    # Guards in one process, and "dies" leaves the default group short of a rank). How a guarded
    # job ends cleanly is test_guard_close.py's (exit_ranks.py: real interpreter exits).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
