"""The daemon's middle hands each run to its sinks (gpumon.daemon_sinks, issue 22 point 6): a sink that
raises is logged and counted and costs the other sinks nothing; the order where it matters (the health
state before remediation reads it and before the exporter publishes it; report.json after /metrics)
is declared and kept."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gpumon.agent import Agent
from gpumon.config import RemediationSettings, SlurmSettings, load_config
from gpumon.daemon import Daemon
from gpumon.daemon_report import ReportSink, ReportWriter
from gpumon.daemon_sinks import ExporterSink, HealthSink, RemediationSink, Sink, Sinks
from gpumon.export.prometheus import SnapshotHolder, make_registry
from gpumon.health import Health
from gpumon.health.store import load_view
from gpumon.hw.tools import ToolRunner
from gpumon.model import Action, CheckRun, Finding, Phase, Severity
from gpumon.registry import load_checks
from gpumon.remediate.runner import RemediationLoop
from gpumon.sim import nvml_inject
from gpumon.sim.scenario import load_scenario
from gpumon.sim.simulation import Simulation


class Broken(Sink):
    """A site's sink with a bug: it raises on every run it is handed."""

    name = "broken"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.enough = threading.Event()  # thermal seen three times: the test has what it waits for

    def record(self, run: CheckRun) -> None:
        self.seen.append(run.check)
        if self.seen.count("thermal") >= 3:
            self.enough.set()
        raise RuntimeError(f"bug in a site's sink ({run.check})")

    def health_changed(self) -> None:
        raise RuntimeError("bug in a site's sink (health)")


