"""``gpumon why`` at its edges (issue 35, points 1 to 3) on nodes in network namespaces.

Four test hosts of the fabric tests' harness (tests/fabric/netns.py: each host its own network
namespace behind one bridge), each running ``gpumon daemon --simulate`` over its own simulated node,
its query API on the host's address; ``gpumon why`` runs in the switch's namespace, as on a
controller, in its explicit mode (``--nodes --start --end``) right after each job:

- ``node0``: its clock runs 90 s ahead (tests/why/skewed_clock.py shifts the daemon's own wall clock:
  its checks, its health store, its API's ``now`` and its simulated node's kernel log all agree, as
  on a real node); GPU 1 falls off the bus (Xid 79) once node1's Xid is EARLIER_S old;
- ``node1``: GPU 3 falls off the bus 1 s in, and the fault stays open (awaiting reboot_node);
- ``node2``: healthy;
- ``node3``: its kernel log cannot be read (``/dev/kmsg`` a directory): the xid check says so.

The jobs are windows on this host's clock around the faults as the nodes recorded them. node0's
fault is rendered into its simulated node while its daemon watches (the simulator's own renderer, at
the node's scenario time on its own clock, as tests/why/test_why_slurm.py does): the daemons start
seconds apart on a busy machine, so scenario times alone would not say which node's Xid came first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fabric.netns import TestNet

from conftest import clean_env
from live_faults import start_fault

BIN = Path(sys.executable).parent
SKEWED = Path(__file__).with_name("skewed_clock.py")
PORT = 9426
SKEW_S = 90.0  # ahead: more than the minute after the job's end that `why` reads
EARLIER_S = 4.0  # node1's Xid before node0's, at least: more than the onset window of the test below
SCENARIOS = {
    "node0": "faults: []\n",
    "node1": "faults:\n  - {at_s: 1, kind: xid, gpu: 3, code: 79}\n",
    "node2": "faults: []\n",
    "node3": "faults: []\n",
}


@dataclass
class Nodes:
    net: TestNet
    base: Path
    start: float  # before any daemon started: every job below starts here unless said otherwise

    def ip(self, node: str) -> str:
        return next(h.ip for h in self.net.hosts if h.name == node)

    def get(self, node: str, path: str) -> dict[str, Any] | None:
        """GET a node's query API from the switch's namespace (the test's own has no route to the
        hosts); None when it does not answer."""
        url = f"http://{self.ip(node)}:{PORT}{path}"
        code = ("import sys,urllib.request\ntry:\n"
                f" print(urllib.request.urlopen({url!r}, timeout=3).read().decode())\n"
                "except Exception:\n print('{}')\n")
        proc = self.net.run_ns(self.net.switch_ns, [sys.executable, "-c", code], timeout=20)
        try:
            doc = json.loads(proc.stdout or "{}")
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and doc.get("api") == 1 else None

    def wait(self, node: str, path: str, want: Callable[[dict[str, Any]], Any], what: str,
             timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.get(node, path)
            if doc is not None and want(doc):
                return doc
            time.sleep(0.3)
        raise AssertionError(f"{node}: {what} not seen within {timeout} s\n"
                             + (self.base / node / "daemon.log").read_text(errors="replace")[-3000:])

    def why(self, nodes: tuple[str, ...], start: float, end: float | None, *extra: str
            ) -> tuple[int, dict[str, Any]]:
        urls = [arg for n in nodes for arg in ("--node-url", f"{n}=http://{self.ip(n)}:{PORT}")]
        argv = [str(BIN / "gpumon"), "why", "--nodes", ",".join(nodes), "--start", repr(start),
                *(["--end", repr(end)] if end is not None else []), *urls, "--timeout", "5", "--json", *extra]
        proc = self.net.run_ns(self.net.switch_ns, argv, env=clean_env(), timeout=60)
        assert proc.stdout, proc.stderr
        return proc.returncode, json.loads(proc.stdout)


def _xid(doc: dict[str, Any], component: str) -> dict[str, Any] | None:
    return next((e for e in doc["events"] if e["check"] == "xid" and e["component"] == component
                 and e["kind"] == "finding"), None)


def _first_seen(doc: dict[str, Any], component: str) -> float:
    """When the node first recorded the GPU lost: its Xid's finding or a ``gpu_lost`` one."""
    return min(float(e["time"]) for e in doc["events"]
               if e["kind"] == "finding" and e["component"] == component
               and (e["check"] == "xid" or (e.get("evidence") or {}).get("gpu_lost")))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    base = tmp_path_factory.mktemp("whyedges")
    with TestNet(len(SCENARIOS)) as net:
        made = Nodes(net, base, time.time())
        for h in net.hosts:
            d = base / h.name
            d.mkdir()
            (d / "s.yaml").write_text(f"name: {h.name}\nsku: h100-sxm\n{SCENARIOS[h.name]}")
            (d / "gpumon.yaml").write_text(f"node_name: {h.name}\n")
            if h.name == "node3":
                (d / "sim" / "host" / "dev" / "kmsg").mkdir(parents=True)
            argv = [sys.executable, "-m", "gpumon"]
            if h.name == "node0":
                argv = [sys.executable, str(SKEWED), repr(SKEW_S)]
            argv += ["--config", str(d / "gpumon.yaml"), "daemon", "--simulate", str(d / "s.yaml"),
                     "--sim-dir", str(d / "sim"), "--listen", f"{h.ip}:{PORT}"]
            with (d / "daemon.log").open("w") as log:
                net.popen(h.index, argv, env=clean_env(), stdout=subprocess.DEVNULL, stderr=log)
        early = _xid(made.wait("node1", "/api/v1/events?limit=10000", lambda doc: _xid(doc, "gpu/3"),
                               "the Xid 79 on gpu/3"), "gpu/3")
        assert early is not None
        made.wait("node0", "/api/v1/findings", lambda doc: True, "the API")
        while time.time() < early["time"] + EARLIER_S:  # the order and distance the jobs below need
            time.sleep(0.1)
        d0 = base / "node0"
        start_fault(d0 / "s.yaml", d0 / "sim", {"kind": "xid", "gpu": 1, "code": 79}, SKEW_S)
        made.wait("node0", "/api/v1/events?limit=10000", lambda doc: _xid(doc, "gpu/1"),
                  "the Xid 79 on gpu/1")
        made.wait("node3", "/api/v1/events?limit=10000", lambda doc: _xid(doc, "node"),
                  "the xid check's unreadable kernel log")
        made.wait("node2", "/api/v1/findings", lambda doc: True, "the API")
        yield made


