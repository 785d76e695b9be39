"""The Slurm backend and the HealthCheckProgram wrapper against a real Slurm 22.05 on loopback.

The module fixture starts munged, slurmctld and three slurmd (gpu01..gpu03, all
``NodeHostname=localhost`` on their own ports) from the Debian packages
``slurm-wlm`` and ``munge``, with every file (config, munge key and socket,
state, spool, logs) in a temporary directory and ``SLURM_CONF`` pointing the
tools at it: nothing global is touched. No GRES: draining does not depend on it.

A broken or odd Slurm (tool missing, controller down, output we cannot parse)
is played by the real tools with a bad config, or by small scripts standing in
for ``sinfo``/``scontrol`` on a private search path; gpumon's own code runs
unpatched throughout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from slurm_conf import common_lines

from gpumon.hw.tools import ToolRunner
from gpumon.model import Action
from gpumon.remediate.base import OWNER_PREFIX, SchedulerBackend
from gpumon.remediate.slurm import (
    MAX_REASON_BYTES,
    SlurmBackend,
    SlurmError,
    drain_reason,
    parse_sinfo,
    reason_action,
    state_flags,
)

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "contrib" / "slurm-healthcheck.sh"
NODES = ("gpu01", "gpu02", "gpu03")
# slurmctld and slurmd live in /usr/sbin, which a non-login PATH may lack
SBIN_PATH = os.pathsep.join(
    p for p in (os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin") if p)
OPERATOR_REASON = "maintenance: PSU swap"


def _require(*tools: str) -> dict[str, str]:
    found = {t: shutil.which(t, path=SBIN_PATH) for t in tools}
    missing = sorted(t for t, p in found.items() if p is None)
    if missing:
        why = (f"{', '.join(missing)} not installed (Debian packages slurm-wlm and munge: "
               "apt-get install slurm-wlm munge)")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; .ci/run must install them")
        pytest.skip(why)
    return {t: p for t, p in found.items() if p is not None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class Slurm:
    conf: Path
    env: dict[str, str]
    dir: Path

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True, timeout=30)

    def drained(self) -> dict[str, tuple[str, str]]:
        """``sinfo -R`` as DESIGN.md reads drains back: node -> (state, reason)."""
        proc = self.run("sinfo", "-R", "-h", "-o", "%N|%T|%E")
        assert proc.returncode == 0, proc.stderr
        out: dict[str, tuple[str, str]] = {}
        for line in proc.stdout.splitlines():
            names, state, reason = line.split("|", 2)
            for name in self.run("scontrol", "show", "hostnames", names).stdout.split():
                out[name] = (state, reason)
        return out

    def state(self, node: str) -> str:
        proc = self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T")
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split("\n", 1)[0].strip()

    def wait(self, node: str, ok: Callable[[str], bool], timeout: float = 15) -> str:
        # slurmctld applies a resume right away, but the node's state passes
        # through the next registration/ping; DESIGN.md: poll ~1 s.
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.state(node)
            if ok(state):
                return state
            time.sleep(0.2)
        raise AssertionError(f"{node} stayed {state!r}")

    def operator(self, node: str, state: str = "DRAIN", reason: str = OPERATOR_REASON) -> None:
        proc = self.run("scontrol", "update", f"NodeName={node}", f"State={state}", f"Reason={reason}")
        assert proc.returncode == 0, proc.stderr

    def reset(self, node: str) -> None:
        """Back to idle with no reason, whoever drained it."""
        if self.state(node).rstrip("*") != "idle":
            self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
            self.wait(node, lambda s: s == "idle")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.dir.glob("*.log")))


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    exe = _require("munged", "slurmctld", "slurmd", "scontrol", "sinfo")
    # munged and slurmd listen on Unix sockets in here, and a socket path is
    # limited to 107 bytes: pytest's deep tmp_path could pass that on a CI runner.
    base = Path(tempfile.mkdtemp(prefix="gpumon-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        yield from _run_cluster(base, exe)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_cluster(base: Path, exe: dict[str, str]) -> Iterator[Slurm]:
    for sub in ("state", "spool"):  # slurmd creates spool/<node> but not its parent
        (base / sub).mkdir()
    munge_dir = base / "munge"
    munge_dir.mkdir(mode=0o755)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)  # munged refuses a key others can read
    sock = munge_dir / "munge.socket"
    ctld_port = _free_port()
    node_ports = {n: _free_port() for n in NODES}
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=gpumontest",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        *common_lines(base, sock),
        *(f"NodeName={n} NodeHostname=localhost Port={p} CPUs=1 RealMemory=100 State=UNKNOWN"
          for n, p in node_ports.items()),
        f"PartitionName=main Nodes={','.join(NODES)} Default=YES State=UP",
        "",
    ]))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SBIN_PATH}
    procs: list[subprocess.Popen[bytes]] = []
    cluster = Slurm(conf, env, base)

    def start(*argv: str, log: str) -> None:
        with open(base / log, "wb") as out:
            procs.append(subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))

    try:
        start(exe["munged"], "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
              f"--log-file={base / 'munged-file.log'}", f"--pid-file={munge_dir / 'munged.pid'}",
              f"--seed-file={munge_dir / 'munged.seed'}", log="munged.log")
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        start(exe["slurmctld"], "-D", "-i", "-f", str(conf), log="slurmctld.out.log")
        for n in NODES:
            start(exe["slurmd"], "-D", "-N", n, "-f", str(conf), log=f"slurmd-{n}.out.log")
        deadline = time.monotonic() + 40
        while True:
            assert all(p.poll() is None for p in procs), "a Slurm daemon exited:\n" + cluster.logs()
            proc = cluster.run("sinfo", "-h", "-N", "-o", "%N|%T")
            states = dict(line.split("|", 1) for line in proc.stdout.split()) if proc.returncode == 0 else {}
            if all(states.get(n) == "idle" for n in NODES):
                break
            assert time.monotonic() < deadline, f"nodes not idle: {states}\n{cluster.logs()}"
            time.sleep(0.3)
        yield cluster
    finally:
        # slurmd first, then the controller, munged last (both talk to it on the way out)
        for p in reversed(procs):
            _stop(p)


def _backend(slurm: Slurm, node: str = "gpu01", clock: Callable[[], float] = time.time) -> SlurmBackend:
    return SlurmBackend(node, ToolRunner(default_timeout=20), slurm_conf=str(slurm.conf), clock=clock)


# -- against the real controller --------------------------------------------------------------


def test_backend_satisfies_the_protocol(slurm: Slurm) -> None:
    backend: SchedulerBackend = _backend(slurm)
    assert backend.name == "slurm"
    assert backend.current().out is False


def test_drain_read_back_with_sinfo_and_resume_after_retest(slurm: Slurm) -> None:
    backend = _backend(slurm, "gpu01")
    summary = 'Xid 79 on gpu/3 | "fell off the bus" — ünïcode\nsecond line'
    try:
        observed = backend.take_out(Action.RESET_GPU, summary, dry_run=True)
        assert observed.done and observed.changes and "State=DRAIN" in observed.changes[0]
        assert "gpu01" not in slurm.drained(), "observe mode changed the node"

        before = time.time()
        outcome = backend.take_out(Action.RESET_GPU, summary, dry_run=False)
        assert outcome.done, outcome.detail
        state, reason = slurm.drained()["gpu01"]
        assert state == "drained"
        assert reason == 'gpumon: reset_gpu: Xid 79 on gpu/3 | "fell off the bus" — ünïcode second line'
        now = backend.current()
        assert now.out and now.by_gpumon and now.reason == reason
        assert now.since is not None and before - 2 <= now.since <= time.time() + 2

        # the same action again changes nothing (the reason time stays, see fleet_share)
        again = backend.take_out(Action.RESET_GPU, "another summary", dry_run=False)
        assert again.done and not again.changes
        assert slurm.drained()["gpu01"][1] == reason
        # a worse action is written over gpumon's own reason
        worse = backend.take_out(Action.INSPECT_HARDWARE, "row remap failed", dry_run=False)
        assert worse.done and worse.changes
        assert slurm.drained()["gpu01"][1] == "gpumon: inspect_hardware: row remap failed"

        # the retest passed: lift it
        assert backend.bring_back("bootstrap retest passed", dry_run=True).done
        assert "gpu01" in slurm.drained(), "observe mode resumed the node"
        lifted = backend.bring_back("bootstrap retest passed", dry_run=False)
        assert lifted.done and lifted.changes == ["scontrol update NodeName=gpu01 State=RESUME"], lifted
        slurm.wait("gpu01", lambda s: s == "idle")
        assert "gpu01" not in slurm.drained()
        assert backend.current().out is False
        # nothing left to lift: done, no change
        idle = backend.bring_back("again", dry_run=False)
        assert idle.done and not idle.changes
    finally:
        slurm.reset("gpu01")


def test_an_operators_drain_is_never_touched(slurm: Slurm) -> None:
    backend = _backend(slurm, "gpu02")
    try:
        slurm.operator("gpu02")
        now = backend.current()
        assert now.out and not now.by_gpumon and now.reason == OPERATOR_REASON
        lift = backend.bring_back("retest passed", dry_run=False)
        assert not lift.done and not lift.changes and OPERATOR_REASON in lift.detail
        # nor is it taken over: our reason would make it ours to resume later
        take = backend.take_out(Action.REBOOT_NODE, "Xid 79", dry_run=False)
        assert not take.done and not take.changes
        assert slurm.drained()["gpu02"] == ("drained", OPERATOR_REASON)
        time.sleep(1.0)  # a resume, had one been sent, shows within ~1 s
        assert slurm.drained()["gpu02"] == ("drained", OPERATOR_REASON)
    finally:
        slurm.reset("gpu02")


def test_an_operators_down_counts_as_out_and_is_left_alone(slurm: Slurm) -> None:
    backend = _backend(slurm, "gpu03")
    try:
        slurm.operator("gpu03", "DOWN", "ops: reseat cable")
        now = backend.current()
        assert now.out and not now.by_gpumon and now.reason == "ops: reseat cable"
        assert not backend.take_out(Action.RESET_GPU, "x", dry_run=False).done
        # an operator's drain on top of DOWN (scontrol: DOWN+DRAIN) is still theirs
        slurm.operator("gpu03", "DRAIN", "ops: reseat cable")
        assert "DOWN+DRAIN" in slurm.run("scontrol", "show", "node", "-o", "gpu03").stdout
        assert not backend.bring_back("retest", dry_run=False).done
        assert slurm.drained()["gpu03"][1] == "ops: reseat cable"
    finally:
        slurm.reset("gpu03")


def test_fleet_share_counts_only_gpumons_recent_drains(slurm: Slurm) -> None:
    try:
        assert _backend(slurm, "gpu01").take_out(Action.REBOOT_NODE, "Xid 79", dry_run=False).done
        slurm.operator("gpu02")
        share = _backend(slurm, "gpu03").fleet_share(600)
        assert (share.taken_out_recently, share.total) == (1, 3)
        # an hour later the same drain is outside a 10 min window
        later = _backend(slurm, "gpu03", clock=lambda: time.time() + 3600).fleet_share(600)
        assert (later.taken_out_recently, later.total) == (0, 3)
    finally:
        slurm.reset("gpu01")
        slurm.reset("gpu02")


def test_unknown_node_is_an_error_not_a_healthy_node(slurm: Slurm) -> None:
    backend = _backend(slurm, "gpu99")
    with pytest.raises(SlurmError, match="not known to Slurm"):
        backend.current()
    out = backend.take_out(Action.RESET_GPU, "x", dry_run=False)
    assert not out.done and "not known" in out.detail


def test_controller_down_is_not_done_with_slurms_message(slurm: Slurm, tmp_path: Path) -> None:
    # the same cluster seen through a port where no slurmctld listens; a short
    # MessageTimeout keeps Slurm's own retries to about a second
    text = slurm.conf.read_text()
    bad = tmp_path / "slurm.conf"
    bad.write_text("MessageTimeout=2\n" + "\n".join(
        f"SlurmctldPort={_free_port()}" if line.startswith("SlurmctldPort=") else line
        for line in text.splitlines()) + "\n")
    backend = SlurmBackend("gpu01", ToolRunner(default_timeout=20), slurm_conf=str(bad))
    for outcome in (backend.take_out(Action.RESET_GPU, "x", dry_run=False),
                    backend.bring_back("x", dry_run=False)):
        assert not outcome.done and not outcome.changes
        assert "Unable to contact slurm controller" in outcome.detail, outcome.detail
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        backend.fleet_share(600)


# -- without a controller ----------------------------------------------------------------------


def test_missing_scontrol_and_sinfo_is_an_outcome_not_a_crash() -> None:
    backend = SlurmBackend("gpu01", ToolRunner(default_timeout=5, search_path=""))
    for outcome in (backend.take_out(Action.RESET_GPU, "x", dry_run=False),
                    backend.take_out(Action.RESET_GPU, "x", dry_run=True),
                    backend.bring_back("x", dry_run=False)):
        assert not outcome.done and "not installed" in outcome.detail, outcome
    with pytest.raises(SlurmError, match="not installed"):
        backend.current()
    with pytest.raises(SlurmError, match="not installed"):
        backend.fleet_share(600)


def _tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("sinfo_output", [
    "this is not sinfo output\n",  # a wrapper or a newer sinfo printing something else
    "gpu01|drained|yesterday-ish|gpumon: reset_gpu: x\n",  # a time format we did not ask for
    "gpu[01-02]|drained|2026-01-01T00:00:00|x\n",  # an unexpanded hostlist: --Node was ignored
    "",  # no line for our node
])
def test_unparsable_output_never_drains_or_resumes(tmp_path: Path, sinfo_output: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "sinfo.out").write_text(sinfo_output)
    _tool(bindir, "sinfo", f"cat '{tmp_path / 'sinfo.out'}'")
    marker = tmp_path / "scontrol-called"
    _tool(bindir, "scontrol", f"touch '{marker}'")
    backend = SlurmBackend("gpu01", ToolRunner(default_timeout=5, search_path=str(bindir)))
    with pytest.raises(SlurmError):
        backend.current()
    take = backend.take_out(Action.RESET_GPU, "x", dry_run=False)
    back = backend.bring_back("x", dry_run=False)
    assert not take.done and not back.done
    assert not marker.exists(), "scontrol ran although the node's state was unreadable"


def test_a_hung_sinfo_is_bounded(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "sinfo", "exec sleep 30")
    backend = SlurmBackend("gpu01", ToolRunner(default_timeout=20, search_path=str(bindir)), timeout_s=0.5)
    start = time.monotonic()
    outcome = backend.take_out(Action.RESET_GPU, "x", dry_run=False)
    assert not outcome.done and "did not finish within 0.5 s" in outcome.detail
    assert time.monotonic() - start < 5


# Lines captured from this Slurm 22.05.8 while writing the backend (sinfo
# --Node --format='%N|%T|%H|%E' and scontrol's State= field): a node draining
# under a running job, DOWN+DRAIN, no reason.
CAPTURED = (
    "gpu01|draining|2026-11-29T23:41:58|gpumon: x: y\n"
    "gpu02|idle|Unknown|none\n"
    "gpu03|drained*|2026-11-29T23:40:09|gpumon: reset_gpu: Xid 79 on gpu/3 | \"fell off\" the bus — ünïcode\n"
    "gpu03|drained*|2026-11-29T23:40:09|gpumon: reset_gpu: listed again for a second partition\n"
    "gpu04|down*|2026-11-29T23:41:59|Not responding\n"
    "gpu05|idle|2026-11-29T23:41:59|none\n"
)


def test_parse_captured_sinfo_lines() -> None:
    nodes = {n.name: n for n in parse_sinfo(CAPTURED)}
    assert list(nodes) == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu05"]
    assert nodes["gpu01"].drained and nodes["gpu01"].by_gpumon
    assert not nodes["gpu02"].out and nodes["gpu02"].reason == "" and nodes["gpu02"].reason_time is None
    gpu03 = nodes["gpu03"]
    assert gpu03.drained and gpu03.reason.endswith('| "fell off" the bus — ünïcode')
    assert gpu03.reason_time == 1795995609.0  # 2026-11-29T23:40:09 UTC
    assert nodes["gpu04"].out and not nodes["gpu04"].drained and not nodes["gpu04"].by_gpumon
    assert nodes["gpu05"].reason == "none", "a reason that really says none has a time"
    for scontrol_state in ("IDLE+DRAIN", "ALLOCATED+DRAIN", "DOWN+DRAIN+NOT_RESPONDING", "MIXED+DRAIN"):
        assert "drain" in state_flags(scontrol_state)
    assert state_flags("idle~") == {"idle"} and state_flags("drng") == {"drng"}


def test_reason_is_one_line_owned_and_capped() -> None:
    assert drain_reason(Action.REBOOT_NODE, "") == "gpumon: reboot_node"
    long = drain_reason(Action.RESET_GPU, "ü" * 500)
    assert len(long.encode()) <= MAX_REASON_BYTES and long.endswith("...")
    assert long.startswith(f"{OWNER_PREFIX}: reset_gpu: ü")
    assert drain_reason(Action.RESET_GPU, "a\tb\r\nc\x1bd") == "gpumon: reset_gpu: a b c d"
    assert reason_action("gpumon: reset_gpu: x: y") == "reset_gpu"
    assert reason_action("maintenance: gpumon: x") is None


def test_a_node_list_is_refused_as_node_name() -> None:
    from gpumon.errors import ConfigError

    for bad in ("gpu[01-64]", "gpu01,gpu02", "gpu01 gpu02", "", "-x"):
        with pytest.raises(ConfigError):
            SlurmBackend(bad, ToolRunner(default_timeout=5))


# -- contrib/slurm-healthcheck.sh --------------------------------------------------------------


def _hc_env(slurm: Slurm, tmp_path: Path, bindir: Path, defaults: str = "", **extra: str) -> dict[str, str]:
    """What slurmd gives a HealthCheckProgram (only SLURMD_NODENAME, seen on 22.05.8), plus
    the test's config and a PATH with the stand-in gpumon; the wrapper appends system dirs."""
    (tmp_path / "defaults").write_text(defaults)
    return {"SLURMD_NODENAME": "gpu03", "SLURM_CONF": str(slurm.conf), "PATH": str(bindir),
            "GPUMON_HC_DEFAULTS": str(tmp_path / "defaults"), "TMPDIR": str(tmp_path), **extra}


