"""A real Prometheus (Debian package) scrapes ``gpumon daemon --simulate`` on loopback, with the scrape
config gpumon ships for systemd hosts (config/prometheus/gpumon-scrape.yaml).

The shipped config is used as it is but for what a test must change: the file_sd path (a temporary
targets file naming the test's exporter on 127.0.0.1:PORT), the rule file's path (the config is
written to a temporary folder) and a 1 s scrape interval (30 s would make a test wait up to 30 s for
its first scrape). ``promtool`` checks the shipped file untouched.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import clean_env, need_tool, tls_web_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "config" / "prometheus" / "gpumon-scrape.yaml"
EXAMPLE_TARGETS = ROOT / "config" / "prometheus" / "gpumon-targets.example.yaml"
RULES = ROOT / "config" / "prometheus" / "gpumon-rules.yaml"
TLS_BEGIN, TLS_END = "# --- TLS and basic auth", "# --- end TLS and basic auth"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc = json.load(resp)
    assert doc["status"] == "success"
    return list(doc["data"]["result"])


def _uncomment_tls(text: str) -> str:
    """The shipped config with its TLS and basic-auth block uncommented, as its comment says to do."""
    out, inside = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(TLS_BEGIN):
            inside = True
        elif stripped.startswith(TLS_END):
            inside = False
        elif inside and stripped.startswith("# ") and not stripped.startswith("# ("):
            indent = line[:len(line) - len(line.lstrip())]
            line = indent + stripped[2:]
        out.append(line)
    return "\n".join(out) + "\n"


def shipped_config(tmp_path: Path, targets: list[str], *, tls: dict[str, str] | None = None) -> Path:
    """The shipped scrape config, pointed at ``targets`` (file_sd) and the shipped rules, 1 s scrapes;
    ``tls``: the TLS/basic-auth block uncommented, with these file paths in place of the shipped ones."""
    text = SHIPPED.read_text()
    if tls is not None:
        text = _uncomment_tls(text)
        for shipped, ours in tls.items():
            assert shipped in text, shipped
            text = text.replace(shipped, ours)
    doc = yaml.safe_load(text)
    [job] = doc["scrape_configs"]
    assert job["job_name"] == "gpumon"
    [sd] = job["file_sd_configs"]
    assert sd["files"] == ["/etc/prometheus/gpumon-targets/*.yaml"]
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "test.yaml").write_text(yaml.safe_dump([{"targets": targets,
                                                                    "labels": {"cluster": "test"}}]))
    sd["files"] = [str(tmp_path / "targets" / "*.yaml")]
    assert doc["rule_files"] == ["gpumon-rules.yaml"]
    doc["rule_files"] = [str(RULES)]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    doc["global"] = {"evaluation_interval": "1s"}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


@contextlib.contextmanager
def running(*commands: tuple[list[str], dict[str, str] | None]) -> Iterator[None]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for cmd, env in commands]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def _prometheus_cmd(config: Path, tmp_path: Path, port: int) -> list[str]:
    return [need_tool("prometheus", "prometheus"), f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]


def _daemon_cmd(scenario: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpumon", *extra, "daemon", "--simulate", str(scenario), "--duration", "60",
            "--listen", f"127.0.0.1:{port}"]


def test_promtool_check_config_passes_on_the_shipped_file_as_is(tmp_path: Path) -> None:
    proc = subprocess.run([need_tool("promtool", "prometheus"), "check", "config", str(SHIPPED)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"SUCCESS: {SHIPPED} is valid prometheus config file syntax" in out, out
    assert "SUCCESS: 1 rule files found" in out, out  # gpumon-rules.yaml, found next to it
    # the one warning: the targets folder of a Prometheus host, which this machine is not
    warnings = [ln.strip() for ln in out.splitlines() if "WARNING" in ln]
    assert warnings == ['WARNING: file "/etc/prometheus/gpumon-targets/*.yaml" for file_sd in scrape job '
                        '"gpumon" does not exist'], out


def test_the_example_targets_file_is_discovered_with_instance_the_host(tmp_path: Path) -> None:
    """promtool's own service discovery and relabeling of the shipped example targets file."""
    config = tmp_path / "prometheus.yml"
    config.write_text(SHIPPED.read_text()
                      .replace("/etc/prometheus/gpumon-targets/*.yaml", str(EXAMPLE_TARGETS))
                      .replace("  - gpumon-rules.yaml", f"  - {RULES}"))
    proc = subprocess.run([need_tool("promtool", "prometheus"), "check", "service-discovery", "--timeout=1s",
                           str(config), "gpumon"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {(t["labels"]["__address__"], t["labels"]["instance"], t["labels"]["job"], t["labels"]["cluster"])
             for t in json.loads(proc.stdout)}
    assert found == {("gpu001.cluster.example:9426", "gpu001.cluster.example", "gpumon", "train-a"),
                     ("gpu002.cluster.example:9426", "gpu002.cluster.example", "gpumon", "train-a"),
                     ("gpu101.cluster.example:9426", "gpu101.cluster.example", "gpumon", "train-b")}


def test_prometheus_sees_the_fault_arrive(tmp_path: Path) -> None:
    gpumon_port, prom_port = _free_port(), _free_port()
    scenario = tmp_path / "s.yaml"
    # the fault 8 s in: the daemon's and Prometheus's start-up and a first 1 s scrape must fit before it
    # (4 s did not, once, on a loaded 2-core machine)
    scenario.write_text("name: prom\nsku: h100-sxm\nfaults:\n  - {at_s: 8, kind: xid, gpu: 3, code: 79}\n")
    config = shipped_config(tmp_path, [f"127.0.0.1:{gpumon_port}"])
    with running((_daemon_cmd(scenario, gpumon_port), clean_env()),
                 (_prometheus_cmd(config, tmp_path, prom_port), None)):
        deadline = time.monotonic() + 45
        healthy_seen = False
        fault: list[dict[str, Any]] = []
        lost: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                up = _query(prom_port, 'up{job="gpumon"}')
                if not healthy_seen and up and up[0]["value"][1] == "1":
                    ok = _query(prom_port, 'gpumon_finding_severity{check="throttle",component="gpu/3"}')
                    healthy_seen = bool(ok) and ok[0]["value"][1] == "0"
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
        # the shipped job's labels: job as the rules select it, instance the host, the file's labels
        [up_now] = _query(prom_port, 'up{job="gpumon"} == 1')
        assert (up_now["metric"]["instance"], up_now["metric"]["cluster"]) == ("127.0.0.1", "test")
        # the rules' join onto gpumon_build_info (the `node` label every alert carries) finds its match
        joined = _query(prom_port, '(gpumon_health_state{component="node",state="unhealthy"} == 1) '
                                   '* on (job, instance) group_left (node) gpumon_build_info')
        assert joined and joined[0]["metric"]["node"], joined
        with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/rules", timeout=5) as resp:
            groups = {g["name"] for g in json.load(resp)["data"]["groups"]}
        assert "gpumon-health" in groups, groups  # rule_files of the shipped config loaded


def test_the_shipped_tls_and_basic_auth_block_scrapes_a_tls_exporter(tmp_path: Path) -> None:
    """Uncommented as its comment says, the block scrapes a node serving /metrics over TLS with basic
    auth (exporter.web_config_file), which refuses a scrape without the password."""
    web, crt = tls_web_config(tmp_path, "prometheus", "s3cret")
    gpumon_config = tmp_path / "gpumon.yaml"
    gpumon_config.write_text(f"exporter:\n  web_config_file: {web}\n")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    gpumon_port, prom_port = _free_port(), _free_port()
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: prom-tls\nsku: h100-sxm\nfaults: []\n")
    config = shipped_config(tmp_path, [f"127.0.0.1:{gpumon_port}"], tls={
        "/etc/prometheus/gpumon-ca.crt": str(crt), "/etc/prometheus/gpumon-scrape.password": str(password)})
    assert yaml.safe_load(config.read_text())["scrape_configs"][0]["scheme"] == "https"
    with running((_daemon_cmd(scenario, gpumon_port, "--config", str(gpumon_config)), clean_env()),
                 (_prometheus_cmd(config, tmp_path, prom_port), None)):
        deadline = time.monotonic() + 30
        build: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not build:
            time.sleep(0.5)
            with contextlib.suppress(OSError):
                build = _query(prom_port, 'gpumon_build_info{job="gpumon"} and on (job, instance) '
                                          '(up{job="gpumon"} == 1)')
        assert build, "Prometheus never scraped the TLS + basic-auth exporter with the shipped block"
        assert build[0]["metric"]["instance"] == "127.0.0.1"
        # the exporter does refuse a scrape without the password: the block is what made it work
        ctx = ssl.create_default_context(cafile=str(crt))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"https://127.0.0.1:{gpumon_port}/metrics", timeout=5, context=ctx)
        refused.value.close()
        assert refused.value.code == 401
