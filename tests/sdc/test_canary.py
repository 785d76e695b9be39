"""SDC canaries end to end: record, run, fault harness, replay bundles, capture example, the check.

"GPUs" are worker processes on the CPU (spawned, one thread each), driven through the real CLI and
the real runner; the fault harness flips bits inside one worker's kernels. Workloads are small
(``builtin_workloads("cpu")``) so that the whole file runs in well under a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import clean_env
from gpumon.hw import local_cpu_model
from gpumon.model import Action, Severity
from gpumon.sdc import cli as canary_cli
from gpumon.sdc.bundle import deterministic_scope, read_manifest
from gpumon.sdc.golden import DeviceKey, Golden, GoldenKey, device_key
from gpumon.sdc.inject import FaultInjector, FaultSpec, FaultSpecError
from gpumon.sdc.runner import Report, WorkerInfo, _compare
from gpumon.sdc.workloads import (
    WORKLOAD_NAMES,
    Recorder,
    WorkloadRun,
    builtin_workloads,
    run_workload,
)
from gpumon_checks.sdc_canary import SdcCanaryCheck, SdcCanaryConfig
from gpumon_checks.sdc_canary.verdict import findings as findings_of

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4


@cache
def canary_command() -> tuple[str, ...]:
    """``gpumon canary`` once the CLI carries it; until then the canary module's own entry point."""
    from gpumon.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    wired = any("canary" in a.choices for a in actions)
    return (sys.executable, "-m", "gpumon", "canary") if wired else (sys.executable, "-m", "gpumon.sdc.cli")


def canary(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*canary_command(), *args], capture_output=True, text=True, env=clean_env(),
                          timeout=timeout, cwd=ROOT)


def report_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"no JSON (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}") from None
    return doc


