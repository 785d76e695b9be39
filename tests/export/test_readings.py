"""Every metric explains itself: a HELP with meaning, unit and source for every reading in the code,
declared by the check that publishes it (``Check.readings``), and on a real exposition of a simulated
node (healthy and faulty), which promtool passes; a site check's declarations reach /metrics too."""

from __future__ import annotations

import ast
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpumon.check import Check, CheckContext
from gpumon.export.prometheus import FAMILIES, Snapshot, SnapshotHolder, make_registry
from gpumon.export.readings import ReadingCatalog, generic_help, installed, is_generic
from gpumon.health import Health
from gpumon.model import CheckRun, Finding, ReadingSpec, Severity, reading
from gpumon.registry import load_checks

ROOT = Path(__file__).resolve().parents[2]


def _reading_calls() -> dict[str, dict[str, set[str]]]:
    """Reading name -> the files that publish it -> the labels they give it, from every
    ``reading(...)`` call in checks/ and gpumon/."""
    found: dict[str, dict[str, set[str]]] = {}
    files = sorted([*(ROOT / "checks").rglob("*.py"), *(ROOT / "gpumon").rglob("*.py")])
    for path in files:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (func.id if isinstance(func, ast.Name)
                    else func.attr if isinstance(func, ast.Attribute) else "")
            if name != "reading" or not node.args:
                continue
            first = node.args[0]
            # a name computed at run time could not be checked against the declarations
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                f"{rel}:{node.lineno}: reading() with a name that is not a string literal")
            labels = found.setdefault(first.value, {}).setdefault(rel, set())
            for kw in node.keywords:
                assert kw.arg is not None, f"{rel}:{node.lineno}: reading() with **labels cannot be checked"
                labels.add(kw.arg)
    return found


def test_every_reading_in_the_code_is_declared_by_its_check_and_every_declaration_published() -> None:
    used = _reading_calls()
    assert len(used) >= 20  # the scan sees the checks (a broken scan would pass vacuously)
    catalog = installed()
    missing = sorted(set(used) - set(catalog))
    assert not missing, f"readings no check declares (Check.readings): {missing}"
    stale = sorted(set(catalog) - set(used))
    assert not stale, f"declared readings no check publishes any more (renamed?): {stale}"
    for name, files in used.items():
        # declared by the check the publishing code belongs to (gpumon/fabric/: the fabric check)
        for f in files:
            assert any(f"/{check}" in f"/{f}" for check in catalog.declared_by(name)), (
                name, f, catalog.declared_by(name))
        labels = set().union(*files.values())
        assert labels <= set(catalog[name].labels), (name, labels, catalog[name].labels)


def test_each_declaration_says_meaning_unit_source_and_follows_the_counter_rule() -> None:
    catalog = installed()
    for name, spec in catalog.items():
        assert spec.name == name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert catalog.kind_of(name) == spec.kind
        assert spec.meaning.endswith((".", ")")), name
        assert spec.unit is not None or "flag" in spec.meaning, name
        assert "Source: " in spec.help and "\n" not in spec.help and not is_generic(spec.help), name
        reading(name, 1, **dict.fromkeys(spec.labels, "x"))  # a valid reading name and labels
    for family, text in FAMILIES.items():
        assert family.startswith("gpumon_") and "Source:" in text and "\n" not in text, family


