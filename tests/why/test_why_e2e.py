"""The query API of real daemons on simulated nodes, and ``gpumon why`` against them (issue 21).

Three ``gpumon daemon --simulate`` processes on loopback ports, started once for the module:

- ``n-ib``: InfiniBand mlx5_2 port 1 down for 3 s, served over TLS with basic auth (the
  exporter's web config, as tests/conftest.py's tls_web_config writes it);
- ``n-xid``: GPU 3 falls off the bus (Xid 79; NVML then answers GPU_IS_LOST);
- ``n-ok``: healthy;

and ``n-down``, a port nobody listens on. The job log is tests/data/why/watchdog-timeout.log: the
PyTorch/NCCL lines in their real formats (sources in the file), with a 5 s watchdog timeout so that
"one watchdog timeout before the failure" falls inside a test's few seconds.
"""

from __future__ import annotations

import base64
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kube_objects import failed_backoff_job, failed_pytorchjob, serve, write_kubeconfig

from conftest import DATA, clean_env, run_gpumon, tls_web_config

LOG = DATA / "why" / "watchdog-timeout.log"
USER, PASSWORD = "why", "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Nodes:
    ports: dict[str, int]
    cert: Path
    password_file: Path
    job_start: float
    tmp: Path

    def url(self, node: str) -> str:
        scheme = "https" if node == "n-ib" else "http"
        return f"{scheme}://127.0.0.1:{self.ports[node]}"

    def node_urls(self, *nodes: str) -> list[str]:
        out = []
        for n in nodes:
            out += ["--node-url", f"{n}={self.url(n)}"]
        return out


# two GPUs spinning in a collective: ~100 % utilization, little power, no memory or PCIe traffic, a
# rank's process on each (tests/checks/test_collective_hang.py's HUNG)
_SPINNING = "".join(f"  - {{at_s: 0, kind: activity, gpu: {g}, pct: 100, memory_pct: 0, power_w: 118, "
                    f"pcie_mbps: 0.5}}\n  - {{at_s: 0, kind: compute_process, gpu: {g}, pid: {4200 + g}}}\n"
                    for g in (0, 1))
SCENARIOS = {
    "n-ib": "faults:\n  - {at_s: 5, kind: ib_down, device: mlx5_2, port: 1, duration_s: 3}\n",
    "n-xid": "faults:\n  - {at_s: 3, kind: xid, gpu: 3, code: 79}\n",
    "n-ok": "faults: []\n",
    "n-wait1": "faults:\n" + _SPINNING,
    "n-wait2": "faults:\n" + _SPINNING,
}
# the waiting nodes' hung-collective check samples every second and calls 2 s of the signature stuck
_HANG_FAST = "checks:\n  collective_hang:\n    interval_s: 1\n    hold_s: 2\n    max_sample_gap_s: 5\n"