def by_component(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["component"]: f for f in doc["findings"]}


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``canary record`` across 4 worker processes, 2 iterations each: every run must agree."""
    path = tmp_path_factory.mktemp("golden") / "golden.json"
    proc = canary("record", "--out", str(path), "--workers", str(WORKERS), "--iterations", "2",
                  "--device", "cpu", "--json")
    doc = report_of(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["canary"]["recorded"] == len(WORKLOAD_NAMES)
    assert doc["canary"]["iterations"] == {str(i): 2 for i in range(WORKERS)}
    return path


Run = subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def faulty_run(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """``canary run`` (human output, -v) with the fault harness on worker 2: every fp32 ``mm`` kernel
    output gets one bit flipped in one element. The workloads without an optimizer step only: the
    first optimizer costs each worker a second of imports, and the test file must stay fast."""
    state = tmp_path_factory.mktemp("state")
    proc = canary("run", "--golden", str(golden), "--workers", str(WORKERS), "--device", "cpu",
                  "--workload", "gemm_fp64", "--workload", "gemm_fp32", "--workload", "moe_routing",
                  "--inject", "worker=2,dtype=fp32,ops=mm,rate=1,seed=5", "--state-dir", str(state), "-v")
    return proc, state


def evidence_lines(proc: Run) -> dict[str, str]:
    """The ``key: value`` evidence lines -v prints under a failing GPU."""
    out = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.strip().partition(": ")
        if sep and key in ("first_differing_tensor", "expected_fingerprint", "observed_fingerprint",
                                  "bundle"):
            out[key] = value
    return out


# Every workload but the transformer step: the first optimizer step costs each worker process a second
# of imports (torch._dynamo), and this file must stay under a minute on a 2-core machine. The step's
# bits are compared with the golden of 4 processes in test_bit_exact_across_processes_and_repeated_runs.
QUICK = [w for w in WORKLOAD_NAMES if w != "transformer_step"]


def test_record_then_healthy_run_exits_0(golden: Path, tmp_path: Path) -> None:
    proc = canary("run", "--golden", str(golden), "--workers", str(WORKERS), "--device", "cpu",
                  *(a for w in QUICK for a in ("--workload", w)), "--state-dir", str(tmp_path), "--json")
    doc = report_of(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["status"] == "ok"
    found = by_component(doc)
    assert sorted(found) == [f"gpu/{i}" for i in range(WORKERS)]
    for f in found.values():
        assert f["severity"] == "ok" and f["check"] == "sdc_canary"
        assert f["evidence"]["compared_with"] == [f"golden ({len(QUICK)} workloads)",
                                                  f"{WORKERS - 1} other GPUs"]
        assert f["evidence"]["iterations"] == 1
    assert doc["canary"]["no_golden"] == []
    assert not (tmp_path / "sdc").exists()  # no failure, no bundle


def test_fault_on_worker_2_exits_2_naming_it_and_the_first_differing_tensor(
        faulty_run: tuple[Run, Path]) -> None:
    proc, _ = faulty_run
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    failing = [ln for ln in lines if ln.strip().startswith("FAIL")]
    # only worker 2 is blamed; gemm_fp32 is the first fp32 workload, its first mm output the point "mm"
    assert len(failing) == 1, proc.stdout
    assert "gpu/2" in failing[0] and "GPU 2 computed wrong bits: gemm_fp32 iteration 0" in failing[0]
    assert "first differing tensor 'mm'" in failing[0] and "vs golden" in failing[0]
    assert failing[0].endswith("[inspect_hardware]")
    assert sum(ln.strip().startswith("OK") for ln in lines) == WORKERS - 1
    ev = evidence_lines(proc)
    assert ev["first_differing_tensor"] == "mm"
    assert ev["expected_fingerprint"] != ev["observed_fingerprint"]


def test_replay_bundle_round_trip(faulty_run: tuple[Run, Path], golden: Path) -> None:
    proc, state = faulty_run
    bundle = Path(evidence_lines(proc)["bundle"])
    assert bundle.parent == state / "sdc" / "bundles"
    manifest = read_manifest(bundle)
    fields = ("kind", "workload", "worker", "first_differing_tensor")
    assert [manifest[k] for k in fields] == ["failure", "gemm_fp32", 2, "mm"]
    # CPU workers without --gpus: worker 2 stands for GPU 2, which no NVML knows here
    assert manifest["gpu"] == {"index": 2, "uuid": None, "serial": None, "pci_bus_id": None, "name": None,
                               "device": "cpu"}
    assert "-gpu2-gemm_fp32-it0" in bundle.name
    assert manifest["injected_fault"]["spec"].startswith("worker=2,dtype=fp32,")
    assert manifest["expected_is_golden"]
    recorded = Golden.load(golden).get(GoldenKey.from_json(manifest["key"]))
    assert recorded is not None and manifest["expected"] == [p.to_json() for p in recorded]
    flip = manifest["injected_fault"]["flips"][0]
    assert (flip["op"], flip["next_point"]) == ("mm", "mm")

    replay = canary("replay", str(bundle), "--workers", "2", "--device", "cpu", "--state-dir",
                    str(state / "replay"), "--json")
    rdoc = report_of(replay)
    # healthy workers compute the golden bits again: the fault was the worker's, not the workload's
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert all(f["severity"] == "ok" for f in rdoc["findings"])
    diff = rdoc["canary"]["bundle"]["kept_tensors_diff"]
    # the kept tensors show exactly the flipped bit of the flipped element
    assert diff["tensor"] == "mm"
    assert diff["elements_differing"] == 1
    assert (diff["first_element"], diff["bits_flipped"]) == (flip["element"], [flip["bit"]])


def test_bit_exact_across_processes_and_repeated_runs(golden: Path) -> None:
    """The golden was made by 4 processes x 2 iterations that all agreed (record refuses otherwise);
    this process computes the very same bits again, twice."""
    entries = Golden.load(golden)
    device = torch.device("cpu")
    key = device_key(device, cpu_model=local_cpu_model())
    with deterministic_scope():
        for name, workload in builtin_workloads("cpu").items():
            first, _ = run_workload(workload, device)
            second, _ = run_workload(workload, device)
            assert first.error is None
            assert first.signature() == second.signature(), name
            recorded = entries.get(GoldenKey(name, workload.params, key))
            assert recorded is not None, name
            assert [p.to_json() for p in first.points] == [p.to_json() for p in recorded], name


def test_example_captures_a_real_training_step_and_replays_it(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sdc_capture_replay.py"), "--out",
                           str(tmp_path), "--workers", "2", "--device", "cpu", "--train-steps", "2"],
                          capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "healthy replay: exit 0" in proc.stdout
    manifest = read_manifest(tmp_path / "bundle")
    names = [p[0] for p in manifest["expected"]["points"]]
    assert names[:1] == ["batch.tokens"] and "loss" in names
    assert names.index("out.embed") < names.index("out.layers.1") < names.index("loss")
    assert any(n.startswith("grad.") for n in names) and any(n.startswith("param.") for n in names)
    assert any(n.startswith("optim.") and n.endswith(".exp_avg") for n in names)


# -- comparison logic, on fabricated runs ----------------------------------------------------------

def _runs(points_by_worker: dict[int, list[tuple[str, int]]]
          ) -> tuple[list[WorkerInfo], dict[int, list[WorkloadRun]]]:
    from gpumon.sdc.fingerprint import Fingerprint
    from gpumon.sdc.workloads import Point

    key = DeviceKey("test GPU", "none", "none", "x", "cpu")
    workers = [WorkerInfo(i, "cpu", key) for i in points_by_worker]
    runs = {i: [WorkloadRun("w", "p", [Point(n, "float32", (2,), Fingerprint(v, v)) for n, v in pts])]
            for i, pts in points_by_worker.items()}
    return workers, runs


def test_strict_majority_names_the_dissenter_without_a_golden() -> None:
    good = [("a", 1), ("b", 2), ("c", 3)]
    workers, runs = _runs({0: good, 1: good, 2: [("a", 1), ("b", 9), ("c", 9)], 3: good})
    report = Report(workers=workers, iterations={i: 1 for i in runs}, workloads=["w"])
    from gpumon.sdc.runner import Options

    _compare(report, workers, runs, 0, Options(workers=4))
    found = {f.component: f for f in findings_of(report)}
    assert found["gpu/2"].severity is Severity.FAIL and found["gpu/2"].action is Action.INSPECT_HARDWARE
    assert found["gpu/2"].evidence["first_differing_tensor"] == "b"
    assert found["gpu/2"].evidence["compared_with"] == "majority of 3/4"
    assert all(found[f"gpu/{i}"].severity is Severity.OK for i in (0, 1, 3))


def test_no_majority_is_unknown_with_the_split() -> None:
    a, b = [("a", 1)], [("a", 2)]
    workers, runs = _runs({0: a, 1: b, 2: a, 3: b})
    report = Report(workers=workers, iterations={i: 1 for i in runs}, workloads=["w"])
    from gpumon.sdc.runner import Options

    _compare(report, workers, runs, 0, Options(workers=4))
    found = findings_of(report)
    assert {f.severity for f in found} == {Severity.UNKNOWN}
    assert found[0].evidence["split"] == [[0, 2], [1, 3]]


def test_golden_decides_when_there_is_no_majority() -> None:
    a, b = [("a", 1)], [("a", 2)]
    workers, runs = _runs({0: a, 1: b})
    from gpumon.sdc.fingerprint import Fingerprint
    from gpumon.sdc.runner import Options
    from gpumon.sdc.workloads import Point

    golden = Golden({GoldenKey("w", "p", workers[0].key): [Point("a", "float32", (2,), Fingerprint(1, 1))]})
    report = Report(workers=workers, iterations={0: 1, 1: 1}, workloads=["w"])
    _compare(report, workers, runs, 0, Options(workers=2, golden=golden))
    found = {f.component: f.severity for f in findings_of(report)}
    assert found == {"gpu/0": Severity.OK, "gpu/1": Severity.FAIL}


# -- the fault harness ---------------------------------------------------------------------------

def test_fault_spec_parsing() -> None:
    spec = FaultSpec.parse("worker=2,dtype=bfloat16,rate=0.5,range=-1:1,bits=0:6,ops=mm|addmm,seed=3")
    assert (spec.worker, spec.dtype, spec.rate, spec.low, spec.high, spec.bits, spec.ops) == (
        2, "bf16", 0.5, -1.0, 1.0, (0, 6), ("mm", "addmm"))
    assert FaultSpec.parse(spec.to_text()) == spec
    for bad in ("dtype=float32", "worker=1,rate=2", "worker=1,bits=0:16,dtype=float16", "worker=1,color=red",
                "worker=x"):
        with pytest.raises(FaultSpecError):
            FaultSpec.parse(bad)


def test_fault_spec_speaks_the_workloads_dtype_names() -> None:
    """Issue 12 #5: ``--inject worker=1,dtype=fp32`` was refused ('fp32' is not one of float64,
    float32, ...) while the workloads are named gemm_fp32: the short names are the vocabulary, torch's
    names mean the same, and a refusal lists both."""
    same = {"fp64": ("fp64", "float64", "torch.float64", "double"),
            "fp32": ("fp32", "FP32", "float32", "torch.float32", "float"),
            "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
            "fp16": ("fp16", "float16", "half")}
    for short, names in same.items():
        assert short in {w.removeprefix("gemm_") for w in WORKLOAD_NAMES if w.startswith("gemm_")}
        for name in names:
            spec = FaultSpec.parse(f"worker=1,dtype={name},rate=1")
            assert spec.dtype == short and spec.to_text().startswith(f"worker=1,dtype={short},")
            assert FaultSpec(worker=1, dtype=name) == FaultSpec(worker=1, dtype=short)
    assert FaultSpec.parse("worker=1,dtype=fp32").torch_dtype is torch.float32
    assert FaultSpec.parse("worker=1,dtype=bf16").torch_dtype is torch.bfloat16
    with pytest.raises(FaultSpecError) as refused:
        FaultSpec.parse("worker=1,dtype=fp8")
    for accepted in ("fp64", "fp32", "bf16", "fp16", "float32", "bfloat16"):
        assert accepted in str(refused.value)
    # TF32 is a matmul mode: its outputs are fp32 tensors, and the refusal says so
    with pytest.raises(FaultSpecError, match="dtype=fp32"):
        FaultSpec.parse("worker=1,dtype=tf32")


def test_harness_flips_only_its_dtype_range_and_bits() -> None:
    gemm = builtin_workloads("cpu")["gemm_fp32"]
    device = torch.device("cpu")
    with deterministic_scope():
        clean, _ = run_workload(gemm, device)
        # another dtype path: nothing happens
        bf16 = FaultInjector(FaultSpec(worker=0, dtype="bfloat16"))
        run, _ = run_workload(gemm, device, bf16)
        assert bf16.flips == [] and run.signature() == clean.signature()
        # only values in [0.5, 1] and only the low 4 mantissa bits
        spec = FaultSpec(worker=0, dtype="float32", low=0.5, high=1.0, bits=(0, 3), ops=("mm",), seed=1)
        inj = FaultInjector(spec)
        run, kept = run_workload(gemm, device, inj, keep=True)
        _, reference = run_workload(gemm, device, keep=True)
        assert inj.flips and all(f.op == "mm" and 0 <= f.bit <= 3 for f in inj.flips)
        first = inj.flips[0]
        before = reference["mm"].reshape(-1)[first.element]
        assert 0.5 <= float(before) <= 1.0
        xor = int(kept["mm"].view(torch.int32).reshape(-1)[first.element]) ^ int(
            reference["mm"].view(torch.int32).reshape(-1)[first.element])
        assert xor == 1 << first.bit
        # rate 0: never
        never = FaultInjector(FaultSpec(worker=0, dtype="float32", rate=0.0))
        run, _ = run_workload(gemm, device, never)
        assert never.flips == [] and never.calls > 0 and run.signature() == clean.signature()


def test_harness_does_not_touch_the_fingerprints() -> None:
    """Points are fingerprinted under the harness's quiet(): a flip lands in the workload's tensor."""
    inj = FaultInjector(FaultSpec(worker=0, dtype="int64", rate=1.0))
    rec = Recorder(harness=inj)
    t = torch.arange(100)
    with rec.compute():
        rec.point("t", t)
    assert inj.flips == []


def test_cli_refuses_bad_inputs_with_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert canary_cli._standalone(["run", "--golden", str(tmp_path / "absent.json"), "--device", "cpu"]) == 3
    assert "golden" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert canary_cli._standalone(["run", "--golden", str(tmp_path / "bad.json"), "--device", "cpu"]) == 3
    assert canary_cli._standalone(["run", "--inject", "dtype=float32", "--device", "cpu"]) == 3
    assert "worker" in capsys.readouterr().err
    assert canary_cli._standalone(["replay", str(tmp_path), "--device", "cpu"]) == 3


# -- a hung GPU -----------------------------------------------------------------------------------

HANG_MARKER = "GPUMON_SDC_TEST_HANG_MARKER"


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def loss_that_may_hang(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Hangs in the one process that claims the marker file (removing it), as a stuck kernel would."""
    marker = os.environ.get(HANG_MARKER)
    if marker:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)
            time.sleep(60)
    out: torch.Tensor = model(batch["x"]).square().mean()
    return out


