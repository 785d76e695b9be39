"""The first hour of a new operator (issue 12): README's commands run as a newcomer runs them, the real
CLI in a subprocess on simulated nodes.

- ``gpumon check --simulate S`` shows every fault of the scenario, also one that is over by the end
  (an IB port down for 9 s and back);
- ``--simulate`` keeps the node per user and per scenario (``$XDG_STATE_HOME/gpumon/sim/S``, here under
  the test's own tmp directory): the demo daemon, then ``status``, then ``run-bootstrap`` all find it,
  and every file a command names exists after it;
- piped output (COLUMNS=80, as in a pager or a log) never breaks a word, one record per line;
- the exit code does not depend on where stdout goes (a reader that left: ``| head``);
- ``list-checks`` shows no interval for checks the daemon does not schedule.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env, run_gpumon
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
    proc = run_gpumon("daemon", "--simulate", str(scenario), "--sim-dir", str(d / "sim"), "--duration", "3",
                      "--listen", "127.0.0.1:0", timeout=90)
    assert proc.returncode == 0, proc.stderr
    return d / "sim" / "state"


# --------------------------------------------------------------------- 4: piped output breaks no word

def test_list_checks_piped_at_80_columns_keeps_every_description_whole() -> None:
    proc = run_gpumon("list-checks", env=clean_env(COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    for name, cls in load_checks().items():
        [row] = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"│ {name} ")]
        assert cls.description in row, (name, row)  # one record per line, no word folded


def test_status_piped_at_80_columns_keeps_every_word_whole(bad_node: Path) -> None:
    doc = json.loads(run_gpumon("status", "--state-dir", str(bad_node), "--json").stdout)
    proc = run_gpumon("status", "--state-dir", str(bad_node), env=clean_env(COLUMNS="80"))
    assert proc.returncode == 2, proc.stderr
    bad = {n: c for n, c in doc["components"].items() if c["state"] != "healthy"}
    assert {"gpu/1", "gpu/3"} <= set(bad), bad
    for name, comp in bad.items():
        [row] = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"│ {name} ")]
        for why in comp["why"]:
            assert f"{why['check']}: {why['message']}" in row, (why, row)


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