def _run_wrapper(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # /bin/sh is dash on Debian: a POSIX shell, not bash
    return subprocess.run(["/bin/sh", str(WRAPPER)], env=env, capture_output=True, text=True, timeout=60)


def test_wrapper_drains_with_gpumons_reason_on_exit_2(slurm: Slurm, tmp_path: Path) -> None:
    # `gpumon` here is gpumon itself (on a simulated faulty node), reached
    # through a shim because the venv is not on the system PATH
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", f'exec "{sys.executable}" -m gpumon "$@"')
    report = subprocess.run([sys.executable, "-m", "gpumon", "check", "--json", "--simulate",
                             "faulty-8xh100"], capture_output=True, text=True, timeout=60)
    assert report.returncode == 2
    fails = [f for f in json.loads(report.stdout)["findings"] if f["severity"] == "fail"]
    worst = max(Action(f["action"]) for f in fails)
    try:
        env = _hc_env(slurm, tmp_path, bindir, defaults='GPUMON_ARGS="--simulate faulty-8xh100"\n')
        proc = _run_wrapper(env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        state, reason = slurm.drained()["gpu03"]
        assert state == "drained"
        assert reason.startswith(f"gpumon: {worst.value}: ")
        assert f"(+{len(fails) - 1} more failing)" in reason and len(reason.encode()) <= 200
        # the daemon's backend recognises the wrapper's drain as gpumon's own
        backend = _backend(slurm, "gpu03")
        assert backend.current().by_gpumon
        assert backend.bring_back("bootstrap passed", dry_run=False).done
        slurm.wait("gpu03", lambda s: s == "idle")
    finally:
        slurm.reset("gpu03")


@pytest.mark.parametrize(("code", "stderr"), [(0, ""), (1, "")])
def test_wrapper_leaves_the_node_on_0_and_1(slurm: Slurm, tmp_path: Path, code: int, stderr: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", f'echo "{{\\"status\\": \\"warn\\"}}"; exit {code}')
    proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu03" not in slurm.drained()


def test_wrapper_on_exit_3_leaves_the_node_and_says_why(slurm: Slurm, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", 'echo "gpumon: /etc/gpumon/gpumon.yaml:3: remediation: unknown key" >&2; exit 3')
    try:
        proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir))
        assert proc.returncode == 1
        assert "could not run (exit 3): gpumon: /etc/gpumon/gpumon.yaml:3" in proc.stdout
        assert "gpu03" not in slurm.drained()
        # a site that wants it drains on 3 too
        proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir, defaults="GPUMON_HC_DRAIN_ON_ERROR=1\n"))
        assert slurm.drained()["gpu03"][1] == "gpumon: unknown: gpumon check could not run (exit 3)"
        assert _backend(slurm, "gpu03").current().by_gpumon
    finally:
        slurm.reset("gpu03")


