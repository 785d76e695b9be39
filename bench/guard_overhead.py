"""What the in-job guard (gpumon.guard) costs per training step, per check, on a small transformer
trained with real DDP; check 1's cost split into a model (fixed per step, per bucket, per gradient
byte) fitted over several models and bucket sizes; both modes of check 1 measured A/B; and the
same measurement on a model of the user's.

    .venv/bin/python bench/guard_overhead.py [--world 2] [--rounds 5] [--steps 100] [--launches 1]
                                             [--device cpu|cuda]
    .venv/bin/python bench/guard_overhead.py --ab [--launches 8] [--kinds none,after,check1]
    .venv/bin/python bench/guard_overhead.py --fit [--paired] [--launches 2] [--save-fit fit.json]
    .venv/bin/python bench/guard_overhead.py --project 450,2048,80 [--fit-file fit.json]
    .venv/bin/python bench/guard_overhead.py --model mypkg.train:make_model --batch mypkg.train:make_batch
                                             [--loss mypkg.train:loss_fn] [--bucket-cap-mb 25]

``--world`` ranks are local processes (gloo on CPU, NCCL with ``--device cuda``, one GPU each),
each training the same 2-layer ``nn.TransformerEncoder`` language model (d_model 128, 4 heads,
sequence 64, micro-batch 8 per rank; ``--size medium``: 4 layers, d_model 256, 8 heads, ff 1024) on
deterministic token batches.

**The interleaved run** (no mode flag). Configurations, each its own DDP model, measured in
interleaved rounds of ``--steps`` steps (so that load on a shared machine hits them alike), the
median round per configuration:

- ``none``: plain DDP, no guard;
- ``hook``: plain DDP with its all-reduce as a Python comm hook and no check (``bare_hook``): the
  floor of a check done in a comm hook, as check 1 is in its default mode;
- ``check 1``: ``Guard(weight_check_every=0)``: the non-finite gradient check every step (the
  guard's comm hook: a NaN/Inf test of each bucket before and after the all-reduce, every rank's
  local flag carried in the last bucket, one host read of the flags before ``optimizer.step()``);
- ``after``: ``Guard(weight_check_every=0, nonfinite="after")``: check 1 with no comm hook (DDP's
  C++ all-reduce), one fused NaN/Inf pass over the reduced gradients before ``optimizer.step()``;
- ``check 3``: the weight fingerprint check (``guard.check_weights()``), timed by itself and
  amortised over N = ``--weight-every`` (100) steps;
- ``check 2``: the ring re-execution audit, measured as a guard auditing every step
  (``audit_every=1``) against check 1 alone, amortised over M = ``--audit-every`` (500);
- ``pace``: check 1 and the straggler scores (``pace_window`` K, 100: the Guard's default),
  against check 1 alone;
- ``all``: ``Guard(weight_check_every=N, audit_every=M, pace_window=K)``, measured the same way;
- ``pace_after``, ``all_after``: ``pace`` and ``all`` with ``nonfinite="after"``.

**The A/B** (``--ab``): each configuration of ``--kinds`` (default none, after, check1) in launches
of its own (one configuration per process group: a fresh model, nothing else in the process), the
launches alternating between the configurations, ``--launches`` of each; per configuration the
median of its launches' median rounds, and the spread of the launches.

**The cost model** (``--fit``): check 1's extra time per step, in each mode, is fitted as
``fixed + per_bucket * buckets + per_byte * gradient bytes`` (least squares) over the points of
``FIT_POINTS`` (three model sizes, each with DDP's default buckets and with small ones;
``FIT_POINTS_CUDA`` with ``--device cuda``), each point and configuration in launches of its own,
alternating; printed with the fit (R², each point's
residual) and saved with ``--save-fit``. ``--fit --paired``: each point and mode one launch of one
guarded model whose rounds run with the check on and off in turn (the launch's own speed cancels
out; mode "hook" over a bare Python comm hook), fitted on the median difference of the pairs.
``--project STEP_MS,GRAD_MB,BUCKETS`` prints what the model
projects for a step of that time, gradient megabytes and bucket count (``--fit-file``: a saved fit).

**Your model** (``--model``/``--batch``, or ``measure()`` from Python): the A/B of ``none``,
``after`` and ``check1`` on a model of yours: ``--model module:function`` returns the model (an
``nn.Module``, built alike on every rank; it is moved to the device and wrapped in DDP here),
``--batch module:function`` takes the device and returns one micro-batch (reused every step),
``--loss module:function`` (optional) takes (model, batch) and returns the loss (default: the model
called on the batch, ``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict, and the
mean of the first tensor of its output). Printed: the step, the gradient bytes and buckets, each
mode's measured cost, and what the fitted model (``--fit-file``) projects for it.

Every configuration runs under ``gpumon.guard.deterministic()`` (the audit refuses a run that is
not deterministic), so the baseline pays what the audit's precondition costs too.

Overheads are printed as % of the ``none`` step time, with the machine and the load it ran under.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe

from gpumon.guard import Guard, deterministic

VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS, FF = 256, 64, 8, 128, 4, 2, 256
# --size: the model trained (d_model, heads, layers, ff); "small" is the default above (339k
# parameters), "medium" a 4-layer d_model 256 one (3.3M) whose step is long enough for the guard's
# fixed per-step costs to show what they weigh beside real work; "mid" (1.0M) between them; "large"
# (101M, 404 MB of fp32 gradients) for a GPU's cost model (FIT_POINTS_CUDA)
SIZES = {"small": (128, 4, 2, 256), "mid": (192, 4, 2, 768), "medium": (256, 8, 4, 1024),
         "large": (1024, 16, 8, 4096)}


def set_size(name: str, batch_size: int | None = None) -> None:
    global D_MODEL, HEADS, LAYERS, FF, BATCH
    D_MODEL, HEADS, LAYERS, FF = SIZES[name]
    if batch_size is not None:
        BATCH = batch_size


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ, device=tokens.device)
        out: torch.Tensor = self.head(self.encoder(self.embed(tokens) + self.pos, mask=mask, is_causal=True))
        return out


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``: any rank can rebuild any other's (the audit)."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loop's own forward and loss: what the audit (check 2) replays on another rank."""
    x, y = b
    loss: torch.Tensor = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    return loss


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    set_size(args.size)  # a spawned process imports this module afresh
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def rebuild(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(r, step, device)

    def make(kind: str) -> tuple[DDP, torch.optim.Optimizer, Guard | None]:
        torch.manual_seed(0)
        model = DDP(TinyLM().to(device), device_ids=[rank] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if kind == "none":
            return model, opt, None
        if kind == "hook":
            model.register_comm_hook(None, bare_hook)
            return model, opt, None
        extra: dict[str, Any] = {}
        if kind in ("audit1", "all", "all_after"):
            extra = {"audit_every": 1 if kind == "audit1" else args.audit_every, "batch_for": rebuild,
                     "loss_fn": lm_loss}
        if kind.endswith("after"):
            extra["nonfinite"] = "after"
        every = args.weight_every if kind in ("all", "all_after") else 0
        # the straggler scores (gpumon.guard.pace) are on by default: off in check1 and audit1, so
        # that "pace" (check 1 + the scores every --pace-window steps) shows what they add
        pace = args.pace_window if kind in ("pace", "all", "pace_after", "all_after") else 0
        return model, opt, Guard(model, opt, weight_check_every=every, timeout_s=300, spool_dir=out,
                                 pace_window=pace, **extra)

    # the audit refuses a run that is not deterministic: every configuration runs so, alike
    deterministic()
    kinds = list(args.order)
    setups = {kind: make(kind) for kind in kinds}
    notes: list[str] = []
    steps_done = dict.fromkeys(kinds, 0)

    def train(kind: str, n: int) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds, its threads included) per step."""
        model, opt, guard = setups[kind]
        dist.barrier()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            step = steps_done[kind]
            x, y = batch(rank, step, device)
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, (x, y))
            loss.backward()  # type: ignore[no-untyped-call]
            if guard is None:
                opt.step()
            else:
                guard.step(loss, (x, y))
            steps_done[kind] += 1
        sync()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    for kind in kinds:  # warm-up: allocator, autograd graph, gloo connections
        train(kind, args.warmup)
    rounds: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            wall_s, cpu_s = train(kind, args.steps)
            rounds[kind].append(wall_s)
            cpu[kind].append(cpu_s)
    # check 3 by itself: the on-demand weight check, as often as it takes to time it
    _, _, g1 = setups["check1"]
    assert g1 is not None
    g1.check_weights()
    checks = []
    for _ in range(args.weight_calls):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        g1.check_weights()
        sync()
        checks.append(time.perf_counter() - t0)
    disabled = {k: s[2].disabled for k, s in setups.items() if s[2] is not None and s[2].disabled}
    if rank == 0:
        params = sum(p.numel() for p in setups["none"][0].parameters())
        Path(out, "result.json").write_text(json.dumps({
            "rounds": rounds, "cpu": cpu, "weight_check_s": checks, "notes": notes, "params": params,
            "disabled": disabled}))
    dist.barrier()
    dist.destroy_process_group()
    leave()


def leave() -> None:
    """End a spawned rank here, its result written: the DDP models' reference cycles keep the
    process group's C++ threads alive into interpreter teardown, which can abort a finished rank
    (SIGABRT, "terminate called without an active exception", pytorch/pytorch#179291; seen once in
    a launch of this benchmark), and the benchmark measures steps, not its own exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bare_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce as a Python comm hook, with no check: what the guard's hook does
    without its checks (the sum of buffer / world over the model's group, the process group called
    directly, one callback). What it costs over DDP's built-in C++ all-reduce is the floor of any
    check that is done in a DDP comm hook, as issue 19 asks for check 1."""
    group = dist.group.WORLD
    assert group is not None
    buf = bucket.buffer().div_(group.size())
    return group.allreduce([buf]).get_future().then(lambda f: f.value()[0])


# DDP compares a hook's annotations with the real objects; this module's are strings (__future__)
bare_hook.__annotations__ = {"state": Any, "bucket": GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


def paired_hook(guarded: Callable[..., Any], on: list[bool]) -> Callable[..., Any]:
    """One comm hook that is the guard's while ``on[0]`` and ``bare_hook`` otherwise (--paired)."""
    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        return guarded(state, bucket) if on[0] else bare_hook(state, bucket)

    hook.__annotations__ = dict(bare_hook.__annotations__)
    return hook


# -- one configuration per launch: the A/B, the cost model, the user's model ------------------------

# check 1's configurations in the A/B and the fit; "none" is the baseline of both
KINDS = ("none", "after", "check1")
MODE_OF = {"check1": "hook", "after": "after"}
# the cost model's points: (size, micro-batch per rank, DDP bucket_cap_mb). Three model sizes (1.4,
# 4.1 and 13 MB of fp32 gradients), each with DDP's default buckets (a 1 MiB first bucket, then 25
# MB: 2 buckets here) and with small ones; the micro-batch shrinks as the model grows, so that every
# step stays near 20-50 ms on one CPU thread and the guard's cost is not lost in a long step's noise.
FIT_POINTS: tuple[tuple[str, int, float], ...] = (
    ("small", 8, 25.0), ("small", 8, 0.25), ("mid", 4, 25.0), ("mid", 4, 0.5),
    ("medium", 1, 25.0), ("medium", 1, 1.0))
# on a GPU the small models' steps are all fixed costs: the per-byte part needs gradients of
# hundreds of MB (bench/gpu_validate.py passes these with --points)
FIT_POINTS_CUDA: tuple[tuple[str, int, float], ...] = (
    ("small", 8, 25.0), ("medium", 8, 25.0), ("medium", 8, 1.0), ("large", 8, 25.0), ("large", 8, 5.0))


@dataclass
class Job:
    """One launch: one configuration (``kind``) on one model, timed in ``rounds`` of ``steps``."""

    kind: str
    size: str = "small"
    batch: int = BATCH
    bucket_cap_mb: float = 25.0
    rounds: int = 3
    steps: int = 60
    warmup: int = 10
    threads: int = 1
    device: str = "cpu"
    # rounds alternate with the check on and off on the same model and guard (--paired): rounds
    # holds the "on" rounds, off_rounds the "off" rounds, in pairs
    paired: bool = False
    # a model of the user's: callables, or "module:function" strings imported in each rank
    model: Any = None
    make_batch: Any = None
    loss: Any = None


@dataclass
class Launched:
    """What one launch measured (rank 0's view; every rank trains the same steps)."""

    kind: str
    rounds: list[float]  # wall seconds per step, one per round
    cpu: list[float]  # rank 0's CPU seconds per step, one per round
    grad_bytes: int
    buckets: int
    params: int
    disabled: str | None = None
    other_cores: float | None = None  # the cores other processes kept busy during the launch
    off_rounds: list[float] = field(default_factory=list)  # --paired: the same model, check off
    off_cpu: list[float] = field(default_factory=list)

    @property
    def step(self) -> float:
        return statistics.median(self.rounds)


def resolve(ref: Any) -> Any:
    """A callable, or ``module:function`` imported here."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"{ref!r}: expected module:function")
    return getattr(importlib.import_module(module), name)


def first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    items = list(output.values()) if isinstance(output, dict) else list(output) \
        if isinstance(output, (list, tuple)) else []
    for item in items:
        try:
            return first_tensor(item)
        except TypeError:
            continue
    raise TypeError(f"the model's output holds no tensor ({type(output).__name__}): pass --loss")


def default_loss(model: nn.Module, b: Any) -> torch.Tensor:
    """The model called on the batch; the mean of the first tensor it returns."""
    if isinstance(b, dict):
        out = model(**b)
    elif isinstance(b, (list, tuple)):
        out = model(*b)
    else:
        out = model(b)
    return first_tensor(out).float().mean()


def buckets_of(model: DDP) -> int:
    """The buckets DDP all-reduced in the last step (after its rebuild at the first step)."""
    try:
        got = model._get_ddp_logging_data().get("num_buckets_reduced")  # type: ignore[no-untyped-call]
        if isinstance(got, int) and got > 0:
            return got
    except Exception:
        pass
    return -1


def worker_one(rank: int, world: int, port: int, job: Job, out: str) -> None:
    """One launch of one configuration: a fresh process group, model and guard, nothing else."""
    set_size(job.size, job.batch)
    cuda = job.device == "cuda"
    torch.set_num_threads(job.threads)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    deterministic()
    torch.manual_seed(0)
    if job.model is not None:
        module: nn.Module = resolve(job.model)().to(device)
        fixed = resolve(job.make_batch)(device)
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] = resolve(job.loss) if job.loss else default_loss

        def batch_of(step: int) -> Any:
            return fixed
    else:
        module = TinyLM().to(device)
        loss_fn = lm_loss

        def batch_of(step: int) -> Any:
            return batch(rank, step, device)
    model = DDP(module, device_ids=[rank] if cuda else None, bucket_cap_mb=job.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard: Guard | None = None
    on = [True]  # --paired: this round's check is on
    if job.kind == "hook":
        model.register_comm_hook(None, bare_hook)
    elif job.kind in MODE_OF:
        if job.paired and MODE_OF[job.kind] == "hook":
            # the guard's comm hook and the bare one behind one registered hook: an "off" round is
            # the same Python comm hook without the check (the floor, measured by the A/B)
            register = model.register_comm_hook
            model.register_comm_hook = lambda state, hook: register(state, paired_hook(hook, on))  # type: ignore[method-assign]
        guard = Guard(model, opt, weight_check_every=0, timeout_s=300, spool_dir=out, pace_window=0,
                      nonfinite=MODE_OF[job.kind])
    elif job.kind != "none":
        raise ValueError(f"kind {job.kind!r}: one of none, hook, {', '.join(MODE_OF)}")
    if job.paired and guard is None:
        raise ValueError("--paired measures a guarded configuration (after, check1)")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    done = 0

    def train(n: int) -> tuple[float, float]:
        nonlocal done
        dist.barrier()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            b = batch_of(done)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, b)
            loss.backward()  # type: ignore[no-untyped-call]
            if guard is None or not on[0]:
                opt.step()
            else:
                guard.step(loss, b)
            done += 1
        sync()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    train(job.warmup)
    if job.paired:
        on[0] = False
        train(job.warmup)  # the "off" path warmed up too
    rounds: list[float] = []
    cpu: list[float] = []
    off_rounds: list[float] = []
    off_cpu: list[float] = []
    for i in range(job.rounds):
        # on, off; off, on; ...: a drift over the launch falls on both alike
        for state in ((True, False) if i % 2 == 0 else (False, True)) if job.paired else (True,):
            on[0] = state
            wall_s, cpu_s = train(job.steps)
            (rounds if state else off_rounds).append(wall_s)
            (cpu if state else off_cpu).append(cpu_s)
    on[0] = True
    if rank == 0:
        params = [p for p in module.parameters() if p.requires_grad]
        got = Launched(job.kind, rounds, cpu, sum(p.numel() * p.element_size() for p in params),
                       buckets_of(model), sum(p.numel() for p in params),
                       guard.disabled if guard is not None else None, off_rounds=off_rounds, off_cpu=off_cpu)
        Path(out, "result.json").write_text(json.dumps(asdict(got)))
    dist.barrier()
    if guard is not None:
        guard.close()
    dist.destroy_process_group()
    leave()


def busy_seconds() -> float | None:
    """CPU seconds every process of this machine has spent (``/proc/stat``: user, nice, system, irq,
    softirq, steal); None where there is no such file."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields]
    return float(sum(ticks[i] for i in (0, 1, 2, 5, 6, 7) if i < len(ticks))) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def launch(job: Job, world: int) -> Launched:
    """One launch; ``other_cores``: the cores other processes of the machine kept busy meanwhile."""
    busy0, own0, t0 = busy_seconds(), own_seconds(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="guard-bench-") as out:
        spawn(worker_one, args=(world, _free_port(), job, out),  # type: ignore[no-untyped-call]
              nprocs=world, join=True)
        got = Launched(**json.loads(Path(out, "result.json").read_text()))
    busy1, own1, t1 = busy_seconds(), own_seconds(), time.monotonic()
    if busy0 is not None and busy1 is not None and t1 > t0:
        got.other_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
    return got


# a launch during which other processes kept more than this share of a core busy is run again
# (--max-other-cores), up to REDO times, after waiting QUIET_WAIT_S
REDO, QUIET_WAIT_S = 3, 30.0


def alternate(jobs: dict[Any, Job], launches: int, world: int, say: Callable[[str], None] = print,
              max_other: float | None = None) -> dict[Any, list[Launched]]:
    """Every job in ``launches`` launches of its own, the order turned each time (job 1 2 3, 2 3 1,
    3 1 2, ...), so that a slow minute of a shared machine falls on each alike. ``max_other``: a
    launch during which other processes kept more cores busy than that is run again (each launch
    says how many they kept busy)."""
    keys = list(jobs)
    got: dict[Any, list[Launched]] = {k: [] for k in keys}
    for i in range(launches):
        turn = i % len(keys)
        for key in keys[turn:] + keys[:turn]:
            for attempt in range(REDO + 1):
                res = launch(jobs[key], world)
                other = res.other_cores
                say(f"  launch {i + 1}/{launches} {key}: {res.step * 1e3:.2f} ms/step (rounds "
                    f"{' '.join(f'{r * 1e3:.2f}' for r in res.rounds)}), other processes "
                    f"{'?' if other is None else f'{other:.2f}'} cores, load {os.getloadavg()[0]:.2f}")
                if max_other is None or other is None or other <= max_other or attempt == REDO:
                    break
                say(f"    others were busy (> {max_other:g} cores): again in {QUIET_WAIT_S:.0f} s")
                time.sleep(QUIET_WAIT_S)
            got[key].append(res)
    return got


def median_step(runs: Sequence[Launched]) -> float:
    """The median of the launches' median rounds."""
    return statistics.median(r.step for r in runs)


def spread(runs: Sequence[Launched]) -> tuple[float, float]:
    steps = [r.step for r in runs]
    return min(steps), max(steps)


@dataclass
class Fit:
    """Check 1's extra seconds per step in one mode: fixed + per_bucket * buckets + per_byte * bytes."""

    mode: str
    fixed_s: float
    per_bucket_s: float
    per_byte_s: float
    r2: float
    points: list[dict[str, float]] = field(default_factory=list)

    def predict(self, buckets: float, grad_bytes: float) -> float:
        return self.fixed_s + self.per_bucket_s * buckets + self.per_byte_s * grad_bytes

    def describe(self) -> str:
        return (f"{self.fixed_s * 1e6:8.1f} us per step + {self.per_bucket_s * 1e6:7.2f} us per bucket + "
                f"{self.per_byte_s * 1e12:7.2f} us per MB of gradients (R^2 {self.r2:.3f})")


def fit_cost(mode: str, points: Sequence[tuple[float, float, float]]) -> Fit:
    """Least squares of ``extra_s = fixed + per_bucket * buckets + per_byte * bytes`` over
    ``points`` of (buckets, gradient bytes, extra seconds per step)."""
    import numpy as np

    a = np.array([[1.0, b, g] for b, g, _ in points])
    y = np.array([d for _, _, d in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ coef
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / total if total > 0 else 0.0
    rows = [{"buckets": b, "grad_bytes": g, "extra_s": d, "predicted_s": float(p)}
            for (b, g, d), p in zip(points, pred, strict=True)]
    return Fit(mode, float(coef[0]), float(coef[1]), float(coef[2]), r2, rows)


def print_projection(fits: Sequence[Fit], step_s: float, grad_bytes: float, buckets: float,
                     measured: dict[str, float] | None = None) -> None:
    """Each mode's projected extra time for a step of ``step_s`` seconds, with the measured one."""
    for f in fits:
        extra = f.predict(buckets, grad_bytes)
        seen = ""
        if measured and f.mode in measured:
            seen = f"; measured {measured[f.mode] * 1e3:+.3f} ms ({measured[f.mode] / step_s * 100:+.2f} %)"
        print(f"  nonfinite={f.mode!r:<8} projected {extra * 1e3:+.3f} ms per step = "
              f"{extra / step_s * 100:+.2f} % of a {step_s * 1e3:.1f} ms step{seen}")


def load_fits(path: str | None) -> list[Fit]:
    if not path:
        return []
    doc = json.loads(Path(path).read_text())
    if doc.get("method") == "paired":
        print(f"{path}: a paired fit: its nonfinite='hook' projection is over a bare Python comm hook "
              "(add that floor, measured by --ab --kinds none,hook)")
    return [Fit(**f) for f in doc["fits"]]


def header(world: int, device: str, threads: int) -> str:
    what = (f"{torch.cuda.get_device_name(0)}, NCCL" if device == "cuda" else
            f"CPU, gloo, {threads} torch thread(s) per rank")
    return f"machine: {describe()}\ntorch {torch.__version__}; {world} ranks, {what}"


def run_ab(args: argparse.Namespace) -> int:
    """Each configuration of ``--kinds`` on the small model, in launches of its own, alternating."""
    kinds = args.kinds.split(",")
    if kinds[0] != "none":
        kinds = ["none", *[k for k in kinds if k != "none"]]
    jobs = {k: Job(k, size=args.size, batch=BATCH, bucket_cap_mb=args.bucket_cap_mb, rounds=args.rounds,
                   steps=args.steps, warmup=args.warmup, threads=args.threads, device=args.device)
            for k in kinds}
    load0 = os.getloadavg()
    t0 = time.monotonic()
    print(header(args.world, args.device, args.threads), flush=True)
    got = alternate(jobs, args.launches, args.world, max_other=args.max_other_cores)
    load1 = os.getloadavg()
    first = got["none"][0]
    print(f"A/B: TransformerEncoder {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, ff {FF}, seq {SEQ}, "
          f"micro-batch {BATCH}/rank, {first.params:,} parameters ({first.grad_bytes / 1e6:.2f} MB of "
          f"gradients, {first.buckets} buckets), AdamW; {args.launches} launches per configuration, "
          f"alternating, each {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; load "
          f"average {load0[0]:.2f} at start, {load1[0]:.2f} at end; wall {time.monotonic() - t0:.0f} s")
    report_ab(got, kinds)
    return 0


def report_ab(got: dict[str, list[Launched]], kinds: Sequence[str]) -> None:
    base = median_step(got["none"])
    base_cpu = statistics.median(statistics.median(r.cpu) for r in got["none"])
    lo_base, hi_base = spread(got["none"])
    print(f"\n{'configuration':<26}{'step (median)':>14}{'launches min..max':>22}{'overhead':>10}"
          f"{'worst..best pairing':>24}{'rank 0 CPU/step':>22}")
    for k in kinds:
        runs = got[k]
        step = median_step(runs)
        lo, hi = spread(runs)
        cpu = statistics.median(statistics.median(r.cpu) for r in runs)
        over = (step - base) / base * 100
        # the spread of the overhead: the slowest launch of this configuration against the fastest
        # plain one, and the fastest against the slowest
        span = ("" if k == "none" else
                f"{(lo - hi_base) / base * 100:+.2f}..{(hi - lo_base) / base * 100:+.2f} %")
        cpu_over = "" if k == "none" else f", {(cpu - base_cpu) / base_cpu * 100:+.2f} %"
        note = " (GUARD OFF: " + str(runs[0].disabled) + ")" if any(r.disabled for r in runs) else ""
        others = [r.other_cores for r in runs if r.other_cores is not None]
        if others:
            note += f"; other processes <= {max(others):.2f} cores"
        print(f"{k:<26}{step * 1e3:>11.2f} ms{lo * 1e3:>12.2f}..{hi * 1e3:<8.2f}ms"
              f"{'' if k == 'none' else f'{over:+.2f} %':>10}{span:>24}{cpu * 1e3:>12.2f} ms{cpu_over}{note}")
    print("\noverhead = (median of a configuration's launch medians - none's) / none's; worst..best "
          "pairing = the same with its launches' slowest against none's fastest and its fastest against "
          "none's slowest: a figure inside that range is not told from noise.")


def after_pass_seconds(size: str, device: str, repeat: int = 500) -> tuple[float, int]:
    """Mode "after"'s own work on one model's gradients, in this process: ``reduced_nonfinite`` and
    the read of its flag (the step's host sync), median of ``repeat``; and the gradient bytes."""
    from gpumon.guard.after import reduced_nonfinite

    set_size(size)
    dev = torch.device(device)
    grads = [torch.randn_like(p) for p in TinyLM().to(dev).parameters()]
    times = []
    for i in range(repeat + 20):
        t = time.perf_counter()
        bool(reduced_nonfinite(grads))
        if i >= 20:  # warm-up
            times.append(time.perf_counter() - t)
    set_size("small")
    return statistics.median(times), sum(g.numel() * g.element_size() for g in grads)


def fit_jobs(args: argparse.Namespace, kinds: Sequence[str], paired: bool = False
             ) -> tuple[tuple[tuple[str, int, float], ...], dict[Any, Job]]:
    """--fit's points (``--points`` or the device's default) and one job per point and kind."""
    default = FIT_POINTS_CUDA if args.device == "cuda" else FIT_POINTS
    points = default if not args.points else tuple(
        (s, int(b), float(c)) for s, b, c in (p.split(":") for p in args.points.split(",")))
    jobs = {(point, kind): Job(kind, size=point[0], batch=point[1], bucket_cap_mb=point[2],
                               rounds=args.rounds, steps=args.steps, warmup=args.warmup, threads=args.threads,
                               device=args.device, paired=paired)
            for point in points for kind in kinds}
    return points, jobs


def save_and_project(args: argparse.Namespace, fits: Sequence[Fit], note: str = "", **extra: Any) -> None:
    """--save-fit's file, and the projection for --project's step (default: the small benchmark's)."""
    if args.save_fit:
        Path(args.save_fit).write_text(json.dumps({
            "machine": describe(), "torch": torch.__version__, "device": args.device, "world": args.world,
            "threads": args.threads, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "fits": [asdict(f) for f in fits], **extra}, indent=1))
        print(f"saved: {args.save_fit}")
    step_ms, grad_mb, buckets_n = (float(x) for x in args.project.split(",")) if args.project else (
        20.0, 1.36, 2.0)
    print(f"\nprojection for a {step_ms:g} ms step with {grad_mb:g} MB of gradients in {buckets_n:g} buckets "
          f"(on this machine's costs{note}):")
    print_projection(fits, step_ms / 1e3, grad_mb * 1e6, buckets_n)


def print_fits(title: str, data: dict[str, list[tuple[float, float, float]]]) -> list[Fit]:
    """Fit each mode's (buckets, gradient bytes, extra seconds) points and print the fits with each
    point measured against the model."""
    fits = [fit_cost(mode, pts) for mode, pts in data.items()]
    print(title)
    for f in fits:
        print(f"  nonfinite={f.mode!r:<8} {f.describe()}")
        for p in f.points:
            print(f"    {p['grad_bytes'] / 1e6:6.2f} MB, {p['buckets']:3.0f} buckets: measured "
                  f"{p['extra_s'] * 1e3:+.3f} ms, model {p['predicted_s'] * 1e3:+.3f} ms")
    return fits


def launch_fit_jobs(args: argparse.Namespace, jobs: dict[Any, Job]) -> tuple[dict[Any, list[Launched]], str]:
    """Run the cost model's launches (the machine's header first); what they measured, and the
    conditions they ran under (load average at start and end, wall time) in words."""
    load0 = os.getloadavg()
    t0 = time.monotonic()
    print(header(args.world, args.device, args.threads), flush=True)
    got = alternate(jobs, args.launches, args.world, max_other=args.max_other_cores)
    load1 = os.getloadavg()
    return got, (f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; wall "
                 f"{time.monotonic() - t0:.0f} s")


def run_fit(args: argparse.Namespace) -> int:
    """The cost model: FIT_POINTS x (none, after, check1), each in launches of its own."""
    points, jobs = fit_jobs(args, KINDS)
    got, conditions = launch_fit_jobs(args, jobs)
    print(f"cost model: {len(points)} points x {len(KINDS)} configurations, {args.launches} launches each "
          f"(alternating), {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; "
          f"{conditions}\n")
    print(f"{'model':<8}{'batch':>6}{'cap MB':>8}{'grad MB':>9}{'buckets':>8}{'plain step':>12}"
          f"{'after: extra (a..b)':>28}{'hook: extra (a..b)':>28}")
    data: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODE_OF.values()}
    data_cpu: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODE_OF.values()}
    rows = []
    for point in points:
        base_runs = got[(point, "none")]
        base = median_step(base_runs)
        base_cpu = statistics.median(statistics.median(r.cpu) for r in base_runs)
        hook_runs = got[(point, "check1")]
        buckets = float(max(r.buckets for r in hook_runs + base_runs))
        grad = float(base_runs[0].grad_bytes)
        cells = []
        for kind in ("after", "check1"):
            runs = got[(point, kind)]
            extra = median_step(runs) - base
            data[MODE_OF[kind]].append((buckets, grad, extra))
            cpu = statistics.median(statistics.median(r.cpu) for r in runs)
            data_cpu[MODE_OF[kind]].append((buckets, grad, cpu - base_cpu))
            lo, hi = spread(runs)
            blo, bhi = spread(base_runs)
            cells.append(f"{extra * 1e3:+.3f} ms ({(lo - bhi) * 1e3:+.2f}..{(hi - blo) * 1e3:+.2f})")
        rows.append({"size": point[0], "batch": point[1], "bucket_cap_mb": point[2], "grad_bytes": grad,
                     "buckets": buckets, "plain_step_s": base,
                     "launches": {k: [r.step for r in got[(point, k)]] for k in KINDS}})
        print(f"{point[0]:<8}{point[1]:>6}{point[2]:>8g}{grad / 1e6:>9.2f}{buckets:>8.0f}"
              f"{base * 1e3:>9.2f} ms{cells[0]:>28}{cells[1]:>28}")
    fits = print_fits("\nfitted: extra time per step = fixed + per bucket x buckets + per MB x gradient MB",
                      data)
    print("\nmode after's own work by itself (its NaN/Inf pass over each model's gradients and the read of "
          "its flag, one process, timed 500 times, median): what the whole-step figures above cannot resolve "
          "when the launches spread by more than it")
    direct = []
    for size in dict.fromkeys(p[0] for p in points):
        seconds, grad_bytes = after_pass_seconds(size, args.device)
        direct.append((1.0, float(grad_bytes), seconds))
        print(f"  {size:<8} {grad_bytes / 1e6:6.2f} MB: {seconds * 1e6:7.1f} us")
    if len(direct) >= 2:
        import numpy as np

        slope, icpt = np.polyfit([g for _, g, _ in direct], [s for _, _, s in direct], 1)
        print(f"  fitted: {icpt * 1e6:.1f} us per step + {slope * 1e12:.2f} us per MB of gradients")
    print("\nthe same fitted on rank 0's CPU time per step (which other load on the machine disturbs "
          "less than wall time; not the wall time a step costs):")
    for f in (fit_cost(mode, pts) for mode, pts in data_cpu.items()):
        print(f"  nonfinite={f.mode!r:<8} {f.describe()}")
    print("\nextra (a..b): the extra time per step, and in brackets the same with a configuration's "
          "slowest launch against plain's fastest and its fastest against plain's slowest.")
    save_and_project(args, fits, points=rows)
    return 0


def paired_extra(runs: Sequence[Launched], cpu: bool = False) -> list[float]:
    """--paired: each round's extra seconds per step with the check on over its paired "off" round."""
    out: list[float] = []
    for r in runs:
        on, off = (r.cpu, r.off_cpu) if cpu else (r.rounds, r.off_rounds)
        out += [a - b for a, b in zip(on, off, strict=True)]
    return out


def run_paired(args: argparse.Namespace) -> int:
    """The cost model from paired rounds: in each launch one guarded model trains rounds with the
    check on and off in turn (mode "after": ``guard.step`` or the plain ``optimizer.step()``; mode
    "hook": the guard's comm hook or the bare one behind it), so that a launch's own speed, which
    moves by more than the check costs, cancels out. Mode "hook"'s figure is its cost over a bare
    Python comm hook (the floor, +1.4 to +2 % in the A/B)."""
    kinds = ("after", "check1")
    points, jobs = fit_jobs(args, kinds, paired=True)
    got, conditions = launch_fit_jobs(args, jobs)
    print(f"paired cost model: {len(points)} points x {len(kinds)} modes, {args.launches} launch(es) each, "
          f"{args.rounds} pairs of rounds (check on, check off) x {args.steps} steps after 2 x {args.warmup} "
          f"warm-up; {conditions}\n")
    print(f"{'model':<8}{'batch':>6}{'cap MB':>8}{'grad MB':>9}{'buckets':>8}{'off step':>11}"
          f"{'after: extra (IQR)':>28}{'hook over floor (IQR)':>28}")
    data: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODE_OF.values()}
    data_cpu: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODE_OF.values()}
    for point in points:
        cells = []
        off = 0.0
        for kind in kinds:
            runs = got[(point, kind)]
            if any(r.disabled for r in runs):
                print(f"WARNING: the guard switched itself off at {point} {kind}: {runs[0].disabled}")
            extra = paired_extra(runs)
            q = statistics.quantiles(extra, n=4) if len(extra) >= 2 else [extra[0]] * 3
            buckets = float(max(r.buckets for r in runs))
            grad = float(runs[0].grad_bytes)
            off = statistics.median(x for r in runs for x in r.off_rounds)
            data[MODE_OF[kind]].append((buckets, grad, statistics.median(extra)))
            data_cpu[MODE_OF[kind]].append((buckets, grad, statistics.median(paired_extra(runs, cpu=True))))
            cells.append(f"{statistics.median(extra) * 1e3:+.3f} ms ({q[0] * 1e3:+.2f}..{q[2] * 1e3:+.2f})")
        print(f"{point[0]:<8}{point[1]:>6}{point[2]:>8g}{grad / 1e6:>9.2f}{buckets:>8.0f}{off * 1e3:>8.2f} ms"
              f"{cells[0]:>28}{cells[1]:>28}")
    fits = print_fits("\nfitted (wall): extra time per step = fixed + per bucket x buckets + per MB x "
                      "gradient MB", data)
    print("fitted (rank 0's CPU time):")
    for f in (fit_cost(mode, pts) for mode, pts in data_cpu.items()):
        print(f"  nonfinite={f.mode!r:<8} {f.describe()}")
    print("\nextra (IQR): the median over every pair of rounds of (check on - check off), per step, and "
          "the quartiles of those differences. 'hook' is over a bare Python comm hook: add the floor.")
    save_and_project(args, fits, "; 'hook' over the floor", method="paired")
    return 0


