"""The first hour of a new operator (issue 12): the quick start's commands (README.md's "Quick start",
walked through in docs/quickstart.md) run as a newcomer runs them, the real CLI in a subprocess on
simulated nodes.

- ``gpumon check --simulate S`` shows every fault of the scenario, also one that is over by the end
  (an IB port down for 9 s and back);
- ``--simulate`` keeps the node per user and per scenario (``$XDG_STATE_HOME/gpumon/sim/S``, here under
  the test's own tmp directory): the demo daemon, then ``status``, then ``run-bootstrap`` all find it,
  and every file a command names exists after it;
- piped output (COLUMNS=80, as in a pager or a log) never breaks a word, one record per line, and is
  not padded to the widest record (issue 18: 1,677 characters a line);
- on a terminal of 100 or 80 columns no word is cut or folded (issue 18: ``ROBUST_CHANNEL_GPU_HAS_F…``);
- one lost GPU is one WARNING line in the daemon's log, however many checks see it (issue 18: 7 lines);
- the exit code does not depend on where stdout goes (a reader that left: ``| head``);
- ``list-checks`` shows no interval for checks the daemon does not schedule.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Findings, clean_env, daemon_until, run_gpumon
from gpumon.model import Phase
from gpumon.registry import load_checks
from gpumon.sim.scenario import Fault, load_scenario


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose simulated nodes live under tmp_path."""
    return clean_env(XDG_STATE_HOME=str(tmp_path / "xdg"), **extra)


def _component(fault: Fault) -> str:
    if fault.kind in ("ib_down", "ib_rate", "ib_errors"):
        return f"ib/{fault.device}/{fault.port}"
    assert fault.gpu is not None, fault
    return f"gpu/{fault.gpu}"


# --------------------------------------------------------------------- 1: the one-shot shows every fault

def test_one_shot_of_a_scenario_shows_every_fault_of_it(tmp_path: Path) -> None:
    scenario = load_scenario("faulty-8xh100")
    proc = run_gpumon("check", "--simulate", "faulty-8xh100", "--json", env=_env(tmp_path))
    assert proc.returncode == 2, proc.stderr
    findings = json.loads(proc.stdout)["findings"]
    bad = {f["component"] for f in findings if f["severity"] not in ("ok", "skipped")}
    for fault in scenario.faults:
        assert _component(fault) in bad, (fault, sorted(bad))
    # the IB port was down from 60 s to 69 s and is up again at the end: seen by the run at 60 s
    [ib] = [f for f in findings if f["component"] == "ib/mlx5_2/1"]
    assert (ib["check"], ib["severity"], ib["action"]) == ("ib", "fail", "check_cables"), ib
    assert "9.0 s" in ib["message"], ib
    # a single Xid line is one event, however many runs the replay made
    [xid79] = [f for f in findings if f["check"] == "xid" and f["component"] == "gpu/3"]
    assert "events" not in xid79["message"], xid79
    # the one-shot's node is its own, temporary one: nothing is left behind
    assert not (tmp_path / "xdg").exists()


