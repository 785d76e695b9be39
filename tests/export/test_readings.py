"""Every metric explains itself: a HELP with meaning, unit and source for every reading in the code,
and on a real exposition of a simulated node (healthy and faulty), which promtool passes."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.export.prometheus import FAMILIES, Snapshot, SnapshotHolder, make_registry
from gpumon.export.readings import READINGS, generic_help, help_for, is_generic, kind_of
from gpumon.health import Health
from gpumon.model import CheckRun, Finding, Severity, reading

ROOT = Path(__file__).resolve().parents[2]


def _reading_calls() -> dict[str, set[str]]:
    """Reading name -> the files that publish it, from every ``reading(...)`` call in checks/ and gpumon/."""
    found: dict[str, set[str]] = {}
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
            # a name computed at run time could not be checked against the table
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                f"{rel}:{node.lineno}: reading() with a name that is not a string literal")
            found.setdefault(first.value, set()).add(rel)
    return found


def test_every_reading_in_the_code_has_a_help_and_every_entry_a_reading() -> None:
    used = _reading_calls()
    assert len(used) >= 20  # the scan sees the checks (a broken scan would pass vacuously)
    missing = sorted(set(used) - set(READINGS))
    assert not missing, f"readings without an entry in gpumon/export/readings.py: {missing}"
    stale = sorted(set(READINGS) - set(used))
    assert not stale, f"entries no check publishes any more (renamed?): {stale}"
    for name, files in used.items():
        for check in READINGS[name].checks:
            assert any(f"/{check}" in f"/{f}" for f in files), (name, check, files)


def test_each_entry_says_meaning_unit_source_and_follows_the_counter_rule() -> None:
    for name, doc in READINGS.items():
        assert (doc.kind == "counter") == name.endswith("_total"), name
        assert kind_of(name) == doc.kind
        assert "Source:" in doc.help, name
        assert "Unit:" in doc.help or "flag" in doc.help, name
        assert "\n" not in doc.help and not is_generic(doc.help), name
        reading(name, 1)  # a valid reading name
    for family, text in FAMILIES.items():
        assert family.startswith("gpumon_") and "Source:" in text and "\n" not in text, family


def test_a_site_reading_gets_a_help_that_names_its_check() -> None:
    assert help_for("site_fan_rpm", ["fans"]) == generic_help("site_fan_rpm", ["fans"])
    assert is_generic(help_for("site_fan_rpm", ["fans"])) and "fans" in help_for("site_fan_rpm", ["fans"])
    assert kind_of("site_fan_spins_total") == "counter" and kind_of("site_fan_rpm") == "gauge"
    f = Finding("fans", "node", Severity.OK, "m", evidence={"readings": [reading("site_fan_rpm", 9000)]})
    snap = Snapshot("n", "p", "v", {"fans": CheckRun("fans", [f], 0, 0, "completed")})
    families = {m.name: m for m in text_string_to_metric_families(
        generate_latest(make_registry(SnapshotHolder(snap))).decode())}
    assert families["gpumon_site_fan_rpm"].documentation == generic_help("site_fan_rpm", ["fans"])


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
    assert len(names & {f"gpumon_{r.removesuffix('_total')}" for r in READINGS}) >= 10  # the readings
    for family in families:
        exported = f"{family.name}_total" if family.type == "counter" else family.name
        reading_name = exported.removeprefix("gpumon_")
        if reading_name in READINGS:
            assert family.documentation == READINGS[reading_name].help, family.name
            assert family.type == READINGS[reading_name].kind, family.name
        else:
            # not a reading: one of the exporter's own families (counters under their base name)
            assert family.documentation == FAMILIES[family.name], family.name
        assert not is_generic(family.documentation), family.name
    proc = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)