def test_a_node_whose_clock_runs_ahead_keeps_its_culprit(nodes: Nodes) -> None:
    """Point 1: node0's Xid 79 came 8 s before the job failed; on node0's clock that is 82 s after
    the failure (past the minute after the end that `why` reads). Corrected by the skew measured
    from node0's answer, it is the culprit, and the verdict says what was corrected."""
    history = nodes.get("node0", "/api/v1/events?limit=10000") or {"events": []}
    raw = _xid(history, "gpu/1")
    assert raw is not None
    happened = raw["time"] - SKEW_S  # on this host's clock
    code, doc = nodes.why(("node0", "node2"), nodes.start, happened + 8)
    assert code == 2 and doc["verdict"] == "infrastructure", (doc["suspects"], doc["notes"])
    # (the NVML checks see the GPU lost too, each at its next run: the same loss, not a suspect more)
    assert {(s["node"], s["component"]) for s in doc["suspects"]} == {("node0", "gpu/1")}, doc["suspects"]
    top = next(s for s in doc["suspects"] if s["what"] == "xid")
    assert top["tier"] == 1 and top["action"] == "reboot_node", top
    assert top["time"] == pytest.approx(happened, abs=1.0) and top["relative_s"] == pytest.approx(-8, abs=1)
    # one loss, dated from when the node first saw it: its Xid, or an NVML check that read the GPU
    # lost before the xid check read the kernel log (on a busy machine, by tens of milliseconds)
    assert top["node_time"] == pytest.approx(_first_seen(history, "gpu/1"), abs=1e-3), (top, raw["time"])
    assert top["in_onset_window"] is True
    [fix] = doc["clock_corrections"]
    assert fix["node"] == "node0" and fix["clock_skew_s"] == pytest.approx(SKEW_S, abs=1.0), fix
    assert fix["corrected_by_s"] == pytest.approx(-fix["clock_skew_s"])
    assert any(n.startswith("node0: its clock is +90") and "corrected by -90" in n for n in doc["notes"]), \
        doc["notes"]
    assert [c["node"] for c in doc["culprits"]] == ["node0"]
    assert next(n for n in doc["nodes"] if n["node"] == "node2")["clock_skew_s"] == pytest.approx(0, abs=1)