def test_a_hung_worker_is_a_failure_of_its_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumon.sdc import capture
    from gpumon.sdc.runner import Options, run

    torch.manual_seed(0)
    model = tiny_model()
    bundle = capture(tmp_path / "bundle", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     batch={"x": torch.randn(3, 4)}, loss_fn=loss_that_may_hang, model_factory=tiny_model)
    marker = tmp_path / "hang"
    marker.touch()
    monkeypatch.setenv(HANG_MARKER, str(marker))
    started = time.monotonic()
    report = run(Options(workers=1, bundles=(bundle,), device="cpu", timeout_s=3,
                         cpu_model=local_cpu_model()))
    assert time.monotonic() - started < 30
    (f,) = findings_of(report)
    assert (f.component, f.severity, f.action) == ("gpu/0", Severity.FAIL, Action.RESET_GPU)
    assert "hung" in f.message and "iteration 0" in f.message


# -- the check -------------------------------------------------------------------------------------

def test_check_gates() -> None:
    from gpumon.hw.inventory import Inventory

    assert SdcCanaryCheck().supported(Inventory()) == "no GPUs visible to NVML"
    assert SdcCanaryCheck.phase.value == "canary"


def test_check_runs_on_idle_gpus_only(sim: Any, tmp_path: Path) -> None:
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {at_s: 0, kind: utilization, gpu: 1, pct: 90}\n")
    ctx = h.context(SdcCanaryCheck, 1.0)
    ctx.options = dataclasses.replace(SdcCanaryConfig(), gpus=[0, 1, 2], device="cpu", iterations=2,
                                     workloads=["gemm_fp32"], bundle_dir=str(tmp_path / "bundles"))
    found = {f.component: f for f in SdcCanaryCheck().run(ctx)}
    assert found["gpu/1"].severity is Severity.SKIPPED and "busy" in found["gpu/1"].message
    for g in ("gpu/0", "gpu/2"):
        assert found[g].severity is Severity.OK, found[g]
        assert found[g].evidence["iterations"] == 2
    assert "gpu/3" not in found
    ctx.options = dataclasses.replace(ctx.options, majority=False)
    skipped = SdcCanaryCheck().run(ctx)
    assert [(f.component, f.severity) for f in skipped] == [("node", Severity.SKIPPED)]


def test_a_simulated_gpu_that_computes_wrong_bits_is_caught(sim: Any, tmp_path: Path) -> None:
    """The scenario's ``sdc`` fault: GPU 2's canary worker runs under the fault harness (its device
    model, gpumon/sim/devices.py); no error anywhere, only its fingerprints differ."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {kind: sdc, gpu: 2, dtype: float32, rate: 1.0}\n")
    ctx = h.context(SdcCanaryCheck, 1.0)
    # "auto" on a simulated node is the CPU: the machine's own GPUs are never measured under its names
    ctx.options = dataclasses.replace(SdcCanaryConfig(), device="auto", iterations=1, workloads=["gemm_fp32"],
                                     bundle_dir=str(tmp_path / "bundles"))
    found = {f.component: f for f in SdcCanaryCheck().run(ctx)}
    bad = found["gpu/2"]
    assert (bad.severity, bad.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert "gemm_fp32" in bad.message
    assert all(found[f"gpu/{i}"].severity is Severity.OK for i in (0, 1, 3))
    assert all(found[f"gpu/{i}"].evidence["device"] == "cpu" for i in (0, 1, 3))
