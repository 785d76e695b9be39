"""``gpumon why --prometheus``: a node that is gone, judged from what a real Prometheus scraped of it.

Two ``gpumon daemon --simulate`` processes on loopback, scraped every second by a real Prometheus
(Debian package), each target labelled as gpumon's scrape configs label it (``instance`` the node's
name, here with a domain to show it is matched; ``host`` the short name, for
``--prometheus-node-label``):

- ``n-a``: Xid 79 on GPU 3, then InfiniBand mlx5_2 port 1 down for 5 s (both rendered into its
  simulated node once Prometheus has scraped its IB port up: a scenario's fault times count from the
  node's start, which a daemon slow to start on a busy machine would miss); once its history has the
  outage, its daemon is stopped: the node is gone, its API refuses;
- ``n-b``: healthy, left running;

and ``n-c``, a node Prometheus never scraped. Before ``n-a`` goes, its own API's outage record is
kept: what Prometheus says is held to it (within the 1 s scrape resolution).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import clean_env, need_tool, run_gpumon
from live_faults import end_fault, start_fault

NODES = ("n-a", "n-b")
# past NCCL_IB_TIMEOUT=17's 3.76 s retry window, short of the ib check's 7 s fail threshold
OUTAGE_S = 5.0
# NCCL_IB_TIMEOUT=17: a 3.76 s retry window, which the 5 s outage outlasts
NCCL = ("--nccl-env", "NCCL_IB_TIMEOUT=17", "--nccl-version", "2.18.3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@dataclass
class Fleet:
    prom: str
    ports: dict[str, int]
    start: float
    end: float
    outage: dict[str, Any]  # n-a's own API's record of the outage, before it went


def _stop(p: subprocess.Popen[bytes]) -> None:
    p.terminate()
    try:
        p.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _downtime(prom: str) -> list[float]:
    """Every value of n-a's ``gpumon_ib_downtime_seconds`` of its mlx5_2 port 1 that Prometheus
    holds from the last minute."""
    q = urllib.parse.urlencode({"query": 'gpumon_ib_downtime_seconds{instance="n-a.cluster.test",'
                                         'component="ib/mlx5_2/1"}[60s]'})
    return [float(v) for r in _json(f"{prom}/api/v1/query?{q}")["data"]["result"] for _, v in r["values"]]


def _until(what: str, probe: Callable[[], Any], log: Path, timeout: float = 60) -> Any:
    """``probe()`` until it answers something true (an unreachable API is not an answer yet); the
    daemon's ``log`` says why not."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = probe()
        except OSError:
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, (f"{what}: not within {timeout} s\n"
                                             + log.read_text(errors="replace")[-4000:])
        time.sleep(0.3)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prometheus = need_tool("prometheus", "prometheus")
    tmp = tmp_path_factory.mktemp("why-prom")
    ports = {name: _free_port() for name in NODES}
    prom_port = _free_port()
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "gpumon", "static_configs": [
                  {"targets": [f"127.0.0.1:{ports[n]}"],
                   "labels": {"instance": f"{n}.cluster.test", "host": n}} for n in NODES]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = []
    start = time.time()
    procs["prometheus"] = subprocess.Popen(
        [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for name in NODES:
        d = tmp / name
        d.mkdir()
        (d / "s.yaml").write_text(f"name: {name}\nsku: h100-sxm\nfaults: []\n")
        (d / "gpumon.yaml").write_text(f"node_name: {name}\n")
        logs.append(open(d / "daemon.log", "w"))  # noqa: SIM115 (closed at teardown)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "gpumon", "--config", str(d / "gpumon.yaml"), "daemon", "--simulate",
             str(d / "s.yaml"), "--sim-dir", str(d / "sim"), "--duration", "120",
             "--listen", f"127.0.0.1:{ports[name]}"],
            stdout=subprocess.DEVNULL, stderr=logs[-1], env=clean_env())
    prom = f"http://127.0.0.1:{prom_port}"
    port = "ib/mlx5_2/1"
    api = f"http://127.0.0.1:{ports['n-a']}/api/v1"
    try:
        # n-a watched and scraped: Prometheus holds its port up (no downtime)
        a = tmp / "n-a"
        log = a / "daemon.log"
        _until("Prometheus scraping n-a's IB port", lambda: _downtime(prom), log)
        start_fault(a / "s.yaml", a / "sim", {"kind": "xid", "gpu": 3, "code": 79})
        start_fault(a / "s.yaml", a / "sim", {"kind": "ib_down", "device": "mlx5_2", "port": 1})
        # down for OUTAGE_S as n-a's ib check measures it, however late a busy machine runs it
        _until(f"n-a's ib check seeing its port down {OUTAGE_S:g} s", lambda: any(
            f["component"] == port and f["evidence"].get("ongoing_outage_s", 0) >= OUTAGE_S
            for f in _json(f"{api}/findings")["findings"]), log)
        end_fault(a / "s.yaml", a / "sim", "ib_down")
        # the state's record, in the event of the port's recovery (warn -> ok), or if a busy
        # machine's check measured it past the ib check's 7 s fail threshold, in its current
        # finding (kept at fail: no new event). A sample can read the port's link_downed counter
        # risen before its state goes down: an outage "between two samples" of its own, not this one.
        def ended() -> dict[str, Any] | None:
            seen = _json(f"{api}/events?limit=10000")["events"] + _json(f"{api}/findings")["findings"]
            return next((o for e in seen if e["component"] == port
                         for o in e["evidence"].get("recent_outages") or []
                         if o.get("end") is not None and o["seen_by"] == "state"), None)
        outage: dict[str, Any] = _until("the IB outage, ended, in n-a's history", ended, log)
        # Prometheus has the whole outage: two scrapes of the port's downtime at its full length
        # (the port back up), however late a busy machine's scrapes come
        _until("Prometheus scraping the whole outage", lambda: sum(
            v >= outage["down_s"] - 0.5 for v in _downtime(prom)) >= 2, log)
        _stop(procs.pop("n-a"))  # the node is gone
        end = time.time()
        q = urllib.parse.urlencode({"query": 'up{instance="n-a.cluster.test"}'})
        _until("Prometheus seeing n-a go down", lambda: any(
            r["value"][1] == "0" for r in _json(f"{prom}/api/v1/query?{q}")["data"]["result"]), log)
        yield Fleet(prom, ports, start, end, outage)
    finally:
        for p in procs.values():
            _stop(p)
        for f in logs:
            f.close()


