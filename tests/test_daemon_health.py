"""Issue 14, the daemon's own files: the health store and report.json under a real daemon.

Real ``gpumon daemon --simulate`` processes, real SQLite files, real scrapes of /metrics, and
a real full file system (a 1 MiB tmpfs mounted on the state directory; skipped where this
machine does not allow mounts: tests run as root here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env
from gpumon.daemon_report import REPORT_MIN_INTERVAL_S
from gpumon.health.keeper import Health
from gpumon.health.store import DB_NAME
from gpumon.model import Action, Finding, Severity
from live_faults import end_fault, start_fault


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def _wait(pred: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


@contextlib.contextmanager
def _daemon(scenario: Path, simdir: Path, *args: str, config: Path | None = None,
            log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon whose stderr goes to ``log``; killed on the way out if it still runs."""
    cmd = [sys.executable, "-m", "gpumon"]
    if config is not None:
        cmd += ["--config", str(config)]
    cmd += ["daemon", "--simulate", str(scenario), "--sim-dir", str(simdir), *args]
    with open(log if log is not None else os.devnull, "w") as err, \
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=clean_env()) as proc:
        try:
            yield proc
        finally:
            proc.kill()
            proc.wait(timeout=30)


def _status(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon", "status", "--json", "--history", "50",
                           "--state-dir", str(state)], capture_output=True, text=True, env=clean_env(),
                          timeout=60)


