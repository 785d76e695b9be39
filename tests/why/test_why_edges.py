"""``gpumon why`` at its edges (issue 35, points 1 to 3), on the reasoning and on the query API.

- a node whose clock is off: its times are corrected by its measured skew before they are compared
  with the job's, both ways, and the verdict says so; `why` asks such a node for the job's window
  on the node's own clock;
- a fault open when the job started: its span runs to now (the API's ``open``, /findings' faults),
  through a real health store and the real query API;
- the onset window: every suspect and culprit says whether it came in it; a culprit before it is
  drained with a reason that does not say it failed the job; a kernel-log gap is missing evidence.

The same on nodes in network namespaces with real daemons: tests/why/test_why_edges_netns.py.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from gpumon.export.api import HistoryApi, identity_of
from gpumon.health.keeper import Health
from gpumon.model import Action, Finding, Severity
from gpumon.why.collect import Access, NodeEvidence, fetch_node
from gpumon.why.job import Job
from gpumon.why.reason import Reasoner, Verdict, nccl_settings
from gpumon.why.report import admin_comment, to_json
from gpumon_checks.xid.check import XidCheck, _Poll

T0 = 1_800_000_000.0
END = T0 + 3600.0
BOOT = "b0b0b0b0-0000-4000-8000-000000000001"
LOST = "Xid 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on gpu/{gpu}"


def _node(name: str, events: list[dict[str, Any]], *, skew: float | None = 0.0,
          faults: list[dict[str, Any]] | None = None, boot_time: float = T0 - 86400) -> NodeEvidence:
    return NodeEvidence(name, f"http://{name}:9426", identity={"node": name, "boot_id": BOOT,
                                                                "boot_time": boot_time},
                        events=events, faults=faults or [], history_from=T0 - 7200, clock_skew_s=skew)


def _xid79(t: float, gpu: int, ident: int, **extra: Any) -> dict[str, Any]:
    return {"id": ident, "time": t, "last_seen": t, "kind": "finding", "check": "xid",
            "component": f"gpu/{gpu}", "boot_id": BOOT, "severity": "fail", "action": "reboot_node",
            "message": LOST.format(gpu=gpu), "evidence": {"code": 79, "gpu_lost": True}, **extra}


def _fault(event: Mapping[str, Any]) -> dict[str, Any]:
    """The open fault /api/v1/findings lists for ``event`` (as Fault.to_json), not repeated since."""
    return {"check": event["check"], "component": event["component"], "key": "79", "severity": "fail",
            "action": "reboot_node", "reported_action": "reboot_node", "message": event["message"],
            "evidence": event["evidence"], "raised": event["time"], "last_seen": event["time"],
            "event_id": event["id"], "reported": False, "status": "awaiting reboot_node (no longer reported)"}


def _judge(*nodes: NodeEvidence, start: float = T0, end: float = END, watchdog: float = 600.0,
           margin: float | None = None) -> tuple[Verdict, dict[str, Any]]:
    job = Job(tuple(n.node for n in nodes), start, end, "42", "FAILED", "1:0", "scontrol", 1.0)
    extra = {} if margin is None else {"onset_margin_s": margin}
    v = Reasoner(job, list(nodes), None, nccl_settings({}, None), now=end + 60, watchdog_s=watchdog,
                 **extra).judge()
    return v, to_json(v)


# -- 1. a node whose clock is off ----------------------------------------------------------------------


def test_a_node_30_s_ahead_keeps_the_xid_that_came_8_s_before_the_failure() -> None:
    """The issue's case: on the node's clock the Xid 79 is 22 s after the failure."""
    ahead = _node("n1", [_xid79(END + 22, 1, 7)], skew=30.0)
    _, doc = _judge(ahead, _node("n2", []))
    assert doc["verdict"] == "infrastructure" and doc["exit_code"] == 2, (doc["suspects"], doc["notes"])
    [top] = doc["suspects"]
    assert (top["node"], top["what"], top["time"], top["node_time"]) == ("n1", "xid", END - 8, END + 22)
    assert top["relative_s"] == -8.0 and top["in_onset_window"] is True
    assert doc["clock_corrections"] == [{"node": "n1", "clock_skew_s": 30.0, "corrected_by_s": -30.0}]
    assert ("n1: its clock is +30.0 s off this host's (measured when it answered): its times are corrected "
            "by -30.0 s before they are compared with the job's (node_time: as the node recorded them)"
            in doc["notes"]), doc["notes"]
    assert [c["node"] for c in doc["culprits"]] == ["n1"]
    assert doc["admin_comment"].startswith("gpumon why: infrastructure; #1 n1 gpu/1 -8 s: Xid 79")
    # the correction is what decides: the same history with no skew measured is after the job
    _, doc = _judge(_node("n1", [_xid79(END + 22, 1, 7)], skew=None), _node("n2", []))
    assert doc["verdict"] == "no_infrastructure_evidence" and doc["clock_corrections"] == []


def test_a_node_behind_is_corrected_too_and_a_small_skew_is_left_alone() -> None:
    """30 s behind: the reboot its clock puts 10 s before the failure came 20 s after it, so it is
    no suspect. Half a second is within what one request can measure: left as recorded."""
    reboot = {"id": 3, "time": END - 10, "last_seen": END - 10, "kind": "boot", "check": "",
              "component": "node", "boot_id": "new-boot", "evidence": {}, "payload": {"previous": BOOT}}
    behind = _node("n1", [reboot], skew=-30.0, boot_time=END - 12)
    behind.identity = {"node": "n1", "boot_id": "new-boot", "boot_time": END - 12}
    _, doc = _judge(behind)
    assert doc["verdict"] == "no_infrastructure_evidence", doc["suspects"]
    assert doc["clock_corrections"] == [{"node": "n1", "clock_skew_s": -30.0, "corrected_by_s": 30.0}]
    _, doc = _judge(_node("n1", [dict(reboot)], skew=None, boot_time=END - 12))
    assert [s["what"] for s in doc["suspects"]] == ["reboot"]  # what the node's clock alone says

    _, doc = _judge(_node("n1", [_xid79(END - 100, 1, 7)], skew=0.5))
    assert doc["clock_corrections"] == [] and doc["suspects"][0]["node_time"] is None
    assert doc["suspects"][0]["time"] == END - 100
    # nor 3 s measured over a request that took 8 s: no more than the measurement's own error
    slow = _node("n1", [_xid79(END - 100, 1, 7)], skew=3.0)
    slow.clock_skew_error_s = 4.0
    _, doc = _judge(slow)
    assert doc["clock_corrections"] == [] and doc["suspects"][0]["time"] == END - 100


class _AheadApi(http.server.BaseHTTPRequestHandler):
    """A node's query API whose clock is 90 s ahead; it keeps the events queries it was asked."""

    asked: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/api/v1/findings":
            doc: dict[str, Any] = {"api": 1, "now": time.time() + 90.0, "node": {"node": "n1"},
                                   "findings": [], "health": {"state": "healthy", "faults": []}}
        else:
            self.asked.append(urllib.parse.parse_qs(url.query))
            doc = {"api": 1, "now": time.time() + 90.0, "events": [], "truncated": False,
                   "history_from": None}
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def ahead_api() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AheadApi)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    _AheadApi.asked.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_why_asks_a_node_ahead_for_the_jobs_window_on_the_nodes_clock(ahead_api: str) -> None:
    """90 s ahead, the job's last 90 s are after "until" on the node's clock: the window asked is
    widened by the skew measured from its first answer."""
    since, until = time.time() - 600, time.time() - 30
    ev = fetch_node("n1", Access(overrides={"n1": ahead_api}), since, until, 5.0)
    assert ev.error is None and ev.clock_skew_s == pytest.approx(90.0, abs=1.0)
    assert ev.clock_skew_error_s is not None and 0 <= ev.clock_skew_error_s < 1.0
    [query] = _AheadApi.asked
    assert float(query["since"][0]) == since
    assert float(query["until"][0]) == pytest.approx(until + 90.0, abs=1.0)