def test_a_fault_open_when_the_job_started_counts(nodes: Nodes) -> None:
    """Point 2: node1's Xid 79 was raised before the job and stays open (awaiting reboot_node) all
    through it; its check's repeats are folded into the state only once a minute, so its stored
    and current last_seen are from before the job. The API says it is open, its span runs to now,
    and `why` names it."""
    current = nodes.get("node1", "/api/v1/findings")
    assert current is not None
    [fault] = [f for f in current["health"]["faults"] if (f["check"], f["component"]) == ("xid", "gpu/3")]
    assert fault["status"].startswith("awaiting reboot_node"), fault
    start = max(fault["raised"], fault["last_seen"]) + 1.0  # after what the state last recorded
    history = nodes.get("node1", "/api/v1/events?" + f"since={start!r}&limit=10000")
    assert history is not None
    event = _xid(history, "gpu/3")
    assert event is not None, "an open fault's event is in every window up to now"
    assert event["open"] is True and event["last_seen"] == history["now"] and event["time"] < start, event
    code, doc = nodes.why(("node1", "node2"), start, None)
    assert code == 2 and doc["verdict"] == "infrastructure", (doc["suspects"], doc["notes"])
    assert {(s["node"], s["component"]) for s in doc["suspects"]} == {("node1", "gpu/3")}, doc["suspects"]
    top = next(s for s in doc["suspects"] if s["what"] == "xid")
    assert top["open"] is True and top["time"] < start and top["in_onset_window"] is True, top
    [culprit] = doc["culprits"]
    assert culprit["drain_reason"].startswith("gpumon: reboot_node: why: gpu/3: Xid 79"), culprit


def test_a_fault_before_the_onset_window_is_no_cause_of_the_failure(nodes: Nodes) -> None:
    """Point 3: node0's Xid 79 half a second before the failure, node1's more than EARLIER_S before
    it, with a 1 s watchdog and a 1 s onset margin (the window: from 2 s before the failure to it).
    Both nodes are culprits to drain; only node0's reason and the AdminComment say it failed the job."""
    raw = _xid(nodes.get("node0", "/api/v1/events?limit=10000") or {"events": []}, "gpu/1")
    assert raw is not None
    end = raw["time"] - SKEW_S + 0.5
    code, doc = nodes.why(("node0", "node1"), nodes.start, end, "--watchdog-timeout", "1",
                          "--onset-margin", "1")
    assert code == 2, doc
    assert doc["onset_window"]["from_relative_s"] == -2.0 and doc["onset_window"]["to_relative_s"] == 0.0
    by_node = {c["node"]: c for c in doc["culprits"]}
    assert set(by_node) == {"node0", "node1"}, doc["culprits"]
    assert by_node["node0"]["in_onset_window"] is True
    assert by_node["node0"]["drain_reason"].startswith("gpumon: reboot_node: why: gpu/1: Xid 79")
    early = by_node["node1"]
    assert early["in_onset_window"] is False and early["relative_s"] < -EARLIER_S, (early, doc["suspects"])
    assert early["drain_reason"].startswith("gpumon: reboot_node: during the job, not at its failure (-"), \
        early
    assert "why:" not in early["drain_reason"]
    assert [(s["node"], s["in_onset_window"]) for s in doc["suspects"] if s["what"] == "xid"] == [
        ("node0", True), ("node1", False)], doc["suspects"]
    parts = doc["admin_comment"].split("; ")
    assert parts[0] == "gpumon why: infrastructure" and parts[1].startswith("#1 node0 gpu/1 "), parts
    said = {p.split(" ")[1]: p for p in parts[1:] if p.startswith("#")}
    assert ", before the onset window: " in said["node1"] and "onset" not in said["node0"], parts


def test_an_unreadable_kernel_log_is_missing_evidence_not_an_application_xid(nodes: Nodes) -> None:
    """Point 3, the kernel-log gap: node3's xid check could not read the kernel log. Its timeline
    item is missing evidence on node3, not an "Xid None ... the application's own fault", and with
    no suspect elsewhere the verdict cannot be "no infrastructure evidence"."""
    code, doc = nodes.why(("node2", "node3"), nodes.start, None)
    assert code == 1 and doc["verdict"] == "inconclusive", (doc["timeline"], doc["notes"])
    [gap] = doc["missing_evidence"]
    assert (gap["node"], gap["component"], gap["what"]) == ("node3", "node", "missing_evidence"), gap
    assert "kernel log unreadable" in gap["summary"] and gap["open"] is True
    assert not [i for i in doc["timeline"] if "Xid None" in i["why"]], doc["timeline"]
    assert any(n.startswith("node3: missing evidence from ") for n in doc["notes"]), doc["notes"]
    assert doc["admin_comment"].endswith("missing evidence (Xids not seen): node3"), \
        doc["admin_comment"]