def _get(nodes: Nodes, node: str, path: str, *, auth: bool = True) -> tuple[int, dict[str, Any]]:
    headers = {}
    if auth and node == "n-ib":
        headers["Authorization"] = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    ctx = ssl.create_default_context(cafile=str(nodes.cert)) if node == "n-ib" else None
    req = urllib.request.Request(nodes.url(node) + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"raw": body.decode(errors="replace")}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    tmp = tmp_path_factory.mktemp("why")
    web, crt = tls_web_config(tmp, USER, PASSWORD)
    password_file = tmp / "password"
    password_file.write_text(PASSWORD + "\n")
    ports = {name: _free_port() for name in (*SCENARIOS, "n-down")}
    procs, logs = [], []
    for name, faults in SCENARIOS.items():
        d = tmp / name
        d.mkdir()
        (d / "s.yaml").write_text(f"name: {name}\nsku: h100-sxm\n{faults}")
        config = f"node_name: {name}\n"
        config += f"exporter:\n  web_config_file: {web}\n" if name == "n-ib" else ""
        config += _HANG_FAST if name.startswith("n-wait") else ""
        (d / "gpumon.yaml").write_text(config)
        logs.append(open(d / "daemon.log", "w"))  # noqa: SIM115 (closed at teardown)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpumon", "--config", str(d / "gpumon.yaml"), "daemon", "--simulate",
             str(d / "s.yaml"), "--sim-dir", str(d / "sim"), "--duration", "120",
             "--listen", f"127.0.0.1:{ports[name]}"],
            stdout=subprocess.DEVNULL, stderr=logs[-1], env=clean_env()))
    made = Nodes(ports, crt, password_file, 0.0, tmp)
    try:
        started: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while len(started) < len(SCENARIOS) and time.monotonic() < deadline:
            time.sleep(0.3)
            for name in SCENARIOS:
                if name in started:
                    continue
                try:
                    code, doc = _get(made, name, "/api/v1/findings")
                except OSError:
                    continue
                if code == 200:
                    started[name] = float(doc["node"]["daemon_started"])
        assert len(started) == len(SCENARIOS), f"daemons not serving: {sorted(set(SCENARIOS) - set(started))}"
        # the job starts once every daemon watches its node (before any fault of the scenarios)
        made.job_start = max(started.values()) + 0.1
        # ... and ends once the IB port is back and its outage is stored (the ok finding after it)
        while time.monotonic() < deadline:
            _, doc = _get(made, "n-ib", "/api/v1/events?limit=10000")
            if any(e["check"] == "ib" and e["component"] == "ib/mlx5_2/1"
                   and e["evidence"].get("recent_outages") for e in doc["events"]):
                break
            time.sleep(0.3)
        else:
            pytest.fail("the IB outage never reached n-ib's history")
        while time.monotonic() < deadline:  # and the Xid 79 n-xid's (at 3 s: long since, unless slow)
            _, doc = _get(made, "n-xid", "/api/v1/findings")
            if any(f["check"] == "xid" for f in doc["health"]["faults"]):
                break
            time.sleep(0.3)
        else:
            pytest.fail("the Xid 79 never reached n-xid's health state")
        yield made
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()


# -- the query API -------------------------------------------------------------------------------


def test_api_needs_the_exporters_basic_auth(nodes: Nodes) -> None:
    code, doc = _get(nodes, "n-ib", "/api/v1/events", auth=False)
    assert code == 401, doc
    code, _ = _get(nodes, "n-ib", "/api/v1/findings", auth=False)
    assert code == 401
    code, doc = _get(nodes, "n-ib", "/api/v1/events")
    assert code == 200 and doc["api"] == 1


def test_api_events_say_the_ib_outage_to_the_second_with_the_nodes_identity(nodes: Nodes) -> None:
    code, doc = _get(nodes, "n-ib", "/api/v1/events?" + urllib.parse.urlencode(
        {"since": nodes.job_start - 60, "until": time.time(), "limit": 10000}))
    assert code == 200, doc
    ident = doc["node"]
    assert ident["node"] == "n-ib" and ident["host"] == socket.gethostname()
    assert ident["boot_id"] and ident["boot_time"] < ident["daemon_started"]
    assert doc["truncated"] is False and doc["count"] == len(doc["events"])
    assert [e for e in doc["events"] if e["kind"] == "boot"], "the daemon's boot event"
    outages = [o for e in doc["events"] if e["component"] == "ib/mlx5_2/1"
               for o in e["evidence"].get("recent_outages") or []]
    assert outages, doc["events"]
    o = outages[-1]
    assert 2.0 <= o["down_s"] <= 4.5 and o["end"] - o["start"] == pytest.approx(o["down_s"], abs=0.1)
    assert nodes.job_start < o["start"]
    for e in doc["events"]:
        assert {"time", "check", "component", "severity", "action", "message", "evidence"} <= set(e)


def test_api_findings_are_the_current_faults(nodes: Nodes) -> None:
    code, doc = _get(nodes, "n-xid", "/api/v1/findings")
    assert code == 200
    assert doc["node"]["node"] == "n-xid"
    assert doc["health"]["state"] == "unhealthy", doc
    faults = {(f["check"], f["component"]) for f in doc["health"]["faults"]}
    assert ("xid", "gpu/3") in faults, faults
    assert any(f["check"] == "xid" and f["evidence"].get("code") == 79
               for f in doc["findings"]), doc["findings"]