def test_wrapper_bounds_a_hung_gpumon(slurm: Slurm, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", "exec sleep 30")
    start = time.monotonic()
    proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir, GPUMON_HC_TIMEOUT="1"))
    assert proc.returncode == 1 and "did not finish within 1 s" in proc.stdout
    assert time.monotonic() - start < 10
    assert "gpu03" not in slurm.drained()


# gpumon's report as `check --json` prints it (json.dumps, indent 2), failing, with findings
# the wrapper cannot summarise
_FAIL_REPORT_UNREADABLE = 'printf \'{\\n  "status": "fail",\\n  "findings": []\\n}\\n\''


def test_wrapper_exit_2_with_an_unreadable_report_and_over_an_operators_drain(
        slurm: Slurm, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", _FAIL_REPORT_UNREADABLE + "; exit 2")
    env = _hc_env(slurm, tmp_path, bindir)
    try:
        slurm.operator("gpu03")
        proc = _run_wrapper(env)
        assert proc.returncode == 0 and "left alone" in proc.stdout, proc.stdout + proc.stderr
        assert slurm.drained()["gpu03"] == ("drained", OPERATOR_REASON)
        slurm.reset("gpu03")
        proc = _run_wrapper(env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert slurm.drained()["gpu03"][1] == ("gpumon: unknown: gpumon check failed (exit 2) but its "
                                                "report could not be read")
    finally:
        slurm.reset("gpu03")


def test_wrapper_exit_2_without_gpumons_report_never_drains(slurm: Slurm, tmp_path: Path) -> None:
    # what an older gpumon's argparse, sh or python print for a usage error: exit 2, no report
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", "echo 'usage: gpumon [-h] ...' >&2; "
          "echo 'gpumon: error: unrecognized arguments: --cofnig' >&2; exit 2")
    proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("exited 2 without a failing gpumon report (a usage error?): gpumon: error: unrecognized "
            "arguments: --cofnig; node left as it is") in proc.stdout
    assert "gpu03" not in slurm.drained()


def test_wrapper_with_a_typo_in_gpumon_args_leaves_the_node(slurm: Slurm, tmp_path: Path) -> None:
    """Issue 18: one bad rollout of GPUMON_ARGS must not drain the fleet. gpumon itself (a real
    faulty simulated node, which WOULD be drained) with a misspelt flag: exit 3, node untouched."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", f'exec "{sys.executable}" -m gpumon "$@"')
    env = _hc_env(slurm, tmp_path, bindir, defaults='GPUMON_ARGS="--simulate faulty-8xh100 --cofnig x"\n')
    try:
        proc = _run_wrapper(env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert ("gpumon check could not run (exit 3): gpumon: usage error (exit 3, nothing was "
                "checked): unrecognized arguments: --cofnig; node left as it is") in proc.stdout, proc.stdout
        assert "gpu03" not in slurm.drained()
    finally:
        slurm.reset("gpu03")


# every sh script in contrib/ (the health check, the why epilog): a new one is linted without a list
CONTRIB_SCRIPTS = sorted(WRAPPER.parent.glob("*.sh"))


def test_contrib_scripts_are_found() -> None:
    assert {p.name for p in CONTRIB_SCRIPTS} >= {"slurm-healthcheck.sh", "slurm-epilog-why.sh"}


@pytest.mark.parametrize("script", CONTRIB_SCRIPTS, ids=[p.name for p in CONTRIB_SCRIPTS])
def test_wrapper_is_shellcheck_clean(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck missing: .ci/run must install the Debian package shellcheck")
        pytest.skip("shellcheck not installed (Debian package shellcheck)")
    proc = subprocess.run([shellcheck, "--shell=sh", str(script)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_wrapper_circuit_breaker_blocks_a_new_drain(slurm: Slurm, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _tool(bindir, "gpumon", _FAIL_REPORT_UNREADABLE + "; exit 2")
    try:
        assert _backend(slurm, "gpu01").take_out(Action.REBOOT_NODE, "Xid 79", dry_run=False).done
        # 1 of 3 nodes (33 %) is already gpumon's: over the default 20 %
        proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir))
        assert proc.returncode == 1 and "circuit breaker: 1 of 3 nodes" in proc.stdout, proc.stdout
        assert "gpu03" not in slurm.drained()
        proc = _run_wrapper(_hc_env(slurm, tmp_path, bindir, GPUMON_HC_MAX_PERCENT="50"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert slurm.drained()["gpu03"][1].startswith("gpumon: unknown: ")
    finally:
        slurm.reset("gpu01")
        slurm.reset("gpu03")