def test_the_declarations_are_the_loaded_checks_own() -> None:
    checks = load_checks()
    assert installed() == ReadingCatalog.of(checks.values())
    assert installed()["gpu_temperature_celsius"] is checks["thermal"].readings[0]
    # a check that extends another declares what it publishes with the other's code
    assert installed().declared_by("remapped_rows") == ("memory", "memory_headroom")
    assert Check.readings == ()


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"name": "fan_spins", "kind": "counter"}, "a counter's name ends in _total"),
    ({"name": "fan_spins_total", "kind": "gauge"}, "a counter's name ends in _total"),
    ({"kind": "histogram"}, "neither gauge nor counter"),
    ({"name": "gpumon_fan_rpm"}, "bad reading name"),
    ({"labels": ("check",)}, "bad label 'check'"),
    ({"labels": ("Fan",)}, "bad label 'Fan'"),
    ({"source": " "}, "meaning, unit and source"),
    ({"unit": ""}, "meaning, unit and source"),
    ({"meaning": "two\nlines."}, "one line"),
])
def test_a_bad_declaration_fails_when_its_check_is_defined(kwargs: dict[str, object], error: str) -> None:
    good: dict[str, object] = {"name": "fan_rpm", "kind": "gauge", "meaning": "Fan speed.", "unit": "rpm",
                               "source": "the fan controller"}
    ReadingSpec(**good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=error):
        ReadingSpec(**{**good, **kwargs})  # type: ignore[arg-type]


def test_help_is_meaning_unit_source_note() -> None:
    spec = ReadingSpec("fan_rpm", "gauge", "Fan speed (label fan).", unit="revolutions per minute",
                       source="the fan controller", labels=("fan",), note="Below 1000 the node fails.")
    assert spec.help == ("Fan speed (label fan). Unit: revolutions per minute. Source: the fan controller. "
                         "Below 1000 the node fails.")
    flag = ReadingSpec("fan_failed", "gauge", "1 once the fan stopped, else 0 (a flag).", unit=None,
                       source="the fan controller")
    assert flag.help == "1 once the fan stopped, else 0 (a flag). Source: the fan controller."


class _Fans(Check):
    name = "fans"
    description = "chassis fans"
    readings: ClassVar[tuple[ReadingSpec, ...]] = (
        ReadingSpec("fan_rpm", "gauge", "Speed of a chassis fan (label fan).", unit="revolutions per minute",
                    source="the fan controller", labels=("fan",)),
        ReadingSpec("fan_stalls_total", "counter", "Stalls of a chassis fan since boot.", unit="stalls",
                    source="the fan controller's event log"),
    )

    def run(self, ctx: CheckContext) -> list[Finding]:
        raise NotImplementedError


def _families(snap: Snapshot, catalog: ReadingCatalog | None = None) -> dict[str, Metric]:
    text = generate_latest(make_registry(SnapshotHolder(snap), catalog)).decode()
    return {m.name: m for m in text_string_to_metric_families(text)}


def test_a_site_check_declares_its_readings_and_an_undeclared_one_gets_a_help_that_names_its_check() -> None:
    f = Finding("fans", "node", Severity.OK, "m", evidence={"readings": [
        reading("fan_rpm", 9000, fan=1), reading("fan_stalls_total", 2), reading("site_fan_rpm", 9000)]})
    snap = Snapshot("n", "p", "v", {"fans": CheckRun("fans", [f], 0, 0, "completed")})
    families = _families(snap, ReadingCatalog.of([_Fans, *load_checks().values()]))
    rpm, stalls = families["gpumon_fan_rpm"], families["gpumon_fan_stalls"]
    undeclared = families["gpumon_site_fan_rpm"]
    assert rpm.documentation == _Fans.readings[0].help and rpm.type == "gauge"
    assert stalls.documentation == _Fans.readings[1].help and stalls.type == "counter"
    assert undeclared.documentation == generic_help("site_fan_rpm", ["fans"])
    assert is_generic(undeclared.documentation) and "fans" in undeclared.documentation
    # without the check's declarations (not loaded): generic, typed by the name
    families = _families(snap, ReadingCatalog.of(load_checks().values()))
    assert is_generic(families["gpumon_fan_rpm"].documentation)
    assert families["gpumon_fan_stalls"].type == "counter"
    catalog = ReadingCatalog()
    assert catalog.kind_of("site_fan_spins_total") == "counter" and catalog.kind_of("site_fan_rpm") == "gauge"


