"""Replay bundles name the GPU, not the worker (issue 14 #7).

``gpumon canary run --gpus 4,5,6,7`` runs workers 0..3 on GPUs 4..7, and the daemon's canary runs on
the idle GPUs only: worker numbers are GPU numbers only when every GPU takes part. A bundle named
``-gpu2-`` for a fault on GPU 6, and ``canary replay`` saying "the failure of GPU 2", sent an operator
to the wrong GPU. Bundles now carry the GPU's index, UUID and serial (NVML, through the hardware
layer), are named by the GPU, and replay on that GPU by default.

End to end through the CLI on a simulated node (the NVML injection library serves the UUIDs and
serials; CPU workers stand in for the GPUs; the scenario's ``sdc`` fault makes GPU 6's worker flip
bits). The expected UUID and serial are read through the real NVML stack (``sim`` fixture).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import run_gpumon
from gpumon.model import Action, Severity
from gpumon.sdc.bundle import read_manifest
from gpumon_checks.sdc_canary import SdcCanaryCheck, SdcCanaryConfig

SCENARIO = ("name: sdc-gpu6\nsku: h100-sxm\ngpus: 8\nfaults:\n"
            "  - {kind: sdc, gpu: 6, dtype: float32, rate: 1.0}\n")

Run = subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def gpu6(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Path]:
    """``canary run --gpus 4,5,6,7`` on the simulated node whose GPU 6 computes wrong fp32 bits."""
    d = tmp_path_factory.mktemp("gpu6")
    scenario = d / "sdc-gpu6.yaml"
    scenario.write_text(SCENARIO)
    proc = run_gpumon("--simulate", str(scenario), "canary", "run", "--gpus", "4,5,6,7",
                      "--workload", "gemm_fp32", "--state-dir", str(d / "state"), "--json", timeout=300)
    return proc, d, scenario


def nvml_gpu(sim: Any, index: int) -> Any:
    """GPU ``index`` of the scenario's node as NVML (the injection library) reports it."""
    h = sim(SCENARIO)
    [g] = [g for g in h.context(SdcCanaryCheck, 0.0).inventory.gpus if g.index == index]
    return g


def bundle_of(proc: Run) -> Path:
    doc = json.loads(proc.stdout)
    [bundle] = doc["canary"]["bundles"]
    return Path(bundle)


def test_run_on_gpus_4_to_7_names_gpu_6_in_finding_folder_and_manifest(gpu6: tuple[Run, Path, Path],
                                                                        sim: Any) -> None:
    proc, d, _ = gpu6
    assert proc.returncode == 2, proc.stdout + proc.stderr
    g6 = nvml_gpu(sim, 6)
    assert g6.uuid.startswith("GPU-") and g6.serial
    doc = json.loads(proc.stdout)
    [bad] = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert bad["component"] == "gpu/6" and bad["action"] == "inspect_hardware"
    assert (bad["evidence"]["uuid"], bad["evidence"]["serial"]) == (g6.uuid, g6.serial)
    bundle = bundle_of(proc)
    assert bundle.parent == d / "state" / "sdc" / "bundles"
    assert "-gpu6-gemm_fp32-it0" in bundle.name, bundle.name  # was -gpu2-: the worker
    manifest = read_manifest(bundle)
    assert manifest["gpu"] == {"index": 6, "uuid": g6.uuid, "serial": g6.serial,
                               "pci_bus_id": g6.pci_bus_id, "name": g6.name, "device": "cpu"}
    assert manifest["worker"] == 2  # the run's third worker: kept, but no longer the only name
    assert manifest["reference_gpu"] in (4, 5, 7) and manifest["reference_worker"] in (0, 1, 3)
    workers = {w["index"]: w["gpu"]["index"] for w in doc["canary"]["workers"]}
    assert workers == {0: 4, 1: 5, 2: 6, 3: 7}


def test_replay_names_gpu_6_and_runs_on_it(gpu6: tuple[Run, Path, Path], sim: Any) -> None:
    proc, d, scenario = gpu6
    bundle = bundle_of(proc)
    g6 = nvml_gpu(sim, 6)
    replay = run_gpumon("--simulate", str(scenario), "canary", "replay", str(bundle), "--state-dir",
                        str(d / "replay"), timeout=300)
    out = replay.stdout
    assert replay.returncode == 2, out + replay.stderr  # GPU 6 still computes wrong bits
    assert f"the failure of GPU 6 (UUID {g6.uuid}, serial {g6.serial}" in out, out
    assert "reproduced on GPU(s) 6" in out
    # the scenario's own fault, not the harness's: the simulated GPU computes it again (issue 18 #9)
    assert read_manifest(bundle)["injected_fault"]["by"] == "simulated"
    assert "captured on a simulated node whose GPU 6 computes wrong bits" in out, out
    assert "NOT replayed" not in out
    # by default on the GPU that failed, alone; its expected bits come from the bundle
    assert "1 workers" in out and "replaying on GPU 6" in out
    fails = [ln for ln in out.splitlines() if ln.strip().startswith("FAIL")]
    assert len(fails) == 1 and "gpu/6" in fails[0], out
    assert "GPU 2" not in out


