"""``gpumon why`` over many nodes: time to a verdict, and what a silent node costs.

A real ``gpumon daemon --simulate faulty-8xh100`` runs for a while; its query API's answers
(``/api/v1/findings`` and ``/api/v1/events``: a GPU fallen off the bus, an IB port down, ...) are
recorded. Then one threaded HTTP server on loopback stands in for ``--nodes`` nodes, each answering
those recorded documents under ``/<node>/api/v1/...`` (the node's own name put in); ``--silent`` of
them accept the connection and never answer (a hung exporter or a black-holed host: the case that
costs the per-node timeout), ``--dead`` of them are on a port nothing listens on (refused at once).
``gpumon why --nodes ... --api-url http://127.0.0.1:PORT/{node}`` runs as a user runs it, and its
wall time is measured for each configuration.

    .venv/bin/python bench/why_fanout.py [--nodes 64,256,1024] [--silent 0,8] [--timeout 5]

What this models and what not: the client side (threads, HTTP, JSON, the reasoning) with real
answers of realistic size; one server process answers every node, so server-side latency is
loopback's, not a fleet network's (add the fleet's round-trip time once per wave of ``--workers``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(seconds: float) -> tuple[dict[str, Any], dict[str, Any], float]:
    """(findings document, events document, when) of a real daemon on a faulty simulated node."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="why-bench-") as d:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", "daemon", "--simulate", "faulty-8xh100",
                                 "--sim-dir", d, "--listen", f"127.0.0.1:{port}", "--duration",
                                 str(seconds + 30)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(seconds)
            base = f"http://127.0.0.1:{port}/api/v1"
            with urllib.request.urlopen(f"{base}/findings", timeout=10) as r:
                findings = json.loads(r.read())
            with urllib.request.urlopen(f"{base}/events?limit=10000", timeout=10) as r:
                events = json.loads(r.read())
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return findings, events, time.time()


class StandIns(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, findings: dict[str, Any], events: dict[str, Any], silent: set[str]) -> None:
        self.docs = {"findings": findings, "events": events}
        self.silent = silent
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(BaseHTTPRequestHandler):
    server: StandIns

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        _, node, *rest = self.path.split("?")[0].split("/")
        if node in self.server.silent:
            self.server.release.wait(120)  # never answers within any per-node timeout
            return
        kind = rest[-1] if rest else ""
        if kind not in self.server.docs:
            self.send_error(404)
            return
        doc = dict(self.server.docs[kind])
        doc["node"] = {**doc.get("node", {}), "node": node, "host": node}
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def run_why(nodes: list[str], port: int, dead: set[str], dead_port: int, start: float, end: float,
            timeout: float, workers: int) -> tuple[float, dict[str, Any]]:
    args = [sys.executable, "-m", "gpumon", "why", "--nodes", ",".join(nodes), "--start", str(start),
            "--end", str(end), "--api-url", f"http://127.0.0.1:{port}/{{node}}", "--timeout", str(timeout),
            "--workers", str(workers), "--json"]
    for n in dead:
        args += ["--node-url", f"{n}=http://127.0.0.1:{dead_port}"]
    t0 = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"gpumon why exited {proc.returncode}: {proc.stderr[-2000:]}") from None
    return wall, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="64,256,1024", help="node counts, comma-separated")
    ap.add_argument("--silent", default="0,8", help="silent nodes per run, comma-separated")
    ap.add_argument("--dead", type=int, default=4, help="nodes on a port nothing listens on")
    ap.add_argument("--timeout", type=float, default=5.0, help="gpumon why --timeout (per node)")
    ap.add_argument("--workers", type=int, default=64, help="gpumon why --workers")
    ap.add_argument("--record-s", type=float, default=20.0, help="how long the real daemon runs first")
    args = ap.parse_args()
    findings, events, when = record(args.record_s)
    print(f"machine: {describe()}")
    print(f"recorded from a real gpumon daemon --simulate faulty-8xh100 after {args.record_s:.0f} s: "
          f"{len(findings.get('findings', []))} current findings, {events.get('count')} events, "
          f"{len(json.dumps(events)) + len(json.dumps(findings))} bytes per node")
    print(f"per-node timeout {args.timeout:g} s, {args.workers} nodes asked at once, {args.dead} dead "
          "(connection refused) in every run\n")
    print(f"{'nodes':>6} {'silent':>7} {'verdict':>28} {'suspects':>9} {'unreachable':>12} {'wall':>8}")
    dead_port = _free_port()  # bound and closed: nothing listens there
    for n in (int(x) for x in args.nodes.split(",")):
        for k in (int(x) for x in args.silent.split(",")):
            names = [f"n{i:04d}" for i in range(n)]
            silent = set(names[:k])
            dead = set(names[k:k + args.dead])
            server = StandIns(findings, events, silent)
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                wall, doc = run_why(names, server.server_address[1], dead, dead_port, when - 3600, when,
                                    args.timeout, args.workers)
            finally:
                server.release.set()
                server.shutdown()
                server.server_close()
            unreachable = sum(1 for x in doc.get("nodes", []) if not x.get("reachable", True))
            print(f"{n:>6} {k:>7} {doc.get('verdict', '?'):>28} {len(doc.get('suspects', [])):>9} "
                  f"{unreachable:>12} {wall:>7.1f}s")
    print("\nwall = the whole command (Python start, asking every node, reasoning, JSON). A silent node "
          "costs one per-node timeout, paid in parallel with the others up to --workers at once.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
