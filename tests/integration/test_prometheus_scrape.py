"""A real Prometheus (Debian package) scrapes ``gpumon daemon --simulate`` on loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import clean_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc = json.load(resp)
    assert doc["status"] == "success"
    return list(doc["data"]["result"])


def test_prometheus_sees_the_fault_arrive(tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus missing: .ci/run must install the Debian package prometheus")
        pytest.skip("prometheus not installed (Debian package prometheus)")
    gpumon_port, prom_port = _free_port(), _free_port()
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: prom\nsku: h100-sxm\nfaults:\n  - {at_s: 4, kind: xid, gpu: 3, code: 79}\n")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gpumon\n    static_configs: [{{targets: ['127.0.0.1:{gpumon_port}']}}]\n")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpumon", "daemon", "--simulate", str(scenario), "--duration", "60",
         "--listen", f"127.0.0.1:{gpumon_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env())
    prom = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 45
        healthy_seen = False
        fault: list[dict[str, object]] = []
        lost: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                up = _query(prom_port, 'up{job="gpumon"}')
                if not healthy_seen and up and up[0]["value"][1] == "1":  # type: ignore[index]
                    ok = _query(prom_port, 'gpumon_finding_severity{check="throttle",component="gpu/3"}')
                    healthy_seen = bool(ok) and ok[0]["value"][1] == "0"  # type: ignore[index]
                fault = _query(prom_port, 'gpumon_finding_severity{check="xid",component="gpu/3"} == 4')
                # the node's health series: what fleet alerts are built on
                lost = _query(prom_port, 'gpumon_health_state{component="node",state="unhealthy"} == 1')
            except OSError:
                continue  # Prometheus still starting
            if fault and lost:
                break
        assert healthy_seen, "Prometheus never scraped the node healthy before the fault"
        assert fault, "Prometheus never saw the Xid 79 on gpu/3"
        assert lost, "Prometheus never saw the node's health state turn unhealthy"
        action = _query(prom_port, 'gpumon_recommended_action{component="gpu/3",action="reboot_node"} == 1')
        assert action, "Prometheus never saw gpu/3's recommended action"
    finally:
        for p in (daemon, prom):
            p.terminate()
        for p in (daemon, prom):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