def _scenario(tmp_path: Path, name: str, faults: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nsku: h100-sxm\ngpus: 8\nfaults:\n{faults}")
    return path


def _report(simdir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((simdir / "state" / "report.json").read_text()))
    except (OSError, ValueError):
        return {}


def _ran(simdir: Path, check: str) -> bool:
    """The check's first run is in report.json (ok findings folded into one per check)."""
    return any(f["check"] == check for f in _report(simdir).get("findings", []))


def _finding(simdir: Path, component: str) -> dict[str, Any] | None:
    """The component's finding in report.json: one that is not ok (ok ones are folded)."""
    return next((f for f in _report(simdir).get("findings", []) if f["component"] == component), None)


def _findings_stored(simdir: Path, component: str) -> list[dict[str, Any]]:
    """The component's finding events in the health store, oldest first."""
    status = _status(simdir / "state")
    if status.returncode not in (0, 1, 2):
        return []
    port = json.loads(status.stdout)["components"].get(component, {})
    return [e["payload"] for e in port.get("history", []) if e["kind"] == "finding"]


# -- 1. history is transitions, not every new number ---------------------------------------------


def test_an_ib_outage_is_stored_as_its_transitions_not_one_event_a_second(tmp_path: Path) -> None:
    """mlx5_2 down for 10 s, sampled every second: the port's finding says "down now for N s"
    with a new N each second, warn for 7 s, then fail. Stored: the transitions (ok -> warn ->
    fail), not one event per new number (~11 before); what status says is the newest words."""
    simdir = tmp_path / "sim"
    scenario = _scenario(tmp_path, "outage", "  []\n")
    log = tmp_path / "daemon.log"
    comp = "ib/mlx5_2/1"
    with _daemon(scenario, simdir, "--duration", "300", "--listen", "127.0.0.1:0", log=log) as proc:
        # the port down while the daemon watches (tests/live_faults.py: a scenario's time counts from
        # the node's start, which a daemon slow to start on a busy machine would partly miss), until
        # its finding fails (7 s), then up again
        assert _wait(lambda: _ran(simdir, "ib"), 60), log.read_text()
        start_fault(scenario, simdir, {"kind": "ib_down", "device": "mlx5_2", "port": 1})
        assert _wait(lambda: (_finding(simdir, comp) or {}).get("severity") == "fail", 60), log.read_text()
        end_fault(scenario, simdir, "ib_down")
        assert _wait(lambda: (_finding(simdir, comp) or {}).get("message", "").startswith("an outage of "),
                     60), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    assert "ib ib/mlx5_2/1: warn -> fail" in log.read_text()
    db = sqlite3.connect(simdir / "state" / DB_NAME)
    rows = db.execute("SELECT json_extract(payload, '$.severity') FROM events"
                      " WHERE component = 'ib/mlx5_2/1' AND kind = 'finding' ORDER BY id").fetchall()
    db.close()
    assert [r[0] for r in rows] == ["ok", "warn", "fail"], rows
    status = _status(simdir / "state")
    assert status.returncode == 2, status.stderr  # unhealthy: check_cables
    port = json.loads(status.stdout)["components"]["ib/mlx5_2/1"]
    assert (port["state"], port["action"]) == ("unhealthy", "check_cables")
    (fault,) = port["why"]
    # the newest words, refreshed in place (the port came back: the outage is over)
    assert fault["message"].startswith("an outage of "), fault["message"]
    assert fault["evidence"]["outages"] == 1 and "ongoing_outage_s" not in fault["evidence"]
    # the history keeps the words of each transition
    words = [e["payload"]["message"] for e in port["history"] if e["kind"] == "finding"]
    assert words[1].startswith("down now (") and words[2].startswith("down for "), words


def test_an_ib_blip_that_never_left_ok_is_recorded(tmp_path: Path) -> None:
    """A 3 s outage between two samples (ib every 10 s): the port's finding stays ok, only its
    evidence counts the outage (link_downed). That finding is stored: the blip is history,
    where before nothing but the port's first ok was."""
    simdir = tmp_path / "sim"
    scenario = _scenario(tmp_path, "blip", "  []\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("daemon:\n  jitter: 0\nchecks:\n  ib:\n    interval_s: 10\n")
    log = tmp_path / "daemon.log"
    comp = "ib/mlx5_3/1"
    with _daemon(scenario, simdir, "--duration", "300", "--listen", "127.0.0.1:0", config=cfg,
                 log=log) as proc:
        # down for 2 s right after the port's first sample, up long before its next one (10 s later)
        assert _wait(lambda: _ran(simdir, "ib"), 60), log.read_text()
        start_fault(scenario, simdir, {"kind": "ib_down", "device": "mlx5_3", "port": 1})
        time.sleep(2)  # the outage's length
        end_fault(scenario, simdir, "ib_down")
        # the port's next sample, ok again, its finding counting the outage (a stored transition: the
        # report folds ok findings into the check's one line)
        assert _wait(lambda: len(_findings_stored(simdir, comp)) == 2, 60, step=0.5), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    assert "ib/mlx5_3/1: ok -> warn" not in log.read_text(), "a sample saw the port down: not a blip"
    status = _status(simdir / "state")
    assert status.returncode == 0, status.stderr
    port = json.loads(status.stdout)["components"]["ib/mlx5_3/1"]
    assert port["state"] == "healthy"
    found = [e["payload"] for e in port["history"] if e["kind"] == "finding"]
    assert [p["severity"] for p in found] == ["ok", "ok"], found
    assert found[0]["evidence"]["outages"] == 0
    assert found[1]["evidence"]["outages"] == 1 and "1 outage(s)" in found[1]["message"], found[1]


# -- 2. report.json follows /metrics -------------------------------------------------------------


def test_report_json_follows_metrics_within_a_second(tmp_path: Path) -> None:
    """A second Xid 48 on GPU 6 changes /metrics (xid_events_total 1 -> 2) but no severity:
    report.json says so at its next write, not its periodic one."""
    simdir = tmp_path / "sim"
    scenario = _scenario(tmp_path, "xid2", "  - {at_s: 2, kind: xid, gpu: 6, code: 48}\n"
                                           "  - {at_s: 5, kind: xid, gpu: 6, code: 48}\n")
    port = _free_port()
    want = 'gpumon_xid_events_total{check="xid",code="48",component="gpu/6"} 2.0'

    def count() -> int | None:
        for f in _report(simdir).get("findings", []):
            if (f["check"], f["component"]) == ("xid", "gpu/6"):
                return int(f["evidence"]["count"])
        return None

    with _daemon(scenario, simdir, "--duration", "20", "--listen", f"127.0.0.1:{port}") as proc:
        try:
            assert _wait(lambda: want in _scrape(port), 60), _scrape(port)
            seen = time.monotonic()
            assert _wait(lambda: count() == 2, 12)
            lag = time.monotonic() - seen
            # one write per REPORT_MIN_INTERVAL_S, and 2 s for a busy machine to run the writer and
            # this poll: a report that waited for its periodic rewrite (REPORT_MAX_AGE_S) misses the
            # 12 s wait above
            assert lag < REPORT_MIN_INTERVAL_S + 2.0, f"report.json {lag:.1f} s behind /metrics"
            # and it was replaced whole, never seen half written (no temporary file left)
            assert not [p.name for p in (simdir / "state").iterdir() if p.name.endswith(".tmp")]
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# -- 3. a corrupt health.db ----------------------------------------------------------------------


def _random_db(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = os.urandom(64 * 1024)
    path.write_bytes(data)
    return data


def _truncated_db(path: Path) -> bytes:
    """A real store with ~300 events, cut to half its size (a crash of the file system, a copy
    that stopped half way)."""
    h = Health.open(path.parent, boot_id="boot-old")
    for i in range(300):
        sev = Severity.WARN if i % 2 else Severity.FAIL
        h.record_findings("throttle", [Finding("throttle", f"gpu/{i % 8}", sev, f"reading {i} " + "x" * 200,
                                               Action.NONE)], complete=True)
    h.close()
    data = path.read_bytes()
    assert len(data) > 64 * 1024
    path.write_bytes(data[:len(data) // 2])
    return data[:len(data) // 2]


@pytest.mark.parametrize("damage", [_random_db, _truncated_db], ids=["random-bytes", "truncated"])
def test_the_daemon_sets_a_corrupt_store_aside_at_once_and_keeps_exporting(
        tmp_path: Path, damage: Callable[[Path], bytes]) -> None:
    simdir = tmp_path / "sim"
    state = simdir / "state"
    bad = damage(state / DB_NAME)
    scenario = _scenario(tmp_path, "corrupt", "  - {at_s: 2, kind: xid, gpu: 6, code: 48}\n")
    port = _free_port()
    log = tmp_path / "daemon.log"
    with _daemon(scenario, simdir, "--listen", f"127.0.0.1:{port}", log=log) as proc:
        try:
            # said at once, while the daemon runs (it was said only at exit: "N events not stored")
            assert _wait(lambda: "is corrupt" in log.read_text(), 20), log.read_text()
            text = log.read_text()
            assert "moved aside to" in text and "a fresh store starts now" in text, text
            aside = sorted(state.glob(f"{DB_NAME}.corrupt-*"))
            assert [p.name for p in aside if not p.name.endswith(("-wal", "-shm"))], aside
            main = next(p for p in aside if not p.name.endswith(("-wal", "-shm")))
            assert main.read_bytes() == bad  # kept as it was, for forensics
            # the exporter goes on, and says what happened
            store = 'gpumon_finding_severity{check="health_store",component="node"} 3.0'
            xid = 'gpumon_finding_severity{check="xid",component="gpu/6"} 4.0'
            assert _wait(lambda: store in (m := _scrape(port)) and xid in m, 20), _scrape(port)
            assert 'gpumon_health_state{component="gpu/6",state="unhealthy"} 1.0' in _scrape(port)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
    assert "not stored" not in log.read_text(), log.read_text()
    status = _status(state)
    assert status.returncode == 2, status.stderr  # the Xid 48 stored in the fresh store
    doc = json.loads(status.stdout)
    why = {(f["check"], f["component"]): f for f in doc["node"]["why"]}
    assert why[("xid", "gpu/6")]["action"] == "reset_gpu"
    note = why[("health_store", "node")]
    assert note["severity"] == "warn" and "was corrupt" in note["message"], note
    assert note["evidence"]["replaced"]["moved_to"] == str(main)
    # a restart keeps the warning (a day long), and does not set the fresh store aside
    with _daemon(scenario, simdir, "--duration", "3", "--listen", "127.0.0.1:0", log=log) as proc:
        assert proc.wait(timeout=60) == 0, log.read_text()
    assert "is corrupt" not in log.read_text()
    assert sorted(state.glob(f"{DB_NAME}.corrupt-*")) == aside
    assert any(f["check"] == "health_store" and f["severity"] == "warn" and "was corrupt" in f["message"]
               for f in _report(simdir)["findings"]), _report(simdir)["findings"]


@pytest.mark.parametrize("damage", [_random_db, _truncated_db], ids=["random-bytes", "truncated"])
def test_status_and_set_healthy_on_a_corrupt_store_say_so(tmp_path: Path,
                                                          damage: Callable[[Path], bytes]) -> None:
    state = tmp_path / "state"
    bad = damage(state / DB_NAME)
    status = subprocess.run([sys.executable, "-m", "gpumon", "status", "--state-dir", str(state)],
                            capture_output=True, text=True, env=clean_env(), timeout=60)
    assert status.returncode == 3
    assert "corrupt" in status.stderr and str(state / DB_NAME) in status.stderr, status.stderr
    assert "Traceback" not in status.stderr
    override = subprocess.run([sys.executable, "-m", "gpumon", "set-healthy", "node", "--reason", "r",
                               "--state-dir", str(state)], capture_output=True, text=True, env=clean_env(),
                              timeout=60)
    assert override.returncode == 3 and "corrupt" in override.stderr, override.stderr
    assert "Traceback" not in override.stderr
    # only the daemon sets a corrupt store aside: a CLI must not swap the file under it
    assert (state / DB_NAME).read_bytes() == bad
    assert not list(state.glob(f"{DB_NAME}.corrupt-*"))


# -- 4. a full disk ------------------------------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as fh:
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()
    return filler


def test_a_full_disk_is_said_as_such_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    """The state directory on a 1 MiB tmpfs, filled while the daemon runs; then faults arrive.
    The daemon says "disk full" (log, health_store finding on /metrics and in report.json's
    store finding), leaves no report.json temporary file behind, and writes the events once
    there is room again."""
    simdir = tmp_path / "sim"
    state = simdir / "state"
    scenario = _scenario(tmp_path, "full", "  []\n")
    port = _free_port()
    log = tmp_path / "daemon.log"
    with _tmpfs(state, "1m"), _daemon(scenario, simdir, "--listen", f"127.0.0.1:{port}", log=log) as proc:
        try:
            assert _wait(lambda: (state / "report.json").is_file() and (state / DB_NAME).is_file(), 60)
            filler = _fill(state)
            # the faults once the disk is full, whenever a busy machine's daemon got this far
            # (tests/live_faults.py)
            for gpu in (6, 5, 4):
                start_fault(scenario, simdir, {"kind": "xid", "gpu": gpu, "code": 48})
            store = 'gpumon_finding_severity{check="health_store",component="node"} 3.0'
            assert _wait(lambda: store in _scrape(port), 20), log.read_text()
            assert _wait(lambda: "xid gpu/4: new -> fail" in log.read_text(), 20), log.read_text()
            time.sleep(1.5)
            text = log.read_text()
            assert "disk full: no space left on the file system of" in text, text
            # SQLite's words ("disk I/O error", "database or disk is full") only after what they mean
            raw = [line for line in text.splitlines() if "I/O error" in line or "disk is full" in line]
            assert all("disk full: " in line for line in raw), raw
            report = _report(simdir)
            assert report, "report.json is gone or half written"
            leftovers = [p.name for p in state.iterdir() if p.name.endswith(".tmp")]
            assert not leftovers, leftovers
            filler.unlink()
            assert _wait(lambda: 'health_store",component="node"} 0.0' in _scrape(port), 20), log.read_text()
            assert "writable again" in log.read_text()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
        status = _status(state)
        assert status.returncode == 2, status.stderr
        why = {f["component"] for f in json.loads(status.stdout)["node"]["why"] if f["check"] == "xid"}
        assert why == {"gpu/4", "gpu/5", "gpu/6"}, why


def test_status_on_a_full_disk(tmp_path: Path) -> None:
    """`gpumon status` on a full file system: with the daemon stopped (no WAL content) it reads
    the store anyway; where the WAL holds data it cannot read without its -shm, it says
    "disk full" (it said only "disk I/O error"), exit 3, no traceback."""
    state = tmp_path / "state"
    with _tmpfs(state, "1m"):
        h = Health.open(state, boot_id="boot-1")
        h.record_findings("xid", [Finding("xid", "gpu/3", Severity.FAIL, "Xid 79 on gpu/3",
                                          Action.REBOOT_NODE, {"code": 79})], complete=True)
        h.close()
        assert not (state / f"{DB_NAME}-wal").exists()
        filler = _fill(state)
        status = _status(state)
        assert status.returncode == 2, status.stderr
        assert json.loads(status.stdout)["components"]["gpu/3"]["action"] == "reboot_node"
        assert "disk full" in status.stderr and "Traceback" not in status.stderr, status.stderr
        filler.unlink()
        # a writer that died (kill -9) leaves WAL content; its -shm is gone (a reboot clears
        # /dev/shm-like state on some setups; here: removed), and the disk is full again
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(state)], stdout=subprocess.PIPE,
                                  text=True)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
        assert (state / f"{DB_NAME}-wal").stat().st_size > 0
        (state / f"{DB_NAME}-shm").unlink()
        _fill(state)
        status = _status(state)
        assert status.returncode == 3
        # SQLite's own words stay in brackets, after what they mean here
        assert "health.db: disk full: no space left on the file system of" in status.stderr, status.stderr
        assert "Traceback" not in status.stderr


_WRITER = """
import sys
from gpumon.daemon_report import REPORT_MIN_INTERVAL_S
from gpumon.health.keeper import Health
from gpumon.model import Action, Finding, Severity
h = Health.open(sys.argv[1], boot_id="boot-1")
h.record_findings("xid", [Finding("xid", "gpu/5", Severity.FAIL, "Xid 48 on gpu/5", Action.RESET_GPU,
                                  {"code": 48})], complete=True)
print("ready", flush=True)
import time
time.sleep(60)
"""


# -- issue 18, point 8: after set-healthy, gpumon status and /metrics say the same ----------------


def _metric(text: str, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples whose labels include ``labels``: the rest of their labels -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body, value = line[len(name) + 1:].rsplit("} ", 1)
        have = dict(part.split("=", 1) for part in body.split(","))
        have = {k: v.strip('"') for k, v in have.items()}
        if all(have.get(k) == v for k, v in labels.items()):
            out[",".join(f"{k}={v}" for k, v in sorted(have.items()) if k not in labels)] = float(value)
    return out


def _gpu1_in_metrics(text: str) -> tuple[str, int | None, bool]:
    """gpu/1 as /metrics shows it: its health state, throttle's severity there, whether accepted."""
    states = [k.removeprefix("state=") for k, v in _metric(text, "gpumon_health_state",
                                                           component="gpu/1").items() if v == 1]
    state = states[0] if len(states) == 1 else ""
    severity = _metric(text, "gpumon_finding_severity", check="throttle", component="gpu/1")
    accepted = _metric(text, "gpumon_finding_accepted", check="throttle", component="gpu/1")
    return state, int(severity[""]) if severity else None, accepted.get("") == 1


def test_after_set_healthy_status_and_metrics_agree_until_the_fault_is_raised_again(tmp_path: Path) -> None:
    """GPU 1 throttled for the whole run; set-healthy gpu/1 while throttle says "current reading; no
    window history yet"; throttle (every second) repeats that word for word until it has 15 s of
    history, then says a share: the fault is raised again. At every read in between, status and
    /metrics tell the same story (before: status said healthy and nothing more while /metrics said
    throttle fails on gpu/1)."""
    scenario = _scenario(tmp_path, "throttled",
                         "  - {at_s: 0, kind: throttle, gpu: 1, reasons: [hw_slowdown]}\n")
    config = tmp_path / "c.yaml"
    # 15 s: the daemon's start, set-healthy's run and a few `gpumon status` reads below all fit before
    # the fault is raised again, on a busy machine too (at 6 s, one beside a CPU hog read it raised
    # again before its first whole read)
    config.write_text("checks:\n  throttle:\n    interval_s: 1\n    min_history_s: 15\n")
    simdir, port = tmp_path / "sim", _free_port()
    state = simdir / "state"
    with _daemon(scenario, simdir, "--listen", f"127.0.0.1:{port}", config=config):
        assert _wait(lambda: _gpu1_in_metrics(_scrape(port))[0] == "unhealthy", 30)
        override = subprocess.run([sys.executable, "-m", "gpumon", "set-healthy", "gpu/1", "--reason",
                                   "fan replaced", "--simulate", str(scenario), "--sim-dir", str(simdir)],
                                  capture_output=True, text=True, env=clean_env(), timeout=60)
        assert override.returncode == 0, override.stderr
        assert "raised again" in override.stdout, override.stdout
        # the daemon folds it within a second (FOREIGN_S), whatever runs
        assert _wait(lambda: _gpu1_in_metrics(_scrape(port))[0] == "healthy", 5)
        phases: list[tuple[str, int | None, bool]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            before = _gpu1_in_metrics(_scrape(port))
            doc = json.loads(_status(state).stdout)
            after = _gpu1_in_metrics(_scrape(port))
            if before != after:
                continue  # the state changed while we read: no moment to compare
            comp = doc["components"]["gpu/1"]
            raised = [f for f in comp["why"] if f["check"] == "throttle"]
            accepted = [a for a in comp.get("accepted", []) if a["check"] == "throttle"]
            state_m, severity_m, accepted_m = before
            assert comp["state"] == state_m, (comp, before)
            assert bool(accepted) == accepted_m, (comp, before)
            if severity_m == 4:  # /metrics says throttle fails on gpu/1: so does status, raised or accepted
                assert raised or accepted, (comp, before)
                shown = (raised or accepted)[0]
                assert shown["severity"] == "fail", (comp, before)
            phases.append(before)
            if state_m == "unhealthy":
                break
        # both phases were seen: accepted (healthy, throttle still failing), then raised again
        assert ("healthy", 4, True) in phases, phases
        assert phases[-1] == ("unhealthy", 4, False), phases
