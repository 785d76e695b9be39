"""The SDC canary's idle gate: compute processes first, utilization second, read through the real stack
(nvidia-ml-py over the NVML injection library, the node state written with NvmlNodeState).

A GPU with a compute process is busy even at 0 % utilization (a job between steps); gpumon's own pid
does not count; where the driver cannot list processes, utilization alone decides and the evidence
says so; an NVML error on the process list leaves that GPU alone with the error as its finding.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumon.check import CheckContext, KernelLog
from gpumon.hw.inventory import collect
from gpumon.model import Finding, Severity
from gpumon.profiles import builtin_profiles
from gpumon.sim.nvml_state import GpuState, InjectedCall, NvmlNodeState, write_state
from gpumon.sim.simulation import simulated_hardware
from gpumon_checks.sdc_canary import SdcCanaryCheck, SdcCanaryConfig

PROCESSES_SYMBOL = "nvmlDeviceGetComputeRunningProcesses_v3"
Run = Callable[..., dict[str, Finding]]


@pytest.fixture
def run_on(nvml_state: Path, tmp_path: Path) -> Iterator[Run]:
    """``run_on(state, **config)`` -> the check's findings by component (one each)."""
    contexts: list[CheckContext] = []

    def run(state: NvmlNodeState, **config: object) -> dict[str, Finding]:
        write_state(state, nvml_state)
        host = tmp_path / f"host{len(contexts)}"
        (host / "sys").mkdir(parents=True)
        hw = simulated_hardware(host)
        hw.nvml.init()
        options = dataclasses.replace(SdcCanaryConfig(), device="cpu", iterations=1, workloads=["gemm_fp32"],
                                     bundle_dir=str(tmp_path / "bundles"), **config)  # type: ignore[arg-type]
        ctx = CheckContext(hw=hw, inventory=collect(hw.nvml, hw.fs), profile=builtin_profiles()["h100-sxm"],
                           options=options, state={}, kernel_log=KernelLog())
        contexts.append(ctx)
        findings = SdcCanaryCheck().run(ctx)
        by = {f.component: f for f in findings}
        assert len(by) == len(findings), findings
        return by

    yield run
    for ctx in contexts:
        ctx.hw.nvml.shutdown()


def _node(*gpus: dict[str, object]) -> NvmlNodeState:
    return NvmlNodeState(gpus=[GpuState(index=i, **g) for i, g in enumerate(gpus)])  # type: ignore[arg-type]


def test_a_compute_process_makes_a_gpu_busy_at_zero_utilization(run_on: Run) -> None:
    state = _node({"compute_processes": [(1234, 30 << 30), (5678, None)]},  # between steps: 0 %
                  {"compute_processes": [(os.getpid(), 500 << 20)]},  # gpumon itself
                  {"utilization_gpu": 90},  # the utilization gate still holds
                  {"compute_processes": [(999, 1)]})  # not asked for: not reported
    found = run_on(state, gpus=[0, 1, 2])
    busy = found["gpu/0"]
    assert (busy.severity, busy.message) == (
        Severity.SKIPPED, "GPU 0 busy: 2 compute process(es): pids 1234, 5678; canaries run on idle GPUs")
    assert busy.evidence["compute_processes"] == [{"pid": 1234, "used_memory_bytes": 30 << 30},
                                                  {"pid": 5678, "used_memory_bytes": None}]
    hot = found["gpu/2"]
    assert (hot.severity, hot.message) == (Severity.SKIPPED,
                                           "GPU 2 busy (90 % utilization); canaries run on idle GPUs")
    assert hot.evidence == {"compute_processes": [], "utilization_pct": 90}
    # GPU 1 is idle (our own pid aside); alone and without a golden there is nothing to compare with
    alone = found["gpu/1"]
    assert alone.severity is Severity.SKIPPED and "one idle GPU" in alone.message
    assert alone.evidence["idle_gate"] == {"compute_processes": [], "utilization_pct": 0}
    assert set(found) == {"gpu/0", "gpu/1", "gpu/2"}


