"""How the daemon stops: a second SIGINT exits at once; a start-up that fails part-way stops what it
had started. Real daemons in subprocesses: a real hung NVML call (the injection library) holds the
graceful stop, a real port already bound fails the start-up."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from conftest import clean_env, report_findings
from gpumon.daemon import FORCED_EXIT


def _wait_for(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        said = path.read_text() if path.exists() else ""
        if text in said:
            return said
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path.read_text() if path.exists() else ''}")


def test_a_second_sigint_exits_at_once_while_a_hung_check_holds_the_graceful_stop(tmp_path: Path) -> None:
    # throttle's NVML call hangs 100 s (bound 90 s): its run holds the graceful stop, which waits up
    # to shutdown_grace_s (120 s) for running checks
    scenario = tmp_path / "hang.yaml"
    scenario.write_text("name: hang\nsku: h100-sxm\ngpus: 8\nfaults:\n"
                        "  - {kind: nvml_hang, gpu: 4, function: nvmlDeviceGetCurrentClocksEventReasons, "
                        "seconds: 100}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("timeouts:\n  nvml_call_s: 90\ndaemon:\n  shutdown_grace_s: 120\n"
                   "checks:\n  throttle:\n    timeout_s: 120\n")
    log = tmp_path / "daemon.log"
    with log.open("w") as err, subprocess.Popen(
            [sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate", str(scenario),
             "--sim-dir", str(tmp_path / "sim"), "--listen", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=err, env=clean_env()) as proc:
        try:
            _wait_for(log, "gpumon daemon on", 30)
            # every check starts at once: once the others' first runs are in the report (throttle's
            # is not: it hangs), throttle has had their time to reach its hung call
            report = tmp_path / "sim" / "state" / "report.json"
            deadline = time.monotonic() + 60
            while len(ran := {check for check, _ in report_findings(report)}) < 5:
                assert time.monotonic() < deadline, f"only {ran} reported\n{log.read_text()}"
                time.sleep(0.1)
            assert "throttle" not in ran, ran
            proc.send_signal(signal.SIGTERM)
            _wait_for(log, "shutting down", 10)
            time.sleep(2.0)
            assert proc.poll() is None, "the graceful stop did not wait for the hung check"
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == FORCED_EXIT == 130
            assert time.monotonic() - sent < 5
        finally:
            proc.kill()
    said = log.read_text()
    assert "second SIGINT: exiting now (exit 130) without waiting for running checks" in said, said


def test_one_sigint_is_still_a_graceful_stop(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    with log.open("w") as err, subprocess.Popen(
            [sys.executable, "-m", "gpumon", "daemon", "--simulate", "healthy-8xh100",
             "--sim-dir", str(tmp_path / "sim"), "--listen", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=err, env=clean_env()) as proc:
        try:
            _wait_for(log, "gpumon daemon on", 30)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()
    # the graceful stop wrote the last report
    assert json.loads((tmp_path / "sim" / "state" / "report.json").read_text())["findings"]


def _marked(mark: str) -> list[psutil.Process]:
    """Processes (any parent) whose environment carries ``mark``: the daemon's children, if any."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GPUMON_TEST_MARK") == mark:
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_a_port_already_bound_fails_the_start_up_cleanly(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "gpumon", "daemon", "--simulate", "healthy-8xh100",
                               "--sim-dir", str(tmp_path / "sim"), "--listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, env=clean_env(GPUMON_TEST_MARK=mark),
                              timeout=60)
    assert proc.returncode == 3, proc.stderr
    said = f"gpumon: cannot run: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
    assert said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 20
    assert not _marked(mark)


# The real CLI in a process of its own that then looks at itself: nothing of the failed start-up
# may be left in a process that goes on (the NVRx socket fails after /metrics was serving).
_PROBE = """
import socket, sys, threading, time
from gpumon.cli import main
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
code = main(["--config", sys.argv[1], "daemon", "--simulate", "healthy-8xh100", "--sim-dir", sys.argv[2],
             "--listen", f"127.0.0.1:{port}"])
ours = ("gpumon-metrics", "gpumon-render", "gpumon-remediate", "gpumon-report", "gpumon-kmsg")
deadline = time.monotonic() + 3
while time.monotonic() < deadline and any(t.name in ours for t in threading.enumerate()):
    time.sleep(0.05)
print(code)
print(sorted(t.name for t in threading.enumerate() if t.name in ours))
with socket.socket() as s:
    s.bind(("127.0.0.1", port))  # the exporter's port is free again
print("port free")
"""


def test_a_start_up_that_fails_after_metrics_were_served_stops_them(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    (tmp_path / "a-file").write_text("")  # the socket's folder is a file: ENOTDIR, even for root
    cfg.write_text(f"exporter:\n  nvhcd_socket: {tmp_path / 'a-file' / 'nvhcd.sock'}\n")
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(cfg), str(tmp_path / "sim")],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "metrics on http://127.0.0.1:" in proc.stderr  # /metrics was serving before the failure
    assert "gpumon: cannot run: exporter.nvhcd_socket" in proc.stderr
    assert proc.stdout.splitlines() == ["3", "[]", "port free"], proc.stdout + proc.stderr
