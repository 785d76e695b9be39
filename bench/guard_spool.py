"""Guard spool flood: what 20,000 files in the guard spool cost ``gpumon daemon``, and what a real
verdict and an Xid among them still get.

The spool (``/var/lib/gpumon/guard``) is mode 1777: any user of the node can fill it. Runs the
real daemon as a child process on a simulated 8xH100 node (``--simulate``, its host root and state
in a temporary ``--sim-dir``, default configuration) and samples it from /proc (psutil):

1. warm-up (imports, the first run of every check), not measured; the spool exists, empty;
2. idle for ``--idle`` s: CPU (user+system of the daemon process / wall, % of one core), RSS,
   health.db (its size after a passive checkpoint by the bench, its -wal apart, its events); an
   Xid 79 on a quiet GPU timed from its append to the first ``/metrics`` scrape that shows it;
3. ``--files`` files written into the spool as an unprivileged user would (owned by ``nobody`` when
   the bench runs as root): a third bad JSON, a third JSON of another program, a third well-formed
   transient verdicts with fresh ids on every GPU. Then, for ``--flood`` s while they stay, the same
   figures per ``--window`` s; ``--real-at`` s in, a real persistent verdict on a quiet GPU (owned
   by the bench's own uid, written like ``gpumon.guard`` writes it) timed to ``/metrics``
   (``gpumon_finding_severity{check="guard"}`` fail), then an Xid 79 timed likewise. The
   windows in which /metrics was polled for those are left out of the CPU figures (a 15 s
   Prometheus scrape does not cost that);
4. at the end: the guard faults in health.db per component, its events, the files left in the
   spool and in ``judged/``, and the time a /metrics scrape took;
5. with the daemon stopped, what one file costs the check in this process (CPU time, the least of
   five passes over ``--per-file`` files of each kind): reading and judging it (``read_verdict``: open,
   read, JSON, the verdict's JSON Schema) and listing it (``os.scandir``, with and without the
   ``lstat`` a new file needs): the figures behind the check's ``max_files`` and ``max_scan``.

    .venv/bin/python bench/guard_spool.py [--files 20000] [--idle 60] [--flood 240] [--window 60]
        [--real-at 30] [--warmup 20] [--per-file 3000]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pwd
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from _machine import describe  # noqa: E402
from storm import KmsgWriter, Node, Sampler, _free_port, _load, _mib, _read_node, _scrape, probe, stop_daemon  # noqa: E402

from gpumon.guard import verdict as vf  # noqa: E402
from gpumon.health.store import DB_NAME, EventStore, load_view  # noqa: E402


def _uuids(sim_dir: Path) -> list[str]:
    return [line.split()[1] for line in (sim_dir / "nvml-state.txt").read_text().splitlines()
            if line.startswith("uuid ")]


def _verdict(fault: str, uuid: str, index: int, rank: int, when: float) -> vf.Verdict:
    who = vf.Identity(rank=rank, world_size=64, host="trn-x01", node_name=None, node_name_source=None,
                      local_rank=index, device=f"cuda:{index}", gpu_uuid=uuid, gpu_index=index)
    return vf.Verdict(check="weights", fault=fault, step=100, message=f"rank {rank}'s weights differ",
                      subject=who, evidence={}, job="slurm:4242", time=when, id=vf.new_id(who, when))


def write_flood(spool: Path, n: int, uuids: list[str], owner: int | None) -> float:
    """The mix: bad JSON, foreign JSON, transient verdicts with fresh ids on every GPU; seconds taken."""
    start = time.monotonic()
    now = time.time()
    for i in range(n):
        kind = i % 3
        if kind == 0:
            path = spool / f"junk-{i:06d}.json"
            path.write_text("{not json")
        elif kind == 1:
            path = spool / f"other-{i:06d}.json"
            path.write_text(json.dumps({"foreign": "json", "n": i}))
        else:
            v = _verdict("transient", uuids[i % len(uuids)], i % len(uuids), i, now)
            path = spool / f"{v.id}.json"
            path.write_text(json.dumps(v.to_json()))
        if owner is not None:
            os.chown(path, owner, owner)
    return time.monotonic() - start


def _db(state: Path) -> tuple[int, int, int]:
    """(health.db bytes, its write-ahead log's bytes, events stored). The log holds the pages not
    yet copied back into the file, and is reused once they are: a passive checkpoint first (it
    waits for no one), so that the file's size is what the store holds."""
    conn = sqlite3.connect(state / DB_NAME)
    try:
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    finally:
        conn.close()
    sizes = [(state / name).stat().st_size if (state / name).is_file() else 0
             for name in (DB_NAME, f"{DB_NAME}-wal")]
    store = EventStore(state / DB_NAME, readonly=True)
    try:
        events = store.count()
    finally:
        store.close()
    return sizes[0], sizes[1], events


def _checkpointed(state: Path) -> int:
    """health.db's size once its write-ahead log is copied back (the daemon stopped)."""
    conn = sqlite3.connect(state / DB_NAME)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return (state / DB_NAME).stat().st_size


def _files(directory: Path) -> int:
    if not directory.is_dir():
        return 0
    with os.scandir(directory) as entries:
        return sum(1 for e in entries if e.name.endswith(".json"))


def _guard_shown(text: str, component: str, at_least: float) -> bool:
    key = f'gpumon_finding_severity{{check="guard",component="{component}"}} '
    at = text.find(key)
    return at >= 0 and float(text[at + len(key):].split("\n", 1)[0]) >= at_least


def real_verdict(spool: Path, uuids: list[str], index: int, url: str, timeout_s: float) -> float:
    """Write one persistent verdict on GPU ``index``; seconds until /metrics shows it (inf: never)."""
    v = _verdict("persistent", uuids[index], index, 0, time.time())
    start = time.perf_counter()
    vf.write(v, spool)
    while time.perf_counter() - start < timeout_s:
        try:
            if _guard_shown(_scrape(url), f"gpu/{index}", 4.0):
                return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.5)
    return float("inf")


