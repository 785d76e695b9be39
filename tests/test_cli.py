"""The CLI end to end, on simulated nodes: real nvidia-ml-py over the injection library."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from conftest import clean_env, run_gpumon
from gpumon.model import Phase
from gpumon.registry import load_checks

CONTINUOUS = {name for name, cls in load_checks().items() if cls.phase is Phase.CONTINUOUS}


def _findings(stdout: str) -> list[dict[str, object]]:
    doc = json.loads(stdout)
    assert doc["status"] in ("ok", "warn", "fail", "error")
    return list(doc["findings"])


def test_faulty_scenario_reports_xid79_and_hw_slowdown_and_exits_2() -> None:
    proc = run_gpumon("check", "--simulate", "faulty-8xh100", "--json")
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "fail" and doc["profile"] == "h100-sxm"
    found = {(f["check"], f["component"]): f for f in doc["findings"]}
    xid79 = found[("xid", "gpu/3")]
    assert (xid79["severity"], xid79["action"]) == ("fail", "reboot_node")
    assert xid79["evidence"]["code"] == 79 and xid79["evidence"]["pci_bus_id"] == "0000:5d:00.0"
    slow = found[("throttle", "gpu/1")]
    assert (slow["severity"], slow["action"]) == ("fail", "inspect_hardware")
    assert slow["evidence"]["active"] == ["hw_slowdown"]
    lost = found[("throttle", "gpu/3")]
    assert (lost["severity"], lost["action"]) == ("fail", "reboot_node")
    assert "GPU lost" in lost["message"]
    app = found[("xid", "gpu/5")]
    assert (app["severity"], app["action"]) == ("warn", "restart_app")
    # every check that ran appears at least once
    assert {f["check"] for f in doc["findings"]} == CONTINUOUS


def test_healthy_scenario_exits_0_with_every_check_present() -> None:
    proc = run_gpumon("check", "--simulate", "healthy-8xh100", "--json")
    assert proc.returncode == 0, proc.stderr
    findings = _findings(proc.stdout)
    assert {f["check"] for f in findings} == CONTINUOUS
    others = [f for f in findings if f["check"] != "fabric"]
    assert {f["severity"] for f in others} == {"ok"}, [f for f in others if f["severity"] != "ok"]
    # no fabric probe has run on a fresh node, and the fabric check says so
    assert [f["severity"] for f in findings if f["check"] == "fabric"] == ["skipped"]


def test_before_the_faults_start_the_node_is_healthy() -> None:
    proc = run_gpumon("check", "--simulate", "faulty-8xh100", "--sim-at", "5", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_human_table_and_named_checks() -> None:
    proc = run_gpumon("check", "throttle", "--simulate", "faulty-8xh100")
    assert proc.returncode == 2
    assert "hw_slowdown" in proc.stdout and "xid" not in proc.stdout.split("\n", 2)[2]
    proc = run_gpumon("check", "nosuchcheck", "--simulate", "faulty-8xh100")
    assert proc.returncode == 3 and "unknown check" in proc.stderr


def test_no_driver_exits_3_with_nvml_not_found(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "proc").mkdir()
    proc = run_gpumon("--host-root", str(tmp_path), "check", "--json")
    assert proc.returncode == 3
    assert "NVML not found — is the NVIDIA driver installed?" in proc.stderr
    assert proc.stdout == ""


DATA = Path(__file__).parent / "data"


def test_a_saved_kernel_log_is_judged_without_nvml(tmp_path: Path) -> None:
    """Issue 18: `check --kmsg-file` on a laptop (no driver, no GPU) exited 3 "NVML not found"; it
    needs no NVML. The real capture of a node whose GPU fell off the bus, with NVSwitch SXids."""
    (tmp_path / "sys").mkdir()
    (tmp_path / "proc").mkdir()
    saved = DATA / "kmsg-xid" / "dmesg_xid79-fallen-off-bus_plus_sxid20034-ltssm-fault-up.log"
    proc = run_gpumon("--host-root", str(tmp_path), "check", "--json", "--kmsg-file", str(saved))
    assert proc.returncode == 2, proc.stderr
    found = {(f["check"], f["component"]): f for f in json.loads(proc.stdout)["findings"]}
    xid = found[("xid", "pci/0000:91:00.0")]
    assert (xid["severity"], xid["action"]) == ("fail", "reboot_node")
    assert "Xid 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in xid["message"]
    assert found[("nvswitch", "nvswitch/0")]["severity"] == "fail"
    # only the log's checks: this laptop's (absent) GPUs are not what the log is about
    assert {c for c, _ in found} <= {"xid", "nvswitch", "pcie"}
    assert not any("NVML not found" in f["message"] for f in found.values())
    # a clean log: exit 0
    clean = DATA / "kmsg-xid" / "dev-kmsg-raw_peermem.log"
    ok = run_gpumon("--host-root", str(tmp_path), "check", "--kmsg-file", str(clean))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = run_gpumon("--host-root", str(tmp_path), "check", "--kmsg-file", str(tmp_path / "nope.log"))
    assert missing.returncode == 3 and "kernel log file not found" in missing.stderr


def test_unusable_host_root_exits_3(tmp_path: Path) -> None:
    proc = run_gpumon("--host-root", str(tmp_path / "missing"), "check")
    assert proc.returncode == 3 and "host root" in proc.stderr


def test_bad_scenario_names_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nsku: h100-sxm\nfaults:\n  - {at_s: 1, kind: xid, gpu: 3}\n")
    proc = run_gpumon("check", "--simulate", str(path))
    assert proc.returncode == 3
    assert f"{path}:4: faults[0]" in proc.stderr and "needs 'code'" in proc.stderr
    path.write_text("name: x\nsku: h100-sxm\nfaults:\n  - {at_s: 1, kind: xid, gpu: 9, code: 79}\n")
    proc = run_gpumon("check", "--simulate", str(path))
    assert proc.returncode == 3 and "gpu 9 does not exist" in proc.stderr


def _scenario(tmp_path: Path, hang_s: float) -> Path:
    path = tmp_path / "hang.yaml"
    path.write_text(
        "name: hang\nsku: h100-sxm\ngpus: 8\nfaults:\n"
        f"  - {{kind: nvml_hang, gpu: 4, function: nvmlDeviceGetCurrentClocksEventReasons, "
        f"seconds: {hang_s}}}\n")
    return path


def test_hung_nvml_call_is_a_finding_within_its_bound(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  nvml_call_s: 1\n")
    start = time.monotonic()
    proc = run_gpumon("--config", str(cfg), "check", "throttle", "--simulate",
                      str(_scenario(tmp_path, 20)), "--json")
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    found = {f["component"]: f for f in _findings(proc.stdout)}
    hung = found["gpu/4"]
    # a GPU whose NVML calls hang: the driver no longer answers for it, a reboot (sources in check.py)
    assert hung["severity"] == "fail" and hung["action"] == "reboot_node"
    assert hung["message"] == "hung after 1 s in nvmlDeviceGetCurrentClocksEventReasons(gpu/4)"
    assert elapsed < 15  # the 20 s hang was not waited out


def _healthy(tmp_path: Path, cfg: Path, *checks: str) -> tuple[dict[str, float], float]:
    """Each check's seconds and the whole command's on the same node without the hang, run now: this
    machine's pace, to compare a run with a hang against (a busy machine slows both)."""
    scenario = tmp_path / "healthy.yaml"
    scenario.write_text("name: healthy\nsku: h100-sxm\ngpus: 8\nfaults: []\n")
    start = time.monotonic()
    proc = run_gpumon("--config", str(cfg), "check", *checks, "--simulate", str(scenario), "--json", "-v")
    elapsed = time.monotonic() - start
    assert proc.returncode in (0, 1), proc.stderr
    return {c["check"]: float(c["seconds"]) for c in json.loads(proc.stdout)["checks"]}, elapsed


