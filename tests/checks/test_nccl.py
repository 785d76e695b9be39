"""The nccl check: a real gloo all-reduce sweep on CPU stand-ins (healthy; a wrong contribution counted
element by element; a silent peer that hangs the collective), and the judgement of GPU sweeps from
measured-like figures (busbw formula checked against a real nccl-tests capture, profile minimum with
the in-check re-measurement).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import time
from typing import Any

import pytest

from gpumon import workers
from gpumon.hw import placement
from gpumon.model import NODE, Action, Severity
from gpumon_checks.nccl import kernels as nccl_kernels
from gpumon_checks.nccl.check import (
    NcclCheck,
    NcclConfig,
    NcclCpu,
    SizeRow,
    Sweep,
    combine,
    judged_busbw,
    table,
    verdict,
    worker_failures,
)

HEALTHY = "name: t\nsku: h100-sxm\ngpus: 8\nfaults: []\n"
SIZES = (4096, 1 << 18)
TINY = NcclConfig(cpu=NcclCpu(devices=4, sizes=list(SIZES), iterations=2, warmup=1))


def _specs(seeds: list[int], sizes: tuple[int, ...] = SIZES) -> list[nccl_kernels.AllReduceSpec]:
    store = os.path.join(tempfile.mkdtemp(prefix="gpumon-test-nccl-"), "store")
    return [nccl_kernels.AllReduceSpec(backend="gloo", store_path=store, sizes=sizes, iterations=2, warmup=1,
                                  seed=s, timeout_s=60) for s in seeds]


def test_healthy_gloo_sweep_on_stand_ins_is_exact(sim: Any) -> None:
    h = sim(HEALTHY.replace("gpus: 8", "gpus: 4"))
    ctx = h.context(NcclCheck, 0)
    ctx.options = TINY
    (f,) = NcclCheck().run(ctx)
    assert (f.severity, f.component) == (Severity.OK, NODE), f.message
    assert "exact" in f.message and "not judged: CPU stand-ins" in f.message
    ev = f.evidence
    assert ev["backend"] == "gloo" and ev["ranks"] == 4
    assert [row["bytes"] for row in ev["sweep"]] == list(SIZES)
    # (a 4 KiB all-reduce on time-sliced CPU processes can round to 0.000 GB/s: check the time)
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in ev["sweep"])
    assert ev["sweep"][-1]["busbw_gbps"] > 0
    assert ev["table"][0].split() == ["size", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    assert ev["devices"] == [f"GPU {r}" for r in range(4)]  # the simulated GPUs they stand in for


def test_a_simulated_gpu_that_corrupts_its_all_reduce_result_is_named(sim: Any) -> None:
    """GPU 1's device model adds one to one element of every all-reduce result it receives
    (gpumon/sim/devices.py): the other ranks' sums are exact, so GPU 1 is the fault."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {kind: allreduce_corrupt, gpu: 1, count: 2}\n")
    ctx = h.context(NcclCheck, 0)
    ctx.options = TINY
    (f,) = NcclCheck().run(ctx)
    assert (f.component, f.severity, f.action) == ("gpu/1", Severity.FAIL, Action.INSPECT_HARDWARE)
    # two elements per all-reduce, checked before and after the timed loop, at each size
    assert f.evidence["wrong"] == 2 * 2 * len(SIZES)
    assert f.evidence["wrong_by_device"] == {"GPU 1": 2 * 2 * len(SIZES)}
    assert f.message.endswith("seen on GPU 1 only; every other rank's sums were exact")


