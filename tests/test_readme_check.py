"""The "Writing a check" page's example runs as written: loaded from docs/extending/writing-a-check.md
itself, configured through the real config loader, run by the real runner on a host-root tree."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpumon.check import Check
from gpumon.checkstate import CheckStateStore
from gpumon.config import load_config
from gpumon.errors import ConfigError
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.model import Action, Severity
from gpumon.profiles import GENERIC
from gpumon.runner import Runner

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending" / "writing-a-check.md"


def _example() -> type[Check]:
    text = PAGE.read_text()
    section = text[text.index("# Writing a check\n"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the Writing a check page has no python example"
    module = types.ModuleType("readme_fans")
    sys.modules[module.__name__] = module  # dataclasses look their module up while building
    exec(compile(code.group(1), str(PAGE), "exec"), module.__dict__)
    cls = module.__dict__["FanCheck"]
    assert isinstance(cls, type) and issubclass(cls, Check)
    return cls


def _run(tmp_path: Path, config_text: str, rpm: str | None) -> list[Any]:
    cls = _example()
    host = tmp_path / "host"
    hwmon = host / "sys/class/hwmon/hwmon0"
    hwmon.mkdir(parents=True)
    if rpm is not None:
        (hwmon / "fan1_input").write_text(rpm)
    conf = tmp_path / "gpumon.yaml"
    conf.write_text(config_text)
    config = load_config(conf, {cls.name: cls})
    runner = Runner(Hardware(host), Inventory(), GENERIC, config, node="test")
    (run,) = runner.run([cls()])
    assert run.outcome == "completed"
    return run.findings


def test_the_example_reports_its_reading_and_judges_by_its_configured_threshold(tmp_path: Path) -> None:
    (ok,) = _run(tmp_path, "checks:\n  fans:\n    min_rpm: 5000\n", "6200\n")
    assert ok.severity is Severity.OK and ok.evidence["readings"] == [["site_fan_rpm", 6200.0, {}]]
    (slow,) = _run(tmp_path / "2", "checks:\n  fans:\n    min_rpm: 7000\n", "6200\n")
    assert (slow.severity, slow.action) == (Severity.WARN, Action.INSPECT_HARDWARE)
    assert "6200 rpm, below 7000" in slow.message


def test_the_example_says_unknown_when_it_cannot_read(tmp_path: Path) -> None:
    (f,) = _run(tmp_path, "checks: {}\n", None)
    assert f.severity in (Severity.SKIPPED, Severity.UNKNOWN) and "fan1_input" in f.message


def test_a_bad_key_in_its_section_names_file_line_and_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, "checks:\n  fans:\n    min_rmp: 5000\n", "6200\n")
    assert "gpumon.yaml" in str(err.value) and "min_rmp" in str(err.value) and ":3" in str(err.value)


def test_its_declared_state_is_kept_by_the_framework_across_runs_and_restarts(tmp_path: Path) -> None:
    cls = _example()
    hwmon = tmp_path / "host/sys/class/hwmon/hwmon0"
    hwmon.mkdir(parents=True)
    conf = tmp_path / "gpumon.yaml"
    conf.write_text("checks: {}\n")
    config = load_config(conf, {cls.name: cls})

    def run_at(rpm: int, store: CheckStateStore) -> str:
        (hwmon / "fan1_input").write_text(f"{rpm}\n")
        runner = Runner(Hardware(tmp_path / "host"), Inventory(), GENERIC, config, node="test", states=store)
        (run,) = runner.run([cls()])
        store.save(cls.name)
        return run.findings[0].message

    states = tmp_path / "state"
    states.mkdir()
    assert "slowest this boot 5100 rpm" in run_at(5100, CheckStateStore(states))
    assert "slowest this boot 4800 rpm" in run_at(4800, CheckStateStore(states))  # a restart: read back
    assert "slowest this boot 4800 rpm" in run_at(6000, CheckStateStore(states))
