"""The SQLite event store and ``Health``: persistence, durability, bounds, a store that cannot be written.

Real SQLite files in tmp_path; a real child process killed with SIGKILL; a real
full file system and a real read-only mount where this machine allows mounts
(tests run as root, so permission bits do not make a directory read-only; the
always-run variants use a path SQLite cannot open and SQLite's own page cap).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.health.keeper import DAY_S, STORE_CHECK, Health
from gpumon.health.state import Event, EventKind, Level, finding_event
from gpumon.health.store import DB_NAME, EventStore, load_view
from gpumon.health.store_file import StoreError
from gpumon.model import NODE, Action, CheckRun, Finding, Severity

ROOT = Path(__file__).resolve().parents[2]
B1, B2 = "boot-1", "boot-2"
NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


def run(check: str, *findings: Finding, outcome: str = "completed") -> CheckRun:
    return CheckRun(check, list(findings), 0.0, 0.0, outcome)


def xid79(gpu: int = 3) -> Finding:
    return Finding("xid", f"gpu/{gpu}", Severity.FAIL, f"Xid 79 fallen off the bus on gpu/{gpu}",
                   Action.REBOOT_NODE, {"code": 79})


def warn(gpu: int, message: str) -> Finding:
    return Finding("throttle", f"gpu/{gpu}", Severity.WARN, message)


def essence(h: Health) -> tuple[object, ...]:
    v = h.view()
    return (v.node.level, v.node.action, [(f.id, f.action, f.message, f.remediated) for f in v.node.why],
            {c: (x.level, x.action) for c, x in v.components.items()})


# -- persistence ------------------------------------------------------------------------------


def test_events_round_trip(tmp_path: Path) -> None:
    store = EventStore(tmp_path / DB_NAME)
    sent = [finding_event(xid79(), time=NOW, boot_id=B1),
            Event(NOW + 1, EventKind.SET_HEALTHY, "gpu/3", "", B1, {"who": "a", "reason": "ü ✓"}),
            Event(NOW + 2, EventKind.BOOT, NODE, "", B2, {"previous": B1}, last_seen=NOW + 5)]
    stored = [store.append(e) for e in sent]
    assert [e.id for e in stored] == [1, 2, 3]
    store.close()
    again = EventStore(tmp_path / DB_NAME)
    loaded = again.load()
    assert loaded.snapshot is None and loaded.upto_id == 0
    assert loaded.events == stored
    assert again.max_id() == 3
    again.close()


def test_state_survives_a_restart_and_a_new_boot_is_recorded_once(tmp_path: Path) -> None:
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    h.record_run(run("xid", xid79(), Finding("xid", "gpu/0", Severity.WARN, "Xid 13", Action.RESTART_APP,
                                            {"code": 13})))
    h.record_run(run("throttle", warn(5, "SW thermal")))
    before = essence(h)
    h.close()

    same = Health.open(tmp_path, boot_id=B1, clock=clock)
    assert essence(same) == before
    n = same.store.count()
    same.close()

    clock.advance(300)
    rebooted = Health.open(tmp_path, boot_id=B2, clock=clock)
    assert rebooted.store.count() == n + 1
    fault = rebooted.view().components["gpu/3"].why[0]
    assert fault.remediated == clock.t and fault.status == "remediated: awaiting retest"
    rebooted.retest_passed(by="bootstrap")
    assert rebooted.view().node.level is Level.HEALTHY
    rebooted.close()
    view = load_view(tmp_path)
    assert view.node.level is Level.HEALTHY
    assert [e.kind for e in view.history["gpu/3"]][-2:] == [EventKind.BOOT, EventKind.RETEST_PASSED]


def test_identical_runs_add_no_rows_and_last_seen_is_refreshed_in_batches(tmp_path: Path) -> None:
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    oks = [Finding("throttle", f"gpu/{i}", Severity.OK, "no hardware slowdown") for i in range(1, 8)]
    h.record_run(run("throttle", warn(0, "SW thermal"), *oks))
    rows = h.store.count()
    for i in range(3600):  # an hour of a 1 s check
        clock.advance(1)
        assert h.record_run(run("throttle", Finding("throttle", "gpu/0", Severity.WARN, "SW thermal",
                                                    evidence={"temperature_c": 80 + i % 5}), *oks)) == []
    assert h.store.count() == rows
    (finding,) = [e for e in h.store.events() if e.check == "throttle" and e.component == "gpu/0"]
    assert finding.last_seen is not None and clock.t - finding.last_seen <= h.touch_interval_s
    h.close()
    assert load_view(tmp_path).node.why[0].last_seen == clock.t


def test_a_set_healthy_from_another_process_reaches_the_daemon(tmp_path: Path) -> None:
    clock = Clock()
    daemon = Health.open(tmp_path, boot_id=B1, clock=clock)
    daemon.record_run(run("xid", xid79()))
    cli = Health.open(tmp_path, boot_id=B1, clock=clock)
    assert cli.view().node.action is Action.REBOOT_NODE
    clock.advance(5)
    cli.set_healthy("gpu/3", who="alice", reason="reseated, dcgmi diag -r 3 passed")
    cli.close()
    with pytest.raises(ValueError):
        daemon.set_healthy("gpu/x", who="a", reason="r")
    with pytest.raises(ValueError):
        daemon.set_healthy("gpu/3", who="a", reason=" ")
    clock.advance(5)
    daemon.record_run(run("xid", xid79()))  # xid repeats the line for the boot: accepted
    assert daemon.view().node.level is Level.HEALTHY
    assert daemon.view().history["gpu/3"][-1].payload["who"] == "alice"
    daemon.close()


def test_status_without_a_store_says_so(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="has the daemon run"):
        load_view(tmp_path)


# -- durability ---------------------------------------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys
    from gpumon.health.keeper import Health
    from gpumon.model import Action, Finding, Severity
    health = Health.open(sys.argv[1], boot_id="boot-1")
    print("ready", flush=True)
    i = 0
    while True:
        # the severity flips at each finding of a GPU: every one is a transition, stored at once
        sev = Severity.FAIL if (i // 8) % 2 else Severity.WARN
        f = Finding("burst", f"gpu/{i % 8}", sev, f"m{i}", Action.RESET_GPU, {"i": i})
        health.record_findings("burst", [f], complete=False)
        if health.error is None:
            print(i, flush=True)  # returned: committed
        i += 1
""")


