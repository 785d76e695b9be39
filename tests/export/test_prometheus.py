"""The Prometheus exposition: exact values, promtool-clean, auth and TLS on a real socket."""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import tls_web_config
from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
from gpumon.export.webserver import WebConfig, load_web_config, serve_metrics
from gpumon.model import Action, CheckRun, Finding, Severity, reading


def _snapshot(temp: float = 41.0, xids: int = 3) -> Snapshot:
    ok = Finding("thermal", "gpu/0", Severity.OK, "fine",
                 evidence={"readings": [reading("gpu_temperature_celsius", temp)]})
    bad = Finding("xid", "gpu/3", Severity.FAIL, "Xid 79", Action.REBOOT_NODE,
                  {"readings": [reading("xid_events_total", xids, code=79)]})
    runs = {"thermal": CheckRun("thermal", [ok], 1000.0, 0.01, "completed"),
            "xid": CheckRun("xid", [bad], 1001.0, 0.02, "completed")}
    health = {"node": ("unhealthy", "reboot_node"), "gpu/3": ("unhealthy", "reboot_node"),
              "gpu/0": ("healthy", "none")}
    return Snapshot("node-a", "h100-sxm", "0.1.0", runs, health)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_exact_values() -> None:
    text = generate_latest(make_registry(SnapshotHolder(_snapshot()))).decode()
    s = _samples(text)
    assert s[("gpumon_build_info", (("node", "node-a"), ("profile", "h100-sxm"), ("version", "0.1.0")))] == 1
    assert s[("gpumon_finding_severity", (("check", "xid"), ("component", "gpu/3")))] == 4
    assert s[("gpumon_finding_severity", (("check", "thermal"), ("component", "gpu/0")))] == 0
    assert s[("gpumon_health_state", (("component", "gpu/3"), ("state", "unhealthy")))] == 1
    assert ("gpumon_health_state", (("component", "gpu/3"), ("state", "healthy"))) not in s
    assert s[("gpumon_health_state", (("component", "node"), ("state", "healthy")))] == 0  # node: all states
    assert s[("gpumon_recommended_action", (("action", "reboot_node"), ("component", "node")))] == 1
    assert s[("gpumon_gpu_temperature_celsius", (("check", "thermal"), ("component", "gpu/0")))] == 41
    assert s[("gpumon_xid_events_total", (("check", "xid"), ("code", "79"), ("component", "gpu/3")))] == 3
    assert s[("gpumon_check_outcome", (("check", "xid"), ("outcome", "completed")))] == 1
    assert s[("gpumon_check_last_run_timestamp_seconds", (("check", "xid"),))] == pytest.approx(1001.02)


def test_series_follow_the_state_back_to_healthy() -> None:
    holder = SnapshotHolder(_snapshot())
    registry = make_registry(holder)
    generate_latest(registry)
    healed = _snapshot()
    holder.set(Snapshot(healed.node, healed.profile, healed.version, healed.runs,
                        {"node": ("healthy", "none"), "gpu/3": ("healthy", "none")}))
    s = _samples(generate_latest(registry).decode())
    # the unhealthy series is gone from the scrape (Prometheus marks it stale), healthy is 1
    assert ("gpumon_health_state", (("component", "gpu/3"), ("state", "unhealthy"))) not in s
    assert s[("gpumon_health_state", (("component", "gpu/3"), ("state", "healthy")))] == 1
    assert s[("gpumon_health_state", (("component", "node"), ("state", "unhealthy")))] == 0


def test_bad_readings_are_refused_or_skipped() -> None:
    with pytest.raises(ValueError):
        reading("Bad-Name", 1)
    with pytest.raises(ValueError):
        reading("x", 1, component="gpu/0")
    f = Finding("c", "node", Severity.OK, "m", evidence={"readings": [["x", "nan?"], "junk", ["ok", 1, {}]]})
    snap = Snapshot("n", "p", "v", {"c": CheckRun("c", [f], 0, 0, "completed")})
    s = _samples(generate_latest(make_registry(SnapshotHolder(snap))).decode())
    assert s[("gpumon_ok", (("check", "c"), ("component", "node")))] == 1


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: .ci/run must install the Debian package prometheus")
        pytest.skip("promtool not installed (Debian package prometheus)")
    return tool


def test_promtool_check_metrics_is_clean() -> None:
    text = generate_latest(make_registry(SnapshotHolder(_snapshot()))).decode()
    proc = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)


