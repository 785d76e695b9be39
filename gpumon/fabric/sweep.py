"""The measurements one rank runs: a collective sweep over the whole group, and pair exchanges.

Imported only inside a rank (it imports torch). Every record is plain data (JSON), judged by
``gpumon.fabric.judge`` on rank 0.

**Data.** Every element a rank sends is a small integer in float32 that says who sent it:
``((i * P + src * Q + seed) mod M) - M // 2`` for element ``i`` of source rank ``src``. Sums of up
to 2^24 / (M / 2) = 32,000 ranks are exact, so a result either equals the expected one or is a
fault. all_gather and alltoall deliver each source's chunk unchanged, so a wrong chunk names its
source rank; all_reduce and reduce_scatter mix the contributions, so when any rank saw a wrong
sum (agreed by a MAX all-reduce of the counts) every rank all-gathers the same inputs once more,
and a contribution that arrives wrong names its rank. Inputs are refilled before every iteration
and every iteration's result is checked, outside the timed region.

**Sizes** follow nccl-tests: the size of a collective is its largest buffer (all_reduce: the
buffer; all_gather: the output; reduce_scatter: the input; alltoall: either), rounded so that each
rank's chunk is whole. algbw = size / time; busbw = algbw x the factors of nccl-tests
doc/PERFORMANCE.md: all_reduce 2(n-1)/n, all_gather, reduce_scatter and alltoall (n-1)/n,
sendrecv 1.

**Timing.** Per iteration, each rank times its own call (CUDA: synchronised before and after);
after the warm-up and three timed iterations the ranks agree (MAX all-reduce) on the time per
iteration and run as many more as fit in the size's budget, at most ``iterations``, so a slow link
cannot stretch the sweep past its deadline and every rank runs the same calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_P, _Q, _M = 7919, 104729, 1021
MIN_TIMED = 3


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests doc/PERFORMANCE.md: the bus bandwidth factor of each operation."""
    if op == "all_reduce":
        return 2.0 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (world - 1) / world
    return 1.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class OpResult:
    """One operation at one size, as one rank saw it."""

    op: str
    nbytes: int
    iterations: int = 0
    p50_s: float = math.nan
    p95_s: float = math.nan
    p99_s: float = math.nan
    wrong: int = 0  # elements this rank received wrong, over every iteration
    checked: int = 0
    # source rank -> wrong elements traced to its contribution (as str keys: JSON)
    wrong_sources: dict[str, int] = field(default_factory=dict)
    peer: int | None = None  # sendrecv: the partner rank
    error: str | None = None
    # the slowest warm-up call and the slowest agreement (through the store) of this size: a stall
    # there (a link down for a second) is a finding as much as one in a timed iteration
    warmup_max_s: float = math.nan
    agree_max_s: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpResult:
        out = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        for name in ("p50_s", "p95_s", "p99_s", "warmup_max_s", "agree_max_s"):
            if getattr(out, name) is None:
                setattr(out, name, math.nan)
        return out


@dataclass(frozen=True)
class SweepPlan:
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    iterations: int
    warmup: int
    size_budget_s: float
    seed: int


@dataclass
class _Timing:
    times: list[float] = field(default_factory=list)
    wrong: int = 0
    checked: int = 0
    sources: dict[int, int] = field(default_factory=dict)
    warmup_max_s: float = math.nan
    agree_max_s: float = math.nan

    def agreed(self, seconds: float) -> None:
        self.agree_max_s = seconds if math.isnan(self.agree_max_s) else max(self.agree_max_s, seconds)


def sizes(min_bytes: int, max_bytes: int, factor: int) -> tuple[int, ...]:
    out, n = [], max(1, min_bytes)
    while n <= max_bytes:
        out.append(n)
        n *= factor
    if out[-1] != max_bytes:
        out.append(max_bytes)
    return tuple(out)


# ranks that must agree on a value, and this rank's value -> the largest of theirs
Agree = Callable[[Sequence[int], float], float]