def test_kill_9_during_a_burst_loses_no_committed_event(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)
    assert child.stdout is not None
    reported: list[int] = []
    try:
        assert child.stdout.readline().strip() == "ready"
        while len(reported) < 400:
            line = child.stdout.readline()
            assert line, "writer died"
            reported.append(int(line))
        os.kill(child.pid, signal.SIGKILL)
        # whatever it printed before it died was committed before it printed
        reported += [int(x) for x in child.stdout.read().split()]
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    store = EventStore(tmp_path / DB_NAME, readonly=True)
    stored = {int(e.payload["evidence"]["i"]) for e in store.events() if e.check == "burst"}
    store.close()
    assert set(reported) <= stored
    # and the state folds from what is there: each GPU shows its latest committed message
    view = load_view(tmp_path)
    for gpu in range(8):
        last = max(i for i in reported if i % 8 == gpu)
        (fault,) = view.components[f"gpu/{gpu}"].why
        assert int(fault.message[1:]) >= last


# -- bounds -------------------------------------------------------------------------------------


def _old_burst(store: EventStore, n: int, start: float) -> None:
    batch: list[Event] = []
    for i in range(n):
        batch.append(finding_event(warn(i % 8, f"SW thermal, reading {i} " + "x" * 200), time=start + i,
                                   boot_id=B1))
        if len(batch) == 1000:
            store.append_many(batch)
            batch = []
    store.append_many(batch)


def test_compaction_bounds_the_file_and_keeps_open_faults(tmp_path: Path) -> None:
    clock = Clock(NOW - 40 * DAY_S)
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    h.record_run(run("xid", xid79()))  # 40 days old and never repaired
    _old_burst(h.store, 20_000, clock.t + 10)
    h.close()
    clock.t = NOW
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    before = essence(h)
    assert before[1] is Action.REBOOT_NODE
    size = h.store.size_bytes()
    assert size > 4_000_000
    assert h.compact() >= 20_000
    assert h.store.count() == 0
    assert h.store.size_bytes() < size / 20
    assert essence(h) == before
    h.close()
    # restarted: the snapshot still holds the old Xid 79
    again = Health.open(tmp_path, boot_id=B1, clock=clock)
    assert essence(again) == before
    again.record_run(run("xid", xid79()))
    assert again.store.count() == 0  # still the same fault: nothing new to store
    again.close()