def _why(fleet: Fleet, nodes: str, *extra: str) -> tuple[int, dict[str, Any]]:
    proc = run_gpumon("why", "--nodes", nodes, "--start", repr(fleet.start), "--end", repr(fleet.end),
                      "--prometheus-step", "1", "--timeout", "5", "--json", *extra, timeout=60)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _explain(fleet: Fleet, doc: dict[str, Any]) -> str:
    """What a wrong answer was made from: the verdict's timeline and n-a's IB series as Prometheus
    holds them (every raw sample), beside the outage n-a's own API recorded."""
    raw = {}
    for metric in ("gpumon_ib_downtime_seconds", "gpumon_ib_outages", "gpumon_build_info", "up"):
        sel = 'instance="n-a.cluster.test"' + (',component="ib/mlx5_2/1"' if "_ib_" in metric else "")
        span = max(1, round(time.time() - fleet.start + 5))
        q = urllib.parse.urlencode({"query": f"{metric}{{{sel}}}[{span}s]", "time": repr(time.time())})
        result = _json(f"{fleet.prom}/api/v1/query?{q}")["data"]["result"]
        raw[metric] = [(float(t) - fleet.start, v) for r in result for t, v in r["values"]]
    return json.dumps({"outage_by_api": {k: (v - fleet.start if k in ("start", "end") and v else v)
                                         for k, v in fleet.outage.items()},
                       "fleet_end": fleet.end - fleet.start, "verdict": doc.get("verdict"),
                       "suspects": doc.get("suspects"), "timeline": doc.get("timeline"),
                       "notes": doc.get("notes"), "raw_samples_from_fleet_start": raw}, indent=1, default=str)