# -- 2. a fault open when the job started --------------------------------------------------------------


def test_a_fault_open_since_before_the_job_is_a_suspect_whatever_its_last_seen() -> None:
    """Raised 5 s before the job, never repeated into the state since (awaiting reboot_node): its
    stored span ends before the job; open, it stands to the failure."""
    start, end = T0, T0 + 30
    xid = _xid79(start - 5, 3, 11)
    _, doc = _judge(_node("n1", [xid], faults=[_fault(xid)]), start=start, end=end)  # an older daemon
    assert doc["verdict"] == "infrastructure", doc["suspects"]
    [top] = doc["suspects"]
    assert (top["what"], top["time"], top["open"], top["until"]) == ("xid", start - 5, True, end)
    assert top["in_onset_window"] is True  # the job started on it and failed soon after
    _, doc = _judge(_node("n1", [{**xid, "open": True}]), start=start, end=end)  # the API says so
    assert doc["verdict"] == "infrastructure" and doc["suspects"][0]["open"] is True
    # raised before the window an older daemon's API answers for: the fault alone says it
    _, doc = _judge(_node("n1", [], faults=[_fault(xid)]), start=start, end=end)
    assert [(s["component"], s["open"]) for s in doc["suspects"]] == [("gpu/3", True)]
    # and what decides is that it is open: closed at its last_seen, it ended before the job
    _, doc = _judge(_node("n1", [xid]), start=start, end=end)
    assert doc["verdict"] == "no_infrastructure_evidence", doc["suspects"]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _ask(api: HistoryApi, path: str, query: str = "") -> dict[str, Any]:
    said: list[str] = []
    body = b"".join(api({"PATH_INFO": path, "QUERY_STRING": query},
                        lambda status, headers: said.append(status)))
    assert said == ["200 OK"], (said, body)
    doc: dict[str, Any] = json.loads(body)
    return doc


