"""What the in-job guard (gpumon.guard) costs per training step, per check, on a small transformer
trained with real DDP.

    .venv/bin/python bench/guard_overhead.py [--world 2] [--rounds 5] [--steps 100] [--launches 1]
                                             [--device cpu|cuda]

``--world`` ranks are local processes (gloo on CPU, NCCL with ``--device cuda``, one GPU each),
each training the same 2-layer ``nn.TransformerEncoder`` language model (d_model 128, 4 heads,
sequence 64, micro-batch 8 per rank; ``--size medium``: 4 layers, d_model 256, 8 heads, ff 1024) on
deterministic token batches. Configurations, each its own
DDP model, measured in interleaved rounds of ``--steps`` steps (so that load on a shared machine hits
them alike), the median round per configuration:

- ``none``: plain DDP, no guard;
- ``hook``: plain DDP with its all-reduce as a Python comm hook and no check (``bare_hook``): the
  floor of a check done in a comm hook, as check 1 is;
- ``check 1``: ``Guard(weight_check_every=0)``: the non-finite gradient check every step (the
  guard's comm hook: a NaN/Inf test of each bucket before and after the all-reduce, every rank's
  local flag carried in the last bucket, one host read of the flags before ``optimizer.step()``);
- ``check 3``: the weight fingerprint check (``guard.check_weights()``), timed by itself and
  amortised over N = ``--weight-every`` (100) steps;
- ``check 2``: the ring re-execution audit, measured as a guard auditing every step
  (``audit_every=1``) against check 1 alone, amortised over M = ``--audit-every`` (500);
- ``pace``: check 1 and the straggler scores (``pace_window`` K, 100: the Guard's default),
  against check 1 alone;
- ``all``: ``Guard(weight_check_every=N, audit_every=M, pace_window=K)``, measured the same way.

Every configuration runs under ``gpumon.guard.deterministic()`` (the audit refuses a run that is
not deterministic), so the baseline pays what the audit's precondition costs too.

Overheads are printed as % of the ``none`` step time, with the machine and the load it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe

from gpumon.guard import Guard, deterministic

VOCAB, SEQ, BATCH, D_MODEL, HEADS, LAYERS, FF = 256, 64, 8, 128, 4, 2, 256
# --size: the model trained (d_model, heads, layers, ff); "small" is the default above (339k
# parameters), "medium" a 4-layer d_model 256 one (3.3M) whose step is long enough for the guard's
# fixed per-step costs to show what they weigh beside real work
SIZES = {"small": (128, 4, 2, 256), "medium": (256, 8, 4, 1024)}


def set_size(name: str) -> None:
    global D_MODEL, HEADS, LAYERS, FF
    D_MODEL, HEADS, LAYERS, FF = SIZES[name]


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
        return self.head(self.encoder(self.embed(tokens) + self.pos, mask=mask, is_causal=True))


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``: any rank can rebuild any other's (the audit)."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loop's own forward and loss: what the audit (check 2) replays on another rank."""
    x, y = b
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


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
        if kind in ("audit1", "all"):
            extra = {"audit_every": 1 if kind == "audit1" else args.audit_every, "batch_for": rebuild,
                     "loss_fn": lm_loss}
        every = args.weight_every if kind == "all" else 0
        # the straggler scores (gpumon.guard.pace) are on by default: off in check1 and audit1, so
        # that "pace" (check 1 + the scores every --pace-window steps) shows what they add
        pace = args.pace_window if kind in ("pace", "all") else 0
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
            loss.backward()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bare_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce as a Python comm hook, with no check: what the guard's hook does
    without its checks (the sum of buffer / world over the model's group, the process group called
    directly, one callback). What it costs over DDP's built-in C++ all-reduce is the floor of any
    check that is done in a DDP comm hook, as issue 19 asks for check 1."""
    group = dist.group.WORLD
    assert group is not None
    buf = bucket.buffer().div_(group.size())
    return group.allreduce([buf]).get_future().then(lambda f: f.value()[0])


# DDP compares a hook's annotations with the real objects; this module's are strings (__future__)
bare_hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


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
    args = ap.parse_args()
    set_size(args.size)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"--device cuda: {torch.cuda.device_count()} GPU(s) for --world {args.world}")
        return 3
    load0 = os.getloadavg()
    # One process keeps one model and one guard per configuration: where each lands in memory, and
    # which runs after which, moved a configuration's steps by more than check 1 costs (seen on
    # this project's 2-core VM). Each launch builds them afresh, in another order, and the rounds
    # of all launches are pooled.
    kinds = ["none", "hook", "check1", "pace", "audit1", "all"]
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    for launch in range(max(1, args.launches)):
        turned = kinds[launch % len(kinds):] + kinds[:launch % len(kinds)]
        args.order = turned[::-1] if launch % 2 else turned
        with tempfile.TemporaryDirectory(prefix="guard-bench-") as out:
            mp.spawn(worker, args=(args.world, _free_port(), args, out), nprocs=args.world, join=True)
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
