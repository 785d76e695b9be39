"""The p2p check's measurement, run inside a worker (gpumon/workers.py) that drives every device:
copy bandwidth for each ordered pair of devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpumon.workers import WorkerContext


@dataclass(frozen=True)
class PeerCopySpec:
    pairs: tuple[tuple[int, int], ...]  # (source, destination) CUDA ordinals
    nbytes: int
    iterations: int
    warmup: int = 2


@dataclass(frozen=True)
class PeerCopy:
    src: int
    dst: int
    gbps: float  # bytes copied / s / 1e9 (one direction, as nvbandwidth reports memcpy)
    seconds: float
    peer_access: bool  # torch.cuda.can_device_access_peer(src, dst)
    verified: bool


def peer_copy_worker(ctx: WorkerContext, spec: PeerCopySpec) -> list[PeerCopy]:
    """Worker (one process, every device): copy bandwidth for each ordered pair, one pair at a time."""
    import torch

    def sync(*ordinals: int) -> None:
        if ctx.is_cuda:
            for o in ordinals:
                torch.cuda.synchronize(o)

    # stand-ins: this thread's CPU time (one thread copies), which other processes' load leaves alone
    clock = time.perf_counter if ctx.is_cuda else time.thread_time
    words = max(1, spec.nbytes // 4)
    out: list[PeerCopy] = []
    for src, dst in spec.pairs:
        ctx.progress(f"copy GPU {src} -> GPU {dst}", src=src, dst=dst)
        # stand-ins share one memory: "peer access" is what a copy between them always has
        access = bool(torch.cuda.can_device_access_peer(src, dst)) if ctx.is_cuda else True
        a = torch.arange(words, dtype=torch.int32, device=ctx.device_for(src)).mul_(40503)
        b = torch.empty(words, dtype=torch.int32, device=ctx.device_for(dst))
        with ctx.link(src, dst):
            for _ in range(spec.warmup):
                b.copy_(a)
            sync(src, dst)
            if ctx.is_cuda:
                t0 = clock()
                for _ in range(spec.iterations):
                    b.copy_(a)
                sync(src, dst)
                seconds = clock() - t0
            else:
                # stand-ins: the fastest copy, times the iterations; a stall of this process (another
                # process's turn on the memory bus) is not the link, a slow link is slow every time
                times = []
                for _ in range(spec.iterations):
                    t0 = clock()
                    b.copy_(a)
                    times.append(clock() - t0)
                seconds = min(times) * spec.iterations
        check = torch.arange(words, dtype=torch.int32, device=ctx.device_for(dst)).mul_(40503)
        verified = bool(torch.equal(b, check))
        out.append(PeerCopy(src, dst, words * 4.0 * spec.iterations / seconds / 1e9 if seconds > 0 else 0.0,
                            seconds, access, verified))
        del a, b, check
    return out