def test_max_events_caps_a_flapping_node(tmp_path: Path) -> None:
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock, max_events=100)
    for i in range(300):
        clock.advance(1)
        h.record_run(run("throttle", warn(0, f"flap {i}")))
        clock.advance(1)
        h.record_run(run("throttle", Finding("throttle", "gpu/0", Severity.OK, "ok")))
    assert h.store.count() > 600
    h.tick()  # the hourly compaction is not due yet
    assert h.store.count() > 600
    clock.advance(3600)
    h.tick()
    assert h.store.count() == 100
    h.close()


# -- a store that cannot be written ---------------------------------------------------------------


def test_a_store_path_that_cannot_be_opened_keeps_the_state_in_memory_and_catches_up(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / DB_NAME).mkdir()  # a directory where the database file should be
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    assert h.error is not None
    h.record_run(run("xid", xid79()))
    h.record_run(run("throttle", warn(1, "SW thermal")))
    view = h.view()
    assert view.node.action is Action.REBOOT_NODE
    store_fault = view.components[NODE].why[0]
    assert (store_fault.check, store_fault.severity, store_fault.action) == (STORE_CHECK, Severity.WARN,
                                                                             Action.NONE)
    assert h.store_finding().evidence["pending"] == len(h.store.pending) > 0
    with pytest.raises(StoreError):
        h.set_healthy("gpu/1", who="alice", reason="known slow fan")
    assert h.view().components["gpu/1"].level is Level.HEALTHY  # applied in memory all the same
    for _ in range(5):
        h.record_run(run("xid", xid79()))
    queued = len(h.store.pending)
    assert queued < 10  # a failing store adds one event, not one per run

    (tmp_path / DB_NAME).rmdir()
    clock.advance(10)
    h.tick()
    assert h.error is None and h.store.pending == []
    assert h.store_finding().severity is Severity.OK
    assert h.view().components[NODE].level is Level.HEALTHY
    memory = essence(h)
    h.close()
    again = Health.open(tmp_path, boot_id=B1, clock=clock)
    assert essence(again) == memory
    again.close()


def test_a_state_dir_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = EventStore(tmp_path / "file" / "state" / DB_NAME, max_pending=5)
    for i in range(10):
        with pytest.raises(StoreError) as err:
            store.append(Event(NOW + i, EventKind.BOOT, NODE, "", f"b{i}"))
    assert err.value.pending == 5 and err.value.dropped == 5
    assert [e.boot_id for e in store.pending] == ["b5", "b6", "b7", "b8", "b9"]


def test_a_full_store_is_compacted_to_make_room(tmp_path: Path) -> None:
    old = EventStore(tmp_path / DB_NAME, max_bytes=256 * 1024)
    with pytest.raises(StoreError) as err:
        _old_burst(old, 5000, NOW - 60 * DAY_S)
    assert err.value.full
    old.close()
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B2, clock=clock, max_bytes=256 * 1024)
    assert h.error is None
    h.record_run(run("xid", xid79()))
    assert h.view().node.action is Action.REBOOT_NODE
    assert [e.kind for e in h.store.events()][-1] is EventKind.FINDING
    h.close()


def test_a_full_store_with_nothing_old_to_drop_reports_and_bounds_its_queue(tmp_path: Path) -> None:
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock, max_bytes=64 * 1024, max_pending=50)
    for i in range(2000):
        clock.advance(1)
        h.record_run(run("throttle", warn(i % 8, f"reading {i} " + "y" * 300)))
        if h.error is not None:
            break
    assert h.error is not None and h.error.full
    for i in range(200):
        h.record_run(run("throttle", warn(i % 8, f"later {i}")))
    assert len(h.store.pending) == 50 and h.store.dropped > 0
    assert h.view().components["gpu/7"].why[0].message == "later 199"
    f = h.store_finding()
    assert f.severity is Severity.WARN and "full" in f.message and f.evidence["dropped"] > 0
    h.store.close()


