"""Series per node on gpumon's /metrics, and how they grow with GPUs and NIC ports (issue 12).

For each scenario the snapshot is what the daemon would hold: the findings of every continuous check
from ``gpumon check --simulate <scenario> --json -v`` (child process: the real checks on the
simulated node), folded into a real health store (SQLite in a temporary directory) for the
per-component health state and action, plus the health store's own finding, as ``gpumon daemon``
exports it (no remediation backend: one adds 5 series; no fabric probe yet: one adds up to 28 on
``node``; the SDC canary, every 6 h, adds 7 plus one per component it reports on).

Series are counted per component class (the ``component`` label's prefix: gpu, ib, pci, nvlink,
node; "fixed" = no component label), from the text exposition. Then the same count for simulated
nodes of 1, 2, 4 and 8 GPUs and 0, 4 and 8 NIC ports (generated scenarios, no faults), which gives
the growth per GPU and per port, and what a fleet of such nodes sends Prometheus.

    .venv/bin/python bench/series.py [--fleet 10000]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _snapshot import node_snapshot
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.export.prometheus import SnapshotHolder, make_registry


def measure(scenario: str) -> tuple[int, int, int, dict[str, int], dict[str, int]]:
    """(series, bytes, gzip bytes, series per component class, components per class)"""
    with tempfile.TemporaryDirectory(prefix="gpumon-series-") as tmp:
        snap = node_snapshot(scenario, Path(tmp))
    text = generate_latest(make_registry(SnapshotHolder(snap)))
    per: collections.Counter[str] = collections.Counter()
    comps: dict[str, set[str]] = collections.defaultdict(set)
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            comp = s.labels.get("component")
            cls = "fixed" if comp is None else comp.split("/")[0]
            per[cls] += 1
            if comp is not None:
                comps[cls].add(comp)
    return sum(per.values()), len(text), len(gzip.compress(text, 6)), dict(per), {
        k: len(v) for k, v in comps.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleet", type=int, default=10_000)
    args = ap.parse_args()
    for scenario in ("healthy-8xh100", "faulty-8xh100"):
        n, size, zipped, per, comps = measure(scenario)
        print(f"{scenario}: {n} series, {size} bytes ({zipped} gzip); series per class {per}; "
              f"components {comps}")
        if scenario.startswith("healthy"):
            fleet = args.fleet
            for interval in (15, 30):
                print(f"  fleet of {fleet}: {n * fleet / interval:,.0f} samples/s at a {interval} s "
                      f"scrape interval; {n * fleet:,} active series; "
                      f"{size * fleet / interval / 1e6:.1f} MB/s plain text "
                      f"({zipped * fleet / interval / 1e6:.1f} MB/s gzip)")
    print("growth (healthy simulated h100-sxm nodes, generated scenarios):")
    with tempfile.TemporaryDirectory(prefix="gpumon-scenarios-") as tmp:
        for gpus, nics in ((1, 0), (1, 1), (2, 2), (4, 4), (8, 0), (8, 4), (8, 8)):
            path = Path(tmp) / f"h100-{gpus}g-{nics}n.yaml"
            path.write_text(f"name: h100-{gpus}g-{nics}n\nsku: h100-sxm\ngpus: {gpus}\nib_devices: {nics}\n"
                            "faults: []\n")
            n, size, zipped, per, comps = measure(str(path))
            print(f"  {gpus} GPUs, {nics} NIC ports: {n} series, {size} bytes; {per}; components {comps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