def test_a_wrong_contribution_fails_and_every_wrong_element_is_counted() -> None:
    """Rank 2 is fed another data pattern through the public API: every sum is off, on every rank."""
    run = workers.run_workers(nccl_kernels.allreduce_worker, _specs([7, 7, 8, 7]), kind="cpu", timeout_s=60)
    assert not run.failed
    rows = combine(run.results)
    elements = [n // 4 for n in SIZES]
    assert [r.wrong for r in rows] == [4 * 2 * e for e in elements]  # 4 ranks, checked twice per size
    assert rows[0].wrong_by_rank == {0: 2 * elements[0], 1: 2 * elements[0], 2: 2 * elements[0],
                                     3: 2 * elements[0]}
    labels = {r: f"cpu worker {r}" for r in range(4)}
    (f,) = verdict(Sweep(rows, False, labels), TINY, None, None)
    assert (f.severity, f.action) == (Severity.FAIL, Action.NONE)  # stand-ins: no hardware to remedy
    wrong = sum(r.wrong for r in rows)
    assert f.message.startswith(f"all-reduce gave {wrong} wrong element(s) of {wrong} checked exact integer")
    assert "seen on cpu worker 0, cpu worker 1, cpu worker 2, cpu worker 3" in f.message
    assert f.evidence["retryable"] is False
    # the same on GPUs is hardware: silently wrong sums go to inspection
    (g,) = verdict(Sweep(rows, True, {r: f"GPU {r}" for r in range(4)}), NcclConfig(), 460.0, "src")
    assert (g.severity, g.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)


def test_wrong_sums_on_one_gpu_at_one_size_only_are_the_nodes() -> None:
    """One GPU wrong at one size: a single flip on the link into it looks the same (ring all-gather:
    the last hop's data goes no further), so the node is named; at two or more sizes, the GPU."""
    def row(nbytes: int, wrong: int) -> SizeRow:
        return SizeRow(nbytes, 0.001, 1.0, 1.5, wrong, {0: 0, 1: wrong, 2: 0, 3: 0}, 4 * nbytes // 2)

    labels = {r: f"GPU {r}" for r in range(4)}
    gpu_of = {r: r for r in range(4)}
    once = Sweep([row(4096, 1), row(1 << 18, 0)], True, labels, as_gpu=True, gpu_of=gpu_of)
    (f,) = verdict(once, NcclConfig(), None, None)
    assert (f.component, f.severity, f.action) == (NODE, Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.message.endswith("seen on GPU 1 only; every other rank's sums were exact (at 1 size(s): too few "
                              "to tell this GPU from the link into it)")
    twice = Sweep([row(4096, 1), row(1 << 18, 3)], True, labels, as_gpu=True, gpu_of=gpu_of)
    (g,) = verdict(twice, NcclConfig(), None, None)
    assert (g.component, g.severity, g.action) == ("gpu/1", Severity.FAIL, Action.INSPECT_HARDWARE)


def _silent_peer(ctx: workers.WorkerContext, spec: nccl_kernels.AllReduceSpec) -> Any:
    """Rank 3 joins the process group and then never takes part: the others wait in their collective."""
    if ctx.rank != 3:
        return nccl_kernels.allreduce_worker(ctx, spec)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{spec.store_path}", rank=ctx.rank,
                            world_size=ctx.world, timeout=datetime.timedelta(seconds=spec.timeout_s))
    ctx.progress("silent")
    time.sleep(120)
    return None


def test_a_collective_hung_by_a_silent_peer_is_reported_within_the_deadline() -> None:
    started = time.monotonic()
    run = workers.run_workers(_silent_peer, _specs([7, 7, 7, 7]), kind="cpu", timeout_s=4)
    assert time.monotonic() - started < 15
    assert [o.state for o in run.outcomes] == ["hung"] * 4
    (f,) = worker_failures(run, cuda=False, by_uuid={})
    assert f.severity is Severity.FAIL and f.component == NODE
    assert f.message.startswith("all-reduce hung on 4 of 4 rank(s): ")
    assert "worker 0 (cpu worker 0) hung in 'all_reduce 4 KiB check'" in f.message
    assert "worker 3 (cpu worker 3) hung in 'silent'" in f.message
    assert [w["state"] for w in f.evidence["workers"]] == ["hung"] * 4


def test_a_dead_rank_is_the_cause_and_its_gpu_is_named(sim: Any) -> None:
    h = sim(HEALTHY)
    ctx = h.context(NcclCheck, 0)
    uuid = placement.normalize_uuid(ctx.inventory.gpus[6].uuid)
    outcomes = [workers.WorkerOutcome(0, "hung", phase="all_reduce 16 GiB timed", seconds=75.0,
                                      identity={"device": "cuda:0"}),
                workers.WorkerOutcome(1, "died", phase="all_reduce 16 GiB timed", exitcode=-9,
                                      identity={"device": "cuda:1", "uuid": uuid})]
    found = worker_failures(workers.WorkerRun(outcomes, 80.0), cuda=True,
                            by_uuid=workers.gpu_index_by_uuid(ctx.inventory))
    by = {f.component: f for f in found}
    assert (by["gpu/6"].severity, by["gpu/6"].action) == (Severity.FAIL, Action.RESET_GPU)
    assert "died in 'all_reduce 16 GiB timed' (exit code -9)" in by["gpu/6"].message
    assert by[NODE].message.startswith("1 rank(s) hung after a peer failed")


# ------------------------------------------------------------------ busbw and the profile minimum


def _report(rank: int, world: int, seconds: dict[int, float], wrong: int = 0) -> nccl_kernels.AllReduceReport:
    return nccl_kernels.AllReduceReport(rank, world, "nccl", tuple(
        nccl_kernels.SizeResult(nbytes=n, elements=n // 4, seconds=s, wrong=wrong, checked=2 * (n // 4))
        for n, s in seconds.items()))


def test_algbw_and_busbw_match_nccl_tests_on_a_real_capture() -> None:
    """shared/realdata/nccl-tests/all_reduce_perf_gcp-a3mega_h100x16_2node_tcp.txt (lessizzmore/
    create-a3mega-ztan-fork @ 02dd8f455c43ced1cf442ef29334bda97149264b, 16 ranks), out-of-place row:
    ``2147483648  536870912  float  sum  -1  12646  169.81  318.40  0``."""
    size, time_us = 2147483648, 12646.0
    reports = [_report(r, 16, {size: time_us / 1e6 * (0.97 if r else 1.0)}) for r in range(16)]
    (row,) = combine(reports)
    assert row.seconds == pytest.approx(time_us / 1e6)  # the slowest rank's time
    assert row.algbw == pytest.approx(169.81, abs=0.01)
    assert row.busbw == pytest.approx(318.40, abs=0.01)
    assert nccl_kernels.busbw(row.algbw, 16) == pytest.approx(row.algbw * 30 / 16)
    # the capture's time is rounded to 1 us, so the last digit of algbw may differ by one
    cells = table([row])[1].split()
    assert cells[:3] == ["2", "GiB", "12646.0"] and cells[4:] == ["318.40", "0"]
    assert float(cells[3]) == pytest.approx(169.81, abs=0.011)


def _rows(busbw: float, world: int = 8) -> list[SizeRow]:
    out = []
    for n in (1 << 30, 16 << 30):
        algbw = busbw * world / (2 * (world - 1)) * (0.8 if n < 16 << 30 else 1.0)
        out.append(SizeRow(n, n / algbw / 1e9, algbw, nccl_kernels.busbw(algbw, world), 0, {}, 2 * n // 4))
    return out


def test_busbw_below_the_profile_fails_only_when_the_retry_is_low_too() -> None:
    options = NcclConfig()
    labels = {r: f"GPU {r}" for r in range(8)}
    assert judged_busbw(_rows(470.0), options.judged_from_bytes) == pytest.approx(470.0)
    assert judged_busbw(_rows(470.0)[:1], options.judged_from_bytes) is None
    (ok,) = verdict(Sweep(_rows(480.0), True, labels), options, 460.0, "Azure ND H100 v5")
    assert ok.severity is Severity.OK and ok.evidence["attempts"] == 1 and ok.evidence["retryable"] is True
    assert ok.evidence["source"] == "Azure ND H100 v5"
    # on /metrics in bytes per second (GB/s x 1e9), the message size in label message_bytes
    [(name, value, labels)] = ok.evidence["readings"]
    assert (name, labels) == ("nccl_allreduce_busbw_bytes_per_second", {"message_bytes": str(16 << 30)})
    assert value == pytest.approx(480e9)
    (passed,) = verdict(Sweep(_rows(420.0), True, labels, retry=_rows(470.0)[1:]), options, 460.0, None)
    assert passed.severity is Severity.OK and passed.evidence["attempts"] == 2
    assert passed.evidence["judged_busbw_gbps"] == pytest.approx(470.0)
    (low,) = verdict(Sweep(_rows(420.0), True, labels, retry=_rows(430.0)[1:]), options, 460.0, None)
    assert (low.severity, low.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert low.message == ("all-reduce busbw 430 GB/s is below the profile's 460 (sizes >= 16 GiB; low again "
                           "on a second measurement)")
    assert "retry_table" in low.evidence
    # no profile figure: measured and shown, not judged
    (unjudged,) = verdict(Sweep(_rows(100.0), True, labels), options, None, None)
    assert unjudged.severity is Severity.OK and "no busbw_min_gbps in the profile" in unjudged.message


def test_sweep_and_options() -> None:
    gib, mib = 1 << 30, 1 << 20
    assert NcclConfig().sweep() == (mib, 4 * mib, 16 * mib, 64 * mib, 256 * mib, gib, 4 * gib, 16 * gib)
    assert NcclConfig(min_bytes=100, max_bytes=1000, step_factor=3).sweep() == (100, 300, 900, 1000)
    with pytest.raises(ValueError):
        NcclConfig(min_bytes=10, max_bytes=1)
    with pytest.raises(ValueError):
        NcclCpu(sizes=[])
    assert dataclasses.replace(TINY).cpu.devices == 4
    assert NcclCheck.name == "nccl" and NcclCheck.phase.value == "bootstrap"
