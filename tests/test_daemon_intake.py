"""The daemon's intake socket (gpumon.intake) and the guard's hand-over over it (gpumon.guard.handover,
checks/guard/intake.py), on a real ``gpumon daemon`` of a simulated node: NVML is the injection
library, whose GPUs list the compute processes the scenario puts there (``compute_process``), so the
daemon attests a verdict by the sender's real pid (SO_PEERCRED) against that list. Senders of other
users are real processes started as those users (root runs these tests, as CI does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env
from gpumon.guard import verdict as vf
from gpumon.guard.handover import SOCKET_ENV
from gpumon.intake import MAX_CONNECTIONS, IntakeServer, IntakeUnavailable, check_directory
from gpumon.intake_protocol import IntakeReply
from gpumon.sim.nvml_state import read_state

NOBODY = 65534
NAMELESS = 12345  # a uid no passwd entry names
PER_UID = 20  # daemon.intake_per_uid_per_min of the node below
# A sender of another uid: the guard's own client, the document on stdin, one reply per send. It
# becomes that user itself, once Python has started: the tests' interpreter may live where only root
# can read (pyenv under /root), and the kernel names a socket's peer by its credentials at connect().
CLIENT = r"""
import json, os, sys
from gpumon.guard import handover
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
ask = json.load(sys.stdin)
out = []
for _ in range(ask["times"]):
    try:
        out.append(handover.send(ask["check"], ask["document"]).to_json())
    except handover.Unreachable as exc:
        out.append({"unreachable": str(exc)})
print(json.dumps(out))
"""


# A sender whose pid NVML lists on a GPU, that hands its verdict over through a child it forked after
# connecting, and exits first: the kernel names the connecting process, now gone (its pid could be
# anyone's next). It waits for the socket and the document on stdin; the child prints the reply.
FORKER = r"""
import json, os, socket, sys, time
path, document = json.loads(sys.stdin.readline())
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
if os.fork():
    os._exit(0)
time.sleep(0.5)
s.sendall(json.dumps({"check": "guard", "document": document}).encode() + b"\n")
print(s.makefile().readline(), end="", flush=True)
"""


def as_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("these tests start senders as other users: CI runs them as root")
        pytest.skip("needs root: the senders run as other users")


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    forker: subprocess.Popen[str]
    sock: Path
    spool: Path
    metrics: str
    uuids: list[str]
    log: Path


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    """One daemon for the module: GPU 1 lists this test process as a compute process, GPU 2 the
    FORKER, GPU 3 pid 1.
    Its socket's directory is under a 0755 one, so that senders of other users can reach it (pytest's
    own tmp tree is 0700), and holds a stale socket of a dead daemon, which the daemon replaces."""
    base = Path(tempfile.mkdtemp(prefix="gpumon-intake-"))
    os.chmod(base, 0o755)
    run = base / "run"
    run.mkdir(mode=0o755)
    sock = run / "intake.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()
    forker = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    scenario = base / "intake-8xh100.yaml"
    scenario.write_text("name: intake-8xh100\nsku: h100-sxm\ngpus: 8\nfaults:\n"
                        f"  - {{at_s: 0, kind: compute_process, gpu: 1, pid: {os.getpid()}, "
                        "memory_mib: 512}\n"
                        f"  - {{at_s: 0, kind: compute_process, gpu: 2, pid: {forker.pid}}}\n"
                        "  - {at_s: 0, kind: compute_process, gpu: 3, pid: 1}\n")
    cfg = base / "gpumon.yaml"
    cfg.write_text(f"daemon:\n  intake_socket: {sock}\n  intake_per_uid_per_min: {PER_UID}\n")
    log = base / "daemon.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate",
                                 str(scenario), "--sim-dir", str(base / "sim"), "--listen", "127.0.0.1:0",
                                 "--duration", "300"], stdout=subprocess.DEVNULL, stderr=err, env=clean_env())
    try:
        deadline, port = time.monotonic() + 60, None
        while port is None or not sock.is_socket() or "intake on unix:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
            found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text())
            port = int(found.group(1)) if found else None
        uuids = [g.uuid for g in read_state(base / "sim" / "nvml-state.txt").gpus]
        spool = base / "sim" / "host" / "var/lib/gpumon/guard"
        yield Node(proc, forker, sock, spool, f"http://127.0.0.1:{port}/metrics", uuids, log)
    finally:
        forker.kill()
        forker.communicate(timeout=30)
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)


def verdict(uuid: str | None, fault: str = "persistent", rank: int = 0) -> vf.Verdict:
    who = vf.Identity(rank=rank, world_size=8, host="sim-node", node_name="sim-node",
                      node_name_source="NODE_NAME", local_rank=rank, device="cuda:1" if uuid else "cpu",
                      gpu_uuid=uuid,
                      gpu_note="resolved through NVML by UUID" if uuid else "device cpu: no GPU")
    t = time.time()
    return vf.Verdict(check="weights", fault=fault, step=7, message="weights differ", subject=who,
                      evidence={"first_parameter": "w"}, job="slurm:1", time=t, id=vf.new_id(who, t))


def raw(sock: Path, data: bytes, *, shut: bool = True, timeout: float = 10.0) -> dict[str, Any]:
    """Send ``data`` as it is and read the one-line reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        try:
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon stopped reading (too large): its reply is still there to read
        return reply_of(s)