class Rank:
    """This rank's view of the group, the device and the clock; ``progress`` says where it is.

    ``agree``: how ranks agree on a number (the slowest time per iteration, whether any saw a wrong
    sum). The probe passes one that goes through the rendezvous store, off the data path under test:
    a device that corrupts what it receives would otherwise corrupt the agreement too, and ranks
    that disagree make different calls and hang. Without one (tests of the sweep alone): a MAX
    all-reduce or an exchange over the process group."""

    def __init__(self, dist: Any, rank: int, world: int, device: str,
                 progress: Callable[[str], None], agree: Agree | None = None) -> None:
        import torch

        self.dist = dist
        self.torch = torch
        self.rank = rank
        self.world = world
        self.device = device
        self.cuda = device.startswith("cuda")
        self.progress = progress
        self._agree = agree

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def pattern(self, n: int, src: int, seed: int, offset: int = 0) -> torch.Tensor:
        th = self.torch
        idx = th.arange(offset, offset + n, dtype=th.int64, device=self.device)
        out: torch.Tensor = ((idx * _P + (src * _Q + seed)) % _M - _M // 2).to(th.float32)
        return out

    def agree_max(self, value: float) -> float:
        """The largest ``value`` of every rank of the group."""
        if self._agree is not None:
            return self._agree(range(self.world), value)
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def agree_pair(self, peer: int, value: float) -> float:
        """The larger ``value`` of this rank and ``peer``."""
        if self._agree is not None:
            return self._agree(sorted((self.rank, peer)), value)
        th = self.torch
        mine = th.tensor([value], dtype=th.float64, device=self.device)
        theirs = th.empty_like(mine)
        _exchange(self.dist, mine, theirs, peer)
        return max(value, float(theirs.item()))


class _Op:
    """One collective at one size: buffers, one call, and the check of its result."""

    name = ""

    def __init__(self, r: Rank, nbytes: int, seed: int) -> None:
        self.r, self.seed = r, seed
        self.chunk = max(1, nbytes // 4 // r.world)

    @property
    def nbytes(self) -> int:
        return self.chunk * self.r.world * 4

    def refill(self) -> None: ...

    def call(self) -> None: ...

    def check(self) -> tuple[int, int, dict[int, int]]:
        """(wrong elements, checked elements, wrong elements by source rank where known)."""
        raise NotImplementedError

    def contribution(self) -> torch.Tensor:
        """What this rank contributed (for tracing a wrong sum to its source)."""
        raise NotImplementedError


def _by_chunk(got: torch.Tensor, want: torch.Tensor, chunk: int) -> tuple[int, dict[int, int]]:
    bad = (got != want).reshape(-1, chunk).sum(dim=1)
    per = {i: int(v) for i, v in enumerate(bad.tolist()) if v}
    return sum(per.values()), per


class _AllReduce(_Op):
    name = "all_reduce"

    def __init__(self, r: Rank, nbytes: int, seed: int) -> None:
        super().__init__(r, nbytes, seed)
        n = self.chunk * r.world
        self.mine = r.pattern(n, r.rank, seed)
        self.buf = self.mine.clone()
        self.want = r.torch.zeros(n, dtype=r.torch.float32, device=r.device)
        for src in range(r.world):
            self.want.add_(r.pattern(n, src, seed))

    def refill(self) -> None:
        self.buf.copy_(self.mine)

    def call(self) -> None:
        self.r.dist.all_reduce(self.buf)

    def check(self) -> tuple[int, int, dict[int, int]]:
        return int((self.buf != self.want).sum()), self.buf.numel(), {}

    def contribution(self) -> torch.Tensor:
        return self.mine


class _ReduceScatter(_Op):
    name = "reduce_scatter"

    def __init__(self, r: Rank, nbytes: int, seed: int) -> None:
        super().__init__(r, nbytes, seed)
        self.mine = r.pattern(self.chunk * r.world, r.rank, seed)
        self.inp = self.mine.clone()
        self.out = r.torch.empty(self.chunk, dtype=r.torch.float32, device=r.device)
        self.want = r.torch.zeros(self.chunk, dtype=r.torch.float32, device=r.device)
        for src in range(r.world):
            self.want.add_(r.pattern(self.chunk, src, seed, offset=r.rank * self.chunk))
        fn = getattr(r.dist, "reduce_scatter_single", None) or r.dist.reduce_scatter_tensor
        self._fn = fn

    def refill(self) -> None:
        self.inp.copy_(self.mine)

    def call(self) -> None:
        self._fn(self.out, self.inp)

    def check(self) -> tuple[int, int, dict[int, int]]:
        return int((self.out != self.want).sum()), self.chunk, {}

    def contribution(self) -> torch.Tensor:
        return self.mine


class _AllGather(_Op):
    name = "all_gather"

    def __init__(self, r: Rank, nbytes: int, seed: int) -> None:
        super().__init__(r, nbytes, seed)
        self.mine = r.pattern(self.chunk, r.rank, seed)
        self.inp = self.mine.clone()
        self.out = r.torch.empty(self.chunk * r.world, dtype=r.torch.float32, device=r.device)
        self.want = r.torch.cat([r.pattern(self.chunk, src, seed) for src in range(r.world)])
        self._fn = getattr(r.dist, "all_gather_single", None) or r.dist.all_gather_into_tensor

    def refill(self) -> None:
        self.inp.copy_(self.mine)

    def call(self) -> None:
        self._fn(self.out, self.inp)

    def check(self) -> tuple[int, int, dict[int, int]]:
        wrong, per = _by_chunk(self.out, self.want, self.chunk)
        return wrong, self.out.numel(), per


class _AllToAll(_Op):
    name = "alltoall"

    def __init__(self, r: Rank, nbytes: int, seed: int) -> None:
        super().__init__(r, nbytes, seed)
        n = self.chunk * r.world
        # chunk j of rank r's input goes to rank j: the part of r's pattern at j's offset
        self.mine = r.pattern(n, r.rank, seed)
        self.inp = self.mine.clone()
        self.out = r.torch.empty(n, dtype=r.torch.float32, device=r.device)
        self.want = r.torch.cat([r.pattern(self.chunk, src, seed, offset=r.rank * self.chunk)
                                 for src in range(r.world)])

    def refill(self) -> None:
        self.inp.copy_(self.mine)

    def call(self) -> None:
        self.r.dist.all_to_all_single(self.out, self.inp)

    def check(self) -> tuple[int, int, dict[int, int]]:
        wrong, per = _by_chunk(self.out, self.want, self.chunk)
        return wrong, self.out.numel(), per


OPS: dict[str, type[_Op]] = {c.name: c for c in (_AllReduce, _AllGather, _ReduceScatter, _AllToAll)}


def _trace_sources(r: Rank, op: _Op) -> dict[int, int]:
    """All-gather every rank's contribution once more; a contribution that arrives wrong names its rank."""
    mine = op.contribution()
    out = r.torch.empty(mine.numel() * r.world, dtype=r.torch.float32, device=r.device)
    fn = getattr(r.dist, "all_gather_single", None) or r.dist.all_gather_into_tensor
    fn(out, mine.clone())
    want = r.torch.cat([r.pattern(mine.numel(), src, op.seed) for src in range(r.world)])
    _, per = _by_chunk(out, want, mine.numel())
    return per


def _timed(r: Rank, plan: SweepPlan, label: str, refill: Callable[[], None], call: Callable[[], None],
           check: Callable[[], tuple[int, int, dict[int, int]]], agree: Callable[[float], float],
           first: bool = False) -> _Timing:
    """Warm-up, then timed iterations (every result checked). Each warm-up call and the agreement
    are timed too: a stall in them (a link down for a second) must leave a trace. ``first``: the
    first size of an operation, whose first call carries one-time setup (connections, lazy
    initialisation: 1.7 s seen under the fault harness) and is not timed as a stall."""
    out = _Timing()
    r.progress(f"{label} warm-up")
    for k in range(plan.warmup):
        refill()
        r.sync()
        t0 = time.perf_counter()
        call()
        r.sync()
        took = time.perf_counter() - t0
        if not (first and k == 0):
            out.warmup_max_s = took if math.isnan(out.warmup_max_s) else max(out.warmup_max_s, took)
    times = out.times
    n = plan.iterations
    i = 0
    while i < n:
        refill()
        r.sync()
        t0 = time.perf_counter()
        call()
        r.sync()
        times.append(time.perf_counter() - t0)
        w, c, per = check()
        out.wrong, out.checked = out.wrong + w, out.checked + c
        for k, v in per.items():
            out.sources[k] = out.sources.get(k, 0) + v
        i += 1
        if i == MIN_TIMED and n > MIN_TIMED:
            # every rank must make the same calls: agree on the slowest rank's time per iteration
            t0 = time.perf_counter()
            per_iter = agree(sum(times) / len(times))
            out.agreed(time.perf_counter() - t0)
            n = max(MIN_TIMED, min(n, int(plan.size_budget_s / per_iter) if per_iter > 0 else n))
            r.progress(f"{label} timed ({n} iterations)")
    return out


def _result(op: str, nbytes: int, t: _Timing, peer: int | None = None) -> OpResult:
    times = t.times
    return OpResult(op=op, nbytes=nbytes, iterations=len(times), p50_s=percentile(times, 0.5),
                    p95_s=percentile(times, 0.95), p99_s=percentile(times, 0.99), wrong=t.wrong,
                    checked=t.checked, wrong_sources={str(k): v for k, v in sorted(t.sources.items())},
                    peer=peer, warmup_max_s=t.warmup_max_s, agree_max_s=t.agree_max_s)


def collective_sweep(r: Rank, plan: SweepPlan, done: list[OpResult]) -> None:
    """Every collective of the plan at every size, over the whole group; results appended to ``done``
    as they finish (the watchdog reports what was measured when a later call hangs)."""
    for name in plan.ops:
        for nbytes in plan.sizes:
            op = OPS[name](r, nbytes, plan.seed)
            label = f"{name} {op.nbytes} B"
            t = _timed(r, plan, label, op.refill, op.call, op.check, r.agree_max,
                       first=nbytes == plan.sizes[0])
            # a wrong sum on any rank: trace it (every rank must take part, so agree first)
            if name in ("all_reduce", "reduce_scatter"):
                t0 = time.perf_counter()
                any_wrong = r.agree_max(float(t.wrong)) > 0
                t.agreed(time.perf_counter() - t0)
                if any_wrong:
                    r.progress(f"{label} tracing a wrong sum")
                    t.sources = _trace_sources(r, op)
            done.append(_result(name, op.nbytes, t))
            del op
            if r.cuda:
                r.torch.cuda.empty_cache()


def pair_exchange(r: Rank, peer: int, plan: SweepPlan, done: list[OpResult]) -> None:
    """Send and receive ``plan.sizes`` to and from ``peer`` at once (both directions), timed and checked."""
    th, dist = r.torch, r.dist

    def agree(value: float) -> float:
        return r.agree_pair(peer, value)

    for nbytes in plan.sizes:
        n = max(1, nbytes // 4)
        mine = r.pattern(n, r.rank, plan.seed)
        want = r.pattern(n, peer, plan.seed)
        send = mine.clone()
        recv = th.empty_like(mine)

        def refill(send: torch.Tensor = send, mine: torch.Tensor = mine) -> None:
            send.copy_(mine)

        def call(send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
            _exchange(dist, send, recv, peer)

        def check(recv: torch.Tensor = recv, want: torch.Tensor = want) -> tuple[int, int, dict[int, int]]:
            wrong = int((recv != want).sum())
            return wrong, recv.numel(), ({peer: wrong} if wrong else {})

        t = _timed(r, plan, f"sendrecv {n * 4} B with rank {peer}", refill, call, check, agree,
                   first=nbytes == plan.sizes[0])
        done.append(_result("sendrecv", n * 4, t, peer=peer))


def _exchange(dist: Any, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
    for req in reqs:
        req.wait()