class _Thermal2(Check):
    name = "thermal2"
    readings: ClassVar[tuple[ReadingSpec, ...]] = (
        ReadingSpec("gpu_temperature_celsius", "gauge", "A site's reading of the GPU temperature.",
                    unit="degrees Fahrenheit", source="a site tool"),)


class _Athermal(_Thermal2):
    name = "athermal"


def test_a_reading_declared_differently_by_two_checks_keeps_the_first_by_name_and_warns(
        caplog: pytest.LogCaptureFixture) -> None:
    checks = load_checks()
    with caplog.at_level(logging.WARNING, logger="gpumon.export.readings"):
        catalog = ReadingCatalog.of([_Thermal2, *checks.values()])
    built_in = checks["thermal"].readings[0]
    assert catalog["gpu_temperature_celsius"] == built_in
    assert catalog.declared_by("gpu_temperature_celsius") == ("thermal",)
    (record,) = caplog.records
    assert record.getMessage() == (
        "reading gpu_temperature_celsius: check thermal2 declares it differently (meaning, unit, source) "
        "from check thermal; /metrics uses thermal's declaration")
    caplog.clear()
    # by name, not by the order handed in: "athermal" comes before "thermal"
    with caplog.at_level(logging.WARNING, logger="gpumon.export.readings"):
        catalog = ReadingCatalog.of([*checks.values(), _Athermal])
    assert catalog["gpu_temperature_celsius"] == _Athermal.readings[0]
    assert "check thermal declares it differently" in caplog.text
    caplog.clear()
    # the same declaration twice (a check that extends another): no warning
    with caplog.at_level(logging.WARNING, logger="gpumon.export.readings"):
        catalog = ReadingCatalog.of([_Thermal2, _Athermal])
    assert not caplog.records and catalog.declared_by("gpu_temperature_celsius") == ("athermal", "thermal2")


def node_snapshot(scenario: str, state_dir: Path) -> Snapshot:
    """What the daemon would hold for a simulated node: every continuous check's findings, the health
    store's per-component state, and a remediation loop's state."""
    from conftest import run_gpumon

    proc = run_gpumon("check", "--simulate", scenario, "--json", "-v")
    assert proc.returncode in (0, 2), proc.stderr
    doc = json.loads(proc.stdout)
    findings: dict[str, list[Finding]] = {}
    for f in doc["findings"]:
        findings.setdefault(f["check"], []).append(Finding.from_json(f))
    runs = {c["check"]: CheckRun(c["check"], findings.get(c["check"], []), doc["time"], c["seconds"],
                                 c["outcome"]) for c in doc["checks"]}
    health = Health.open(state_dir, boot_id="test-boot")
    try:
        for run in runs.values():
            health.record_run(run)
        view = health.view()
        store = health.store_finding()
    finally:
        health.close()
    runs[store.check] = CheckRun(store.check, [store], doc["time"], 0.0, "completed")
    states = {name: (c.level.value, c.action.value) for name, c in view.components.items()}
    states["node"] = (view.node.level.value, view.node.action.value)
    remediation = {"backend": "slurm", "mode": "observe", "breaker_open": False, "errors_total": 1,
                   "decision": "take_out", "error": False}
    return Snapshot(doc["node"], doc["profile"], "0.1.0", runs, states, remediation)


@pytest.mark.parametrize("scenario", ["healthy-8xh100", "faulty-8xh100"])
def test_every_family_of_a_real_exposition_explains_itself_and_promtool_agrees(
        scenario: str, tmp_path: Path) -> None:
    from test_prometheus import _promtool

    text = generate_latest(make_registry(SnapshotHolder(node_snapshot(scenario, tmp_path)))).decode()
    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    assert {"gpumon_health_state", "gpumon_recommended_action", "gpumon_remediation_errors"} <= names
    declared = installed()
    assert len(names & {f"gpumon_{r.removesuffix('_total')}" for r in declared}) >= 10  # the readings
    for family in families:
        exported = f"{family.name}_total" if family.type == "counter" else family.name
        reading_name = exported.removeprefix("gpumon_")
        if reading_name in declared:
            assert family.documentation == declared[reading_name].help, family.name
            assert family.type == declared[reading_name].kind, family.name
        else:
            # not a reading: one of the exporter's own families (counters under their base name)
            assert family.documentation == FAMILIES[family.name], family.name
        assert not is_generic(family.documentation), family.name
    proc = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)


