"""gpumon.workers: worker processes (real ones: hung, dead, failing), bit-exactness across processes,
the GEMM rounding bound, exact gloo all-reduce sums, and the small pure helpers.

Everything runs on CPU stand-ins (device ``cpu``, gloo), the path CI takes; the same functions run on
CUDA devices on a GPU node.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpumon import workers
from gpumon.hw import placement
from gpumon.hw.inventory import Inventory
from gpumon.hw.nvml import GpuInfo
from gpumon_checks.burnin import kernels as burnin_kernels
from gpumon_checks.host_bandwidth import kernels as host_kernels
from gpumon_checks.nccl import kernels as nccl_kernels

ROOT = Path(__file__).resolve().parents[1]


# Worker functions are pickled by name, so they live at module level (the children import this module).

def _sleeper(ctx: workers.WorkerContext, seconds: float) -> float:
    ctx.progress(f"sleeping {seconds:g} s")
    time.sleep(seconds)
    return seconds


def _raiser(ctx: workers.WorkerContext, arg: int) -> int:
    ctx.progress("about to fail")
    raise RuntimeError(f"worker {ctx.rank} failed on purpose")


def _exiter(ctx: workers.WorkerContext, code: int) -> int:
    ctx.progress("exiting")
    os._exit(code)


def _shape(ctx: workers.WorkerContext, arg: int) -> dict[str, Any]:
    return {"rank": ctx.rank, "world": ctx.world, "device": ctx.device, "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------ workers


def test_every_worker_answers_with_its_rank_and_device() -> None:
    run = workers.run_workers(_shape, [0, 0, 0, 0], kind="cpu", timeout_s=60)
    assert [o.state for o in run.outcomes] == ["ok"] * 4
    assert [o.result["rank"] for o in run.outcomes] == [0, 1, 2, 3]
    assert {o.result["world"] for o in run.outcomes} == {4}
    assert {o.result["threads"] for o in run.outcomes} == {1}  # one thread per stand-in
    assert [o.identity["device"] for o in run.outcomes] == [f"cpu worker {r}" for r in range(4)]


def test_a_hung_worker_is_killed_within_the_deadline_and_named() -> None:
    # the deadline is about a hung worker, not the forkserver's first start (torch import, ~1 s on
    # an idle 2-core VM, more on a loaded one): start it before the clock runs
    workers.run_workers(_sleeper, [0.0], kind="cpu", timeout_s=60)
    started = time.monotonic()
    # 4 s: four fresh workers must start and answer within it on a loaded 2-core machine (1.5 s did not, once)
    run = workers.run_workers(_sleeper, [0.0, 60.0, 0.0, 0.0], kind="cpu", timeout_s=4.0)
    elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed  # 4 s deadline + kill + reap, not the 60 s sleep
    states = {o.rank: o.state for o in run.outcomes}
    assert states == {0: "ok", 1: "hung", 2: "ok", 3: "ok"}
    hung = run.outcomes[1]
    assert hung.phase == "sleeping 60 s"
    assert "worker 1 (cpu worker 1) hung in 'sleeping 60 s'" in hung.describe()
    assert "killed" in hung.describe()
    assert [o.rank for o in run.failed] == [1]


def test_once_a_peer_fails_the_others_get_only_the_grace_period() -> None:
    started = time.monotonic()
    run = workers.run_workers(_sleeper_or_raise, [60.0, -1.0, 60.0, 60.0], kind="cpu", timeout_s=60,
                              peer_failure_grace_s=0.5)
    assert time.monotonic() - started < 20
    states = [o.state for o in run.outcomes]
    assert states == ["hung", "error", "hung", "hung"]
    assert "worker 1 failed on purpose" in run.outcomes[1].describe()


def _sleeper_or_raise(ctx: workers.WorkerContext, seconds: float) -> float:
    if seconds < 0:
        return float(_raiser(ctx, 0))
    return _sleeper(ctx, seconds)


def test_a_worker_that_exits_without_an_answer_died() -> None:
    run = workers.run_workers(_exiter, [3], kind="cpu", timeout_s=30)
    (o,) = run.outcomes
    assert (o.state, o.exitcode, o.phase) == ("died", 3, "exiting")
    assert "died in 'exiting' (exit code 3)" in o.describe()


def test_the_devices_are_held_by_one_compute_job_at_a_time() -> None:
    import threading

    holding = threading.Event()
    done = threading.Event()

    def hold() -> None:
        workers.run_workers(_sleeper, [0.8], kind="cpu", timeout_s=30, name="first",
                            on_tick=lambda progress: holding.set(), tick_s=0.05)
        done.set()

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(20)
    with pytest.raises(workers.DevicesBusy, match="first holds them"):
        workers.run_workers(_sleeper, [0.0], kind="cpu", timeout_s=30, name="second")
    t.join(30)
    assert done.is_set()


# ----------------------------------------------------------------------- GEMM bits and bounds


def test_identical_inputs_give_bit_identical_gemms_across_processes() -> None:
    spec = burnin_kernels.BurnSpec(dtypes=("fp32", "fp64", "bf16"), size=96, duration_s=0.1,
                                   copy_bytes=1 << 16,
                            copy_iters=2)
    run = workers.run_workers(burnin_kernels.burn_worker, [spec] * 4, kind="cpu", timeout_s=120, barrier=True)
    assert not run.failed, [o.describe() for o in run.failed]
    for i, dtype in enumerate(spec.dtypes):
        results = [o.result.gemms[i] for o in run.outcomes]
        assert {g.dtype for g in results} == {dtype}
        assert len({g.fingerprint for g in results}) == 1, dtype
        for g in results:
            assert g.unstable_iterations == 0 and g.iterations >= 1
            assert g.reference_bad == 0 and 0 <= g.reference_worst <= 1.0
            assert g.reference_checked == spec.reference_rows * spec.size
    # the bits are those of the same GEMM on the host, single-threaded like the stand-ins
    a, b = burnin_kernels.gemm_inputs(96, "fp64", spec.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert burnin_kernels.fingerprint(a @ b) == run.outcomes[0].result.gemms[1].fingerprint
    finally:
        torch.set_num_threads(threads)
    for o in run.outcomes:
        assert o.result.copy.verified and len(o.result.copy.attempts) == 2


def test_the_reference_bound_holds_for_real_gemms_and_catches_a_wrong_element() -> None:
    for dtype in ("fp32", "fp64", "bf16", "fp16"):
        a, b = burnin_kernels.gemm_inputs(64, dtype, seed=3)
        c = a @ b
        checked, bad, worst = burnin_kernels.reference_check(a, b, c, dtype, rows=64)
        assert (checked, bad) == (64 * 64, 0) and worst <= 1.0, (dtype, worst)
        # one element off by 1 % of its magnitude scale: far outside any rounding of this GEMM
        wrong = c.clone()
        wrong[10, 7] += 0.01 * float((a[10].abs().double() @ b[:, 7].abs().double()).item()) + 0.5
        _, bad, worst = burnin_kernels.reference_check(a, b, wrong, dtype, rows=64)
        assert bad == 1 and worst > 1.0, dtype
    a, b = burnin_kernels.gemm_inputs(16, "fp32", seed=3)
    c = a @ b
    c[0, 0] = float("nan")
    assert burnin_kernels.reference_check(a, b, c, "fp32", rows=16)[1] == 1


def test_gemm_tolerance_follows_the_unit_roundoff() -> None:
    k = 8192
    # output rounding dominates the 16-bit formats; accumulation error grows with k
    assert burnin_kernels.gemm_tolerance("bf16", k) == pytest.approx(2.0**-8 + k * 2.0**-24, rel=1e-3)
    assert burnin_kernels.gemm_tolerance("fp16", k) == pytest.approx(2.0**-11 + k * 2.0**-24, rel=1e-3)
    assert burnin_kernels.gemm_tolerance("fp32", k) == pytest.approx(k * 2.0**-24, rel=1e-3)
    assert burnin_kernels.gemm_tolerance("fp64", k) < 1e-11
    assert burnin_kernels.gemm_tolerance("tf32", k) > burnin_kernels.gemm_tolerance("fp32", k)
    assert burnin_kernels.gemm_tolerance("fp32", 2 * k) > burnin_kernels.gemm_tolerance("fp32", k)
    with pytest.raises(ValueError, match="unknown dtype"):
        burnin_kernels.gemm_tolerance("int8", k)


# ---------------------------------------------------------------------------- all-reduce (gloo)


def _allreduce_specs(seeds: list[int], sizes: tuple[int, ...]) -> list[nccl_kernels.AllReduceSpec]:
    store = os.path.join(tempfile.mkdtemp(prefix="gpumon-test-"), "store")
    return [nccl_kernels.AllReduceSpec(backend="gloo", store_path=store, sizes=sizes, iterations=2, warmup=1,
                                  seed=s, timeout_s=60) for s in seeds]


def test_gloo_all_reduce_sums_are_exact_and_a_wrong_contribution_is_counted() -> None:
    sizes = (4, 4096, 1 << 18)
    run = workers.run_workers(nccl_kernels.allreduce_worker, _allreduce_specs([7, 7, 7, 7], sizes),
                              kind="cpu",
                              timeout_s=120)
    assert not run.failed, [o.describe() for o in run.failed]
    for o in run.outcomes:
        assert [s.nbytes for s in o.result.sizes] == list(sizes)
        assert all(s.wrong == 0 and s.checked == 2 * s.elements for s in o.result.sizes)
        assert all(s.seconds > 0 for s in o.result.sizes)
    # rank 2 contributes the pattern of another seed: every element of every sum is off by its
    # difference, on every rank (rank 2 expects the others' seed-8 pattern, which they did not send)
    run = workers.run_workers(nccl_kernels.allreduce_worker, _allreduce_specs([7, 7, 8, 7], sizes),
                              kind="cpu",
                              timeout_s=120)
    assert not run.failed
    for o in run.outcomes:
        assert [s.wrong for s in o.result.sizes] == [2 * s.elements for s in o.result.sizes]


def test_the_pattern_sums_exactly_in_float32() -> None:
    world = 64
    total = nccl_kernels.expected_sum(0, 5000, world, 7, "cpu")
    exact = sum(nccl_kernels.pattern(0, 5000, r, 7, "cpu").to(torch.int64) for r in range(world))
    assert torch.equal(total.to(torch.int64), exact)
    assert float(nccl_kernels.pattern(0, 5000, 0, 7, "cpu").abs().max()) <= 510


# --------------------------------------------------------------------------------- small helpers


def test_busbw_is_algbw_times_2_n_minus_1_over_n() -> None:
    assert nccl_kernels.busbw(100.0, 8) == pytest.approx(175.0)
    assert nccl_kernels.busbw(100.0, 2) == pytest.approx(100.0)
    assert nccl_kernels.busbw(100.0, 1) == 0.0
    with pytest.raises(ValueError):
        nccl_kernels.busbw(1.0, 0)


def test_placement_on_a_machine_without_cuda() -> None:
    assert not torch.cuda.is_available()
    place = placement.ComputeDevices().place(Inventory(), 4)
    assert (place.kind, place.devices, place.is_cuda) == ("cpu", 4, False)
    eight = Inventory(gpus=[GpuInfo(i, f"GPU-{i}", None, f"0000:{i + 16:02x}:00.0", "NVIDIA H100 80GB HBM3",
                                    "hopper", 18, i) for i in range(8)])
    # a real node whose GPUs NVML sees, but torch cannot use: no stand-in may answer for them
    with pytest.raises(placement.NoCudaOnGpuNode, match="NVML sees 8 GPU"):
        placement.ComputeDevices().place(eight, 4)


def test_devices_are_named_by_uuid_not_by_cuda_ordinal() -> None:
    by_uuid = {"566e6f65-c38e-b12f-4824-6944218668b9": 5}
    named = workers.device_name({"device": "cuda:0", "uuid": "GPU-566E6F65-C38E-B12F-4824-6944218668B9"},
                                by_uuid)
    assert (named.component, named.label, named.gpu_index) == ("gpu/5", "GPU 5", 5)
    unknown = workers.device_name({"device": "cuda:1", "uuid": "0000"}, by_uuid)
    assert (unknown.component, unknown.gpu_index) == ("node", None)
    assert workers.device_name({}, by_uuid, rank=2, kind="cpu").label == "cpu worker 2"
    assert workers.device_name({}, by_uuid, rank=3, kind="cuda").label.startswith("cuda:3")


def test_small_helpers() -> None:
    assert host_kernels.parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert host_kernels.parse_cpulist("") == ()
    assert [nccl_kernels.size_label(n) for n in (4, 4096, 3 << 20, 16 << 30, 1000)] == [
        "4 B", "4 KiB", "3 MiB", "16 GiB", "1000 B"]
    assert placement.normalize_uuid("GPU-AbC") == "abc" and placement.normalize_uuid(None) is None
    assert workers.torch_missing() is None


def test_without_torch_gpumon_imports_and_the_compute_checks_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # a None entry in sys.modules is how Python marks a module as not importable
    monkeypatch.setitem(sys.modules, "torch", None)
    assert workers.torch_missing() == workers.TORCH_MISSING
    assert workers.TORCH_MISSING == "torch not installed (pip install 'gpumon-node[compute]')"
    from gpumon.hw.inventory import Inventory
    from gpumon_checks.burnin.check import BurninCheck
    from gpumon_checks.nccl.check import NcclCheck

    assert BurninCheck().supported(Inventory()) == workers.TORCH_MISSING
    assert NcclCheck().supported(Inventory()) == workers.TORCH_MISSING
    # and no module of gpumon imports torch when it is imported
    code = ("import sys; sys.modules['torch'] = None\n"
            "import gpumon.workers, gpumon_checks.burnin, gpumon_checks.nccl, gpumon_checks.p2p, "
            "gpumon_checks.host_bandwidth\nprint('imported')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
