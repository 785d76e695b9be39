"""``canary replay`` of a bundle from an ``--inject`` run (issue 18 #9).

The fault harness's flips happen in the captured run only: a replay runs the workload fault-free, so
"did not reproduce" is what it must show, and it said so before it said what it replayed or that an
injected fault had been in force. Now the replay first says what it replays (workload, iteration,
GPU, the spec in force), that the injected fault is not replayed, and ``--with-injection`` injects it
again on the same GPU, drawing from the captured worker's random stream: a replay of iteration 0
then computes the very bits the bundle kept.

End to end through the CLI on a simulated 4-GPU node (CPU workers stand in for its GPUs, the NVML
injection library names them), run on GPUs 1..3 so that the faulty worker (2) is GPU 3, not GPU 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_gpumon
from gpumon.sdc.bundle import BundleError, InjectedFault, injected_fault, read_manifest, replay_fault
from gpumon.sdc.inject import FaultInjector, FaultSpec

SCENARIO = "name: inject4\nsku: h100-sxm\ngpus: 4\nfaults: []\n"
SPEC = "worker=2,dtype=fp32,rate=1,seed=3"

Run = subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def injected(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(scenario, state dir, bundle) of ``canary run --gpus 1,2,3 --inject worker=2,...``."""
    d = tmp_path_factory.mktemp("inject")
    scenario = d / "inject4.yaml"
    scenario.write_text(SCENARIO)
    proc = run_gpumon("--simulate", str(scenario), "canary", "run", "--gpus", "1,2,3", "--workload",
                      "gemm_fp32", "--inject", SPEC, "--state-dir", str(d / "state"), "--json", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [bundle] = json.loads(proc.stdout)["canary"]["bundles"]
    return scenario, d, Path(bundle)


def replay(scenario: Path, bundle: Path, state: Path, *extra: str) -> Run:
    return run_gpumon("--simulate", str(scenario), "canary", "replay", str(bundle), "--state-dir",
                      str(state), *extra, timeout=300)


def test_the_bundle_records_the_injected_fault_and_its_gpu(injected: tuple[Path, Path, Path]) -> None:
    _, _, bundle = injected
    manifest = read_manifest(bundle)
    assert (manifest["worker"], manifest["gpu"]["index"]) == (2, 3)
    row = manifest["injected_fault"]
    assert row["spec"].startswith("worker=2,dtype=fp32,rate=1,") and "seed=3" in row["spec"]
    assert (row["by"], row["gpu"]) == ("harness", 3)
    assert row["flips"], "the harness flipped nothing"


def test_replay_says_what_it_replays_and_that_the_injection_is_not_replayed(
        injected: tuple[Path, Path, Path]) -> None:
    scenario, d, bundle = injected
    proc = replay(scenario, bundle, d / "r1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr  # GPU 3 itself computes the right bits
    lines = out.splitlines()
    first = lines[0]
    assert "gemm_fp32 iteration 0 as GPU 3 (UUID GPU-" in first and "first differing tensor 'mm'" in first
    said = {name: next(i for i, ln in enumerate(lines) if text in ln) for name, text in (
        ("spec", "captured under the fault harness (--inject worker=2,dtype=fp32,rate=1,"),
        ("not_replayed", "the injected fault is NOT replayed (--with-injection replays it)"),
        ("verdict", "did not reproduce here (as expected: the injected fault was not replayed)"))}
    assert "GPU 3)" in lines[said["spec"]]
    assert "not the hardware's" in lines[said["not_replayed"]]
    # what is replayed, and under which fault, comes before the verdict
    assert said["spec"] < said["not_replayed"] < said["verdict"], out
    fails = [ln for ln in lines if ln.strip().startswith("FAIL")]
    assert not fails, out


def test_with_injection_reproduces_the_very_bits_on_the_same_gpu(injected: tuple[Path, Path, Path]) -> None:
    scenario, d, bundle = injected
    proc = replay(scenario, bundle, d / "r2", "--with-injection", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [bad] = [f for f in doc["findings"] if f["severity"] == "fail"]
    assert bad["component"] == "gpu/3" and bad["evidence"]["first_differing_tensor"] == "mm"
    manifest = read_manifest(bundle)
    observed = {row[0]: row[3] for row in manifest["observed"]}
    assert bad["evidence"]["observed_fingerprint"] == observed["mm"]  # the captured run's wrong bits
    info = doc["canary"]["bundle"]["injected_fault"]
    assert (info["by"], info["gpu"], info["replayed"]) == ("harness", 3, True)
    # one worker (GPU 3 alone), drawing from worker 2's stream as in the captured run
    assert info["replayed_as"].startswith("worker=0,") and info["replayed_as"].endswith(",stream=2")
    [again] = doc["canary"]["bundles"]
    assert read_manifest(Path(again))["injected_fault"]["gpu"] == 3


def test_an_older_bundle_without_origin_or_gpu_still_loads_and_replays_its_fault(
        injected: tuple[Path, Path, Path], tmp_path: Path) -> None:
    scenario, _, bundle = injected
    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["injected_fault"] = {"spec": manifest["injected_fault"]["spec"],
                                  "flips": manifest["injected_fault"]["flips"]}
    (old / "manifest.json").write_text(json.dumps(manifest))
    fault = injected_fault(read_manifest(old))
    # the run's worker numbers say where it was: worker 2 of the bundle is its GPU 3
    assert fault is not None and (fault.by, fault.gpu, fault.on_failing_gpu) == (None, 3, True)
    proc = replay(scenario, old, tmp_path / "state", "--with-injection")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "reproduced on GPU(s) 3 (with the injected fault)" in proc.stdout
    assert "before bundles said whose fault it was" in proc.stdout


def test_with_injection_on_a_bundle_without_an_injected_fault_is_refused(
        injected: tuple[Path, Path, Path], tmp_path: Path) -> None:
    scenario, _, bundle = injected
    clean = tmp_path / "clean"
    shutil.copytree(bundle, clean)
    manifest = json.loads((clean / "manifest.json").read_text())
    del manifest["injected_fault"]
    (clean / "manifest.json").write_text(json.dumps(manifest))
    proc = replay(scenario, clean, tmp_path / "state", "--with-injection")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "--with-injection: the bundle's run had no fault injected" in proc.stderr


def test_replay_fault_puts_the_fault_on_the_replay_worker_of_its_gpu() -> None:
    fault = InjectedFault(FaultSpec.parse("worker=2,dtype=bf16,rate=0.5,seed=7"), "harness", 6, True)
    spec = replay_fault(fault, (5, 6), 2)
    assert (spec.worker, spec.random_stream, spec.dtype, spec.rate, spec.seed) == (1, 2, "bf16", 0.5, 7)
    # same seed and stream: the replay's injector draws exactly the captured worker's numbers
    assert FaultInjector(spec)._rng.random() == FaultInjector(fault.spec)._rng.random()
    assert FaultSpec.parse(spec.to_text()) == spec
    with pytest.raises(BundleError, match="GPU 6, which this replay does not run on"):
        replay_fault(fault, (0, 1), 2)
    assert replay_fault(fault, (), 8).worker == 6  # CPU workers standing for GPUs 0..7