@pytest.fixture
def make_agent(inject_lib_dir: Path, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Agent]]:
    # Simulation.start sets these for the process: restore them after the test
    monkeypatch.setenv(nvml_inject.STATE_ENV, "unset")
    monkeypatch.setenv("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    made: list[tuple[Agent, Simulation]] = []

    def make(config_text: str) -> Agent:
        registry = load_checks()
        # two cheap NVML checks keep the daemon's turns short
        off = "".join(f"  {name}:\n    enabled: false\n" for name, cls in registry.items()
                      if name not in ("thermal", "gpu_presence")
                      and cls.phase in (Phase.CONTINUOUS, Phase.CANARY))
        cfg = tmp_path / "gpumon.yaml"
        cfg.write_text(config_text.replace("checks:\n", "checks:\n" + off))
        config = load_config(cfg, registry, site_file=tmp_path / "absent.yaml")
        sim = Simulation.start(load_scenario("healthy-8xh100"), None, tmp_path / "sim")
        agent = Agent(config, registry, sim, persist_state=True)
        agent.start()
        made.append((agent, sim))
        return agent

    yield make
    for _, sim in made:
        sim.close()


def test_a_sink_that_raises_is_logged_once_counted_and_costs_the_other_sinks_nothing(
        make_agent: Callable[[str], Agent], caplog: pytest.LogCaptureFixture) -> None:
    agent = make_agent("checks:\n  thermal:\n    interval_s: 1\nexporter:\n  listen: 127.0.0.1:0\n")
    broken = Broken()
    d = Daemon(agent, sinks=[broken])
    # stopped once thermal ran three times (a busy machine may take longer than 3 s), not after a sleep
    stopper = threading.Thread(target=lambda: broken.enough.wait(60.0) and d.stop.set(), daemon=True)
    stopper.start()
    with caplog.at_level(logging.INFO, logger="gpumon.daemon"):
        assert d.serve(duration=60.0) == 0
    stopper.join(timeout=5.0)
    assert d.sinks.names == ["health", "log", "broken", "exporter", "report"]
    # the daemon went on running its checks: thermal every second, each run handed to every sink
    assert broken.seen.count("thermal") >= 3 and "gpu_presence" in broken.seen, broken.seen
    assert d.sinks.errors == {"health": 0, "log": 0, "broken": len(broken.seen), "exporter": 0, "report": 0}
    # the sinks after it got every run: /metrics and report.json have the latest thermal run
    snapshot = d.snapshots.get() if d.snapshots is not None else None
    assert snapshot is not None and snapshot.runs["thermal"] is d.latest["thermal"]
    text = generate_latest(make_registry(d.snapshots)).decode()  # type: ignore[arg-type]
    assert f'gpumon_sink_errors_total{{sink="broken"}} {float(len(broken.seen))}' in text, text
    assert 'gpumon_sink_errors_total{sink="health"} 0.0' in text
    report = json.loads((agent.state_dir / "report.json").read_text())
    assert {f["check"] for f in report["findings"]} >= {"thermal", "gpu_presence"}
    # and the one before it: the health state folded the runs
    assert "gpu/0" in load_view(agent.state_dir).components
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1, [r.getMessage() for r in failures]  # once, not once a second
    assert failures[0].getMessage().startswith("sink broken failed on the run of ") and failures[0].exc_info


def _run(check: str, severity: Severity, action: Action = Action.NONE) -> CheckRun:
    finding = Finding(check, "gpu/1", severity, f"gpu/1 {severity.value}", action, {})
    return CheckRun(check, [finding], time.time(), 0.01, "completed")


@pytest.fixture
def health(tmp_path: Path) -> Iterator[Health]:
    h = Health.open(tmp_path / "state", boot_id="boot-1")
    try:
        yield h
    finally:
        h.close()


def test_the_health_state_has_each_run_before_remediation_and_the_exporter_read_it(
        health: Health, tmp_path: Path) -> None:
    """The daemon's own order: a sink between them sees the run already in the health state, the
    remediation loop already woken for it, and the exporter not yet publishing it; after the
    fan-out the published snapshot shows the run with the state it caused."""

    class _Profile:
        name = "generic"

    class _Agent:  # what the daemon's snapshot takes from its agent
        node = "node-1"
        profile = _Profile()

    loop = RemediationLoop.build(RemediationSettings(backend="slurm", mode="observe",
                                                     slurm=SlurmSettings(node_name="node-1")),
                                 health, None, ToolRunner(default_timeout=5))
    assert loop is not None  # built, never started: no scheduler is asked anything
    woken = loop.wake
    seen: list[tuple[str, bool, bool]] = []

    class Probe(Sink):
        name = "probe"

        def record(self, run: CheckRun) -> None:
            gpu = health.view().components.get("gpu/1")
            published = d.snapshots is not None and d.snapshots.get().runs.get(run.check) is run
            seen.append((gpu.level.value if gpu else "none", woken.is_set(), published))

    d = Daemon(_Agent(), sinks=[Probe()])  # type: ignore[arg-type]
    d.exporter.health, d.exporter.remediation = health, loop
    d.snapshots = SnapshotHolder(d._snapshot())
    writer = ReportWriter(tmp_path, "node-1", "generic", d._latest_runs, health, loop)
    d.sinks = d._sinks(health, loop, writer)
    assert d.sinks.names == ["health", "remediation", "log", "probe", "exporter", "report"]

    d._record(_run("thermal", Severity.OK))
    loop.wake.clear()
    d._record(_run("thermal", Severity.FAIL, Action.RESET_GPU))
    assert seen == [("healthy", True, False), ("unhealthy", True, False)]
    published = d.snapshots.get()
    assert published.runs["thermal"] is d.latest["thermal"]
    assert published.health["gpu/1"] == ("unhealthy", "reset_gpu")
    assert d.sinks.errors == dict.fromkeys(d.sinks.names, 0)


def test_remediation_is_woken_when_the_last_check_reports_after_the_node_changed(health: Health) -> None:
    """The loop decides nothing until every continuous check has reported once. A node that became
    unhealthy before that (a fatal Xid read at start-up, while nvlink's first run was still going)
    was drained one remediation interval (60 s) late: its change woke a loop not yet ready, and
    the last check's report, which changed nothing, did not wake it again (seen in the suite on a
    busy machine)."""
    loop = RemediationLoop.build(RemediationSettings(backend="slurm", mode="observe",
                                                     slurm=SlurmSettings(node_name="node-1")),
                                 health, None, ToolRunner(default_timeout=5))
    assert loop is not None  # built, never started: no scheduler is asked anything
    health_sink = HealthSink(health)
    sink = RemediationSink(loop, health, {"xid", "nvlink"})

    def record(run: CheckRun) -> None:
        health_sink.record(run)
        sink.record(run)

    record(_run("xid", Severity.FAIL, Action.RESET_GPU))
    assert loop.wake.is_set() and not loop.ready.is_set()
    loop.wake.clear()  # the loop woke, was not ready, and sleeps for its interval
    record(_run("nvlink", Severity.OK))
    assert loop.ready.is_set() and loop.wake.is_set()
    loop.wake.clear()
    record(_run("nvlink", Severity.OK))  # once ready, only a change of the node wakes it
    assert not loop.wake.is_set()


def test_an_order_that_breaks_a_declared_one_is_refused(health: Health, tmp_path: Path) -> None:
    exporter = ExporterSink(lambda: ("node-1", "generic"), {}, lambda: None)
    writer = ReportWriter(tmp_path, "node-1", "generic", list, health, None)
    with pytest.raises(ValueError, match="sink 'exporter' must come after health"):
        Sinks([exporter, HealthSink(health)])
    with pytest.raises(ValueError, match="sink 'report' must come after exporter"):
        Sinks([HealthSink(health), ReportSink(writer, lambda: 0), exporter])
    with pytest.raises(ValueError, match="two sinks named 'health'"):
        Sinks([HealthSink(health), HealthSink(health)])
    # a sink it follows that is not there is no constraint (no remediation configured)
    assert Sinks([exporter, ReportSink(writer, lambda: 0)]).names == ["exporter", "report"]


def test_a_sink_before_the_health_state_that_raises_leaves_it_folded(health: Health) -> None:
    """Whatever the position of the sink that raises: the next one gets the run, and a change of
    the health state made elsewhere (set-healthy) is handed on the same way."""
    sinks = Sinks([Broken(), HealthSink(health)])
    sinks.record(_run("thermal", Severity.FAIL, Action.RESET_GPU))
    assert health.view().components["gpu/1"].level.value == "unhealthy"
    sinks.health_changed()
    assert sinks.errors == {"broken": 2, "health": 0}
