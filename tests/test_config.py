from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_gpumon
from gpumon.config import load_config
from gpumon.errors import ConfigError
from gpumon.registry import load_checks

CHECKS = load_checks()


def _load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "gpumon.yaml"
    path.write_text(text)
    return load_config(path, CHECKS, site_file=tmp_path / "absent.yaml")


def _error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    return info.value


def test_defaults_load_and_site_file_overrides(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "timeouts:\n  nvml_call_s: 2.5\nchecks:\n  throttle:\n    interval_s: 5\n")
    assert cfg.timeouts.nvml_call_s == 2.5  # type: ignore[attr-defined]
    assert cfg.timeouts.sysfs_read_s == 2.0  # type: ignore[attr-defined]
    settings = cfg.settings(CHECKS["throttle"])  # type: ignore[attr-defined]
    assert settings.interval_s == 5.0 and settings.timeout_s == CHECKS["throttle"].timeout


def test_unknown_key_names_file_line_and_key(tmp_path: Path) -> None:
    err = _error(tmp_path, "log_level: info\n\ntimeouts:\n  nvml_call_seconds: 3\n")
    assert err.file == str(tmp_path / "gpumon.yaml")
    assert err.line == 4
    assert err.key == "timeouts.nvml_call_seconds"
    assert "unknown key" in str(err)


def test_wrong_type(tmp_path: Path) -> None:
    err = _error(tmp_path, "daemon:\n  jitter: lots\n")
    assert (err.line, err.key) == (2, "daemon.jitter")
    assert "expected a number" in str(err)


def test_bad_value(tmp_path: Path) -> None:
    err = _error(tmp_path, "log_level: chatty\n")
    assert (err.line, err.key) == (1, "log_level")
    err = _error(tmp_path, "daemon:\n  jitter: 0.9\n")
    assert (err.line, err.key) == (2, "daemon.jitter") and "<= 0.5" in str(err)


def test_unknown_check_and_bad_check_option(tmp_path: Path) -> None:
    err = _error(tmp_path, "checks:\n  thermals: {enabled: false}\n")
    assert (err.line, err.key) == (2, "checks.thermals")
    err = _error(tmp_path, "checks:\n  throttle:\n    fail_reasons: [hw_slowdwn]\n")
    assert err.key == "checks.throttle" and "hw_slowdwn" in str(err)
    err = _error(tmp_path, "checks:\n  xid:\n    interval_s: -1\n")
    assert (err.line, err.key) == (3, "checks.xid.interval_s")


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    err = _error(tmp_path, "timeouts:\n  nvml_call_s: [1,\n")
    assert err.line is not None and "invalid YAML" in str(err)


def test_duplicate_key(tmp_path: Path) -> None:
    err = _error(tmp_path, "log_level: info\nlog_level: debug\n")
    assert (err.line, err.key) == (2, "log_level")


def test_cli_bad_config_exits_3_naming_file_line_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("state_dir: /tmp/x\ntimeouts:\n  nvml_call_s: fast\n")
    proc = run_gpumon("--config", str(path), "check", "--simulate", "healthy-8xh100")
    assert proc.returncode == 3
    assert f"{path}:3: timeouts.nvml_call_s" in proc.stderr
    assert proc.stdout == ""  # nothing started, nothing reported


def test_missing_config_file_exits_3(tmp_path: Path) -> None:
    proc = run_gpumon("--config", str(tmp_path / "nope.yaml"), "list-checks")
    assert proc.returncode == 3 and "not found" in proc.stderr
