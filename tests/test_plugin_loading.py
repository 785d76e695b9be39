"""A check plugin that does not load: left out, reported, and every other check still runs.

The plugins are real installed distributions as importlib.metadata finds them: a ``*.dist-info``
folder with an ``entry_points.txt`` on PYTHONPATH, naming a module beside it, and gpumon started as
a real command (``gpumon check``, ``gpumon daemon``, ``gpumon list-checks``) in a subprocess.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from conftest import clean_env
from gpumon.model import Phase
from gpumon.registry import load_checks

# module -> its source; entry point name -> module:attribute
PLUGINS = {
    "import_raises": ("boom_mod", 'raise RuntimeError("plugin exploded on import")\n', "boom_mod:BoomCheck"),
    "not_a_check": ("notcheck_mod", "class NotACheck:\n    pass\n", "notcheck_mod:NotACheck"),
}


def _plugin_dir(tmp_path: Path, which: tuple[str, ...] = ("import_raises",)) -> Path:
    site = tmp_path / "site"
    info = site / "brokenplug-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    lines = ["[gpumon.checks]"]
    for name in which:
        module, source, target = PLUGINS[name]
        (site / f"{module}.py").write_text(source)
        lines.append(f"{name} = {target}")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


def _env(site: Path) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(site))


def _continuous() -> set[str]:
    return {n for n, cls in load_checks().items() if cls.phase is Phase.CONTINUOUS}


def test_a_plugin_that_fails_to_load_is_reported_and_the_others_run(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path, ("import_raises", "not_a_check"))
    proc = subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", "healthy-8xh100", "--json"],
                          capture_output=True, text=True, env=_env(site), timeout=120)
    # unknown (a check that could not say): exit 1, not 3 (could not run) nor 2 (a failure)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "warn"
    by_check = {c["check"]: c["outcome"] for c in doc["checks"]}
    # every built-in continuous check ran
    assert {n for n in _continuous() if by_check.get(n) in ("completed", "skipped")} == _continuous()
    assert by_check["import_raises"] == by_check["not_a_check"] == "not-loaded"
    findings = {f["check"]: f for f in doc["findings"]}
    boom = findings["import_raises"]
    assert boom["severity"] == "unknown" and boom["component"] == "node" and boom["action"] == "none"
    assert "RuntimeError: plugin exploded on import" in boom["message"]
    assert "NOT watched for what import_raises detects" in boom["message"]
    assert boom["evidence"]["entry_point"] == "boom_mod:BoomCheck"
    assert boom["evidence"]["distribution"] == "brokenplug 0.1"
    assert 'raise RuntimeError("plugin exploded on import")' in boom["evidence"]["traceback"]
    assert "not a gpumon Check class" in findings["not_a_check"]["message"]
    # logged once each, at ERROR
    assert proc.stderr.count("ERROR check import_raises did not load") == 1, proc.stderr

    # asked for by name: its own report; an unknown name stays a usage error
    named = subprocess.run([sys.executable, "-m", "gpumon", "check", "--simulate", "healthy-8xh100", "--json",
                            "import_raises"], capture_output=True, text=True, env=_env(site), timeout=120)
    assert named.returncode == 1, named.stderr
    assert [c["check"] for c in json.loads(named.stdout)["checks"]] == ["import_raises"]

    listed = subprocess.run([sys.executable, "-m", "gpumon", "list-checks"], capture_output=True, text=True,
                            env={**_env(site), "COLUMNS": "250"}, timeout=60)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if "import_raises" in line)
    assert "NOT LOADED" in row and "RuntimeError: plugin exploded on import" in row


def test_the_config_section_of_a_check_that_did_not_load_is_no_config_error(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path)
    cfg = tmp_path / "gpumon.yaml"
    cfg.write_text("checks:\n  import_raises:\n    interval_s: 30\n    threshold: 4\n"
                   "bootstrap:\n  optional: [import_raises]\n")
    proc = subprocess.run([sys.executable, "-m", "gpumon", "--config", str(cfg), "check", "--simulate",
                           "healthy-8xh100", "--json"], capture_output=True, text=True, env=_env(site),
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    # a misspelt check stays a configuration error, with or without a broken plugin
    cfg.write_text("checks:\n  xdi:\n    interval_s: 30\n")
    proc = subprocess.run([sys.executable, "-m", "gpumon", "--config", str(cfg), "check", "--simulate",
                           "healthy-8xh100"], capture_output=True, text=True, env=_env(site), timeout=120)
    assert proc.returncode == 3 and "unknown check" in proc.stderr, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_daemon_reports_a_plugin_that_did_not_load_and_runs_the_others(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path)
    port = _free_port()
    simdir = tmp_path / "sim"
    with subprocess.Popen(
            [sys.executable, "-m", "gpumon", "daemon", "--simulate", "healthy-8xh100",
             "--sim-dir", str(simdir), "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(site)) as proc:
        try:
            want = {f'gpumon_check_outcome{{check="{n}",outcome="completed"}} 1.0' for n in _continuous()
                    if n != "fabric"}  # fabric: skipped, no probe has run on this node yet
            want |= {'gpumon_check_outcome{check="import_raises",outcome="not-loaded"} 1.0',
                     'gpumon_finding_severity{check="import_raises",component="node"} 2.0',
                     # not watched for one fault class: degraded, never cordoned for it
                     'gpumon_health_state{component="node",state="degraded"} 1.0'}
            text = ""
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and not want <= set(text.splitlines()):
                time.sleep(0.5)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        text = resp.read().decode()
                except OSError:
                    continue
            assert not want - set(text.splitlines()), sorted(want - set(text.splitlines()))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            assert proc.stderr is not None
            err = proc.stderr.read()
    assert "NOT loaded: import_raises" in err, err
    report = json.loads((simdir / "state" / "report.json").read_text())
    (boom,) = [f for f in report["findings"] if f["check"] == "import_raises"]
    assert boom["severity"] == "unknown" and "plugin exploded on import" in boom["message"]


def test_an_entry_point_whose_check_has_another_name_is_not_loaded(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "misnamed-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: misnamed\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[gpumon.checks]\nmisnamed = misnamed_mod:Misnamed\n")
    (site / "misnamed_mod.py").write_text(
        "from gpumon.check import Check\nfrom gpumon.model import Phase\n"
        "class Misnamed(Check):\n    name = 'other_name'\n    phase = Phase.CONTINUOUS\n"
        "    def run(self, ctx):\n        return []\n")
    probe = ("from gpumon.registry import load_registry; r = load_registry(); "
             "print(sorted(r.not_loaded)); print(r.not_loaded['misnamed'].error); print(len(r.checks))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(site),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    names, error, count = proc.stdout.splitlines()
    assert names == "['misnamed']" and "it names its check 'other_name'" in error
    assert int(count) == len(load_checks())


def test_a_required_bootstrap_check_that_did_not_load_makes_the_suite_incomplete(tmp_path: Path) -> None:
    site = _plugin_dir(tmp_path)
    cfg = tmp_path / "gpumon.yaml"
    cfg.write_text("bootstrap:\n  required: [import_raises]\n")
    proc = subprocess.run([sys.executable, "-m", "gpumon", "--config", str(cfg), "run-bootstrap",
                           "--simulate", "healthy-8xh100", "--sim-dir", str(tmp_path / "sim"),
                           "--only", "pcie_topology", "--json"],
                          capture_output=True, text=True, env=_env(site), timeout=120)
    assert proc.returncode == 3, proc.stderr
    doc = json.loads(proc.stdout)
    (f,) = [f for f in doc["findings"] if f["check"] == "import_raises"]
    assert f["severity"] == "unknown"
    assert "could not run: it did not load: RuntimeError: plugin exploded on import" in f["message"]