def _get(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_basic_auth_and_tls_from_a_web_config(tmp_path: Path) -> None:
    web, crt = tls_web_config(tmp_path, "prom", "s3cret")
    config = load_web_config(web)
    server, _ = serve_metrics(make_registry(SnapshotHolder(_snapshot())), "127.0.0.1", 0, config)
    try:
        port = server.server_port
        ctx = ssl.create_default_context(cafile=str(crt))
        url = f"https://127.0.0.1:{port}/metrics"
        assert _get(url, context=ctx) == 401
        wrong = base64.b64encode(b"prom:nope").decode()
        assert _get(url, {"Authorization": f"Basic {wrong}"}, ctx) == 401
        good = base64.b64encode(b"prom:s3cret").decode()
        assert _get(url, {"Authorization": f"Basic {good}"}, ctx) == 200
        assert _get(url, {"Authorization": f"Basic {good}"}, ctx) == 200  # cached verification
    finally:
        server.shutdown()
        server.server_close()


def test_plain_http_without_web_config() -> None:
    server, _ = serve_metrics(make_registry(SnapshotHolder(_snapshot())), "127.0.0.1", 0, WebConfig())
    try:
        assert _get(f"http://127.0.0.1:{server.server_port}/metrics") == 200
    finally:
        server.shutdown()
        server.server_close()


def test_web_config_errors_name_the_key(tmp_path: Path) -> None:
    from gpumon.errors import ConfigError

    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth: x\n")
    with pytest.raises(ConfigError) as info:
        load_web_config(web)
    assert (info.value.line, info.value.key) == (4, "tls_server_config.client_auth")
    web.write_text("basic_auth_users:\n  prom: plaintext\n")
    with pytest.raises(ConfigError, match="bcrypt"):
        load_web_config(web)


def test_every_check_reading_of_a_faulty_node_is_promtool_clean() -> None:
    import json

    from conftest import run_gpumon

    proc = run_gpumon("check", "--simulate", "faulty-8xh100", "--json", "-v")
    assert proc.returncode == 2, proc.stderr
    runs: dict[str, list[Finding]] = {}
    for f in json.loads(proc.stdout)["findings"]:
        runs.setdefault(f["check"], []).append(Finding.from_json(f))
    snap = Snapshot("n", "h100-sxm", "0.1.0",
                    {c: CheckRun(c, fs, 0.0, 0.0, "completed") for c, fs in runs.items()})
    text = generate_latest(make_registry(SnapshotHolder(snap))).decode()
    s = _samples(text)
    assert s[("gpumon_xid_events_total", (("check", "xid"), ("code", "79"), ("component", "gpu/3")))] == 1
    # one reading, no window yet: the share is known only after the daemon has watched a while
    assert ("gpumon_throttle_active_ratio",
            (("check", "throttle"), ("component", "gpu/1"), ("reason", "hw_slowdown"))) in s
    assert s[("gpumon_gpu_temperature_celsius", (("check", "thermal"), ("component", "gpu/0")))] == 35
    assert ("gpumon_ib_downtime_seconds", (("check", "ib"), ("component", "ib/mlx5_2/1"))) in s
    proc = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)


