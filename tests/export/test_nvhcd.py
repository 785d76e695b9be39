"""The NVRx node health check (nvhcd.HealthCheckService over a Unix socket), served by a real
``gpumon daemon`` and asked by a real gRPC client the way NVIDIA Resiliency Extension's
``NodeHealthCheck`` asks it: healthy means ``success`` and ``fail_count == 0`` in the JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import clean_env
from gpumon.export.nvhcd import METHOD, SERVICE, messages

Request, Response = messages()


def ask(sock: Path, args: list[str] | None = None, timeout: float = 5.0) -> Any:
    """NVRx's call: insecure channel to unix://<socket>, RunHealthCheck(args), a request timeout."""
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/{METHOD}", request_serializer=Request.SerializeToString,
                                   response_deserializer=Response.FromString)
        return call(Request(args=args or ["--no-slurm", "--group", "prolog", "epilog", "logs", "gpu"]),
                    timeout=timeout)


def nvrx_healthy(response: Any) -> bool:
    """NVRx shared_utils/health_check.py NodeHealthCheck._perform_health_check's judgement."""
    if not response.success:
        return False
    return bool(json.loads(response.output).get("fail_count") == 0)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(scenario: str) -> Path:
        sock = tmp_path / f"{scenario}.sock"
        cfg = tmp_path / f"{scenario}.yaml"
        cfg.write_text(f"exporter:\n  nvhcd_socket: {sock}\n")
        p = subprocess.Popen([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate",
                              scenario, "--sim-dir", str(tmp_path / scenario), "--listen", "127.0.0.1:0",
                              "--duration", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=clean_env())
        procs.append(p)
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the daemon did not open its socket"
            time.sleep(0.2)
        return sock

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=20)


def test_a_healthy_node_answers_healthy(daemon: Any) -> None:
    sock = daemon("healthy-8xh100")
    r = ask(sock)
    assert r.success and r.exit_code == 0 and r.error == ""
    out = json.loads(r.output)
    assert out["fail_count"] == 0 and out["source"] == "gpumon"
    assert out["args_ignored"] == ["--no-slurm", "--group", "prolog", "epilog", "logs", "gpu"]
    assert nvrx_healthy(r)
    assert oct(sock.stat().st_mode & 0o777) == "0o666"  # the job's user asks


def test_a_faulty_node_answers_unhealthy_with_the_failing_parts(daemon: Any) -> None:
    sock = daemon("faulty-8xh100")
    deadline, r = time.monotonic() + 40, None
    while time.monotonic() < deadline:
        r = ask(sock)
        if not r.success:
            break
        time.sleep(0.5)
    assert r is not None and not r.success and r.exit_code == 2, r
    out = json.loads(r.output)
    assert out["fail_count"] >= 1 and out["state"] in ("unhealthy", "quarantined")
    assert all(f["state"] in ("unhealthy", "quarantined") and f["why"] for f in out["failed_checks"])
    assert not nvrx_healthy(r)


def test_no_socket_configured_serves_nothing_and_a_bad_path_is_a_startup_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    (tmp_path / "file").write_text("")
    cfg.write_text(f"exporter:\n  nvhcd_socket: {tmp_path / 'file' / 'x.sock'}\n")
    proc = subprocess.run([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate",
                           "healthy-8xh100", "--sim-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                           "--duration", "5"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode != 0 and "exporter.nvhcd_socket" in proc.stderr, proc.stderr[-2000:]