def _window(proc: psutil.Process, seconds: float, state: Path, spool: Path,
            ) -> tuple[float, int, tuple[int, int, int], int, int]:
    """(cpu % of a core, max rss, health.db, files in the spool, files in judged/) over ``seconds``."""
    s = Sampler(proc)
    s.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        s.sample()
    _, _, pct, _ = s.result()
    return pct, max(s.rss), _db(state), _files(spool), _files(spool / "judged")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--flood", type=float, default=240.0, help="seconds measured while the files stay")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--real-at", type=float, default=30.0, help="seconds into the flood: a real verdict")
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--scenario", default="healthy-8xh100")
    ap.add_argument("--per-file", type=int, default=3000, help="files of each kind for the per-file costs")
    args = ap.parse_args(argv)

    print(f"machine: {describe()}")
    load_before = _load()
    tmp = tempfile.TemporaryDirectory(prefix="gpumon-guard-spool-")
    sim_dir = Path(tmp.name) / "sim"
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    total = args.warmup + args.idle + args.flood + 180
    log_path = Path(tmp.name) / "daemon.log"
    cmd = [sys.executable, "-m", "gpumon", "daemon", "--simulate", args.scenario, "--sim-dir", str(sim_dir),
           "--listen", f"127.0.0.1:{port}", "--duration", str(total)]
    with open(log_path, "wb") as log_fh:
        daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_fh, cwd=REPO)
    proc = psutil.Process(daemon.pid)
    owner = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else None
    writer: KmsgWriter | None = None
    try:
        deadline = time.monotonic() + 120
        while True:
            if daemon.poll() is not None:
                print(f"gpumon daemon exited early (code {daemon.returncode}):\n"
                      f"{log_path.read_text(errors='replace')[-3000:]}", file=sys.stderr)
                return 1
            try:
                _scrape(url)
                break
            except OSError:
                if time.monotonic() > deadline:
                    print("gpumon daemon never served /metrics", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        spool = sim_dir / "host" / vf.DEFAULT_DIR.lstrip("/")
        spool.mkdir(parents=True, exist_ok=True)
        spool.chmod(0o1777)
        state = sim_dir / "state"
        uuids = _uuids(sim_dir)
        time.sleep(args.warmup)
        node: Node = _read_node(sim_dir)
        writer = KmsgWriter(node)

        idle = _window(proc, args.idle, state, spool)
        idle_xid = probe(writer, node, 7, url, 0.02)

        wrote_s = write_flood(spool, args.files, uuids, owner)
        rows: list[tuple[str, float, tuple[float, int, tuple[int, int, int], int, int]]] = []
        real_s = xid_s = float("nan")
        elapsed = 0.0
        probed = False
        while elapsed < args.flood:
            span = min(args.window, args.flood - elapsed)
            if not probed and args.real_at < elapsed + span:
                span = max(0.0, args.real_at - elapsed)
                probed = True
                if span > 0:
                    rows.append((f"flood {elapsed:.0f}-{elapsed + span:.0f} s", span,
                                 _window(proc, span, state, spool)))
                    elapsed += span
                # polled for: not counted as the daemon's cost of the files
                real_s = real_verdict(spool, uuids, 6, url, 300.0)
                xid_s = probe(writer, node, 5, url, 0.02)
                continue
            label = f"flood {elapsed:.0f}-{elapsed + span:.0f} s"
            rows.append((label, span, _window(proc, span, state, spool)))
            elapsed += span
        scrapes = []
        for _ in range(5):
            start = time.perf_counter()
            _scrape(url)
            scrapes.append(time.perf_counter() - start)
        load_after = _load()
    finally:
        if writer is not None:
            writer.close()
        stop_daemon(daemon)

    view = load_view(state)
    faults = Counter(f.component for c in view.components.values() for f in c.why if f.check == "guard")
    _, _, events = _db(state)
    packed = _checkpointed(state)
    who = "nobody (uid 65534)" if owner is not None else f"the bench's own uid {os.geteuid()}"
    print(f"conditions: gpumon daemon --simulate {args.scenario}, default config (guard check every 10 s: "
          f"max_files 1000, max_scan 50000, uid_max_verdicts 50/h, max_faults_per_gpu 5); {args.warmup:g} s "
          f"warm-up, {args.idle:g} s idle with an empty spool, then {args.files:,} files written in "
          f"{wrote_s:.1f} s, owned by {who}: a third bad JSON, a third foreign JSON, a third transient "
          f"verdicts with fresh ids on all {len(uuids)} GPUs; {args.flood:g} s measured while they stay; "
          f"psutil every 1 s; load average (1/5/15 min) before {load_before}, after {load_after}")
    print()
    print(f"{'window':24}{'cpu % of a core':>17}{'rss max':>12}{'health.db':>12}{'-wal':>12}{'events':>8}"
          f"{'spool files':>13}{'judged/':>9}")
    for label, _, (pct, rss, (db, wal, events), left, judged) in [("idle", args.idle, idle), *rows]:
        print(f"{label:24}{pct:>16.2f}%{_mib(rss):>12}{db / 1024:>8.0f} KiB{wal / 1024:>8.0f} KiB{events:>8}"
              f"{left:>13,}{judged:>9,}")
    measured = sum(span for _, span, _ in rows)
    mean = sum(span * r[0] for _, span, r in rows) / measured
    rss = max(r[1] for _, _, r in rows)
    print(f"while the files stay ({measured:.0f} s, probe windows left out): cpu {mean:.2f} % of a core, "
          f"rss max {_mib(rss)}; idle: cpu {idle[0]:.2f} %, rss max {_mib(idle[1])}")
    print(f"a real persistent verdict written {args.real_at:g} s into the flood -> /metrics fail on gpu/6: "
          f"{real_s:.1f} s (the check runs every 10 s, and reports it on its first run that reads it)")
    print(f"Xid 79 -> /metrics: idle {idle_xid * 1000:.0f} ms, during the flood {xid_s * 1000:.0f} ms")
    print(f"/metrics scrape at the end: {min(scrapes) * 1000:.1f}-{max(scrapes) * 1000:.1f} ms")
    print(f"health.db at the end: {events} events, {packed / 1024:.0f} KiB once its write-ahead log was "
          "copied back and truncated (daemon stopped); open guard faults per component: "
          f"{dict(sorted(faults.items())) or 'none'}")
    print()
    per_file(Path(tmp.name) / "per-file", args.per_file, uuids)
    tmp.cleanup()
    return 0


def _least_cpu(fn: Callable[[], object], passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def per_file(directory: Path, n: int, uuids: list[str]) -> None:
    from gpumon_checks.guard.spool import read_verdict

    kinds: dict[str, list[Path]] = {"bad JSON": [], "foreign JSON": [], "a transient verdict": []}
    directory.mkdir()
    now = time.time()
    for i in range(n):
        (directory / f"junk-{i:06d}.json").write_text("{not json")
        (directory / f"other-{i:06d}.json").write_text(json.dumps({"foreign": "json", "n": i}))
        v = _verdict("transient", uuids[i % len(uuids)], i % len(uuids), i, now)
        (directory / f"{v.id}.json").write_text(json.dumps(v.to_json()))
    for path in sorted(directory.iterdir()):
        kind = "bad JSON" if path.name.startswith("junk") else (
            "foreign JSON" if path.name.startswith("other") else "a transient verdict")
        kinds[kind].append(path)
    vf.validator()

    def load_all(paths: list[Path]) -> None:
        for path in paths:
            with contextlib.suppress(vf.VerdictError, OSError):
                read_verdict(path)

    def names() -> int:
        with os.scandir(directory) as entries:
            return sum(1 for e in entries if e.name.endswith(".json"))

    def lstats() -> int:
        with os.scandir(directory) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.name.endswith(".json"))

    print(f"== what one spool file costs the check, this process's CPU time, least of 5 passes over {n:,} "
          "files of each kind (the daemon stopped)")
    for kind, paths in kinds.items():
        us = 1e6 * _least_cpu(functools.partial(load_all, paths)) / len(paths)
        print(f"    read and judge {kind:<22} {us:7.1f} us")
    total = sum(len(p) for p in kinds.values())
    print(f"    list an entry (os.scandir)              {1e6 * _least_cpu(names) / total:7.2f} us")
    print(f"    list an entry and lstat it              {1e6 * _least_cpu(lstats) / total:7.2f} us")


if __name__ == "__main__":
    sys.exit(main())
