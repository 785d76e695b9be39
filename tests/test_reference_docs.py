"""The generated reference (docs/reference/) is what tools/gen_reference.py makes of the code now, and
the JSON report's schema describes gpumon's real reports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from conftest import clean_env, run_gpumon
from gpumon.daemon_report import ReportWriter
from gpumon.export.prometheus import HEALTH_STATES, OUTCOMES
from gpumon.health import Health
from gpumon.model import _COMPONENT_RE, Action, CheckRun, Finding, Severity, Status, reading
from gpumon.report import json_report, schema

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
GENERATOR = ROOT / "tools" / "gen_reference.py"
REGENERATE = "python tools/gen_reference.py"


def _generate(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), "--output", str(out)], capture_output=True,
                          text=True, timeout=300, env=clean_env(**env), cwd=out)


def test_the_reference_pages_are_up_to_date(tmp_path: Path) -> None:
    """Regenerated from the code now, every page and schema copy is the committed one."""
    proc = _generate(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    made = sorted(p.name for p in tmp_path.iterdir())
    assert {"checks.md", "metrics.md", "configuration.md", "cli.md", "schemas.md",
            "report-v1.schema.json", "verdict-v1.schema.json"} <= set(made)
    def committed(name: str) -> str | None:
        path = REFERENCE / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    stale = [name for name in made if committed(name) != (tmp_path / name).read_text(encoding="utf-8")]
    assert not stale, (f"docs/reference/ is out of date ({', '.join(stale)}): run `{REGENERATE}` and commit "
                       "the result")


def test_the_pages_do_not_depend_on_the_machine(tmp_path: Path) -> None:
    """Another terminal width, locale, working directory and home: the same pages; and nothing of
    this machine (its paths, its host name) in them."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert _generate(one, COLUMNS="40", HOME=str(one)).returncode == 0
    assert _generate(two, COLUMNS="250", LANG="C", LC_ALL="C", HOME="/nonexistent").returncode == 0
    for page in sorted(one.iterdir()):
        assert page.read_text(encoding="utf-8") == (two / page.name).read_text(encoding="utf-8"), page.name
        text = page.read_text(encoding="utf-8")
        for local in (str(ROOT), str(tmp_path), str(Path.home())):
            assert len(local) < 2 or local not in text, f"{page.name} names {local}"