def test_an_older_bundle_without_gpu_fields_replays_with_a_note(gpu6: tuple[Run, Path, Path],
                                                                tmp_path: Path) -> None:
    proc, _, _ = gpu6
    old = tmp_path / "old-bundle"
    shutil.copytree(bundle_of(proc), old)
    manifest = json.loads((old / "manifest.json").read_text())
    for key in ("gpu", "reference_gpu"):
        del manifest[key]
    (old / "manifest.json").write_text(json.dumps(manifest))
    replay = run_gpumon("canary", "replay", str(old), "--workers", "1", "--device", "cpu", "--state-dir",
                        str(tmp_path / "state"), timeout=300)
    out = replay.stdout
    assert replay.returncode == 0, out + replay.stderr  # a healthy CPU worker computes the expected bits
    assert "the failure of worker 2 did not reproduce here" in out, out
    assert "predates GPU identities" in out and "GPU N only if the run used every GPU" in out


def test_the_check_on_idle_gpus_names_the_gpu_in_its_bundle(sim: Any, tmp_path: Path) -> None:
    """The daemon's case: GPU 1 is busy, so the canary runs on GPUs 0, 2, 3 and GPU 3 is worker 2."""
    h = sim("name: t\nsku: h100-sxm\ngpus: 4\nfaults:\n  - {at_s: 0, kind: utilization, gpu: 1, pct: 90}\n"
            "  - {kind: sdc, gpu: 3, dtype: float32, rate: 1.0}\n")
    ctx = h.context(SdcCanaryCheck, 1.0)
    g3 = next(g for g in ctx.inventory.gpus if g.index == 3)
    ctx.options = dataclasses.replace(SdcCanaryConfig(), iterations=1, workloads=["gemm_fp32"],
                                     bundle_dir=str(tmp_path / "bundles"))
    found = {f.component: f for f in SdcCanaryCheck().run(ctx)}
    assert found["gpu/1"].severity is Severity.SKIPPED
    bad = found["gpu/3"]
    assert (bad.severity, bad.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert (bad.evidence["uuid"], bad.evidence["serial"]) == (g3.uuid, g3.serial)
    [bundle] = list((tmp_path / "bundles").iterdir())
    assert "-gpu3-" in bundle.name, bundle.name
    manifest = read_manifest(bundle)
    assert (manifest["worker"], manifest["gpu"]["index"]) == (2, 3)
    assert (manifest["gpu"]["uuid"], manifest["gpu"]["serial"]) == (g3.uuid, g3.serial)
    assert bad.evidence["bundle"] == str(bundle)


def test_a_cuda_device_that_is_another_gpu_is_said() -> None:
    """On a GPU node the worker reports the UUID CUDA gives its device; where CUDA_VISIBLE_DEVICES
    renumbered the devices, cuda:N is not NVML's GPU N, and the bundle and finding say which it is."""
    from gpumon.sdc.golden import DeviceKey
    from gpumon.sdc.runner import Report, WorkerInfo
    from gpumon_checks.sdc_canary.verdict import findings as findings_of

    key = DeviceKey("NVIDIA H100 80GB HBM3", "550.90.07", "12.4", "2.13.0", "cuda sm_90")
    nvml = {6: {"uuid": "GPU-66666666-0000-0000-0000-000000000006", "serial": "6"},
            2: {"uuid": "GPU-22222222-0000-0000-0000-000000000002", "serial": "2"}}
    same = Report(workers=[WorkerInfo(0, "cuda:6", key, "66666666-0000-0000-0000-000000000006")],
                  iterations={0: 1}, workloads=[], gpu_indices=[6], gpu_identity=nvml)
    assert "identity_note" not in same.identity_of(0) and same.identity_of(0)["serial"] == "6"
    other = Report(workers=[WorkerInfo(0, "cuda:6", key, "22222222-0000-0000-0000-000000000002")],
                   iterations={0: 1}, workloads=[], gpu_indices=[6], gpu_identity=nvml)
    note = other.identity_of(0)["identity_note"]
    assert "NVML gives GPU 2, not GPU 6" in note and "trust the UUID" in note
    [finding] = findings_of(other)
    assert finding.evidence["identity_note"] == note