def reply_of(s: socket.socket) -> dict[str, Any]:
    got = b""
    while not got.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    answer: dict[str, Any] = json.loads(got)
    return answer


def as_user(uid: int, sock: Path, check: str, document: dict[str, Any],
            times: int = 1) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-c", CLIENT, str(uid)],
                          input=json.dumps({"check": check, "document": document, "times": times}),
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env={**clean_env(), SOCKET_ENV: str(sock)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    replies: list[dict[str, Any]] = json.loads(proc.stdout)
    return replies


def stored(node: Node, verdict_id: str) -> tuple[Path, dict[str, Any]]:
    """The file the intake put into the spool (the daemon's guard check may have judged it and
    moved it to judged/ since: a rename, so it is in one of the two)."""
    for _ in range(50):
        for path in (node.spool / f"{verdict_id}.json", node.spool / "judged" / f"{verdict_id}.json"):
            with contextlib.suppress(FileNotFoundError):
                data: dict[str, Any] = json.loads(path.read_text())
                return path, data
        time.sleep(0.1)
    raise AssertionError(f"{verdict_id} is not in {node.spool}")


def test_the_socket_is_open_to_every_local_user_in_a_directory_only_the_daemon_writes(node: Node) -> None:
    assert stat.S_IMODE(node.sock.stat().st_mode) == 0o666 and node.sock.is_socket()  # the stale one replaced
    assert stat.S_IMODE(node.sock.parent.stat().st_mode) == 0o755 and node.sock.parent.stat().st_uid == 0


def test_a_verdict_handed_over_by_the_process_on_its_gpu_is_attested(
        node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from gpumon.guard.core import hand_over

    monkeypatch.setenv(SOCKET_ENV, str(node.sock))
    caplog.set_level(logging.WARNING, logger="gpumon.guard")
    v = verdict(node.uuids[1])
    files: list[Path] = []
    hand_over(v, tmp_path / "spool", files)
    assert files == [] and not (tmp_path / "spool").exists()  # the daemon has it: no spool file
    assert "rank 0: verdict handed to this node's daemon (attested)" in caplog.text, caplog.text
    path, data = stored(node, v.id)
    attestation = data.pop("attestation")
    assert vf.Verdict.from_json(data) == v
    assert attestation["attested"] is True and attestation["gpu_index"] == 1
    assert attestation["peer"]["pid"] == os.getpid() and attestation["peer"]["uid"] == os.geteuid()
    assert os.getpid() in [p["pid"] for p in attestation["processes"]]
    st = path.stat()  # root's: the one owner the guard check trusts, which no user can fake in the spool
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    assert stat.S_IMODE(node.spool.stat().st_mode) == 0o1777  # made as the jobs need it


def test_a_verdict_for_a_gpu_its_sender_does_not_use_is_taken_but_not_attested(node: Node) -> None:
    as_root()
    v = verdict(node.uuids[3])
    (reply,) = as_user(NOBODY, node.sock, "guard", v.to_json())
    assert reply["accepted"] is True and reply["attested"] is False, reply
    assert f"uid {NOBODY} (nobody)" in reply["message"] and "no compute context on GPU 3" in reply["message"]
    assert "NVML lists pid(s) 1" in reply["message"]
    path, data = stored(node, v.id)
    attestation = data["attestation"]
    assert attestation["attested"] is False and attestation["peer"]["uid"] == NOBODY
    assert attestation["peer"]["user"] == "nobody" and attestation["processes"] == [
        {"pid": 1, "used_memory_bytes": None}]
    assert path.stat().st_uid == NOBODY  # judged as nobody's own file: a warning, within its cap


def test_the_daemon_confirms_an_attested_verdict_and_warns_on_a_forged_one(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through the daemon's guard check and /metrics: the verdict this process (on GPU 1)
    hands over takes the node out to be confirmed on GPU 1 (confirm_sdc: the canary waits while this
    process holds the GPU; tests/guard/test_guard_confirm.py has what follows); nobody's "persistent"
    verdict for GPU 4, over the socket and as a file of its own in the spool, is a warning on GPU 4
    and asks nothing (before: fail, the RMA path)."""
    from gpumon.guard.core import hand_over

    as_root()
    monkeypatch.setenv(SOCKET_ENV, str(node.sock))
    attested = verdict(node.uuids[1])
    hand_over(attested, node.spool, [])
    (reply,) = as_user(NOBODY, node.sock, "guard", verdict(node.uuids[4]).to_json())
    assert reply["attested"] is False
    forged = verdict(node.uuids[4], rank=3)
    path = vf.write(forged, node.spool)
    os.chown(path, NOBODY, NOBODY)
    confirming = 'gpumon_recommended_action{action="confirm_sdc",component="gpu/1"} 1.0'
    warn = 'gpumon_finding_severity{check="guard",component="gpu/4"} 3.0'
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(node.metrics, timeout=10) as r:
            text = r.read().decode()
        if confirming in text and warn in text:
            assert 'gpumon_recommended_action{action="none",component="gpu/4"} 1.0' in text
            break
        assert time.monotonic() < deadline, [line for line in text.splitlines() if 'check="guard"' in line]
        time.sleep(0.5)


def test_a_sender_gone_before_its_verdict_is_judged_is_not_attested(node: Node) -> None:
    """Its pid is still in NVML's list (as a new process's could be once the pid is reused)."""
    v = verdict(node.uuids[2])
    assert node.forker.stdin is not None and node.forker.stdout is not None
    node.forker.stdin.write(json.dumps([str(node.sock), v.to_json()]) + "\n")
    node.forker.stdin.flush()
    assert node.forker.wait(timeout=30) == 0  # the process that connected is gone
    reply = json.loads(node.forker.stdout.readline())
    assert reply["accepted"] is True and reply["attested"] is False, reply
    assert f"pid {node.forker.pid}" in reply["message"] and "exited before its verdict was judged" \
        in reply["message"], reply
    _, data = stored(node, v.id)
    assert data["attestation"]["attested"] is False and data["attestation"]["peer"]["pid"] == node.forker.pid


def test_a_cpu_ranks_verdict_is_not_attestable(node: Node) -> None:
    as_root()
    (reply,) = as_user(NOBODY, node.sock, "guard", verdict(None).to_json())
    assert reply["accepted"] is True and reply["attested"] is False
    assert "names no GPU (device cpu: no GPU)" in reply["message"], reply


@pytest.mark.parametrize(("sent", "said"), [
    (b"{not json\n", "not JSON"),
    (b'{"check": "guard", "document": {"n": ' + b"9" * 5000 + b"}}", "not JSON this daemon reads"),
    (b'{"check": "guard", "document": {"pad": "' + b"a" * (2 << 20) + b'"}}\n', "larger than 1048576 bytes"),
    (b'{"check": "nope", "document": {}}', "no check named 'nope'"),
    (b'{"check": "xid", "document": {}}', "check 'xid' takes no documents"),
    (b'{"check": "guard", "document": {"format": "gpumon-guard-verdict", "version": 1}}',
     "not a guard verdict this daemon reads"),
    (b'["check", "guard"]', "must be one JSON object"),
    (b"", "empty request"),
])
def test_junk_is_refused_with_the_reason_and_the_daemon_serves_on(node: Node, sent: bytes, said: str) -> None:
    reply = raw(node.sock, sent)
    assert reply["accepted"] is False and reply["attested"] is False and said in reply["message"], reply
    assert node.proc.poll() is None
    with urllib.request.urlopen(node.metrics, timeout=10) as r:
        assert r.status == 200 and b"gpumon_" in r.read()


def test_silent_clients_are_bounded_in_time_and_number(node: Node) -> None:
    time.sleep(0.3)  # the slots of the tests before are free again
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in silent:
            s.settimeout(10)
            s.connect(str(node.sock))
        time.sleep(0.3)
        busy = raw(node.sock, b'{"check": "nope", "document": {}}')
        assert busy["accepted"] is False and "busy" in busy["message"], busy
        started = time.monotonic()
        for s in silent:
            reply = reply_of(s)
            assert reply["accepted"] is False and "no complete request within 2 s" in reply["message"], reply
        assert time.monotonic() - started < 5
    finally:
        for s in silent:
            s.close()
    assert node.proc.poll() is None


def test_each_uid_is_rate_limited_on_its_own(node: Node) -> None:
    as_root()
    replies = as_user(NAMELESS, node.sock, "nope", {}, times=PER_UID + 1)
    assert all("no check named 'nope'" in r["message"] for r in replies[:PER_UID]), replies
    last = replies[PER_UID]
    assert last["accepted"] is False
    assert f"more than {PER_UID} requests from uid {NAMELESS}" in last["message"], last
    # another uid is served meanwhile
    assert "no check named" in raw(node.sock, b'{"check": "nope", "document": {}}')["message"]
    assert node.proc.poll() is None


def test_a_client_that_asks_again_as_soon_as_it_is_answered_is_never_told_busy(tmp_path: Path) -> None:
    """One slot, one client asking 200 times in a row: each answer comes after its slot is free, so
    the next request never finds the daemon busy with the last (a guard's retries, a busy machine)."""
    as_root()
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    served: list[str] = []

    def handle(name: str, document: dict[str, Any], peer: Any) -> IntakeReply:
        served.append(name)
        return IntakeReply(True)

    server = IntakeServer(d / "intake.sock", handle, per_uid_per_min=1000, max_connections=1)
    try:
        replies = [raw(d / "intake.sock", b'{"check": "c", "document": {}}') for _ in range(200)]
    finally:
        server.stop()
    busy = [r for r in replies if not r["accepted"]]
    assert not busy and len(served) == 200, busy[:3]


def test_without_a_daemon_the_guard_writes_its_spool_file_as_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from gpumon.guard.core import hand_over

    caplog.set_level(logging.WARNING, logger="gpumon.guard")
    dead = tmp_path / "dead.sock"  # a socket nobody listens on: a daemon that died
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(dead))
    for where, why in ((tmp_path / "absent.sock", "no socket at"), (dead, "nothing listens on")):
        monkeypatch.setenv(SOCKET_ENV, str(where))
        v = verdict("GPU-00000000-1111-2222-3333-444444444444")
        files: list[Path] = []
        caplog.clear()
        hand_over(v, tmp_path / "spool", files)
        assert files == [tmp_path / "spool" / f"{v.id}.json"] and vf.read(files[0]) == v
        assert f"verdict written for this node's daemon: {files[0]}" in caplog.text
        assert f"could not reach this node's daemon: {why} {where}" in caplog.text, caplog.text


def test_the_daemon_refuses_a_socket_in_a_directory_others_may_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    cfg = tmp_path / "gpumon.yaml"
    cfg.write_text(f"daemon:\n  intake_socket: {shared / 'intake.sock'}\n")
    proc = subprocess.run([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate",
                           "healthy-8xh100", "--sim-dir", str(tmp_path / "sim"), "--listen", "127.0.0.1:0",
                           "--duration", "5"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert f"daemon.intake_socket {shared / 'intake.sock'}: its directory {shared} is writable by others" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (shared / "intake.sock").exists()


def test_a_socket_directory_of_another_owner_a_live_socket_or_a_file_are_refused(tmp_path: Path) -> None:
    as_root()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(IntakeUnavailable, match=f"owned by uid {NOBODY}"):
        check_directory(theirs)
    (tmp_path / "file").write_text("")
    with pytest.raises(IntakeUnavailable, match="exists and is not a socket"):
        IntakeServer(tmp_path / "file", lambda *_: pytest.fail("no request"), per_uid_per_min=1)
    assert (tmp_path / "file").read_text() == ""  # left where it was
    live = IntakeServer(tmp_path / "live.sock", lambda *_: pytest.fail("no request"), per_uid_per_min=1)
    try:
        with pytest.raises(IntakeUnavailable, match="another process serves"):
            IntakeServer(tmp_path / "live.sock", lambda *_: pytest.fail("no request"), per_uid_per_min=1)
        assert (tmp_path / "live.sock").is_socket()
    finally:
        live.stop()
    assert not (tmp_path / "live.sock").exists()  # removed with its server
