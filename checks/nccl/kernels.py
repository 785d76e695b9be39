"""The nccl check's measurement, run inside the workers (gpumon/workers.py): an all-reduce sweep whose
exact integer sums are checked element by element.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumon.workers import WorkerContext

if TYPE_CHECKING:
    import torch



def busbw(algbw: float, ranks: int) -> float:
    """All-reduce bus bandwidth: algbw x 2(n-1)/n (nccl-tests doc/PERFORMANCE.md, "AllReduce")."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    return algbw * 2.0 * (ranks - 1) / ranks





@dataclass(frozen=True)
class AllReduceSpec:
    backend: str  # "nccl" | "gloo"
    store_path: str  # a file the ranks rendezvous through (torch.distributed FileStore)
    sizes: tuple[int, ...]  # bytes per rank, float32 elements
    iterations: int
    warmup: int
    seed: int = 7
    timeout_s: float = 300.0  # the process group's own bound on one collective
    chunk_elems: int = 1 << 26  # the data pattern is written and checked this many elements at a time


@dataclass(frozen=True)
class SizeResult:
    nbytes: int
    elements: int
    seconds: float  # this rank's mean time per all-reduce
    wrong: int  # elements that differ from the exact sum (two checks: before and after the timing)
    checked: int


@dataclass(frozen=True)
class AllReduceReport:
    rank: int
    world: int
    backend: str
    sizes: tuple[SizeResult, ...]


# Data pattern: element i of rank r holds ((i * P + r * Q + seed) mod M) - M // 2, small integers in
# float32, so every sum over up to 2^24 / (M / 2) ranks is exact and any wrong element is a fault.
_PAT_P, _PAT_Q, _PAT_M = 7919, 104729, 1021


def pattern(start: int, stop: int, rank: int, seed: int, device: str) -> torch.Tensor:
    """float32 values rank ``rank`` contributes at elements [start, stop)."""
    import torch

    idx = torch.arange(start, stop, dtype=torch.int64, device=device)
    return ((idx * _PAT_P + (rank * _PAT_Q + seed)) % _PAT_M - _PAT_M // 2).to(torch.float32)


def expected_sum(start: int, stop: int, world: int, seed: int, device: str) -> torch.Tensor:
    """The exact all-reduce sum at elements [start, stop) when every rank used ``seed``."""
    import torch

    total = torch.zeros(stop - start, dtype=torch.float32, device=device)
    for r in range(world):
        total.add_(pattern(start, stop, r, seed, device))
    return total


def _fill(buf: torch.Tensor, rank: int, seed: int, chunk: int, device: str) -> None:
    for s in range(0, buf.numel(), chunk):
        e = min(buf.numel(), s + chunk)
        buf[s:e].copy_(pattern(s, e, rank, seed, device))


def _count_wrong(buf: torch.Tensor, world: int, seed: int, chunk: int, device: str) -> int:
    wrong = 0
    for s in range(0, buf.numel(), chunk):
        e = min(buf.numel(), s + chunk)
        wrong += int((buf[s:e] != expected_sum(s, e, world, seed, device)).sum())
    return wrong


def allreduce_worker(ctx: WorkerContext, spec: AllReduceSpec) -> AllReduceReport:
    """Worker: a size sweep of all-reduce (sum) over every rank, timed and checked element by element."""
    import datetime

    import torch
    import torch.distributed as dist

    ctx.progress("rendezvous", backend=spec.backend)
    # NCCL: bind the group to this rank's GPU now (eager communicator setup, no device guess later)
    device_id = torch.device(ctx.device) if ctx.is_cuda else None
    dist.init_process_group(spec.backend, init_method=f"file://{spec.store_path}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=spec.timeout_s),
                            device_id=device_id)
    results: list[SizeResult] = []
    for nbytes in spec.sizes:
        elems = max(1, nbytes // 4)
        label = size_label(elems * 4)
        buf = torch.empty(elems, dtype=torch.float32, device=ctx.device)
        wrong = 0
        ctx.progress(f"all_reduce {label} check")
        _fill(buf, ctx.rank, spec.seed, spec.chunk_elems, ctx.device)
        dist.all_reduce(buf)
        wrong += _count_wrong(buf, ctx.world, spec.seed, spec.chunk_elems, ctx.device)
        # the timed loop runs on zeros: a sum of zeros stays zero (repeated sums of the
        # pattern would overflow) and the speed of a sum does not depend on the values
        buf.zero_()
        ctx.progress(f"all_reduce {label} timed")
        for _ in range(spec.warmup):
            dist.all_reduce(buf)
        ctx.sync()
        dist.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(spec.iterations):
            dist.all_reduce(buf)
        ctx.sync()
        seconds = (time.perf_counter() - t0) / max(1, spec.iterations)
        ctx.progress(f"all_reduce {label} recheck")
        _fill(buf, ctx.rank, spec.seed, spec.chunk_elems, ctx.device)
        dist.all_reduce(buf)
        wrong += _count_wrong(buf, ctx.world, spec.seed, spec.chunk_elems, ctx.device)
        results.append(SizeResult(nbytes=elems * 4, elements=elems, seconds=seconds, wrong=wrong,
                                  checked=2 * elems))
        del buf
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    # not in a finally: tearing down after a failed collective (a dead peer) can hang, and the error
    # must reach the parent; the process exit releases the communicator then
    ctx.progress("teardown")
    dist.destroy_process_group()
    return AllReduceReport(rank=ctx.rank, world=ctx.world, backend=spec.backend, sizes=tuple(results))


def size_label(nbytes: int) -> str:
    """4294967296 -> "4 GiB"; sizes that are not whole units stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