def test_api_findings_say_which_checks_judge_the_node(nodes: Nodes) -> None:
    """What lets a post-mortem tell "did not show it" from "not known": n-xid's hung-collective check
    judges its GPUs (seven readable, idle, no process), and no ok finding is listed as a finding."""
    _, doc = _get(nodes, "n-xid", "/api/v1/findings")
    assert {"collective_hang", "xid", "throttle"} <= set(doc["checks_judging"]), doc["checks_judging"]
    assert "fabric" not in doc["checks_judging"]  # skipped: no probe has run there
    assert all(f["severity"] != "ok" for f in doc["findings"])


def _stuck_on(nodes: Nodes, *names: str) -> None:
    """Until each node's hung-collective check has held the signature long enough to warn."""
    deadline = time.monotonic() + 40
    waiting = set(names)
    while waiting and time.monotonic() < deadline:
        for name in sorted(waiting):
            _, doc = _get(nodes, name, "/api/v1/findings")
            if any(f["check"] == "collective_hang" and f["evidence"].get("activity") == "stuck"
                   for f in doc["findings"]):
                waiting.discard(name)
        time.sleep(0.3)
    assert not waiting, f"no hung-collective warning on {sorted(waiting)}"


def test_why_says_the_job_waited_for_the_node_without_the_hung_signature(nodes: Nodes) -> None:
    """Issue 20 point 2 through real daemons: two nodes' GPUs spin in a collective (the signature,
    through the NVML injection library); n-xid, whose GPU fell off the bus, does not show it. Its
    suspect says the job waited for it; with a healthy third node instead, a note says so and the
    verdict stays "no infrastructure evidence"."""
    _stuck_on(nodes, "n-wait1", "n-wait2")
    code, doc = _why(nodes, "n-wait1", "n-wait2", "n-xid")
    assert code == 2, doc
    xid = next(s for s in doc["suspects"] if (s["node"], s["what"]) == ("n-xid", "xid"))
    assert xid["evidence"]["hang_signature"]["shown_on"] == ["n-wait1", "n-wait2"], xid
    assert xid["evidence"]["hang_signature"]["gpus"] == 4
    assert "not on n-xid: the job's collectives waited for n-xid" in xid["why"]
    assert doc["suspects"][0]["node"] == "n-xid"
    assert "collective_hang" in next(n for n in doc["nodes"] if n["node"] == "n-xid")["judging"]
    assert {(i["node"], i["component"]) for i in doc["timeline"] if i["what"] == "hang_signature"} \
        == {(n, f"gpu/{g}") for n in ("n-wait1", "n-wait2") for g in (0, 1)}

    code, doc = _why(nodes, "n-wait1", "n-wait2", "n-ok")
    assert code == 0 and doc["verdict"] == "no_infrastructure_evidence", \
        (doc["verdict"], doc.get("missing_evidence"), doc["notes"], doc["suspects"])
    assert any("not on n-ok: the job's collectives waited for n-ok; no infrastructure event" in n
               for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize(("query", "parameter", "words"), [
    ("since=yesterday", "since", "not Unix seconds nor an RFC 3339"),
    ("until=2024-06-10T06:13:20", "until", "needs its zone"),
    ("since=100&until=50", "since", "since is after until"),
    ("since=0&until=2700000", "since", "at most 31 days"),
    ("limit=0", "limit", "must be 1 to 10000"),
    ("limit=10001", "limit", "must be 1 to 10000"),
    ("limit=ten", "limit", "not a whole number"),
    ("check=xid", "check", "unknown parameter"),
    ("limit=5&limit=6", "limit", "given 2 times"),
])
def test_api_bad_parameters_are_400_with_the_reason(nodes: Nodes, query: str, parameter: str,
                                                    words: str) -> None:
    code, doc = _get(nodes, "n-ok", "/api/v1/events?" + query)
    assert code == 400, doc
    assert doc["parameter"] == parameter and words in doc["error"], doc


def test_api_limit_truncates_and_rfc3339_is_read(nodes: Nodes) -> None:
    code, doc = _get(nodes, "n-xid", "/api/v1/events?limit=1&since=2020-01-01T00:00:00Z&until="
                     + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60)))
    assert code == 400 and "at most 31 days" in doc["error"]  # 2020 .. now is too long a window
    since = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(nodes.job_start - 3600))
    code, doc = _get(nodes, "n-xid", "/api/v1/events?limit=1&since=" + urllib.parse.quote(since))
    assert code == 200, doc
    assert doc["count"] == 1 and doc["truncated"] is True
    code, doc = _get(nodes, "n-xid", "/api/v1/nothing")
    assert code == 404 and "known: /api/v1/events" in doc["error"]