def test_a_node_that_is_gone_is_named_from_prometheus_alone(fleet: Fleet) -> None:
    code, doc = _why(fleet, "n-a,n-b,n-c", "--prometheus", fleet.prom, "--prometheus-only", *NCCL)
    assert code == 2 and doc["verdict"] == "infrastructure", doc
    ib = next((s for s in doc["suspects"] if s["what"] == "ib_outage"), None)
    assert ib is not None, _explain(fleet, doc)
    assert (ib["node"], ib["component"], ib["tier"]) == ("n-a", "ib/mlx5_2/1", 1), ib
    assert "longer than NCCL's IB retry window of 3.76 s" in ib["why"]
    # the outage as the node's own API recorded it, to one 1 s scrape (and the check's 1 s sampling)
    assert ib["evidence"]["start"] == pytest.approx(fleet.outage["start"], abs=2.0), (ib, fleet.outage)
    assert ib["evidence"]["down_s"] == pytest.approx(fleet.outage["down_s"], abs=1.5), (ib, fleet.outage)
    assert ib["evidence"]["end"] is not None  # back up before the node went
    assert ib["relative_s"] < 0
    xid = next(s for s in doc["suspects"] if s["what"] == "xid")
    assert (xid["node"], xid["component"], xid["tier"]) == ("n-a", "gpu/3", 1), xid
    assert xid["evidence"] == {"code": 79, "action": "reboot_node"}, xid
    assert not [s for s in doc["suspects"] if s["node"] == "n-b"], doc["suspects"]
    by = {n["node"]: n for n in doc["nodes"]}
    assert [n["node"] for n in doc["nodes"]] == ["n-a", "n-b", "n-c"]
    assert by["n-a"]["source"] == "prometheus" and by["n-a"]["reachable"] is True
    assert by["n-a"]["identity"]["node"] == "n-a"  # gpumon_build_info's node label
    assert by["n-a"]["url"] == f'{fleet.prom} (instance="n-a.cluster.test")'
    assert by["n-a"]["state"] == "unhealthy"
    # its hung-collective flags were scraped: the node was watched for the signature
    assert by["n-a"]["judging"] == ["collective_hang"] and by["n-b"]["judging"] == ["collective_hang"]
    # never scraped: kept, said so
    assert doc["unreachable"] == ["n-c"]
    assert by["n-c"]["error"].startswith("no data in Prometheus"), by["n-c"]
    assert any(n.startswith("n-a: evidence from Prometheus") and "± one step" in n for n in doc["notes"])


def test_prometheus_answers_only_for_the_nodes_whose_api_does_not(fleet: Fleet) -> None:
    code, doc = _why(fleet, "n-a,n-b", "--prometheus", fleet.prom, *NCCL,
                     "--node-url", f"n-a=http://127.0.0.1:{fleet.ports['n-a']}",
                     "--node-url", f"n-b=http://127.0.0.1:{fleet.ports['n-b']}")
    assert code == 2, doc
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["n-b"]["source"] == "api" and by["n-b"]["reachable"] is True
    assert by["n-a"]["source"] == "prometheus" and by["n-a"]["reachable"] is True
    assert any(n.startswith("n-a: its API did not answer") and "cannot connect" in n and
               "judged from Prometheus" in n for n in doc["notes"]), doc["notes"]
    assert {(s["node"], s["what"]) for s in doc["suspects"]} >= {("n-a", "ib_outage"), ("n-a", "xid")}, \
        _explain(fleet, doc)
    assert doc["unreachable"] == []