PLUGIN = '''
from gpumon.check import Check
from gpumon.model import NODE, Phase, ReadingSpec, reading


class FansCheck(Check):
    name = "zz_fans"
    phase = Phase.CONTINUOUS
    description = "chassis fans (a test's plugin)"
    readings = (
        ReadingSpec("site_fan_rpm", "gauge", "Speed of the chassis fan.", unit="revolutions per minute",
                    source="the test's plugin"),
        ReadingSpec("gpu_temperature_celsius", "gauge", "The plugin's own idea of it.", unit="kelvin",
                    source="the test's plugin"),
    )
    interval = 1.0

    def run(self, ctx):
        return [self.ok(NODE, "fans turn", readings=[reading("site_fan_rpm", 9000)])]
'''


def test_the_daemon_exports_the_help_its_loaded_checks_declare(tmp_path: Path) -> None:
    from conftest import clean_env

    site = tmp_path / "site"
    info = site / "fans-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fans\nVersion: 0.1\n")
    # and a plugin that does not load: the daemon loads its checks once (one log line for it), the
    # exporter takes their declarations from the daemon instead of loading them again
    (info / "entry_points.txt").write_text("[gpumon.checks]\nzz_fans = fans_mod:FansCheck\n"
                                           "zz_broken = broken_mod:Broken\n")
    (site / "fans_mod.py").write_text(PLUGIN)
    (site / "broken_mod.py").write_text('raise RuntimeError("plugin exploded on import")\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    thermal = installed()["gpu_temperature_celsius"].help
    want = {"# HELP gpumon_site_fan_rpm Speed of the chassis fan. Unit: revolutions per minute. Source: the "
            "test's plugin.", "# TYPE gpumon_site_fan_rpm gauge",
            'gpumon_site_fan_rpm{check="zz_fans",component="node"} 9000.0',
            # a built-in reading the plugin declares again, differently: the built-in's HELP stays
            f"# HELP gpumon_gpu_temperature_celsius {thermal}"}
    text = ""
    with subprocess.Popen(
            [sys.executable, "-m", "gpumon", "daemon", "--simulate", "healthy-8xh100", "--sim-dir",
             str(tmp_path / "sim"), "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=clean_env(PYTHONPATH=str(site))) as proc:
        try:
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and not want <= set(text.splitlines()):
                time.sleep(0.5)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                        text = resp.read().decode()
                except OSError:
                    continue
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert not want - set(text.splitlines()), (sorted(want - set(text.splitlines())), err[-3000:])
    assert err.count("reading gpu_temperature_celsius: check zz_fans declares it differently (meaning, unit, "
                     "source) from check thermal; /metrics uses thermal's declaration") == 1, err
    assert err.count("ERROR check zz_broken did not load") == 1, err


def test_the_readme_examples_declaration_is_its_readings_help() -> None:
    from test_readme_check import _example

    fans = _example()
    f = Finding("fans", "node", Severity.OK, "m", evidence={"readings": [reading("site_fan_rpm", 6200)]})
    snap = Snapshot("n", "p", "v", {"fans": CheckRun("fans", [f], 0, 0, "completed")})
    family = _families(snap, ReadingCatalog.of([fans]))["gpumon_site_fan_rpm"]
    assert family.documentation == (
        "Speed of the node's chassis fan 1. Unit: revolutions per minute. Source: sysfs <hwmon>/fan1_input "
        "(checks.fans.hwmon). Below checks.fans.min_rpm the node needs its hardware inspected.")
    assert family.type == "gauge"