def _api_node(name: str, api: HistoryApi, since: float, until: float) -> NodeEvidence:
    """What `why` reads of a node (collect.fetch_node), from the API's WSGI app itself."""
    current = _ask(api, "/api/v1/findings")
    query = urllib.parse.urlencode({"since": since, "until": until, "limit": 10000})
    page = _ask(api, "/api/v1/events", query)
    return NodeEvidence(name, "wsgi", identity=current["node"], events=page["events"],
                        history_from=page["history_from"], findings=current["findings"],
                        faults=current["health"]["faults"], state=current["health"]["state"],
                        clock_skew_s=0.0)


@pytest.fixture
def node_api(tmp_path: Path) -> Iterator[tuple[Health, Clock, HistoryApi]]:
    clock = Clock(T0)
    health = Health.open(tmp_path, boot_id=BOOT, clock=clock)
    api = HistoryApi(tmp_path, identity_of("n1", BOOT, T0 - 86400, T0), health.view, clock=clock)
    try:
        yield health, clock, api
    finally:
        health.close()


def test_the_events_api_gives_an_open_fault_a_span_to_now(node_api: tuple[Health, Clock, HistoryApi]) -> None:
    """A real health store and query API: an Xid 79 the check reported once and then no more
    (its fault awaits reboot_node), asked for 50 s later. Its event is in a window that starts
    after it, ``open``, its ``last_seen`` the answer's ``now``; `why` for a job in that window
    names it. Events whose faults closed keep their span, and every ``last_seen`` is a time."""
    health, clock, api = node_api
    xid = Finding("xid", "gpu/3", Severity.FAIL, LOST.format(gpu=3), Action.REBOOT_NODE,
                  {"code": 79, "gpu_lost": True})
    health.record_findings("xid", [xid], complete=True)
    warm = Finding("thermal", "gpu/0", Severity.WARN, "GPU 0 at 88 C")
    health.record_findings("thermal", [warm], complete=True)
    clock.t = T0 + 5
    health.record_findings("xid", [], complete=True)  # no longer reported: still open, awaiting a reboot
    health.record_findings("thermal", [Finding("thermal", "gpu/0", Severity.OK, "GPU 0 at 60 C")],
                           complete=True)  # closed
    health.flush()
    clock.t = T0 + 50
    doc = _ask(api, "/api/v1/events", f"since={T0 + 20}&until={T0 + 50}")
    assert [(e["check"], e["component"], e["open"], e["last_seen"]) for e in doc["events"]] == [
        ("xid", "gpu/3", True, T0 + 50)], doc["events"]
    doc = _ask(api, "/api/v1/events", f"since={T0 - 10}&until={T0 + 50}")
    assert all(isinstance(e["last_seen"], float) and e["last_seen"] >= e["time"] for e in doc["events"])
    assert {(e["check"], e["open"]) for e in doc["events"] if e["kind"] == "finding"} >= {
        ("xid", True), ("thermal", False)}

    ev = _api_node("n1", api, T0 + 20 - 3600, T0 + 50)
    job = Job(("n1",), T0 + 20, T0 + 45, None, "FAILED", "1:0", "explicit")
    v = Reasoner(job, [ev], None, nccl_settings({}, None), now=T0 + 50).judge()
    assert v.verdict == "infrastructure", [i.to_json(v.end) for i in v.timeline]
    assert [(s.component, s.open, s.time) for s in v.suspects] == [("gpu/3", True, T0)]


# -- 3. the onset window -------------------------------------------------------------------------------