def test_cached_exposition_serves_the_same_samples_in_every_format() -> None:
    import gzip as gz

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    from gpumon.export.prometheus import CachedExposition

    holder = SnapshotHolder(_snapshot())
    app = CachedExposition(holder)
    reference = _samples(generate_latest(make_registry(holder)).decode())
    text, ctype = app.render("text/plain", gzip_ok=False)
    assert ctype.startswith("text/plain") and _samples(text.decode()) == reference
    zipped, _ = app.render("text/plain", gzip_ok=True)
    assert gz.decompress(zipped) == text  # two gzip members, one stream
    om, ctype = app.render("application/openmetrics-text; version=1.0.0", gzip_ok=False)
    assert ctype.startswith("application/openmetrics-text") and om.endswith(b"# EOF\n")
    assert om.count(b"# EOF") == 1
    parsed = {(s.name, tuple(sorted(s.labels.items()))) for f in om_families(om.decode()) for s in f.samples}
    assert {k for k in reference if not k[0].endswith("_created")} <= parsed | {
        k for k in reference if k[0].endswith("_total")}
    # a new content version is rendered again; an unchanged one comes from the cache
    before = holder.version
    holder.set(_snapshot())
    assert holder.version == before
    holder.set(_snapshot(temp=55.0))
    assert holder.version == before + 1
    hot, _ = app.render("text/plain", gzip_ok=False)
    assert _samples(hot.decode())[("gpumon_gpu_temperature_celsius",
                                   (("check", "thermal"), ("component", "gpu/0")))] == 55
    proc = subprocess.run([_promtool(), "check", "metrics"], input=hot.decode(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout


def _run(check: str, value: float, severity: Severity = Severity.OK, started: float = 1000.0) -> CheckRun:
    comp = {"thermal": "gpu/0", "xid": "gpu/3", "ib": "ib/mlx5_0/1"}[check]
    f = Finding(check, comp, severity, "m", evidence={"readings": [reading(f"{check}_value", value, port=1)]})
    return CheckRun(check, [f], started, 0.01, "completed")


def _fresh_render(snap: Snapshot) -> bytes:
    from gpumon.export.prometheus import CachedExposition

    return CachedExposition(SnapshotHolder(snap)).render("text/plain", gzip_ok=False)[0]


def test_only_a_changed_run_renders_again_and_the_text_is_what_a_fresh_render_gives() -> None:
    from gpumon.export.prometheus import CachedExposition

    # the daemon's pattern: every snapshot holds the runs of the last one, and one new run
    runs = {"thermal": _run("thermal", 41.0), "xid": _run("xid", 3.0), "ib": _run("ib", 0.0)}
    holder = SnapshotHolder(Snapshot("n", "p", "v", dict(runs)))
    app = CachedExposition(holder)
    app.render("text/plain", gzip_ok=False)
    # a new run that says the same (the 1 s ib check on a healthy node): no new version
    runs["ib"] = _run("ib", 0.0, started=1001.0)
    snap = Snapshot("n", "p", "v", dict(runs))
    holder.set(snap)
    assert holder.version == 0
    assert app.render("text/plain", gzip_ok=False)[0] == _fresh_render(snap)
    # a changed reading in one check, the others' runs untouched: a new version, rendered
    runs["thermal"] = _run("thermal", 55.0)
    snap = Snapshot("n", "p", "v", dict(runs))
    holder.set(snap)
    assert holder.version == 1
    text = app.render("text/plain", gzip_ok=False)[0]
    assert text == _fresh_render(snap)
    assert _samples(text.decode())[("gpumon_thermal_value", (("check", "thermal"), ("component", "gpu/0"),
                                                             ("port", "1")))] == 55
    # the same snapshot again, then the same runs in a new snapshot: nothing changed
    holder.set(snap)
    holder.set(Snapshot("n", "p", "v", dict(runs)))
    assert holder.version == 1
    # a severity change in the check that runs every second, and a check that goes away
    runs["ib"] = _run("ib", 0.0, Severity.WARN, started=1002.0)
    holder.set(Snapshot("n", "p", "v", dict(runs)))
    assert holder.version == 2
    del runs["xid"]
    snap = Snapshot("n", "p", "v", dict(runs))
    holder.set(snap)
    assert holder.version == 3
    assert app.render("text/plain", gzip_ok=False)[0] == _fresh_render(snap)


_STEP = st.fixed_dictionaries({
    name: st.sampled_from(["keep", "same", "value", "severity", "drop"])
    for name in ("thermal", "xid", "ib")
})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_STEP, st.sampled_from(["healthy", "degraded"]), st.booleans()), min_size=1,
                max_size=8))
def test_cached_signature_changes_exactly_when_a_fresh_one_does(
        steps: list[tuple[dict[str, str], str, bool]]) -> None:
    from gpumon.export.prometheus import CachedExposition, _signature

    runs = {"thermal": _run("thermal", 41.0), "xid": _run("xid", 3.0), "ib": _run("ib", 0.0)}
    values = {name: 0.0 for name in runs}
    snap = Snapshot("n", "p", "v", dict(runs))
    holder = SnapshotHolder(snap)
    app = CachedExposition(holder)
    # the daemon hands over the same health map while the health state stays as it was
    kept = {state: {"node": (state, "none")} for state in ("healthy", "degraded")}
    for step, state, same_map in steps:
        for name, what in step.items():
            if what == "drop":
                runs.pop(name, None)
                continue
            if what == "value":
                values[name] += 1
            if what != "keep" or name not in runs:
                runs[name] = _run(name, values[name], Severity.WARN if what == "severity" else Severity.OK)
        before, version = snap, holder.version
        health = kept[state] if same_map else {"node": (state, "none")}
        snap = Snapshot("n", "p", "v", dict(runs), health)
        holder.set(snap)
        changed = _signature(snap)[0] != _signature(before)[0]
        assert holder.version == version + changed
        assert app.render("text/plain", gzip_ok=False)[0] == _fresh_render(snap)