# -- gpumon why ----------------------------------------------------------------------------------


def _why(nodes: Nodes, *names: str, extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    proc = run_gpumon("why", "--nodes", ",".join(names), "--start", repr(nodes.job_start),
                      "--end", repr(time.time()), *nodes.node_urls(*[n for n in names if n in nodes.ports]),
                      "--cacert", str(nodes.cert), "--user", USER,
                      "--password-file", str(nodes.password_file),
                      "--timeout", "5", "--json", *extra, timeout=60)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_why_names_the_ib_port_and_the_gpu_and_lists_the_dead_node(nodes: Nodes) -> None:
    code, doc = _why(nodes, "n-ib", "n-xid", "n-ok", "n-down", extra=("--log", str(LOG)))
    assert code == 2, doc
    assert doc["schema"] == "gpumon.why/v1" and doc["verdict"] == "infrastructure"
    # the log: a 5 s watchdog, NCCL 2.18 (so NCCL_IB_TIMEOUT 18 by default) but the log says 14
    assert doc["watchdog_timeout_s"] == 5.0
    assert doc["nccl"]["NCCL_IB_TIMEOUT"] == 14 and doc["nccl"]["NCCL_IB_RETRY_CNT"] == 7
    assert doc["nccl"]["retry_window_s"] == pytest.approx(4.096e-6 * 2 ** 14 * 7, abs=1e-3)
    stuck = doc["log"]["stuck_collective"]
    assert stuck["op"] == "ALLREDUCE" and stuck["seq"] == 1580
    suspects = {(s["node"], s["component"], s["what"]) for s in doc["suspects"]}
    assert ("n-ib", "ib/mlx5_2/1", "ib_outage") in suspects, doc["suspects"]
    # (the NVML checks' GPU_IS_LOST findings follow at their own intervals: not waited for here)
    xid = next(s for s in doc["suspects"]
               if (s["node"], s["component"], s["what"]) == ("n-xid", "gpu/3", "xid"))
    assert xid["tier"] == 1 and xid["evidence"] == {"code": 79, "action": "reboot_node"}, xid
    assert not [s for s in doc["suspects"] if s["node"] == "n-ok"], doc["suspects"]
    ib = next(s for s in doc["suspects"] if s["what"] == "ib_outage")
    assert ib["tier"] == 1 and "longer than NCCL's IB retry window" in ib["why"]
    assert ib["relative_s"] < 0 and ib["time"] == pytest.approx(ib["evidence"]["start"])
    # the log's "Connection closed by remote peer n-xid" backs the suspect on n-xid
    assert any("Connection closed by remote peer n-xid" in s["why"]
               for s in doc["suspects"] if s["node"] == "n-xid")
    assert doc["unreachable"] == ["n-down"]
    down = next(n for n in doc["nodes"] if n["node"] == "n-down")
    assert down["reachable"] is False and "cannot connect" in down["error"]
    assert any("did not answer" in n and "lower confidence" in n for n in doc["notes"])
    assert [n["node"] for n in doc["nodes"]] == ["n-ib", "n-xid", "n-ok", "n-down"]


def test_why_with_ncclss_default_window_does_not_blame_a_short_outage(nodes: Nodes) -> None:
    """Without the log's NCCL_IB_TIMEOUT=14: NCCL >= 2.23 defaults (30 s), the 3 s outage is context."""
    code, doc = _why(nodes, "n-ib", extra=("--nccl-version", "2.23.4"))
    assert code == 0, doc
    assert doc["verdict"] == "no_infrastructure_evidence"
    assert doc["nccl"]["retry_window_s"] == pytest.approx(30.06, abs=0.01)
    assert any(i["what"] == "ib_outage" and i["tier"] == 3 and "retried through it" in i["why"]
               for i in doc["timeline"])


def test_why_on_healthy_nodes_says_no_infrastructure_evidence(nodes: Nodes) -> None:
    code, doc = _why(nodes, "n-ok")
    assert code == 0, doc
    assert doc["verdict"] == "no_infrastructure_evidence" and doc["suspects"] == []
    assert "look at the application" in doc["summary"]
    # the table says the same
    proc = run_gpumon("why", "--nodes", "n-ok", "--start", repr(nodes.job_start),
                      *nodes.node_urls("n-ok"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: no infrastructure evidence" in proc.stdout


def test_why_with_a_node_down_and_no_suspect_is_inconclusive(nodes: Nodes) -> None:
    code, doc = _why(nodes, "n-ok", "n-down")
    assert code == 1, doc
    assert doc["verdict"] == "inconclusive" and doc["unreachable"] == ["n-down"]
    code, doc = _why(nodes, "n-down")
    assert code == 3 and doc["verdict"] == "cannot_answer"


def test_why_without_the_password_lists_the_node_as_refused(nodes: Nodes) -> None:
    proc = run_gpumon("why", "--nodes", "n-ib", "--start", repr(nodes.job_start), *nodes.node_urls("n-ib"),
                      "--cacert", str(nodes.cert), "--json", timeout=60)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 3 and doc["nodes"][0]["error"].startswith("HTTP 401"), doc


def test_why_for_a_pytorchjob_names_its_nodes_from_its_pods(nodes: Nodes) -> None:
    """The job from a Kubernetes API (the loopback stub of tests/why/kube_objects.py, read by the real
    client through a kubeconfig): master and worker 0 on n-ok, worker 1 on n-xid, whose GPU fell
    off the bus, exited 1; the nodes' evidence from the real daemons."""
    api = serve(failed_pytorchjob(nodes.job_start, time.time(), ("n-ok", "n-ok", "n-xid")),
                failed_backoff_job(nodes.job_start, time.time(), ("n-ok", "n-ok")))
    try:
        kubeconfig = write_kubeconfig(nodes.tmp / "kubeconfig", api.url)
        proc = run_gpumon("why", "--pytorchjob", "ml/bert", "--kubeconfig", str(kubeconfig),
                          *nodes.node_urls("n-ok", "n-xid"), "--timeout", "5", "--json", timeout=60)
        assert proc.returncode == 2, proc.stderr
        doc = json.loads(proc.stdout)
        job = doc["job"]
        assert job["nodes"] == ["n-ok", "n-xid"] and job["source"] == "kubernetes PyTorchJob ml/bert"
        assert job["state"] == "FAILED (PyTorchJobFailed)" and job["failed"] is True
        assert job["id"] == "ml/bert" and job["exit_code"] == "1"
        assert ("n-xid", "gpu/3", "xid") in {(s["node"], s["component"], s["what"]) for s in doc["suspects"]}
        assert not [s for s in doc["suspects"] if s["node"] == "n-ok"]
        assert any("pod bert-worker-1 (worker 1) on n-xid: container pytorch exited 1 (Error)" in n
                   for n in doc["notes"]), doc["notes"]
        assert doc["admin_comment"].startswith("gpumon why: infrastructure; #1 n-xid gpu/3")

        proc = run_gpumon("why", "--k8s-job", "ml/train-oom", "--kubeconfig", str(kubeconfig),
                          *nodes.node_urls("n-ok"), "--timeout", "5", timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "job ml/train-oom: 1 node(s)" in proc.stdout
        assert "FAILED (BackoffLimitExceeded) (exit 137) [kubernetes Job ml/train-oom]" in proc.stdout
        assert "verdict: no infrastructure evidence" in proc.stdout
        assert "container train exited 137 (OOMKilled)" in proc.stdout
    finally:
        api.close()


def test_why_usage_errors_exit_3(nodes: Nodes) -> None:
    proc = run_gpumon("why", "--nodes", "n-ok")
    assert proc.returncode == 3 and "which job?" in proc.stderr
    proc = run_gpumon("why", "--nodes", "n-ok", "--start", "noon")
    assert proc.returncode == 3 and "--start 'noon'" in proc.stderr
