"""Fingerprint throughput against the machine's memory-copy bandwidth for the same bytes.

    .venv/bin/python bench/sdc_fingerprint.py [--mib 64] [--seconds 1.0] [--device cpu|cuda] [--threads N]

For each dtype: a tensor of ``--mib`` MiB; "copy" is ``dst.copy_(src)`` into a preallocated tensor
of the same size (reads and writes the bytes once: what the memory system gives a streaming kernel);
"fingerprint" is ``fingerprint_tensor`` (both sums, on the device, result left there). Each figure
is the median of repeated timings filling ``--seconds``. Throughput is the tensor's bytes per second
for both, so the ratio is the share of copy bandwidth the fingerprint reaches (goal >= 50 %).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe

from gpumon.sdc.fingerprint import fingerprint_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


def timed(fn: Callable[[], object], seconds: float, sync: Callable[[], None]) -> float:
    fn()
    sync()
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        t = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, nargs="*", default=None,
                    help="CPU thread counts to measure (default: 1 and all)")
    args = ap.parse_args()
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    print(describe())
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}; device {device} ({what}); tensor {args.mib} MiB; median of "
          f"timings over >= {args.seconds:g} s per figure")
    threads = args.threads or ([1, torch.get_num_threads()] if device.type == "cpu" else [0])
    print(f"{'dtype':10s} {'threads':>7s} {'copy GB/s':>10s} {'fingerprint GB/s':>17s} {'ratio':>6s}")
    for n in sorted(set(threads)):
        if device.type == "cpu":
            torch.set_num_threads(n)
        for dtype in DTYPES:
            nbytes = args.mib << 20
            count = nbytes // torch.empty((), dtype=dtype).element_size()
            src = torch.randint(0, 100, (count,), device=device).to(dtype) if not dtype.is_floating_point \
                else torch.randn(count, device=device).to(dtype)
            dst = torch.empty_like(src)
            copy = timed(lambda src=src, dst=dst: dst.copy_(src), args.seconds, sync)
            fp = timed(lambda src=src: fingerprint_tensor(src), args.seconds, sync)
            print(f"{str(dtype).removeprefix('torch.'):10s} {n if n else '-':>7} {nbytes / copy / 1e9:10.2f} "
                  f"{nbytes / fp / 1e9:17.2f} {copy / fp:6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