def measure(model_factory: Callable[[], nn.Module] | str, make_batch: Callable[[torch.device], Any] | str,
            loss_fn: Callable[[nn.Module, Any], torch.Tensor] | str | None = None, *, world: int = 2,
            device: str | None = None, bucket_cap_mb: float = 25.0, launches: int = 3, rounds: int = 3,
            steps: int = 30, warmup: int = 10, threads: int = 1, fit_file: str | None = None,
            max_other_cores: float | None = None) -> dict[str, Any]:
    """Check 1's cost on a model of yours, in both modes: ``none``, ``after`` and ``check1`` (mode
    "hook") each in ``launches`` launches of ``world`` local ranks (gloo on CPU, NCCL with
    ``device="cuda"``, one GPU per rank), alternating. ``model_factory()`` builds the model (a
    module-level function, or ``"module:function"``: each rank imports it), ``make_batch(device)``
    one micro-batch, ``loss_fn(model, batch)`` the loss (default: the mean of the first tensor of the
    model's output). Prints the measured step and costs and, with ``fit_file`` (``--fit --save-fit``),
    what the cost model projects for this model; returns the figures."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    jobs = {k: Job(k, bucket_cap_mb=bucket_cap_mb, rounds=rounds, steps=steps, warmup=warmup, threads=threads,
                   device=dev, model=model_factory, make_batch=make_batch, loss=loss_fn) for k in KINDS}
    print(header(world, dev, threads), flush=True)
    got = alternate(jobs, launches, world, max_other=max_other_cores)
    first = got["none"][0]
    base = median_step(got["none"])
    buckets = max(r.buckets for runs in got.values() for r in runs)
    print(f"your model: {first.params:,} parameters, {first.grad_bytes / 1e6:.2f} MB of gradients, "
          f"{buckets} buckets (bucket_cap_mb {bucket_cap_mb:g}); {launches} launches per configuration, "
          f"{rounds} rounds x {steps} steps")
    report_ab(got, KINDS)
    measured = {MODE_OF[k]: median_step(got[k]) - base for k in MODE_OF}
    fits = load_fits(fit_file)
    if fits:
        print(f"\nthe cost model ({fit_file}) for this model:")
        print_projection(fits, base, first.grad_bytes, buckets, measured)
    return {"step_s": base, "grad_bytes": first.grad_bytes, "buckets": buckets, "extra_s": measured,
            "launches": {k: [asdict(r) for r in runs] for k, runs in got.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks (local processes), default 2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100, help="steps per round per configuration")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-every", type=int, default=100, metavar="N")
    ap.add_argument("--audit-every", type=int, default=500, metavar="M")
    ap.add_argument("--pace-window", type=int, default=100, metavar="K",
                    help="straggler scores every K steps (Guard's default)")
    ap.add_argument("--weight-calls", type=int, default=20, help="timed weight checks")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="the model (default small)")
    ap.add_argument("--launches", type=int, default=1,
                    help="fresh launches of the ranks, each with its own models and guards and the "
                         "configurations in another order; rounds of every launch pooled (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ab = ap.add_argument_group("one configuration per launch (--ab, --fit, --model)")
    ab.add_argument("--ab", action="store_true", help="the A/B of --kinds, each in launches of its own")
    ab.add_argument("--kinds", default=",".join(KINDS),
                    help=f"--ab's configurations (none, hook, {', '.join(MODE_OF)}; default "
                         f"{','.join(KINDS)})")
    ab.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25)")
    ab.add_argument("--max-other-cores", type=float, default=None, metavar="C",
                    help="run a launch again (up to 3 times) when other processes kept more than C cores "
                         "busy during it (a shared machine)")
    ab.add_argument("--fit", action="store_true", help="fit the cost model over FIT_POINTS")
    ab.add_argument("--paired", action="store_true",
                    help="with --fit: each launch one guarded model, rounds with the check on and off in "
                         "turn (the launch's own speed cancels out)")
    ab.add_argument("--points", default="", metavar="SIZE:BATCH:CAP,...",
                    help="--fit's points instead of FIT_POINTS (e.g. small:8:25,small:8:0.25,...)")
    ab.add_argument("--save-fit", metavar="FILE", help="write the fitted model to FILE (JSON)")
    ab.add_argument("--fit-file", metavar="FILE", help="a fitted model (--save-fit) to project with")
    ab.add_argument("--project", metavar="STEP_MS,GRAD_MB,BUCKETS",
                    help="the overhead the model projects for such a step (with --fit, or --fit-file alone)")
    ab.add_argument("--model", metavar="MODULE:FUNCTION", help="your model's factory (no arguments)")
    ab.add_argument("--batch", metavar="MODULE:FUNCTION", help="your micro-batch: FUNCTION(device)")
    ab.add_argument("--loss", metavar="MODULE:FUNCTION", help="your loss: FUNCTION(model, batch) (optional)")
    args = ap.parse_args()
    set_size(args.size)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"--device cuda: {torch.cuda.device_count()} GPU(s) for --world {args.world}")
        return 3
    if args.model or args.batch:
        if not (args.model and args.batch):
            ap.error("--model and --batch go together")
        measure(args.model, args.batch, args.loss, world=args.world, device=args.device,
                bucket_cap_mb=args.bucket_cap_mb, launches=args.launches, rounds=args.rounds,
                steps=args.steps, warmup=args.warmup, threads=args.threads, fit_file=args.fit_file,
                max_other_cores=args.max_other_cores)
        return 0
    if args.fit:
        return run_paired(args) if args.paired else run_fit(args)
    if args.ab:
        return run_ab(args)
    if args.project:
        fits = load_fits(args.fit_file)
        if not fits:
            ap.error("--project needs --fit (measure now) or --fit-file (a saved fit)")
        step_ms, grad_mb, buckets = (float(x) for x in args.project.split(","))
        print(f"projection for a {step_ms:g} ms step, {grad_mb:g} MB of gradients, {buckets:g} buckets "
              f"({args.fit_file}):")
        print_projection(fits, step_ms / 1e3, grad_mb * 1e6, buckets)
        return 0
    load0 = os.getloadavg()
    # One process keeps one model and one guard per configuration: where each lands in memory, and
    # which runs after which, moved a configuration's steps by more than check 1 costs (seen on
    # this project's 2-core VM). Each launch builds them afresh, in another order, and the rounds
    # of all launches are pooled.
    kinds = ["none", "hook", "check1", "after", "pace", "pace_after", "audit1", "all", "all_after"]
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    for launch in range(max(1, args.launches)):
        turned = kinds[launch % len(kinds):] + kinds[:launch % len(kinds)]
        args.order = turned[::-1] if launch % 2 else turned
        with tempfile.TemporaryDirectory(prefix="guard-bench-") as out:
            spawn(worker, args=(args.world, _free_port(), args, out), nprocs=args.world,  # type: ignore[no-untyped-call]
                  join=True)
            got = json.loads(Path(out, "result.json").read_text())
        if not res:
            res = got
            continue
        for key in ("rounds", "cpu"):
            for kind, values in got[key].items():
                res[key][kind] += values
        res["weight_check_s"] += got["weight_check_s"]
        res["notes"] += got["notes"]
        res["disabled"].update(got["disabled"])
    wall = time.monotonic() - t0
    load1 = os.getloadavg()
    what = (f"{torch.cuda.get_device_name(0)}, NCCL" if args.device == "cuda" else
            f"CPU, gloo, {args.threads} torch thread(s) per rank")
    print(f"machine: {describe()}")
    print(f"torch {torch.__version__}; {args.world} ranks, {what}; TransformerEncoder {LAYERS} layers, "
          f"d_model {D_MODEL}, {HEADS} heads, ff {FF}, seq {SEQ}, micro-batch {BATCH}/rank, "
          f"{res['params']:,} parameters, AdamW")
    print(f"{max(1, args.launches)} launch(es) x {args.rounds} interleaved rounds x {args.steps} steps per "
          f"configuration after {args.warmup} warm-up; load average {load0[0]:.1f} at start, "
          f"{load1[0]:.1f} at end; wall {wall:.0f} s")
    for note in res["notes"]:
        print(note)
    if res["disabled"]:
        print(f"WARNING: the guard switched itself off: {res['disabled']}: figures below do not count")
    med = {k: statistics.median(v) for k, v in res["rounds"].items()}
    cpu = {k: statistics.median(v) for k, v in res["cpu"].items()}
    spread = {k: (min(v), max(v)) for k, v in res["rounds"].items()}
    base = med["none"]
    per_check = statistics.median(res["weight_check_s"])
    c1 = (med["check1"] - base) / base * 100
    c3 = per_check / args.weight_every / base * 100
    def cpu_text(kind: str) -> str:
        return f"{cpu[kind] * 1e3:>9.2f} ms {(cpu[kind] - cpu['none']) / cpu['none'] * 100:>+7.2f} %"

    print(f"\n{'configuration':<44}{'step (median)':>14}{'rounds min..max':>22}{'overhead':>11}"
          f"{'rank 0 CPU/step':>20}")
    print(f"{'none (plain DDP)':<44}{base * 1e3:>11.2f} ms{spread['none'][0] * 1e3:>11.2f}.."
          f"{spread['none'][1] * 1e3:<8.2f} ms{'':>8}{cpu['none'] * 1e3:>12.2f} ms")
    hook = (med["hook"] - base) / base * 100
    print(f"{'floor: a Python comm hook, no check':<44}{med['hook'] * 1e3:>11.2f} ms"
          f"{spread['hook'][0] * 1e3:>11.2f}..{spread['hook'][1] * 1e3:<8.2f} ms{hook:>+10.2f} %"
          f"{cpu_text('hook'):>21}")
    print(f"{'check 1 (non-finite gradients, every step)':<44}{med['check1'] * 1e3:>11.2f} ms"
          f"{spread['check1'][0] * 1e3:>11.2f}..{spread['check1'][1] * 1e3:<8.2f} ms{c1:>+10.2f} %"
          f"{cpu_text('check1'):>21}")
    ca = (med["after"] - base) / base * 100
    print(f"{'check 1, nonfinite=after (no comm hook)':<44}{med['after'] * 1e3:>11.2f} ms"
          f"{spread['after'][0] * 1e3:>11.2f}..{spread['after'][1] * 1e3:<8.2f} ms{ca:>+10.2f} %"
          f"{cpu_text('after'):>21}")
    print(f"{f'check 3 (weights, every {args.weight_every} steps)':<44}"
          f"{per_check * 1e3:>11.2f} ms per check{'':>8}{c3:>+10.3f} % amortised")
    cp = (med["pace"] - med["check1"]) / base * 100
    print(f"{f'stragglers (pace, scored every {args.pace_window} steps)':<44}{med['pace'] * 1e3:>11.2f} ms"
          f"{spread['pace'][0] * 1e3:>11.2f}..{spread['pace'][1] * 1e3:<8.2f} ms{cp:>+10.2f} % over check 1"
          f"{cpu_text('pace'):>21}")
    c2 = (med["audit1"] - med["check1"]) / args.audit_every / base * 100
    print(f"{f'check 2 (audit, every {args.audit_every} steps)':<44}"
          f"{(med['audit1'] - med['check1']) * 1e3:>11.2f} ms per audit{'':>8}{c2:>+10.3f} % amortised")
    label = f"all (1 + pace + 3 every {args.weight_every} + audit every {args.audit_every})"
    c_all = (med["all"] - base) / base * 100
    print(f"{label:<44}{med['all'] * 1e3:>11.2f} ms{spread['all'][0] * 1e3:>11.2f}.."
          f"{spread['all'][1] * 1e3:<8.2f} ms{c_all:>+10.2f} %{cpu_text('all'):>21}")
    total = c1 + cp + c2 + c3
    print(f"{'amortised sum (check 1 + pace + check 2 + 3)':<44}{'':>14}{'':>22}{total:>+10.2f} %")
    cpa = (med["pace_after"] - med["after"]) / base * 100
    print(f"{'stragglers over check 1 in mode after':<44}{med['pace_after'] * 1e3:>11.2f} ms"
          f"{spread['pace_after'][0] * 1e3:>11.2f}..{spread['pace_after'][1] * 1e3:<8.2f} ms{cpa:>+10.2f} %"
          f"{cpu_text('pace_after'):>21}")
    c_all_a = (med["all_after"] - base) / base * 100
    print(f"{'all, check 1 in mode after':<44}{med['all_after'] * 1e3:>11.2f} ms"
          f"{spread['all_after'][0] * 1e3:>11.2f}..{spread['all_after'][1] * 1e3:<8.2f} ms{c_all_a:>+10.2f} %"
          f"{cpu_text('all_after'):>21}")
    print(f"{'amortised sum, mode after':<44}{'':>14}{'':>22}{ca + cpa + c2 + c3:>+10.2f} %")
    print(f"{'check 1 over the floor':<44}{'':>14}{'':>22}{c1 - hook:>+10.2f} %")
    print("\noverhead = (median step time - none's) / none's; floor = DDP's all-reduce as a Python "
          "comm hook without a check (check 1 is such a hook: its cost over DDP's C++ all-reduce is "
          "in every design that checks in the hook); check 3 = one check's time / N / none's "
          "step; check 2 = (a step audited every step - a check-1 step) / M / none's step; "
          "rank 0 CPU/step = that process's CPU time (all its threads) per step, which other "
          "load on the machine disturbs less than wall time. On a shared machine the rounds' spread is "
          "the noise floor: a difference inside it is not a measurement.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
