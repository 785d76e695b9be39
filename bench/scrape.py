"""Scrape time of gpumon's exporter for an 8-GPU node (issue 4 goal: <= 10 ms).

The snapshot is what the daemon would hold on a faulty HGX H100 node: the
findings of every continuous check from ``gpumon check --simulate
faulty-8xh100 --json -v`` (run as a child process: the real checks on the
simulated node, with their readings), folded into a real health store (SQLite,
in a temporary directory) for the per-component health state and action, as
``gpumon daemon`` does.

Two figures, each over ``--scrapes`` scrapes after ``--warmup`` untimed ones,
GC on, one client, sequential:

1. ``prometheus_client.generate_latest`` on gpumon's registry (collect + text
   exposition, in process);
2. an HTTP GET of /metrics over loopback from ``gpumon.export.webserver.serve_metrics``
   (the daemon's server), a new TCP connection per scrape (the wsgiref server
   answers HTTP/1.0 and closes), timed from connect to the last body byte; once
   with the headers Prometheus 2.42 sends (OpenMetrics first, gzip) and once as
   plain text without compression.

    .venv/bin/python bench/scrape.py [--scrapes 2000] [--scenario faulty-8xh100]
"""

from __future__ import annotations

import argparse
import gc
import http.client
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import describe
from _snapshot import node_snapshot
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder, make_registry
from gpumon.export.webserver import serve_metrics

# What Prometheus 2.42 sends with every scrape (scrape/scrape.go: scrapeAcceptHeader).
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/2.42.0",
}


def timed(fn: Callable[[], object], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def http_get(port: int, headers: dict[str, str]) -> Callable[[], bytes]:
    def get() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/metrics", headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            return body
        finally:
            conn.close()
    return get


def line(label: str, samples: list[float]) -> str:
    s = sorted(samples)
    ms = [1000 * v for v in s]
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return (f"{label}: p50 {p(0.50):.2f} ms, p90 {p(0.90):.2f} ms, p99 {p(0.99):.2f} ms, "
            f"max {ms[-1]:.2f} ms, mean {statistics.fmean(ms):.2f} ms (n={len(ms)})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--scenario", default="faulty-8xh100")
    args = ap.parse_args()
    if args.scrapes < 1000:
        ap.error("--scrapes must be >= 1000 (p99 needs them)")
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-") as tmp:
        snap = node_snapshot(args.scenario, Path(tmp))
    registry = make_registry(SnapshotHolder(snap))
    text = generate_latest(registry)
    families = list(text_string_to_metric_families(text.decode()))
    samples = sum(len(f.samples) for f in families)
    findings = sum(len(r.findings) for r in snap.runs.values())
    gc.collect()
    gen = timed(lambda: generate_latest(registry), args.scrapes, args.warmup)
    # what the daemon serves: the content part cached between changes of the node's state
    holder = SnapshotHolder(snap)
    server, _thread = serve_metrics(CachedExposition(holder), "127.0.0.1", 0)
    try:
        port = server.server_port
        prom_body = http_get(port, PROMETHEUS_HEADERS)()
        plain = timed(http_get(port, {}), args.scrapes, args.warmup)
        prom = timed(http_get(port, PROMETHEUS_HEADERS), args.scrapes, args.warmup)

        def changed_then_get() -> bytes:
            # worst case: the node's state changed since the last scrape (a new render)
            holder.set(Snapshot(snap.node, snap.profile, snap.version, snap.runs,
                                {**snap.health, "bench/changed": (str(holder.version), "none")}))
            return http_get(port, PROMETHEUS_HEADERS)()

        changed = timed(changed_then_get, args.scrapes, args.warmup)
        app = CachedExposition(holder)
        server2, _ = serve_metrics(app, "127.0.0.1", 0)
        get2 = http_get(server2.server_port, PROMETHEUS_HEADERS)
        warm: list[float] = []
        for i in range(args.scrapes):
            # the daemon's render thread re-renders within ~1 s of a change, before the next scrape
            holder.set(Snapshot(snap.node, snap.profile, snap.version, snap.runs,
                                {**snap.health, "bench/changed": (f"w{i}", "none")}))
            app.prerender()
            warm += timed(get2, 1, 0)
        server2.shutdown()
        server2.server_close()
    finally:
        server.shutdown()
        server.server_close()
    print(f"machine: {describe()}")
    print(f"conditions: snapshot of `gpumon check --simulate {args.scenario} -v` ({len(snap.runs)} checks, "
          f"{findings} findings, health of {len(snap.health)} components, node {snap.health['node'][0]}); "
          f"exposition {len(families)} families, {samples} samples, {len(text)} bytes "
          f"({len(prom_body)} bytes gzip); {args.warmup} warm-up + {args.scrapes} timed scrapes each, "
          "sequential, one client, GC on, server and client in one process on loopback")
    print(line("generate_latest (in process)", gen))
    print(line("HTTP GET /metrics, plain text, new connection each", plain))
    print(line("HTTP GET /metrics, Prometheus 2.42 headers (gzip), new connection each", prom))
    print(line("the same, after a change of the node's state (content re-rendered)", changed))
    print(line("the same, after a change already pre-rendered by the daemon's render thread", warm))
    worst = max(sorted(v)[int(0.99 * len(v))] for v in (plain, prom, warm))
    print(f"goal p99 <= 10 ms: {'met' if worst <= 0.010 else 'NOT met'} (worst p99 {1000 * worst:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