def test_every_suspect_and_culprit_says_whether_it_came_in_the_onset_window() -> None:
    """The issue's case: two nodes' Xid 79s, one 8 s before the failure, one three watchdog timeouts
    before it (the job ran on past it). Both are culprits to drain; only one failed the job."""
    near, early = _node("n1", [_xid79(END - 8, 1, 7)]), _node("n2", [_xid79(END - 1800, 3, 9)])
    _, doc = _judge(early, near)
    assert doc["onset_window"] == {"from": END - 600 - 120, "to": END + 1.0, "from_relative_s": -720.0,
                                   "to_relative_s": 1.0}
    assert [(s["node"], s["in_onset_window"]) for s in doc["suspects"]] == [("n1", True), ("n2", False)]
    culprits = {c["node"]: c for c in doc["culprits"]}
    assert culprits["n1"]["in_onset_window"] is True
    assert culprits["n1"]["drain_reason"] == f"gpumon: reboot_node: why job 42: gpu/1: {LOST.format(gpu=1)}"
    assert culprits["n2"]["in_onset_window"] is False
    assert culprits["n2"]["drain_reason"] == ("gpumon: reboot_node: during job 42, not at its failure "
                                              f"(-30.0 min): gpu/3: {LOST.format(gpu=3)}")
    assert doc["admin_comment"] == ("gpumon why: infrastructure; "
                                    f"#1 n1 gpu/1 -8 s: {LOST.format(gpu=1)}; "
                                    f"#2 n2 gpu/3 -30.0 min, before the onset window: {LOST.format(gpu=3)}")
    assert doc["summary"] == "infrastructure suspect(s) found"
    # every item of the job's run is judged, context too; none outside it
    assert all(i["in_onset_window"] is not None for i in doc["timeline"] if T0 <= i["time"] <= END)


def test_with_no_suspect_in_the_onset_window_the_verdict_says_so() -> None:
    _, doc = _judge(_node("n2", [_xid79(END - 1800, 3, 9)]))
    assert doc["verdict"] == "infrastructure"  # the node had a hardware fault during the job
    assert doc["summary"].startswith("infrastructure suspect(s) found, none in the onset window")
    assert doc["admin_comment"].startswith(
        "gpumon why: infrastructure, none at the failure's onset (faults the job ran on past); "
        "#1 n2 gpu/3 -30.0 min, before the onset window: ")
    assert any(n.startswith("no suspect came in the onset window (-12.0 min to +1 s from the failure)")
               for n in doc["notes"]), doc["notes"]
    assert "not at its failure" in doc["culprits"][0]["drain_reason"]
    # a wider margin takes it in
    _, doc = _judge(_node("n2", [_xid79(END - 1800, 3, 9)]), margin=1300.0)
    assert doc["culprits"][0]["drain_reason"].startswith("gpumon: reboot_node: why job 42: ")


def test_a_kernel_log_gap_is_missing_evidence_not_an_application_xid(
        node_api: tuple[Health, Clock, HistoryApi]) -> None:
    """What the xid check says when it cannot read the kernel log, through the health store and
    the query API: on the timeline as missing evidence on that node (before: "Xid None: catalog
    action none: usually the application's own fault"), and the verdict inconclusive."""
    health, clock, api = node_api
    log = SimpleNamespace(available=False, error="[Errno 21] Is a directory: '/dev/kmsg'", source="/dev/kmsg")
    said = XidCheck()._node_findings(log, _Poll(True, [], T0, T0, True, None, T0), False, saved=False)
    assert [f.severity for f in said] == [Severity.UNKNOWN]
    health.record_findings("xid", said, complete=True)
    health.flush()
    clock.t = T0 + 60
    job = Job(("n1",), T0 + 10, T0 + 50, "42", "FAILED", "1:0", "scontrol")
    v = Reasoner(job, [_api_node("n1", api, T0 - 3600, T0 + 60)], None, nccl_settings({}, None),
                 now=T0 + 60).judge()
    doc = to_json(v)
    assert doc["verdict"] == "inconclusive" and doc["exit_code"] == 1, doc["timeline"]
    assert doc["summary"].startswith("no infrastructure evidence recorded, but not every node could see it")
    [gap] = doc["missing_evidence"]
    assert (gap["node"], gap["what"], gap["tier"], gap["open"]) == ("n1", "missing_evidence", 3, True)
    assert gap["summary"].startswith("Xids not seen: kernel log unreadable: [Errno 21] Is a directory")
    assert not [i for i in doc["timeline"] if "Xid None" in i["why"] or "application's own" in i["why"]]
    assert any(n.startswith("n1: missing evidence from -50 s from the failure, still so at its answer: ")
               for n in doc["notes"]), doc["notes"]
    assert admin_comment(v) == ("gpumon why: inconclusive (no suspect on the nodes that answered); "
                                "missing evidence (Xids not seen): n1")