def test_many_processes_are_all_in_the_evidence(run_on: Run) -> None:
    procs = [(100 + k, k << 20) for k in range(11)]
    found = run_on(_node({"compute_processes": procs}), gpus=[0])
    f = found["gpu/0"]
    assert f.message.startswith("GPU 0 busy: 11 compute process(es): pids 100, 101, 102, 103, 104, 105, "
                                "106, 107 (+3 more)")
    assert [p["pid"] for p in f.evidence["compute_processes"]] == [p for p, _ in procs]


def test_without_a_process_list_utilization_decides_and_the_evidence_says_so(run_on: Run) -> None:
    unsupported = [InjectedCall(PROCESSES_SYMBOL, error=3)]
    state = _node({"calls": unsupported, "compute_processes": [(1234, 1)]},  # unseen: utilization 0
                  {"calls": unsupported, "utilization_gpu": 60},
                  {"calls": unsupported})
    found = run_on(state)
    hot = found["gpu/1"]
    assert hot.severity is Severity.SKIPPED and hot.message.startswith("GPU 1 busy (60 % utilization)")
    assert "idle judged by utilization only" in hot.evidence["compute_processes"]
    for g in ("gpu/0", "gpu/2"):  # the canary ran on both
        assert found[g].severity is Severity.OK, found[g]
        assert found[g].evidence["iterations"] == 1
        gate = found[g].evidence["idle_gate"]
        assert gate["utilization_pct"] == 0 and "idle judged by utilization only" in gate["compute_processes"]


def test_an_nvml_error_on_the_process_list_leaves_the_gpu_alone(run_on: Run) -> None:
    state = _node({"calls": [InjectedCall(PROCESSES_SYMBOL, error=4)]},  # NVML_ERROR_NO_PERMISSION
                  {"calls": [InjectedCall(PROCESSES_SYMBOL, error=15)]},  # GPU lost
                  {}, {"calls": [InjectedCall(PROCESSES_SYMBOL, error=4)]})  # not asked for
    found = run_on(state, gpus=[0, 1, 2])
    assert found["gpu/0"].severity is Severity.UNKNOWN
    assert f"{PROCESSES_SYMBOL}(gpu/0)" in found["gpu/0"].message
    assert found["gpu/1"].severity is Severity.FAIL and "GPU lost" in found["gpu/1"].message
    assert found["gpu/2"].severity is Severity.SKIPPED and "one idle GPU" in found["gpu/2"].message
    assert set(found) == {"gpu/0", "gpu/1", "gpu/2"}


def test_a_scenario_process_on_a_simulated_gpu_keeps_canaries_off_it(sim: Callable[..., Any],
                                                                      tmp_path: Path) -> None:
    """The simulator's ``compute_process`` fault puts a job's process on GPU 1 (at 0 % utilization)."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 3\nfaults:\n"
            "  - {kind: compute_process, gpu: 1, pid: 4242, memory_mib: 2048}\n")
    ctx = h.context(SdcCanaryCheck, 0)
    ctx.options = dataclasses.replace(SdcCanaryConfig(), device="cpu", iterations=1, workloads=["gemm_fp32"],
                                     bundle_dir=str(tmp_path / "bundles"))
    by = {f.component: f for f in SdcCanaryCheck().run(ctx)}
    busy = by["gpu/1"]
    assert (busy.severity, busy.message) == (
        Severity.SKIPPED, "GPU 1 busy: 1 compute process(es): pids 4242; canaries run on idle GPUs")
    assert busy.evidence["compute_processes"] == [{"pid": 4242, "used_memory_bytes": 2048 << 20}]
    ran = {c for c, f in by.items() if "idle_gate" in f.evidence}
    assert ran == {"gpu/0", "gpu/2"}