def _within_one_bound(runs: dict[str, dict[str, Any]], healthy: dict[str, float], bound_s: float) -> None:
    """Each check waited at most one bound: its healthy time (twice that, for a busy machine's noise)
    plus one and a half bounds, where a check that waited the bound once per GPU would take 8."""
    slow = {name: (r["seconds"], healthy.get(name)) for name, r in runs.items()
            if float(r["seconds"]) > 2 * healthy.get(name, 0.0) + 1.5 * bound_s}
    assert not slow, f"check: (seconds, seconds on the healthy node): {slow}"


def test_a_hung_nvml_call_is_its_gpus_finding_within_its_bound_in_every_check(tmp_path: Path) -> None:
    """Issue 14 #1: one NVML function hangs on GPU 4 (30 s, bound 1 s). Every check that meets it
    reports it on gpu/4 within the bound + 1 s, naming that call, with the GPU-hang action; the
    calls after it on that GPU are answered at once; the other GPUs' readings all come through."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  nvml_call_s: 1\n")
    scenario = tmp_path / "hang.yaml"
    scenario.write_text("name: hang\nsku: h100-sxm\ngpus: 8\nfaults:\n"
                        "  - {kind: nvml_hang, gpu: 4, function: nvmlDeviceGetTemperature, seconds: 30}\n")
    healthy, healthy_elapsed = _healthy(tmp_path, cfg)
    start = time.monotonic()
    proc = run_gpumon("--config", str(cfg), "check", "--simulate", str(scenario), "--json", "-v")
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    runs = {c["check"]: c for c in doc["checks"]}
    assert {r["outcome"] for r in runs.values()} <= {"completed", "skipped"}, runs
    # one hung call at a time on GPU 4: each check is done within about one bound
    _within_one_bound(runs, healthy, 1.0)
    # the command as a whole too (not the 30 s hang)
    assert elapsed < 2 * healthy_elapsed + 1.5, (elapsed, healthy_elapsed)
    want = "hung after 1 s in nvmlDeviceGetTemperature(gpu/4)"
    found = {(f["check"], f["component"]): f for f in doc["findings"]}
    for check in ("thermal", "throttle"):  # both read the temperature of every GPU
        hung = found[(check, "gpu/4")]
        assert (hung["severity"], hung["action"], hung["message"]) == ("fail", "reboot_node", want), hung
        for i in (0, 1, 2, 3, 5, 6, 7):
            assert found[(check, f"gpu/{i}")]["severity"] == "ok", found[(check, f"gpu/{i}")]
    # whichever other check met GPU 4 after that call hung was answered with it, not another wait
    for f in doc["findings"]:
        if f["component"] == "gpu/4" and f["severity"] != "ok":
            assert (f["message"], f["action"]) == (want, "reboot_node"), f


def test_a_driver_wide_hang_names_every_gpu_within_one_bound(tmp_path: Path) -> None:
    """Issue 23 #5: one NVML call hangs on EVERY GPU (a driver-wide hang; 30 s, bound 1 s). Each check
    that makes the call names every GPU with it, reboot_node, within the bound + 1 s: the GPUs are
    read at once, so the bound is not waited out once per GPU (8 x 1 s, past a check's own timeout
    with the default 5 s bound: 'throttle' on 'node', action none, after 20 s)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  nvml_call_s: 1\n")
    scenario = tmp_path / "hang.yaml"
    functions = ("nvmlDeviceGetTemperature", "nvmlDeviceGetEccMode")
    scenario.write_text("name: hang\nsku: h100-sxm\ngpus: 8\nfaults:\n" + "".join(
        f"  - {{kind: nvml_hang, gpu: {g}, function: {fn}, seconds: 30}}\n"
        for fn in functions for g in range(8)))
    healthy, _ = _healthy(tmp_path, cfg, "thermal", "throttle", "memory")
    proc = run_gpumon("--config", str(cfg), "check", "thermal", "throttle", "memory", "--simulate",
                      str(scenario), "--json", "-v")
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    runs = {c["check"]: c for c in doc["checks"]}
    assert {r["outcome"] for r in runs.values()} == {"completed"}, runs
    _within_one_bound(runs, healthy, 1.0)  # one bound, not 8
    found = {(f["check"], f["component"]): f for f in doc["findings"]}
    for check, fn in (("thermal", functions[0]), ("throttle", functions[0]), ("memory", functions[1])):
        for g in range(8):
            f = found[(check, f"gpu/{g}")]
            assert (f["severity"], f["action"], f["message"]) == (
                "fail", "reboot_node", f"hung after 1 s in {fn}(gpu/{g})"), f
    assert not [f for f in doc["findings"] if f["component"] == "node" and f["severity"] != "ok"]


def test_hung_check_is_reported_within_timeout_plus_1s_while_others_finish(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  nvml_call_s: 60\nchecks:\n  throttle:\n    timeout_s: 2\n")
    proc = run_gpumon("--config", str(cfg), "check", "throttle", "xid", "--simulate",
                      str(_scenario(tmp_path, 30)), "--json", "-v", env=clean_env())
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    runs = {c["check"]: c for c in doc["checks"]}
    assert runs["throttle"]["outcome"] == "hung"
    assert runs["throttle"]["seconds"] < 3.0  # timeout + 1 s
    assert runs["xid"]["outcome"] == "completed"
    hung = [f for f in doc["findings"] if f["check"] == "throttle"]
    assert hung[0]["message"] == "hung after 2 s in nvmlDeviceGetCurrentClocksEventReasons(gpu/4)"