@contextlib.contextmanager
def mounted(*argv: str) -> Iterator[None]:
    proc = subprocess.run(["mount", *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({proc.stderr.strip()})")
    try:
        yield
    finally:
        # lazy: a store a failed test left open must not keep the mount (and pytest's tmp cleanup) busy
        subprocess.run(["umount", "-l", argv[-1]], capture_output=True)


def test_a_real_full_file_system(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)):
        clock = Clock()
        h = Health.open(mnt, boot_id=B1, clock=clock)
        h.record_run(run("xid", xid79()))
        filler = mnt / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        for i in range(500):
            clock.advance(1)
            h.record_run(run("throttle", warn(i % 8, f"reading {i} " + "z" * 500)))
            if h.error is not None:
                break
        assert h.error is not None, "the store never noticed the full file system"
        assert h.view().node.action is Action.REBOOT_NODE
        filler.unlink()
        clock.advance(1)
        h.tick()
        assert h.error is None and h.store.pending == []
        memory = essence(h)
        h.close()
        again = Health.open(mnt, boot_id=B1, clock=clock)
        assert essence(again) == memory
        again.close()


def test_a_real_read_only_mount(tmp_path: Path) -> None:
    state = tmp_path / "state"
    clock = Clock()
    h = Health.open(state, boot_id=B1, clock=clock)
    h.record_run(run("xid", xid79()))
    h.close()
    with mounted("--bind", str(state), str(state)):
        proc = subprocess.run(["mount", "-o", "remount,ro,bind", str(state)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({proc.stderr.strip()})")
        with pytest.raises(OSError) as err:
            (state / "probe").write_text("x")
        assert err.value.errno == errno.EROFS
        h = Health.open(state, boot_id=B2, clock=clock)
        clock.advance(5)
        h.record_run(run("throttle", warn(2, "SW thermal")))
        assert h.error is not None
        assert h.view().components["gpu/2"].level is Level.DEGRADED
    clock.advance(5)
    h.tick()  # the mount is gone: the directory under it is writable
    assert h.error is None
    view = h.view()
    # the fault stored before, the reboot and the warning kept in memory are all there
    assert view.node.boot_id == B2
    assert view.components["gpu/3"].why[0].status == "remediated: awaiting retest"
    assert view.components["gpu/2"].level is Level.DEGRADED
    memory = essence(h)
    h.close()
    again = Health.open(state, boot_id=B2, clock=clock)
    assert essence(again) == memory
    again.close()


# -- the store and the memory agree ------------------------------------------------------------

_OPS = st.lists(st.tuples(
    st.sampled_from(["run", "run", "run", "reboot", "reset", "retest", "set_healthy", "compact", "quarantine",
                     "release"]),
    st.sampled_from(["gpu/0", "gpu/1", NODE]),
    st.sampled_from(list(Severity)),
    st.sampled_from(list(Action)),
    st.sampled_from(["m1", "m2"]),
), max_size=25)


@settings(max_examples=60)
@given(_OPS)
def test_what_is_stored_folds_to_what_is_in_memory(tmp_path_factory: pytest.TempPathFactory,
                                                   ops: list[tuple[str, str, Severity, Action, str]]) -> None:
    path = tmp_path_factory.mktemp("h")
    clock = Clock()
    boots = iter(f"boot-{i}" for i in range(100))
    h = Health.open(path, boot_id=next(boots), clock=clock, retention_days=1 / DAY_S * 25)
    for op, comp, sev, action, msg in ops:
        clock.advance(10)
        if op == "run":
            h.record_run(run("c", Finding("c", comp, sev, msg, action, {"code": msg})))
        elif op == "reboot":
            h.close()
            h = Health.open(path, boot_id=next(boots), clock=clock, retention_days=1 / DAY_S * 25)
        elif op == "reset":
            h.remediation(Action.RESET_GPU, comp, by="t")
        elif op == "retest":
            h.retest_passed(comp, by="t")
        elif op == "set_healthy":
            h.set_healthy(comp, who="t", reason="r")
        elif op == "compact":
            h.compact()  # folds away everything older than 25 s
        elif op == "quarantine":
            h.quarantine(by="gpumon", reason="r", action=action)
        else:
            h.release(by="gpumon", reason="r")
    memory = essence(h)
    h.close()
    assert essence(Health.open(path, boot_id=None, clock=clock)) == memory


# -- issue 14: refreshes in place, old files, a store corrupted under a running daemon -----------


def ib_down(seconds: float, severity: Severity = Severity.WARN) -> Finding:
    return Finding("ib", "ib/mlx5_2/1", severity, f"down now for {seconds:.1f} s", Action.CHECK_CABLES,
                   {"ongoing_outage_s": seconds, "outages": 1})


def test_new_words_for_the_same_severity_refresh_the_stored_event_not_add_rows(tmp_path: Path) -> None:
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock)
    for i in range(25):
        clock.advance(1)
        h.record_run(run("ib", ib_down(float(i))))
    finds = [e for e in h.store.events() if e.check == "ib"]
    assert len(finds) == 1 and finds[0].payload["message"] == "down now for 0.0 s"
    # in memory at once; on disk within REFRESH_INTERVAL_S (10 s), not every second
    assert h.view().node.why[0].message == "down now for 24.0 s"
    stored = next(e for e in h.store.events() if e.check == "ib").latest
    assert stored is not None and 14.0 <= stored["evidence"]["ongoing_outage_s"] < 24.0, stored
    h.close()
    # what a reader (gpumon status, a restart) folds: the newest words, the transition in the history
    view = load_view(tmp_path)
    (fault,) = view.node.why
    assert fault.message == "down now for 24.0 s" and fault.evidence["ongoing_outage_s"] == 24.0
    assert [e.payload["message"] for e in view.history["ib/mlx5_2/1"]] == ["down now for 0.0 s"]
    # a change of severity is a transition again
    again = Health.open(tmp_path, boot_id=B1, clock=clock)
    clock.advance(1)
    assert len(again.record_run(run("ib", ib_down(25.0, Severity.FAIL)))) == 1
    again.close()


def test_a_file_from_before_the_latest_column_is_read_and_upgraded(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.executescript("""
        PRAGMA journal_mode=WAL;
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, boot_id TEXT NOT NULL,
            kind TEXT NOT NULL, component TEXT NOT NULL, check_name TEXT NOT NULL, payload TEXT NOT NULL,
            last_seen REAL);
        CREATE INDEX events_time ON events (time);
        CREATE TABLE snapshot (id INTEGER PRIMARY KEY CHECK (id = 1), upto_id INTEGER NOT NULL,
            time REAL NOT NULL, payload TEXT NOT NULL);
        PRAGMA user_version=1;
    """)
    event = finding_event(xid79(), time=NOW, boot_id=B1)
    db.execute("INSERT INTO events (time, boot_id, kind, component, check_name, payload)"
               " VALUES (?,?,?,?,?,?)",
               (event.time, B1, "finding", "gpu/3", "xid", json.dumps(dict(event.payload))))
    db.commit()
    db.close()
    assert load_view(tmp_path).node.action is Action.REBOOT_NODE  # read-only: as it is
    h = Health.open(tmp_path, boot_id=B1, clock=Clock())
    assert h.error is None and h.view().node.action is Action.REBOOT_NODE
    h.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert "latest" in [row[1] for row in db.execute("PRAGMA table_info(events)")]
    db.close()


def test_a_store_corrupted_under_a_running_daemon_starts_afresh_from_memory(tmp_path: Path) -> None:
    """The file is overwritten between two writes (the store reconnects after any failure): the
    daemon's Health sets it aside and seeds a fresh store with the state it holds in memory."""
    clock = Clock()
    h = Health.open(tmp_path, boot_id=B1, clock=clock, recover=True)
    h.record_run(run("xid", xid79()))
    h.record_run(run("throttle", warn(2, "SW thermal")))
    memory = essence(h)
    h.store.close()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"{DB_NAME}{suffix}").unlink(missing_ok=True)
    garbage = os.urandom(8192)
    (tmp_path / DB_NAME).write_bytes(garbage)
    clock.advance(5)
    h.record_run(run("throttle", warn(4, "SW thermal")))
    assert h.error is None
    (aside,) = tmp_path.glob(f"{DB_NAME}.corrupt-*")
    assert aside.read_bytes() == garbage
    f = h.store_finding()
    assert f.severity is Severity.WARN and "was corrupt" in f.message and str(aside) in f.message
    view = h.view()
    assert view.components["gpu/3"].action is Action.REBOOT_NODE  # from memory, not lost
    assert view.components["gpu/4"].level is Level.DEGRADED
    h.close()
    again = Health.open(tmp_path, boot_id=B1, clock=clock, recover=True)
    assert essence(again)[:2] == memory[:2]
    assert again.view().components["gpu/4"].level is Level.DEGRADED
    assert again.store_finding().severity is Severity.WARN  # a day long, across restarts
    clock.advance(DAY_S)
    assert again.store_finding().severity is Severity.OK
    again.close()
