"""The burnin check: real burns on CPU stand-ins (a simulated node's GPUs, healthy and with a
straggler the scenario slows; a machine without GPUs; one worker fed other inputs), and the judgement
of GPU-sized runs from measured-like reports on a simulated 8-GPU node (stragglers, the profile
baseline, unstable bits, memory copies, NVML readings during the burn, hung workers).

The straggler is the simulated GPU's device model (gpumon/sim/devices.py, below the hardware layer:
STYLE.md trap 4), timed by the same code that times a GPU's stand-in.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from gpumon import workers
from gpumon.check import CheckContext, KernelLog
from gpumon.errors import ConfigError
from gpumon.hw import Hardware, placement
from gpumon.hw.inventory import Inventory, collect
from gpumon.model import NODE, Action, Finding, Severity, is_component
from gpumon.profiles import builtin_profiles
from gpumon.schema import Source, build
from gpumon_checks.burnin import kernels as burnin_kernels
from gpumon_checks.burnin.check import (
    BurninCheck,
    BurninConfig,
    BurnSampler,
    CpuStandIn,
    fingerprint_outliers,
    judge,
    median_shares,
    stragglers,
)

HEALTHY = "name: t\nsku: h100-sxm\ngpus: 8\nfaults: []\n"
TINY = BurninConfig(cpu=CpuStandIn(devices=4, size=64, duration_s=0.1, copy_bytes=1 << 16))


def _by_component(findings: list[Finding]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.component, []).append(f)
    return out


# ------------------------------------------------------------------------ real runs on CPU stand-ins


def test_healthy_simulated_gpus_pass_with_every_reading(sim: Any) -> None:
    """A simulated node: one CPU worker per simulated GPU, findings on those GPUs."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults: []\n")
    ctx = h.context(BurninCheck, 0)
    ctx.options = TINY
    findings = BurninCheck().run(ctx)
    assert {f.severity for f in findings} == {Severity.OK}, [f.message for f in findings]
    devices = [f for f in findings if "device" in f.evidence]
    assert [(f.component, f.evidence["device"]) for f in devices] == [(f"gpu/{r}", f"GPU {r}")
                                                                      for r in range(4)]
    for f in devices:
        assert set(f.evidence["gemm"]) == {"fp32", "fp64", "bf16"}
        # NVML of the simulated GPUs, read while their stand-ins burn (about once a second)
        assert isinstance(f.evidence["nvml_during_burn"], dict)
        assert f.evidence["memory_copy"]["verified"] is True
        assert "TFLOP/s, bit-identical" in f.message
    prints = {f.evidence["gemm"]["bf16"]["fingerprint"] for f in devices}
    assert len(prints) == 1
    summary = findings[-1]
    assert summary.component == NODE and summary.evidence["placement"] == "cpu"
    assert "4 CPU worker processes stand in for the simulated GPUs" in summary.message
    assert [f.to_json() for f in findings]  # JSON-able


def test_healthy_stand_ins_without_gpus_are_the_node(tmp_path: Path) -> None:
    """A machine without GPUs (not simulated): ``cpu.devices`` workers, findings on ``node``."""
    (tmp_path / "sys").mkdir()
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=Inventory(),
                       profile=builtin_profiles()["h100-sxm"], options=TINY, state={}, kernel_log=KernelLog())
    findings = BurninCheck().run(ctx)
    assert {f.severity for f in findings} == {Severity.OK}, [f.message for f in findings]
    assert {f.component for f in findings} == {NODE}  # a CPU worker is not a GPU
    devices = [f for f in findings if "device" in f.evidence]
    assert [f.evidence["device"] for f in devices] == [f"cpu worker {r}" for r in range(4)]
    assert all(f.evidence["nvml_during_burn"] == "not applicable: CPU stand-ins, no GPU to read"
               for f in devices)
    assert "no GPU: 4 CPU worker processes stand in for GPUs" in findings[-1].message