def test_the_nccl_default_window_and_a_healthy_node_from_prometheus(fleet: Fleet) -> None:
    # NCCL >= 2.23 retries for 30 s: the 5 s outage is context, not a suspect
    code, doc = _why(fleet, "n-a", "--prometheus", fleet.prom, "--prometheus-only",
                     "--nccl-version", "2.23.4")
    assert code == 2 and [s["what"] for s in doc["suspects"] if s["tier"] == 1] == ["xid"], doc["suspects"]
    assert not [s for s in doc["suspects"] if s["what"] == "ib_outage"], doc["suspects"]
    assert any(i["what"] == "ib_outage" and i["tier"] == 3 and "retried through it" in i["why"]
               for i in doc["timeline"])
    code, doc = _why(fleet, "n-b", "--prometheus", fleet.prom, "--prometheus-only",
                     "--prometheus-node-label", "host")
    assert code == 0 and doc["verdict"] == "no_infrastructure_evidence", doc
    assert doc["nodes"][0]["url"] == f'{fleet.prom} (host="n-b")'


def test_prometheus_not_answering_is_every_nodes_error(fleet: Fleet) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    code, doc = _why(fleet, "n-a,n-b", "--prometheus", dead, "--prometheus-only")
    assert code == 3 and doc["verdict"] == "cannot_answer", doc
    assert all(n["error"].startswith(f"Prometheus {dead}: cannot connect")
               for n in doc["nodes"]), doc["nodes"]
    proc = run_gpumon("why", "--nodes", "n-a", "--start", repr(fleet.start), "--prometheus-only")
    assert proc.returncode == 3 and "--prometheus-only needs --prometheus URL" in proc.stderr, proc.stderr


# -- the outage reconstruction, on series as query_range answers them (1 s step) --------------------

def _port(points: list[tuple[float, float]], *, first: float = 0.0, last: float | None = None,
          outages: dict[float, float] | None = None) -> list[dict[str, Any]]:
    from gpumon.why.prom import _Node, _outages
    comp = "ib/mlx5_0/1"
    n = _Node("n", first=first, last=points[-1][0] if last is None else last)
    n.downtime = [({"component": comp}, points)]
    if outages is not None:
        n.outages = {comp: outages}
    found = _outages(n, 1.0)
    return list(found[0]["evidence"]["recent_outages"]) if found else []


def test_outages_from_the_downtime_series() -> None:
    steady = [(float(t), 0.0) for t in range(5)]
    # down from 4.5 to 10.5 (6 s), one scrape repeating the previous reading mid-way: one outage
    rising = [(5.0, 0.5), (6.0, 1.5), (7.0, 1.5), (8.0, 3.5), (9.0, 4.5), (10.0, 5.5), (11.0, 6.0),
              (12.0, 6.0)]
    [o] = _port(steady + rising)
    assert o["start"] == pytest.approx(4.5) and o["down_s"] == pytest.approx(6.0) and o["end"] is not None
    # then a second one 5 s later: two
    again = [(13.0, 6.0), (14.0, 6.0), (15.0, 6.0), (16.0, 7.0), (17.0, 7.5), (18.0, 7.5)]
    assert [round(o["down_s"], 1) for o in _port(steady + rising + again)] == [6.0, 1.5]
    # the node's series end while the port is down (the node went): still down at the last reading
    [o] = _port(steady + rising[:4])
    assert o["end"] is None and o["down_s"] == pytest.approx(3.5)
    # nothing rises: no outage (old downtime in the check's 24 h window is not one)
    assert _port([(float(t), 42.0) for t in range(10)]) == []


def test_an_outage_under_way_at_the_first_sample() -> None:
    points = [(10.0, 2.0), (11.0, 3.0), (12.0, 4.0), (13.0, 4.0)]
    # the only outage in the window (gpumon_ib_outages 1): all its downtime is this one's
    [o] = _port(points, first=10.0, outages={10.0: 1.0, 11.0: 1.0})
    assert o["start"] == pytest.approx(8.0) and o["down_s"] == pytest.approx(4.0)
    # older outages in the window too: only what is seen rising (a lower bound)
    [o] = _port(points, first=10.0, outages={10.0: 2.0})
    assert o["start"] == pytest.approx(10.0) and o["down_s"] == pytest.approx(2.0)
    # a port that appears after the node's first sample had no downtime before
    [o] = _port([(20.0, 3.0), (21.0, 3.0)], first=10.0)
    assert o["start"] == pytest.approx(17.0) and o["down_s"] == pytest.approx(3.0)