def test_the_pages_link_only_to_pages_and_anchors_that_exist() -> None:
    """Every relative link of a page goes to a file of docs/reference/ and, with #anchor, to a heading
    of it (as MkDocs makes the heading's id): ``mkdocs build --strict`` must find no broken link."""
    def slug(heading: str) -> str:
        value = re.sub(r"[^\w\s-]", "", heading).strip().lower()
        return re.sub(r"[-\s]+", "-", value)

    anchors = {page.name: {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}
               for page in REFERENCE.glob("*.md")}
    broken = []
    for page in sorted(REFERENCE.glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            file = file or page.name
            if not (REFERENCE / file).is_file() or (anchor and anchor not in anchors.get(file, set())):
                broken.append(f"{page.name}: {target}")
    assert not broken, "\n".join(broken)


def test_the_pages_name_every_check_option_metric_and_command() -> None:
    from gpumon.cli import build_parser
    from gpumon.export.prometheus import FAMILIES
    from gpumon.registry import load_checks

    checks_md = (REFERENCE / "checks.md").read_text(encoding="utf-8")
    metrics_md = (REFERENCE / "metrics.md").read_text(encoding="utf-8")
    cli_md = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    for name, cls in load_checks().items():
        assert f"\n## {name}\n" in checks_md
        for spec in cls.readings:
            assert f"\n### gpumon_{spec.name}\n" in metrics_md
    for family in FAMILIES:
        assert f"`{family}" in metrics_md
    assert "--kmsg-file" in cli_md and "## gpumon canary replay" in cli_md
    assert build_parser().prog == "gpumon"


# --------------------------------------------------------------------------- the report's schema


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    loaded = schema()
    Draft202012Validator.check_schema(loaded)
    return Draft202012Validator(loaded)


def _valid(validator: Draft202012Validator, doc: dict[str, Any]) -> None:
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    # open to keys a later version adds, yet every key gpumon writes today is described
    undeclared = set(doc) - set(validator.schema["properties"])
    assert not undeclared, f"the report's schema does not describe {sorted(undeclared)}"


def test_the_schema_says_what_the_model_says(validator: Draft202012Validator) -> None:
    defs = validator.schema["$defs"]
    finding = defs["finding"]["properties"]
    assert finding["severity"]["enum"] == [s.value for s in Severity]
    assert finding["action"]["enum"] == [a.value for a in Action]
    assert finding["component"]["pattern"] == _COMPONENT_RE.pattern
    assert validator.schema["properties"]["status"]["enum"] == [s.value for s in Status]
    assert set(OUTCOMES) <= set(defs["check_run"]["properties"]["outcome"]["enum"])
    assert defs["node_health"]["properties"]["state"]["enum"] == list(HEALTH_STATES)
    assert set(defs["finding"]["required"]) == set(Finding("x", "node", Severity.OK, "m").to_json())


@pytest.mark.parametrize("args", [("faulty-8xh100", "--json"), ("healthy-8xh100", "--json", "-v")])
def test_check_json_follows_the_schema(validator: Draft202012Validator, args: tuple[str, ...]) -> None:
    proc = run_gpumon("check", "--simulate", *args)
    assert proc.returncode in (0, 1, 2), proc.stderr
    doc = json.loads(proc.stdout)
    _valid(validator, doc)
    assert doc["simulated"] == args[0]


def test_run_bootstrap_json_follows_the_schema(validator: Draft202012Validator, tmp_path: Path) -> None:
    proc = run_gpumon("run-bootstrap", "--simulate", "healthy-8xh100", "--sim-dir", str(tmp_path / "sim"),
                      "--only", "memory_headroom,pcie_topology", "--json")
    assert proc.returncode in (0, 1, 2), proc.stderr
    doc = json.loads(proc.stdout)
    _valid(validator, doc)
    assert doc["bootstrap"]["left_out"], "the schema's left_out entries were not exercised"


def test_the_daemons_report_json_follows_the_schema(validator: Draft202012Validator, tmp_path: Path) -> None:
    health = Health.open(tmp_path / "state", boot_id="boot-1")
    try:
        now = time.time()
        hot = Finding("thermal", "gpu/1", Severity.FAIL, "HBM at 96 C", Action.RESET_GPU,
                      {"readings": [reading("hbm_temperature_celsius", 96)]})
        runs = [CheckRun("thermal", [hot], now, 0.01, "completed"),
                CheckRun("xid", [Finding("xid", "node", Severity.OK, "no Xid")], now, 0.002, "completed")]
        for run in runs:
            health.record_run(run)
        writer = ReportWriter(tmp_path, "node-1", "generic", lambda: runs, health, None)
        writer.write()
        doc = json.loads((tmp_path / "report.json").read_text())
    finally:
        health.close()
    _valid(validator, doc)
    assert doc["health"]["components"]["gpu/1"]["why"], "the schema's faults were not exercised"


def test_the_schema_refuses_what_is_not_a_report(validator: Draft202012Validator) -> None:
    good = json_report([CheckRun("xid", [Finding("xid", "gpu/0", Severity.WARN, "m", Action.RESTART_APP)],
                                 0.0, 0.1, "completed")], node="n", profile="generic")
    _valid(validator, good)
    bad_severity = json.loads(json.dumps(good))
    bad_severity["findings"][0]["severity"] = "critical"
    bad_component = json.loads(json.dumps(good))
    bad_component["findings"][0]["component"] = "gpu3"
    missing = {k: v for k, v in good.items() if k != "checks"}
    bad_reading = json.loads(json.dumps(good))
    bad_reading["findings"][0]["evidence"] = {"readings": [["x", "high", {}]]}
    for doc in (bad_severity, bad_component, missing, bad_reading):
        assert not validator.is_valid(doc)