def test_a_straggler_simulated_gpu_fails_and_alone(sim: Any) -> None:
    """The scenario's straggler: GPU 2's stand-in computes at a tenth of the speed (gpumon/sim/devices.py)."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {kind: compute_slow, gpu: 2, factor: 0.1}\n")
    ctx = h.context(BurninCheck, 0)
    ctx.options = TINY
    by = _by_component(BurninCheck().run(ctx))
    (slow,) = by["gpu/2"]
    assert (slow.severity, slow.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    for dtype in ("fp32", "fp64", "bf16"):
        assert f"{dtype} " in slow.message
        assert slow.evidence["gemm"][dtype]["share_of_median"] < 0.3
    assert "straggler below 50%" in slow.message
    assert all(by[f"gpu/{i}"][0].severity is Severity.OK for i in (0, 1, 3))


def test_a_worker_fed_other_inputs_is_caught_by_its_bits(sim: Any) -> None:
    """Identical inputs must give identical bits: worker 2 gets another seed through the public API."""
    h = sim(HEALTHY)
    ctx = h.context(BurninCheck, 0)
    options = TINY
    spec = burnin_kernels.BurnSpec(dtypes=("fp32", "bf16"), size=64, duration_s=0.1, copy_bytes=1 << 16,
                            copy_iters=2)
    specs = [spec, spec, dataclasses.replace(spec, seed=spec.seed + 1), spec]
    place = placement.Placement("cpu", 4, "test: 4 CPU stand-ins")
    run = workers.run_workers(burnin_kernels.burn_worker, specs, kind="cpu", timeout_s=120, barrier=True)
    assert not run.failed
    options = dataclasses.replace(TINY, cpu=dataclasses.replace(TINY.cpu, dtypes=["fp32", "bf16"]))
    findings = judge(run, place, options, ctx, None, {}, 120.0)
    odd = [f for f in findings if f.severity is Severity.FAIL]
    assert len(odd) == 1
    bad = odd[0]
    assert bad.evidence["device"] == "cpu worker 2" and bad.action is Action.NONE  # stand-in: no remedy
    assert bad.message.startswith("cpu worker 2: ")
    assert "fp32 GEMM result differs from the other devices' bit for bit" in bad.message
    assert "bf16 GEMM result differs" in bad.message
    # its own GEMM is right for its own inputs: the reference check passes, only the bits disagree
    assert bad.evidence["gemm"]["fp32"]["reference_bad"] == 0


def test_a_worker_that_fails_releases_the_others_and_alone_is_blamed(sim: Any) -> None:
    """Worker 1 is asked for a dtype it cannot run; the others, waiting for it at the start of the
    second burn, are released at once and reported as not measured, not as faulty."""
    h = sim(HEALTHY)
    ctx = h.context(BurninCheck, 0)
    spec = burnin_kernels.BurnSpec(dtypes=("fp32", "bf16"), size=32, duration_s=0.05, copy_bytes=0,
                                   copy_iters=0)
    specs = [spec, dataclasses.replace(spec, dtypes=("fp32", "int8")), spec, spec]
    started = time.monotonic()
    run = workers.run_workers(burnin_kernels.burn_worker, specs, kind="cpu", timeout_s=60, barrier=True,
                              peer_failure_grace_s=30)
    assert time.monotonic() - started < 20  # released by the broken barrier, not by the grace period
    assert [o.state for o in run.outcomes] == ["error"] * 4
    assert [o.waited_for_peer for o in run.outcomes] == [True, False, True, True]
    options = dataclasses.replace(TINY, cpu=dataclasses.replace(TINY.cpu, dtypes=["fp32", "bf16"]))
    findings = judge(run, placement.Placement("cpu", 4, "test"), options, ctx, None, {}, 60.0)
    by_device = {f.evidence.get("device"): f for f in findings}
    culprit = by_device["cpu worker 1"]
    assert culprit.severity is Severity.UNKNOWN  # a stand-in's crash says nothing about hardware
    assert "worker 1 (cpu worker 1) failed in 'prepare': KeyError: 'int8'" in culprit.message
    for r in (0, 2, 3):
        f = by_device[f"cpu worker {r}"]
        assert f.severity is Severity.UNKNOWN
        assert f.message == f"cpu worker {r}: not measured: waited for cpu worker 1, which failed"


# -------------------------------------------------------------------------------- pure judgement


def test_stragglers_are_judged_against_the_node_median() -> None:
    rates = {0: 790.0, 1: 781.0, 2: 795.0, 3: 600.0, 4: 788.0, 5: 776.0, 6: 792.0, 7: 785.0}
    med, _ = median_shares(rates)
    assert med == pytest.approx(786.5)
    assert stragglers(rates, 0.9) == {3: pytest.approx(600 / 786.5)}
    assert stragglers(rates, 0.7) == {}
    assert stragglers({0: 700.0, 1: 800.0}, 0.9) == {}  # 700 / 750 = 93 %
    assert stragglers({0: 500.0, 1: 800.0}, 0.9) == {0: pytest.approx(500 / 650)}
    assert stragglers({0: 1.0}, 0.9) == {}  # nothing to compare with
    assert median_shares({}) == (0.0, {})
    assert median_shares({0: 0.0, 1: 0.0})[1] == {0: 1.0, 1: 1.0}


def test_fingerprints_outside_the_majority_are_outliers() -> None:
    assert fingerprint_outliers({0: "a", 1: "a", 2: "b", 3: "a"}) == ("a", [2])
    assert fingerprint_outliers({0: "a", 1: "a", 2: "a"}) == ("a", [])
    # no majority: nobody can say which half is right
    assert fingerprint_outliers({0: "a", 1: "a", 2: "b", 3: "b"}) == (None, [0, 1, 2, 3])
    assert fingerprint_outliers({0: "a", 1: "b"}) == (None, [0, 1])
    assert fingerprint_outliers({0: "a"}) == ("a", [])
    assert fingerprint_outliers({}) == (None, [])


def _gemm(dtype: str, tflops: float, *, fingerprint: str = "f" * 64, unstable: int = 0, bad: int = 0) -> Any:
    return burnin_kernels.GemmResult(dtype=dtype, size=8192, iterations=400, gemm_s=20.0, tflops=tflops,
                              block_tflops=(tflops * 0.99, tflops, tflops * 1.01), fingerprint=fingerprint,
                              unstable_iterations=unstable, unstable_elements=unstable * 3,
                              reference_checked=65536, reference_bad=bad, reference_worst=3.0 if bad else 0.2,
                              wall_s=22.0)


def _copy(gbps: float, verified: bool = True) -> burnin_kernels.CopyResult:
    return burnin_kernels.CopyResult(nbytes=2 << 30, iterations=20, seconds=1.0, gbps=gbps, verified=verified,
                              attempts=(gbps * 0.98, gbps))


def test_gpu_runs_are_judged_per_gpu_by_uuid(sim: Any) -> None:
    """Eight CUDA workers' measured-like reports; CUDA ordinals deliberately differ from NVML indices."""
    h = sim(HEALTHY)
    ctx = h.context(BurninCheck, 0)
    gpus = ctx.inventory.gpus
    order = [7, 6, 5, 4, 3, 2, 1]  # CUDA ordinal r runs on NVML GPU order[r]; GPU 0 is not visible
    rates = {7: 786.0, 6: 790.0, 5: 781.0, 4: 783.0, 3: 600.0, 2: 788.0, 1: 792.0}
    outcomes = []
    for rank, index in enumerate(order):
        report = burnin_kernels.BurnReport(
            gemms=(_gemm("bf16", rates[index], fingerprint=("e" * 64) if index == 5 else "f" * 64),
                   _gemm("fp64", 55.0, unstable=2 if index == 6 else 0, bad=1 if index == 4 else 0)),
            copy=_copy(1500.0 if index == 2 else 2950.0, verified=index != 1))
        identity = {"device": f"cuda:{rank}", "uuid": placement.normalize_uuid(gpus[index].uuid),
                    "name": gpus[index].name}
        outcomes.append(workers.WorkerOutcome(rank, "ok", result=report, identity=identity, seconds=25.0))
    run = workers.WorkerRun(outcomes, wall_s=30.0)
    options = BurninConfig(dtypes=["bf16", "fp64"], baseline_tflops={"bf16": 989.4},
                          memory_bandwidth_gbps=3350.0)
    place = placement.Placement("cuda", 7, "7 CUDA device(s) visible to torch")
    by_uuid = workers.gpu_index_by_uuid(ctx.inventory)
    sampler = BurnSampler(ctx, by_uuid)
    # NVML readings during the burn, read through the injection library as the check does each second
    progress = {rank: workers.Progress("burn", 0.0, {"dtype": "bf16"}, dict(o.identity))
                for rank, o in enumerate(outcomes)}
    sampler.tick(progress)
    sampler.tick({0: workers.Progress("prepare", 0.0, {}, dict(outcomes[0].identity))})  # not burning
    findings = judge(run, place, options, ctx, sampler, by_uuid, 300.0)
    assert all(is_component(f.component) for f in findings)
    by = _by_component(findings)
    verdict = {c: (fs[0].severity, fs[0].action) for c, fs in by.items() if c.startswith("gpu/")}
    fail = (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert verdict == {"gpu/0": (Severity.UNKNOWN, Action.NONE), "gpu/1": fail, "gpu/2": fail, "gpu/3": fail,
                       "gpu/4": fail, "gpu/5": fail, "gpu/6": fail, "gpu/7": (Severity.OK, Action.NONE)}
    msg = {c: fs[0].message for c, fs in by.items()}
    assert "GPU 0 not tested" in msg["gpu/0"]
    assert "device memory copy is not equal to its source" in msg["gpu/1"]
    assert "memory copy 1500 GB/s is 51% of the node median" in msg["gpu/2"]
    assert "of the profile's 3350" in msg["gpu/2"]
    assert msg["gpu/3"].startswith("GPU 3: bf16 600 TFLOP/s is 76% of the node median 786 "
                                   "(straggler below 90%)")
    assert "61% of the profile's 989.4 (below 65%)" in msg["gpu/3"]
    assert "fp64: 1 of 65536 checked elements off the fp64 reference" in msg["gpu/4"]
    assert "bf16 GEMM result differs from the other devices' bit for bit" in msg["gpu/5"]
    assert "fp64: 2 of 400 repeated GEMMs gave different bits from the first" in msg["gpu/6"]
    assert msg["gpu/7"] == "GPU 7: bf16 786, fp64 55 TFLOP/s, bit-identical and within the reference bound"
    ev = by["gpu/7"][0].evidence
    assert ev["device"] == "GPU 7"
    assert ev["gemm"]["bf16"]["share_of_baseline"] == pytest.approx(786 / 989.4, 1e-3)
    nvml = ev["nvml_during_burn"]
    assert nvml["samples"] == 1 and nvml["sm_clock_mhz_min"] > 0 and nvml["temperature_c_max"] > 0
    # the simulated GPUs sit idle (NVML says so), which a real burn would not: it shows in the evidence
    idle = ctx.hw.nvml.clocks_event_reasons(7) & 0x1
    assert nvml["clock_event_reasons_seen"] == ({"gpu_idle": 1} if idle else {})
    assert ("[clock event reasons during the burn: gpu_idle]" in msg["gpu/3"]) == bool(idle)
    assert ev["readings"][0][:2] == ["burnin_gemm_flop_per_second", 786e12]  # 786 TFLOP/s


def test_hung_or_crashed_workers_fail_the_gpu_and_name_where(sim: Any) -> None:
    h = sim(HEALTHY)
    ctx = h.context(BurninCheck, 0)
    gpus = ctx.inventory.gpus
    ok = burnin_kernels.BurnReport(gemms=(_gemm("bf16", 780.0),), copy=_copy(2900.0))
    outcomes = [
        workers.WorkerOutcome(0, "ok", result=ok, identity={"uuid": placement.normalize_uuid(gpus[0].uuid),
                                                            "device": "cuda:0", "name": gpus[0].name}),
        workers.WorkerOutcome(1, "hung", phase="burn", seconds=200.0,
                              identity={"uuid": placement.normalize_uuid(gpus[1].uuid), "device": "cuda:1"}),
        workers.WorkerOutcome(2, "died", phase="prepare", exitcode=-11, identity={}),
    ]
    options = BurninConfig(dtypes=["bf16"])
    findings = judge(workers.WorkerRun(outcomes, 200.0), placement.Placement("cuda", 3, "3"), options, ctx,
                     None,
                     workers.gpu_index_by_uuid(ctx.inventory), 200.0)
    by = _by_component(findings)
    assert (by["gpu/1"][0].severity, by["gpu/1"][0].action) == (Severity.FAIL, Action.RESET_GPU)
    assert "worker 1 (cuda:1) hung in 'burn' after 200 s; killed" in by["gpu/1"][0].message
    # a worker that died before saying which GPU it had is still named by its CUDA ordinal
    died = [f for f in by[NODE] if "cuda:2" in f.message]
    assert died and died[0].severity is Severity.FAIL and "exit code -11" in died[0].message


def test_a_hung_stand_in_of_a_simulated_gpu_is_no_gpu_remedy(sim: Any) -> None:
    """A CPU worker that hangs is gpumon's or torch's trouble: the simulated GPU gets no reset."""
    h = sim(HEALTHY)
    ctx = h.context(BurninCheck, 0)
    gpus = ctx.inventory.gpus
    stand_ins = tuple(placement.StandIn(g.index, placement.normalize_uuid(g.uuid), g.name) for g in gpus[:2])
    ok = burnin_kernels.BurnReport(gemms=(_gemm("bf16", 0.02),), copy=None)
    outcomes = [
        workers.WorkerOutcome(0, "ok", result=ok,
                              identity={"uuid": stand_ins[0].uuid, "device": "cpu worker 0"}),
        workers.WorkerOutcome(1, "hung", phase="burn", seconds=30.0,
                              identity={"uuid": stand_ins[1].uuid, "device": "cpu worker 1"}),
    ]
    options = dataclasses.replace(TINY, cpu=dataclasses.replace(TINY.cpu, dtypes=["bf16"]))
    findings = judge(workers.WorkerRun(outcomes, 30.0), placement.Placement("cpu", 2, "sim", stand_ins),
                     options,
                     ctx, None, workers.gpu_index_by_uuid(ctx.inventory), 30.0)
    hung = _by_component(findings)["gpu/1"][0]
    assert (hung.severity, hung.action) == (Severity.FAIL, Action.NONE)
    assert "worker 1 (cpu worker 1) hung in 'burn' after 30 s; killed" in hung.message


def test_gpu_node_where_torch_has_no_cuda_is_unknown_not_a_cpu_burn(nvml_state: Path, tmp_path: Path) -> None:
    """NVML sees 8 GPUs (not simulated), torch sees no CUDA: the check must not burn CPUs and say ok."""
    (tmp_path / "host" / "sys").mkdir(parents=True)
    hw = Hardware(tmp_path / "host")
    hw.nvml.init()
    try:
        ctx = CheckContext(hw=hw, inventory=collect(hw.nvml, hw.fs), profile=builtin_profiles()["h100-sxm"],
                           options=TINY, state={}, kernel_log=KernelLog())
        (f,) = BurninCheck().run(ctx)
    finally:
        hw.nvml.shutdown()
    assert f.severity is Severity.UNKNOWN
    assert "NVML sees 8 GPU(s) but torch sees no CUDA device" in f.message


def test_options_are_validated() -> None:
    src = Source("test")
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        build(BurninConfig, {"dtypes": ["int8"]}, src)
    with pytest.raises(ConfigError, match="tf32"):
        build(BurninConfig, {"cpu": {"dtypes": ["tf32"]}}, src)
    with pytest.raises(ConfigError, match="must be <= 1"):
        build(BurninConfig, {"straggler_share": 1.5}, src)
    cfg = build(BurninConfig, {"baseline_tflops": {"bf16": 989.4, "fp64": 67}, "cpu": {"devices": 2}}, src)
    assert cfg.baseline_tflops == {"bf16": 989.4, "fp64": 67.0} and cfg.cpu.devices == 2
    assert BurninCheck.phase.value == "bootstrap" and BurninCheck.name == "burnin"


PROFILE_SNIPPET = """\
name: h100-test
match: ["^NVIDIA H100 80GB HBM3$"]
checks:
  burnin:
    baseline_tflops:
      value: {bf16: 989, fp16: 989, tf32: 494.5, fp32: 67, fp64: 67}
      source: "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: dense = half the 'with sparsity' figures"
    memory_bandwidth_gbps: {value: 3350, source: "NVIDIA H100 datasheet, H100 SXM: 3.35 TB/s"}
  nccl:
    busbw_min_gbps: {value: 460, source: "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ 7e6ac77"}
  p2p:
    min_gbps: {value: 335, source: "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ 7e6ac77"}
  host_bandwidth:
    min_gbps: {value: 48, source: "Azure/azurehpc-health-checks conf/nd96isr_h100_v5.conf @ 7e6ac77"}
"""


def test_profile_thresholds_reach_the_checks_options(tmp_path: Path) -> None:
    """The SKU values these checks read come from a profile's ``checks:`` section, with their sources."""
    from gpumon.config import load_config, with_profile
    from gpumon.profiles import load_profile_file
    from gpumon.registry import load_checks
    from gpumon_checks.host_bandwidth.check import HostBandwidthCheck
    from gpumon_checks.nccl.check import NcclCheck
    from gpumon_checks.p2p.check import P2pCheck

    mine = {c.name: c for c in (BurninCheck, NcclCheck, P2pCheck, HostBandwidthCheck)}
    registry = {**load_checks(), **mine}
    path = tmp_path / "h100-test.yaml"
    path.write_text(PROFILE_SNIPPET)
    profile = load_profile_file(path)
    config = with_profile(load_config(None, registry, site_file=tmp_path / "absent.yaml"), registry, profile)
    burnin = config.settings(BurninCheck).options
    assert burnin.baseline_tflops["tf32"] == 494.5 and burnin.memory_bandwidth_gbps == 3350.0
    assert config.settings(NcclCheck).options.busbw_min_gbps == 460.0
    assert config.settings(P2pCheck).options.min_gbps == 335.0
    assert config.settings(HostBandwidthCheck).options.min_gbps == 48.0
    assert profile.source_of("checks.burnin.baseline_tflops").startswith("NVIDIA H100 Tensor Core GPU")
    assert config.settings(BurninCheck).timeout_s == BurninCheck.timeout
