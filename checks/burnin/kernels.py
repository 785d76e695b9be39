"""The burn-in's measurements, run inside the workers (gpumon/workers.py): timed GEMMs in each dtype,
every result checked against an fp64 reference within a proven bound, and a device-memory copy.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumon.workers import WAITING, WorkerContext, timing_event

if TYPE_CHECKING:
    import torch



# GEMM dtypes by the name used in config and reports. tf32 is fp32 storage with TF32 tensor-core
# math (CUDA only); fp32 is IEEE fp32 math (TF32 off).
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp64")
CPU_DTYPES = ("bf16", "fp16", "fp32", "fp64")

# Unit roundoff u = 2^-p of each storage format (p = significand bits incl. the implicit one):
# IEEE 754 binary16/32/64 (p = 11, 24, 53), bfloat16 (p = 8), TF32 (p = 11: 10 stored bits,
# NVIDIA A100 Tensor Core GPU Architecture whitepaper, "TF32").
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "tf32": 2.0**-11, "fp32": 2.0**-24, "fp64": 2.0**-53}




def gemm_tolerance(dtype: str, k: int) -> float:
    """Bound on |C - C_exact| / (|A| @ |B|) for one element of an m x k x n GEMM in ``dtype``.

    A deterministic worst-case bound (Higham, Accuracy and Stability of Numerical Algorithms,
    2nd ed., 3.1: |fl(x.y) - x.y| <= gamma_k |x|.|y|, gamma_k = k u / (1 - k u)), so a result
    outside it is wrong, never merely unlucky rounding:

    - bf16/fp16: inputs exact in fp32, products exact, fp32 accumulation (cuBLAS
      CUBLAS_COMPUTE_32F; reduced-precision reductions are switched off by the worker):
      gamma_k(fp32) plus one rounding of the output to the storage format.
    - tf32: each input rounded to TF32 inside the tensor core (<= 2^-10 relative even when
      truncated, 10 stored bits), so a product is off by <= 2 x 2^-10; then fp32 accumulation.
    - fp32: gamma_k(fp32). fp64: gamma_k(fp64) twice, because the fp64 reference is rounded too.
    """
    u32 = UNIT_ROUNDOFF["fp32"]

    def gamma(u: float) -> float:
        return k * u / (1.0 - k * u)

    if dtype in ("bf16", "fp16"):
        return gamma(u32) + UNIT_ROUNDOFF[dtype]
    if dtype == "tf32":
        return 2.0 * 2.0**-10 + gamma(u32) + u32
    if dtype == "fp32":
        return gamma(u32)
    if dtype == "fp64":
        return 2.0 * gamma(UNIT_ROUNDOFF["fp64"])
    raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")





@dataclass(frozen=True)
class BurnSpec:
    dtypes: tuple[str, ...]
    size: int  # square GEMM n x n x n
    duration_s: float  # per dtype, all devices together
    seed: int = 20260101
    reference_rows: int = 8
    copy_bytes: int = 1 << 30
    copy_iters: int = 20
    block_s: float = 0.25  # verification and timing granularity
    barrier_timeout_s: float = 300.0


@dataclass(frozen=True)
class GemmResult:
    dtype: str
    size: int
    iterations: int
    gemm_s: float  # device time spent in the timed GEMMs
    tflops: float
    block_tflops: tuple[float, ...]
    fingerprint: str  # sha256 of the first output's bytes
    unstable_iterations: int  # timed GEMMs whose output differed from the first one's
    unstable_elements: int
    reference_checked: int
    reference_bad: int  # checked elements outside the rounding bound
    reference_worst: float  # max |C - ref| / bound over the checked elements (<= 1 is right)
    wall_s: float


@dataclass(frozen=True)
class CopyResult:
    nbytes: int
    iterations: int
    seconds: float
    gbps: float  # (read + write) bytes / s / 1e9, as CUDA's bandwidthTest counts device-to-device
    verified: bool  # the copy equals its source
    attempts: tuple[float, ...] = ()  # GB/s of each measurement; ``gbps`` is the best


@dataclass(frozen=True)
class BurnReport:
    gemms: tuple[GemmResult, ...]
    copy: CopyResult | None


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
            "fp32": torch.float32, "fp64": torch.float64}[name]


def _set_math(name: str, cuda: bool) -> None:
    """TF32 on for tf32 only; no reduced-precision reductions, so the rounding bound holds."""
    import torch

    torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
    if cuda:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def gemm_inputs(size: int, dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands: uniform in [-1, 1), the same bits for a seed on every device and host.

    Drawn on the CPU (torch's CPU generator does not depend on the device), then cast.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(size, size, generator=gen, dtype=torch.float32).mul_(2).sub_(1)
    b = torch.rand(size, size, generator=gen, dtype=torch.float32).mul_(2).sub_(1)
    target = _torch_dtype(dtype)
    return a.to(target), b.to(target)


def fingerprint(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (on the host): equal fingerprints mean bit-identical results."""
    import torch

    flat = t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def reference_check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dtype: str,
                    rows: int) -> tuple[int, int, float]:
    """(checked, outside the bound, worst |C - ref| / bound) for ``rows`` evenly spaced rows of C.

    The reference is an fp64 GEMM on the host of the same (already cast) operands; the bound is
    ``gemm_tolerance`` times ``|A| @ |B|`` (plus the smallest normal number for exact zeros).
    """
    import torch

    n = a.shape[0]
    k = a.shape[1]
    picks = sorted({min(n - 1, (i * n) // max(1, rows)) for i in range(max(1, rows))})
    a_rows = a[picks].to("cpu", torch.float64)
    c_rows = c[picks].to("cpu", torch.float64)
    tol = gemm_tolerance(dtype, k)
    bad = 0
    worst = 0.0
    chunk = 1024  # columns of B at a time: bounds host memory for large n
    b_host = b.to("cpu")
    for j0 in range(0, b.shape[1], chunk):
        b_cols = b_host[:, j0:j0 + chunk].to(torch.float64)
        ref = a_rows @ b_cols
        bound = (a_rows.abs() @ b_cols.abs()).mul_(tol).add_(torch.finfo(torch.float64).tiny)
        ratio = (c_rows[:, j0:j0 + chunk] - ref).abs_().div_(bound)
        # NaN compares false: count it as outside the bound explicitly
        ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
        bad += int((ratio > 1.0).sum())
        worst = max(worst, float(ratio.max()))
    return len(picks) * b.shape[1], bad, worst


def _timed_gemm_block(ctx: WorkerContext, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                      first: torch.Tensor, count: int, bad: torch.Tensor, bad_iters: torch.Tensor) -> float:
    """``count`` GEMMs, each output compared with the first one's on the device; GEMM seconds."""
    import torch

    if ctx.is_cuda:
        marks = [(timing_event(), timing_event()) for _ in range(count)]
        for begin, end in marks:
            begin.record()
            torch.matmul(a, b, out=c)
            end.record()
            diff = (c != first).sum()
            bad.add_(diff)
            bad_iters.add_((diff > 0).to(bad_iters.dtype))
        torch.cuda.synchronize()
        return float(sum(begin.elapsed_time(end) for begin, end in marks)) / 1000.0
    # a CPU stand-in's own CPU time, not wall time: N workers time-slice on fewer cores and the
    # wall clock would time the scheduler (torch runs one thread per stand-in: this one)
    spent = 0.0
    for _ in range(count):
        t0 = time.thread_time()
        torch.matmul(a, b, out=c)
        spent += time.thread_time() - t0
        diff = (c != first).sum()
        bad.add_(diff)
        bad_iters.add_((diff > 0).to(bad_iters.dtype))
    return spent


def _burn_dtype(ctx: WorkerContext, spec: BurnSpec, dtype: str) -> GemmResult:
    import torch

    wall0 = time.monotonic()
    n = spec.size
    _set_math(dtype, ctx.is_cuda)
    ctx.progress("prepare", dtype=dtype)
    a_host, b_host = gemm_inputs(n, dtype, spec.seed)
    a = a_host.to(ctx.device)
    b = b_host.to(ctx.device)
    first = torch.matmul(a, b)
    ctx.sync()
    ctx.progress("reference", dtype=dtype)
    checked, ref_bad, ref_worst = reference_check(a_host, b_host, first, dtype, spec.reference_rows)
    digest = fingerprint(first)
    c = torch.empty_like(first)
    bad = torch.zeros((), dtype=torch.int64, device=ctx.device)
    bad_iters = torch.zeros((), dtype=torch.int64, device=ctx.device)
    # calibrate the block length: blocks of ~block_s of wall time (GEMMs and their compares)
    t0 = time.perf_counter()
    _timed_gemm_block(ctx, a, b, c, first, 3, bad, bad_iters)
    per_iter = max((time.perf_counter() - t0) / 3, 1e-6)
    count = max(1, int(spec.block_s / per_iter))
    bad.zero_()
    bad_iters.zero_()
    ctx.progress(WAITING, dtype=dtype)
    ctx.barrier(spec.barrier_timeout_s)  # every device starts the timed burn together
    ctx.progress("burn", dtype=dtype)
    flops = 2.0 * n * n * n
    blocks: list[float] = []
    spent = 0.0
    iterations = 0
    end = time.monotonic() + spec.duration_s
    while True:
        seconds = _timed_gemm_block(ctx, a, b, c, first, count, bad, bad_iters)
        spent += seconds
        iterations += count
        blocks.append(flops * count / seconds / 1e12 if seconds > 0 else 0.0)
        if time.monotonic() >= end:
            break
    ctx.progress("burn done", dtype=dtype)
    tflops = flops * iterations / spent / 1e12 if spent > 0 else 0.0
    return GemmResult(dtype=dtype, size=n, iterations=iterations, gemm_s=spent, tflops=tflops,
                      block_tflops=tuple(round(x, 4) for x in blocks), fingerprint=digest,
                      unstable_iterations=int(bad_iters), unstable_elements=int(bad),
                      reference_checked=checked, reference_bad=ref_bad, reference_worst=ref_worst,
                      wall_s=time.monotonic() - wall0)


def copy_bandwidth(ctx: WorkerContext, nbytes: int, iterations: int) -> CopyResult:
    """Device-to-device copy of ``nbytes``: (read + write) GB/s, and whether the copy is exact."""
    import torch

    words = max(1, nbytes // 4)
    # a pattern, not zeros: a stuck bit or misrouted block shows up in the compare
    src = torch.arange(words, dtype=torch.int32, device=ctx.device).mul_(40503)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up (allocation, first touch)
    ctx.sync()
    if ctx.is_cuda:
        begin, end = timing_event(), timing_event()
        begin.record()
        for _ in range(iterations):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        seconds = float(begin.elapsed_time(end)) / 1000.0
    else:
        t0 = time.perf_counter()
        for _ in range(iterations):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    moved = 2.0 * words * 4 * iterations
    return CopyResult(nbytes=words * 4, iterations=iterations, seconds=seconds,
                      gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
                      verified=bool(torch.equal(dst, src)))


def burn_worker(ctx: WorkerContext, spec: BurnSpec) -> BurnReport:
    """Worker: the GEMM burn for each dtype, then the device memory copy bandwidth."""
    gemms = tuple(_burn_dtype(ctx, spec, dtype) for dtype in spec.dtypes)
    copy: CopyResult | None = None
    if spec.copy_bytes > 0 and spec.copy_iters > 0:
        ctx.progress("memory copy")
        # measured twice, judged on the better: bandwidth varies run to run, and a probe should
        # fail only if it stays low on a second try
        tries = [copy_bandwidth(ctx, spec.copy_bytes, spec.copy_iters) for _ in range(2)]
        best = max(tries, key=lambda t: t.gbps)
        copy = CopyResult(nbytes=best.nbytes, iterations=best.iterations, seconds=best.seconds,
                          gbps=best.gbps, verified=all(t.verified for t in tries),
                          attempts=tuple(t.gbps for t in tries))
    return BurnReport(gemms=gemms, copy=copy)
