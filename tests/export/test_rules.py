"""Alerting rules and the Grafana dashboard in config/, checked with Prometheus's own tools.

Rules: ``promtool check rules`` and ``promtool test rules`` (the unit tests in
config/prometheus/gpumon-rules.test.yaml) run here, and every alert must have a
unit test that shows it firing and, later in the same test, resolved.

Dashboard: what these tests prove, and what they do not.

- The file is JSON in the shape Grafana imports (schemaVersion >= 36, a
  ``${DS_PROMETHEUS}`` datasource input used by every panel and target, a
  ``node`` variable).
- Every panel expression, with the Grafana variables replaced by plain values
  ($node, $job -> ``.*``; $__rate_interval -> 2m), parses with the PromQL parser
  of the installed Prometheus (``promtool check rules`` on recording rules made
  of them): ``promtool query`` needs a running server, so this is how it is
  parsed offline.
- Every ``gpumon_*`` name they use is one gpumon exports: a family name in
  gpumon/ (the collector) or a reading a check publishes (``reading("name", ...)``
  in checks/).
- Every panel expression returns data when evaluated (``promtool test rules``,
  Prometheus's own engine) over the series of a real exposition: the findings of
  every continuous check on the simulated faulty 8xH100 node, folded into the
  health store, rendered by gpumon's collector, with the job/instance labels a
  scrape adds. So label names and joins match what gpumon really exports.
- Not proven: that Grafana renders the panels as intended (no Grafana runs here),
  nor anything about panels' look, units or colours.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
from gpumon.health import Health
from gpumon.model import CheckRun, Finding

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "config" / "prometheus" / "gpumon-rules.yaml"
RULE_TESTS = ROOT / "config" / "prometheus" / "gpumon-rules.test.yaml"
DASHBOARD = ROOT / "config" / "grafana" / "gpumon-dashboard.json"
# the alerts' runbooks: one `##` heading per alert on this page of the docs site, which MkDocs serves at
# operators/alerts/ (use_directory_urls) under the site's base, the placeholder the rules ship with
ALERTS_PAGE = ROOT / "docs" / "operators" / "alerts.md"
DOCS_BASE = "https://example.invalid/gpumon/"
# Named by issue 4 for the circuit breaker; the lead adds it to the exporter. Allowed before it
# exists so that the alert can ship with the rules; found in gpumon/ once it is there.
ANNOUNCED = {"gpumon_remediation_breaker_open"}
_METRIC = re.compile(r"\b(gpumon_[a-z0-9_]+)\b")
_VARIABLES = {"$__rate_interval": "2m", "$__interval": "1m", "$__range": "1h", "$job": ".*", "$node": ".*"}


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: .ci/run must install the Debian package prometheus")
        pytest.skip("promtool not installed (Debian package prometheus)")
    return tool


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _exported_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "gpumon").rglob("*.py"):
        names.update(re.findall(r"[\"'](gpumon_[a-z0-9_]+)[\"']", path.read_text()))
    for path in (ROOT / "checks").rglob("*.py"):
        names.update(f"gpumon_{n}" for n in re.findall(r"\breading\(\s*\"([a-z0-9_]+)\"", path.read_text()))
    return names


# -- rules ----------------------------------------------------------------------------------------


def test_promtool_check_rules_is_clean() -> None:
    proc = _run("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in proc.stdout, proc.stdout
    assert proc.stderr.strip() == "", proc.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    proc = _run("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout and "FAILED" not in proc.stdout, proc.stdout


def test_every_alert_is_tested_firing_and_then_resolved() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    shown: dict[str, set[str]] = {}
    for case in doc["tests"]:
        evals = sorted(case["alert_rule_test"], key=lambda e: _minutes(e["eval_time"]))
        fired: set[str] = set()
        for e in evals:
            name = e["alertname"]
            if e.get("exp_alerts"):
                fired.add(name)
                shown.setdefault(name, set()).add("fires")
            elif name in fired:
                shown.setdefault(name, set()).add("resolves")
            else:
                shown.setdefault(name, set()).add("quiet")
    for alert in _alerts():
        seen = shown.get(alert["alert"])
        assert seen == {"fires", "resolves", "quiet"}, (alert["alert"], seen)


def _minutes(text: str) -> float:
    m = re.fullmatch(r"(\d+)([smh])", text)
    assert m, text
    return int(m[1]) * {"s": 1 / 60, "m": 1, "h": 60}[m[2]]


def _page_headings(path: Path) -> dict[str, tuple[int, str]]:
    """Heading text -> (level, anchor) of a docs page, as MkDocs makes them: Python-Markdown's toc
    extension (mkdocs.yml's, with attr_list for a heading's own {#id}; fenced code is not headings)."""
    import markdown

    md = markdown.Markdown(extensions=["toc", "attr_list", "fenced_code"])
    md.convert(path.read_text())
    out: dict[str, tuple[int, str]] = {}

    def walk(tokens: list[dict[str, Any]]) -> None:
        for t in tokens:
            out.setdefault(t["name"], (t["level"], t["id"]))
            walk(t["children"])

    walk(md.toc_tokens)
    return out


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    alerts = _alerts()
    assert len({a["alert"] for a in alerts}) == len(alerts)
    headings = _page_headings(ALERTS_PAGE)
    for a in alerts:
        assert a["labels"]["severity"] in ("page", "ticket"), a["alert"]
        assert set(a["annotations"]) == {"summary", "description", "runbook_url"}, a["alert"]
        # the alerts page has a `## <alert>` heading, and the runbook_url is that page on the docs site
        # at that heading's anchor
        assert a["alert"] in headings, f"docs/operators/alerts.md has no heading '## {a['alert']}'"
        level, anchor = headings[a["alert"]]
        assert level == 2, (a["alert"], level)
        # the form the rules file's header promises: the alert's name in lower case
        assert anchor == a["alert"].lower(), (a["alert"], anchor)
        assert a["annotations"]["runbook_url"] == f"{DOCS_BASE}operators/alerts/#{anchor}", a["alert"]


def test_the_rule_tests_expect_the_same_runbook_urls() -> None:
    """promtool compares the annotations, so this holds already; said here in words, so that a test
    file left on old URLs fails by name."""
    urls = {a["alert"]: a["annotations"]["runbook_url"] for a in _alerts()}
    doc = yaml.safe_load(RULE_TESTS.read_text())
    seen = 0
    for case in doc["tests"]:
        for e in case["alert_rule_test"]:
            for alert in e.get("exp_alerts") or []:
                assert alert["exp_annotations"]["runbook_url"] == urls[e["alertname"]], e["alertname"]
                seen += 1
    assert seen >= len(urls)


def test_rules_use_only_metrics_gpumon_exports() -> None:
    exported = _exported_names() | ANNOUNCED
    for a in _alerts():
        text = a["expr"] + " ".join(a["annotations"].values())
        unknown = set(_METRIC.findall(text)) - exported
        assert not unknown, (a["alert"], unknown)


def test_the_alerts_the_issue_asks_for_exist() -> None:
    exprs = {a["alert"]: a["expr"] for a in _alerts()}
    wanted = {
        "GpumonNodeUnhealthy": 'state="unhealthy"', "GpumonNodeQuarantined": 'state="quarantined"',
        "GpumonGpuNeedsReset": 'action="reset_gpu"', "GpumonNodeNeedsReboot": 'action="reboot_node"',
        "GpumonHardwareRepair": "inspect_hardware", "GpumonIbPortFailing": 'check="ib"',
        "GpumonXidStorm": "gpumon_xid_events_total", "GpumonSdcCanaryFailed": 'check="sdc_canary"',
        "GpumonSdcInJob": 'check="guard"',
        "GpumonDown": 'up{job="gpumon"}', "GpumonChecksStale": "gpumon_check_last_run_timestamp_seconds",
        "GpumonCheckHung": "hung|still-hung",
        "GpumonRemediationBreakerOpen": "gpumon_remediation_breaker_open",
    }
    for name, needle in wanted.items():
        assert needle in exprs.get(name, ""), name


# -- dashboard ------------------------------------------------------------------------------------


def _panels() -> list[dict[str, Any]]:
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p["type"] != "row"]


def _targets() -> list[tuple[str, str]]:
    """(where, expr with the Grafana variables replaced) for every target of every panel."""
    out = []
    for p in _panels():
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in _VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, (p["title"], expr)
            out.append((f"panel {p['id']} {p['title']!r} target {t['refId']}", expr))
    return out


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["schemaVersion"] >= 36
    assert [(i["name"], i["type"], i["pluginId"]) for i in doc["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert "node" in variables and "gpumon_build_info" in variables["node"]["query"]
    assert all(v["datasource"] == ds for v in variables.values())
    panels = _panels()
    ids = [p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("health state", "not healthy", "recommended actions", "xid", "infiniband downtime",
                  "throttle", "temperatures", "aer", "check duration", "check outcomes"):
        assert topic in titles, topic
    for p in panels:
        assert p["datasource"] == ds, p["title"]
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ds and t["expr"].strip(), p["title"]
            # every panel follows the node variable
            assert 'node=~"$node"' in t["expr"], p["title"]


def test_dashboard_exprs_parse_with_promtool(tmp_path: Path) -> None:
    targets = _targets()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, (_, expr) in enumerate(targets)]}]}
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    proc = _run("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(targets)} rules found" in proc.stdout


def test_dashboard_exprs_use_only_metrics_gpumon_exports() -> None:
    exported = _exported_names() | ANNOUNCED
    for where, expr in _targets():
        unknown = set(_METRIC.findall(expr)) - exported
        assert not unknown, (where, unknown)


def _faulty_node_snapshot() -> Snapshot:
    from conftest import run_gpumon

    proc = run_gpumon("check", "--simulate", "faulty-8xh100", "--json", "-v")
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    findings: dict[str, list[Finding]] = {}
    for f in doc["findings"]:
        findings.setdefault(f["check"], []).append(Finding.from_json(f))
    runs = {c["check"]: CheckRun(c["check"], findings.get(c["check"], []), doc["time"], c["seconds"],
                                 c["outcome"]) for c in doc["checks"]}
    with tempfile.TemporaryDirectory() as tmp:
        health = Health.open(tmp, boot_id="test-boot")
        for run in runs.values():
            health.record_run(run)
        view = health.view()
        health.close()
    # the node's roll-up last: view.components has an entry "node" of its own
    states = {name: (c.level.value, c.action.value) for name, c in view.components.items()}
    states["node"] = (view.node.level.value, view.node.action.value)
    assert states["node"][0] == "unhealthy"
    return Snapshot(doc["node"], doc["profile"], "0.1.0", runs, states)


def _input_series(text: str) -> list[dict[str, str]]:
    """The exposition as promtool input series, as Prometheus would store one scrape a minute."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**s.labels, "job": "gpumon", "instance": "n1:9426"}
            sel = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
            value = format(s.value, "f")
            # counters move so that rate()/increase() have something to show
            values = f"{value}+1x20" if family.type == "counter" else f"{value}x20"
            out.append({"series": f"{s.name}{{{sel}}}", "values": values})
    breaker = 'gpumon_remediation_breaker_open{job="gpumon",instance="n1:9426"}'
    out.append({"series": breaker, "values": "0x20"})
    return out


def test_every_dashboard_panel_returns_data_for_a_faulty_node(tmp_path: Path) -> None:
    text = generate_latest(make_registry(SnapshotHolder(_faulty_node_snapshot()))).decode()
    targets = _targets()
    names = {f"Panel{i}": where for i, (where, _) in enumerate(targets)}
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"alert": f"Panel{i}", "expr": f"absent({expr})"} for i, (_, expr) in enumerate(targets)]}]}
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = {"rule_files": ["panels.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": _input_series(text),
        "alert_rule_test": [{"eval_time": "10m", "alertname": name, "exp_alerts": []} for name in names]}]}
    (tmp_path / "panels.test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = _run("test", "rules", "panels.test.yaml", cwd=tmp_path)
    empty = [names[n] for n in re.findall(r"alertname: (Panel\d+),", proc.stdout + proc.stderr)]
    assert proc.returncode == 0 and not empty, (
        f"panels with no data: {empty}\n{proc.stdout[-3000:]}{proc.stderr}")