def test_check_help_says_what_a_one_shot_on_a_scenario_does() -> None:
    proc = run_gpumon("check", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "replayed on a private temporary node" in text, text
    assert "at every fault's start and end" in text and "the report is the last run's" in text, text


# ----------------------------------------------------------- 2: one simulated node, found by every command

def test_demo_daemon_then_status_then_run_bootstrap_share_one_node(tmp_path: Path) -> None:
    env = _env(tmp_path)
    node = tmp_path / "xdg" / "gpumon" / "sim" / "faulty-8xh100"
    # before any daemon: status says there is no state, and how to make one
    proc = run_gpumon("status", "--simulate", "faulty-8xh100", env=env)
    assert proc.returncode == 3 and "gpumon daemon --simulate faulty-8xh100" in proc.stderr, proc.stderr

    proc = run_gpumon("daemon", "--simulate", "faulty-8xh100", "--duration", "3", "--listen", "127.0.0.1:0",
                      env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert f"simulated node faulty-8xh100 (new boot) in {node}" in proc.stderr, proc.stderr
    boot = json.loads((node / "sim.json").read_text())["boot_id"]

    proc = run_gpumon("status", "--simulate", "faulty-8xh100", "--json", env=env)
    assert proc.returncode == 0, proc.stderr  # the first fault comes at 10 s: healthy so far
    doc = json.loads(proc.stdout)
    assert doc["node"]["boot_id"] == boot and doc["components"], doc["node"]
    assert str(node / "state") in proc.stderr

    proc = run_gpumon("run-bootstrap", "--simulate", "faulty-8xh100", "--only", "memory_headroom", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "simulated node faulty-8xh100 (at t=" in proc.stderr and str(node) in proc.stderr
    [report] = re.findall(r"^report: (\S+)$", proc.stdout, re.M)
    assert Path(report).is_file() and Path(report).parent == node / "state", report
    assert json.loads((node / "state" / "bootstrap-latest.json").read_text())["checks"]
    # the one-shot resumed the node (same boot): it did not boot it again
    assert json.loads((node / "sim.json").read_text())["boot_id"] == boot
    assert run_gpumon("status", "--simulate", "faulty-8xh100", env=env).returncode == 0

    # a user's other scenario is another node
    proc = run_gpumon("status", "--simulate", "healthy-8xh100", env=env)
    assert proc.returncode == 3 and str(tmp_path / "xdg" / "gpumon" / "sim" / "healthy-8xh100") in proc.stderr


# ------------------------------------------------------------- an unhealthy node for the output tests

BAD = ("name: bad-now\nsku: h100-sxm\ngpus: 8\nfaults:\n"
       "  - {at_s: 0, kind: xid, gpu: 3, code: 79}\n"
       "  - {at_s: 0, kind: throttle, gpu: 1, reasons: [hw_slowdown]}\n")


@pytest.fixture(scope="module")
def bad_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state directory of a simulated node that a daemon found unhealthy."""
    d = tmp_path_factory.mktemp("bad")
    scenario = d / "bad.yaml"
    scenario.write_text(BAD)
    state = d / "sim" / "state"
    proc = daemon_until(["daemon", "--simulate", str(scenario), "--sim-dir", str(d / "sim"), "--duration",
                         "300", "--listen", "127.0.0.1:0"], state / "report.json",
                        lambda found: all(found.get(f, {}).get("severity") == "fail"
                                          for f in (("xid", "gpu/3"), ("throttle", "gpu/1"))),
                        "both faults judged")
    assert proc.returncode == 0, proc.stderr
    return state


# --------------------------------------------------------------------- 4: piped output breaks no word

def test_list_checks_piped_at_80_columns_keeps_every_description_whole() -> None:
    proc = run_gpumon("list-checks", env=clean_env(COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    for name, cls in load_checks().items():
        [row] = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"│ {name} ")]
        assert cls.description in row, (name, row)  # one record per line, no word folded


def _row(lines: list[str], name: str) -> str:
    [row] = [ln for ln in lines if re.match(rf"{re.escape(name)}\s", ln)]
    return row


def test_status_piped_at_80_columns_keeps_every_word_whole(bad_node: Path) -> None:
    doc = json.loads(run_gpumon("status", "--state-dir", str(bad_node), "--json").stdout)
    proc = run_gpumon("status", "--state-dir", str(bad_node), env=clean_env(COLUMNS="80"))
    assert proc.returncode == 2, proc.stderr
    bad = {n: c for n, c in doc["components"].items() if c["state"] != "healthy"}
    assert {"gpu/1", "gpu/3"} <= set(bad), bad
    lines = proc.stdout.splitlines()
    for name, comp in bad.items():
        row = _row(lines, name)  # one record per line
        for why in comp["why"]:
            assert f"{why['check']}: {why['message']}" in row, (why, row)


def test_status_piped_pads_no_line(bad_node: Path) -> None:
    proc = run_gpumon("status", "--state-dir", str(bad_node))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(ln == ln.rstrip() for ln in lines), [ln for ln in lines if ln != ln.rstrip()]
    # -v lists every component with its history, the node's boot (an event with no check and no
    # words) among it
    verbose = run_gpumon("status", "-v", "--state-dir", str(bad_node)).stdout.splitlines()
    assert any(ln.endswith(" node boot") for ln in verbose), verbose
    assert all(ln == ln.rstrip() for ln in verbose), [ln for ln in verbose if ln != ln.rstrip()]
    # each record is as long as what it says, not as the widest one (gpu/3 has seven reasons)
    header = next(ln for ln in lines if ln.startswith("component"))
    assert header.split() == ["component", "state", "action", "since", "why"] and len(header) < 100
    gpu1, gpu3 = _row(lines, "gpu/1"), _row(lines, "gpu/3")
    assert len(gpu1) < len(gpu3) - 100, (gpu1, gpu3)
    assert gpu1.endswith("(current reading; no window history yet)"), gpu1
    check = run_gpumon("check", "--simulate", str(bad_node.parent.parent / "bad.yaml"))
    assert check.returncode == 2, check.stderr
    lines = check.stdout.splitlines()
    assert all(ln == ln.rstrip() for ln in lines)
    header = next(ln for ln in lines if ln.startswith("check"))
    assert header.split() == ["check", "component", "severity", "action", "message"] and len(header) < 80


# ------------------------------------------------------------- on a terminal: no word cut or folded

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _on_terminal(*args: str, columns: int) -> tuple[int, str]:
    """The command's exit code and what it showed on a terminal (a pty) of ``columns`` columns."""
    master, slave = pty.openpty()
    with subprocess.Popen([sys.executable, "-m", "gpumon", *args], stdout=slave, stderr=subprocess.DEVNULL,
                          env=clean_env(COLUMNS=str(columns), LINES="50", TERM="xterm-256color")) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        os.close(master)
        code = proc.wait(timeout=120)
    return code, _ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


@pytest.mark.parametrize("columns", [100, 80])
def test_status_on_a_terminal_cuts_no_word_that_names_the_fault(bad_node: Path, columns: int) -> None:
    doc = json.loads(run_gpumon("status", "--state-dir", str(bad_node), "--json").stdout)
    code, shown = _on_terminal("status", "--state-dir", str(bad_node), columns=columns)
    assert code == 2, shown
    assert "…" not in shown, shown
    assert all(len(ln) <= columns for ln in shown.splitlines()), shown
    # a message may wrap, at its spaces only: every word of it is on the screen whole
    words = set(shown.split())
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in words, shown
    for name, comp in doc["components"].items():
        if comp["state"] == "healthy":
            continue
        assert name in words and comp["action"] in words, (name, shown)
        for why in comp["why"]:
            assert set(why["message"].split()) <= words, (why["message"], shown)


@pytest.mark.parametrize("columns", [100, 80])
def test_check_on_a_terminal_cuts_no_word_that_names_the_fault(bad_node: Path, columns: int) -> None:
    scenario = str(bad_node.parent.parent / "bad.yaml")
    doc = json.loads(run_gpumon("check", "--simulate", scenario, "--json").stdout)
    code, shown = _on_terminal("check", "--simulate", scenario, columns=columns)
    assert code == 2, shown
    assert "…" not in shown and all(len(ln) <= columns for ln in shown.splitlines()), shown
    words = set(shown.split())
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in words, shown
    for f in doc["findings"]:
        assert {f["check"], f["component"]} <= words, (f, shown)
        # each `check --simulate` replays on a temporary node of its own: its paths differ per run
        said = {w for w in f["message"].split() if "/gpumon-sim-" not in w}
        assert said <= words, (f["message"], shown)


# ------------------------------------------------------------- one lost GPU, one WARNING line

def test_one_lost_gpu_is_one_warning_line_in_the_daemons_log(tmp_path: Path) -> None:
    """faulty-8xh100's GPU 3 falling off the bus (Xid 79, then NVML answers GPU_IS_LOST), at 2 s instead
    of 30 s and with every NVML check run each second, so that each of them sees the loss in seconds."""
    scenario = tmp_path / "lost.yaml"
    scenario.write_text("name: lost\nsku: h100-sxm\ngpus: 8\nfaults:\n"
                        "  - {at_s: 0, kind: throttle, gpu: 1, reasons: [hw_slowdown]}\n"
                        "  - {at_s: 2, kind: xid, gpu: 3, code: 79}\n")
    config = tmp_path / "fast.yaml"
    config.write_text("checks:\n" + "".join(f"  {name}:\n    interval_s: 1\n" for name in (
        "gpu_presence", "memory", "nvlink", "nvswitch", "thermal", "throttle", "xid")))
    def judged(found: Findings) -> bool:  # five checks failed gpu/3 (the asserts below need 1 + 4)
        return (len({c for (c, comp), f in found.items() if comp == "gpu/3" and f["severity"] == "fail"}) >= 5
                and found.get(("throttle", "gpu/1"), {}).get("severity") == "fail")
    proc = daemon_until(["--config", str(config), "daemon", "--simulate", str(scenario), "--sim-dir",
                         str(tmp_path / "sim"), "--duration", "300", "--listen", "127.0.0.1:0"],
                        tmp_path / "sim" / "state" / "report.json", judged, "the loss seen by five checks")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if " gpu/3: " in ln]
    warnings = [ln for ln in lines if " gpumon WARNING " in ln]
    assert len(warnings) == 1, "\n".join(lines)
    assert "-> fail:" in warnings[0] and ("Xid 79" in warnings[0] or "lost" in warnings[0]), warnings
    first = warnings[0].split(" gpumon WARNING ")[1].split()[0]
    # the other checks that saw the loss say so at INFO, naming the check that reported it
    infos = [ln for ln in lines if " gpumon INFO " in ln]
    seen = {ln.split(" gpumon INFO ")[1].split()[0] for ln in infos}
    assert len(seen) >= 4, "\n".join(lines)
    assert all(f"the loss of gpu/3 was reported by {first}" in ln for ln in infos), infos
    # GPU 1's throttling is another fault: its own WARNING line
    assert any(" gpumon WARNING throttle gpu/1: " in ln for ln in proc.stderr.splitlines()), proc.stderr
    # still one finding per check in the health state, as before
    doc = json.loads(run_gpumon("status", "--state-dir", str(tmp_path / "sim" / "state"), "--json").stdout)
    gpu3 = doc["components"]["gpu/3"]
    assert {w["check"] for w in gpu3["why"]} >= {first, *seen}, gpu3


# ------------------------------------------------------------- 5: the exit code is the command's, piped

def _exit_code_with_the_reader_gone(*args: str) -> tuple[int, str]:
    """The command's exit code when its stdout is a pipe whose reader has left (`| head` done)."""
    with subprocess.Popen([sys.executable, "-m", "gpumon", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=clean_env()) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        return proc.wait(timeout=120), err


def test_exit_code_does_not_depend_on_where_stdout_goes(bad_node: Path) -> None:
    for args in (("status", "--state-dir", str(bad_node)), ("status", "--state-dir", str(bad_node), "--json"),
                 ("check", "--simulate", "faulty-8xh100")):
        assert run_gpumon(*args).returncode == 2, args
        code, err = _exit_code_with_the_reader_gone(*args)
        assert code == 2, (args, err)
        assert "Traceback" not in err and "BrokenPipe" not in err, err
    # the shell's own pipe: the status of gpumon, not of head
    shell = 'set -o pipefail; "$0" -m gpumon status --state-dir "$1" | head -n 1'
    proc = subprocess.run(["bash", "-c", shell, sys.executable, str(bad_node)], capture_output=True,
                          text=True, env=clean_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("node: unhealthy"), proc.stdout


# ------------------------------------------------------------- 6: no interval for on-demand checks

def test_list_checks_shows_no_interval_for_checks_run_on_demand() -> None:
    proc = run_gpumon("list-checks")
    assert proc.returncode == 0, proc.stderr
    for name, cls in load_checks().items():
        [row] = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"│ {name} ")]
        interval = row.split("│")[3].strip()
        if cls.phase in (Phase.CONTINUOUS, Phase.CANARY):  # the daemon schedules these
            assert re.fullmatch(r"[0-9.]+s", interval), (name, row)
        else:
            assert interval == "-", (name, row)
    assert "- : run on demand" in proc.stdout
