"""Run the bootstrap suite on a real GPU node and print the measured baselines.

For the day a GPU machine is lent: installs nothing, runs
``gpumon run-bootstrap --json -v`` (pass ``--simulate SCENARIO`` to try it on a
simulated node), times it against the 5-minute budget of issue 5, and prints
every reading the checks published (TFLOP/s per dtype, memory and copy
bandwidth, all-reduce busbw per size, RDMA Gb/s, ...) with the check, the
component and the verdict, plus the machine (NVML inventory via gpumon).
Then, when torch sees CUDA GPUs, the in-job guard's overhead benchmark
(bench/guard_overhead.py) on them: DDP over NCCL, one rank per GPU (up to 4),
each check's cost per step (issue 19, point 9), check 1's two modes (``nonfinite="hook"`` and
``"after"``) A/B in launches of their own, and check 1's cost model fitted on the GPU (fixed per
step + per bucket + per gradient byte) printed with a projection (issue 37); ``--no-guard`` skips it.

    .venv/bin/python bench/gpu_validate.py [--simulate healthy-8xh100] [--no-guard] [-- extra gpumon args]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import describe

BUDGET_S = 300.0  # issue 5: the default suite finishes in <= 5 minutes on an 8xH100 node


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--simulate", metavar="SCENARIO")
    ap.add_argument("--no-guard", action="store_true", help="skip the guard overhead benchmark")
    ap.add_argument("extra", nargs="*", help="more gpumon arguments (after --)")
    args = ap.parse_args()
    code = bootstrap(args)
    if not args.no_guard and not args.simulate:
        code = max(code, guard_overhead())
    return code


def guard_overhead() -> int:
    """The guard's overhead benchmark on this node's GPUs (NCCL), or why it did not run: the
    interleaved run of every check (both modes of check 1 among them), the A/B of check 1's two
    modes (each configuration in launches of its own), and the cost model fitted on this GPU and
    printed beside them (fixed + per bucket + per gradient byte, with a projection)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=300)
    count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    print("\nin-job guard overhead (bench/guard_overhead.py):")
    if count == 0:
        why = probe.stderr.strip().splitlines()[-1:] if probe.returncode else ["torch sees no CUDA GPU"]
        print(f"  not run: {why[0] if why else 'torch sees no CUDA GPU'}")
        return 0
    script = str(Path(__file__).with_name("guard_overhead.py"))
    world = ["--device", "cuda", "--world", str(min(count, 4))]
    code = 0
    with tempfile.TemporaryDirectory(prefix="gpu-validate-") as tmp:
        fit = str(Path(tmp, "fit.json"))
        runs = [
            ("every check, interleaved (check 1 in both modes)", [*world]),
            ("check 1's two modes, A/B: each configuration in launches of its own",
             [*world, "--ab", "--launches", "4", "--rounds", "3", "--steps", "100"]),
            ("the cost model of check 1 on this GPU (both modes)",
             [*world, "--fit", "--paired", "--launches", "1", "--rounds", "8", "--steps", "50",
              "--save-fit", fit, "--project", "500,2000,80"]),
        ]
        for what, extra in runs:
            cmd = [sys.executable, script, *extra]
            print(f"\n  {what}\n  command: guard_overhead.py {' '.join(extra)}", flush=True)
            proc = subprocess.run(cmd, timeout=3600)
            code = max(code, proc.returncode)
    return code


def bootstrap(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "gpumon", "run-bootstrap", "--json", "-v", *args.extra]
    if args.simulate:
        cmd[3:3] = ["--simulate", args.simulate]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
    wall = time.monotonic() - start
    print(f"machine: {describe()}")
    print(f"command: {' '.join(cmd[1:])}")
    if proc.returncode == 3 or not proc.stdout.strip():
        print(f"gpumon could not run (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return proc.returncode or 3
    doc = json.loads(proc.stdout)
    gpus = doc.get("inventory", {}).get("gpus") if isinstance(doc.get("inventory"), dict) else None
    print(f"node: {doc.get('node')}, profile {doc.get('profile')}, gpus: {gpus if gpus else 'see profile'}")
    boot = doc.get("bootstrap", {})
    print(f"suite: {doc.get('status')} (exit {proc.returncode}) in {wall:.1f} s "
          f"({'within' if wall <= BUDGET_S else 'OVER'} the {BUDGET_S:.0f} s budget); "
          f"order: {', '.join(boot.get('order', []))}")
    # the plan (each check's cost, docs/operators/bootstrap.md) next to what it took here
    planned = {c["check"]: c.get("expected_s") for c in boot.get("checks", [])}
    print("\nper check (seconds measured / planned, outcome):")
    for run in doc.get("checks", []):
        plan = planned.get(run["check"])
        plan_text = f"{plan:>6.0f} s" if isinstance(plan, (int, float)) else "     ?  "
        print(f"  {run['check']:<16} {run['seconds']:>8.1f} s / {plan_text}  {run['outcome']}")
    print("\nmeasured baselines (every reading the checks published):")
    rows = 0
    for f in doc.get("findings", []):
        for item in f.get("evidence", {}).get("readings", []) or []:
            try:
                name, value, labels = item
            except (TypeError, ValueError):
                continue
            label = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            print(f"  {f['check']:<16} {f['component']:<14} {name}{{{label}}} = {value:g}  [{f['severity']}]")
            rows += 1
    if not rows:
        print("  (none)")
    print("\nnot ok:")
    for f in doc.get("findings", []):
        if f["severity"] != "ok":
            where = f"{f['check']:<16} {f['component']:<14}"
            print(f"  {where} {f['severity']:<8} {f['action']:<16} {f['message']}")
    return int(proc.returncode)


if __name__ == "__main__":
    sys.exit(main())
