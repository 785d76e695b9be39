from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_gpumon
from gpumon.config import load_config
from gpumon.errors import ConfigError
from gpumon.registry import load_checks
from gpumon.schema import MAX_FILE_BYTES, build, load_yaml

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


# ----------------------------------------------------------------------------- hostile files (issue 14)

def _alias_bomb(levels: int = 9, fanout: int = 9) -> str:
    """A "billion laughs": each level a list of ``fanout`` aliases of the level below."""
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * fanout) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _refused_quickly(proc: subprocess.CompletedProcess[str], elapsed: float, file: Path) -> None:
    assert proc.returncode == 3, proc.stderr
    assert f"{file}:" in proc.stderr and "aliases expand to more than" in proc.stderr, proc.stderr
    assert elapsed < 20, elapsed  # expanding 9**9 nodes took minutes and 4.9 GB


def test_alias_bomb_config_exits_3_at_once_naming_the_file(tmp_path: Path) -> None:
    bomb = tmp_path / "gpumon.yaml"
    bomb.write_text(_alias_bomb())
    start = time.monotonic()
    proc = run_gpumon("check", "--config", str(bomb), "--simulate", "healthy-8xh100", timeout=60)
    _refused_quickly(proc, time.monotonic() - start, bomb)
    assert f"{bomb}:5:" in proc.stderr  # the alias that crossed the limit: level 5 is 9**5 nodes


def test_alias_bomb_scenario_and_profile_files_exit_3(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(_alias_bomb())
    start = time.monotonic()
    proc = run_gpumon("check", "--simulate", str(scenario), timeout=60)
    _refused_quickly(proc, time.monotonic() - start, scenario)

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "bomb.yaml").write_text(_alias_bomb())
    config = tmp_path / "gpumon.yaml"
    config.write_text(f"profile_dirs: [{profiles}]\n")
    start = time.monotonic()
    proc = run_gpumon("check", "--config", str(config), "--simulate", "healthy-8xh100", timeout=60)
    _refused_quickly(proc, time.monotonic() - start, profiles / "bomb.yaml")


def test_a_few_aliases_still_share_settings(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "checks:\n  xid: &every_5_min {interval_s: 300}\n  pcie: *every_5_min\n")
    assert cfg.settings(CHECKS["xid"]).interval_s == 300  # type: ignore[attr-defined]
    assert cfg.settings(CHECKS["pcie"]).interval_s == 300  # type: ignore[attr-defined]


def test_recursive_alias_and_deep_nesting_are_config_errors(tmp_path: Path) -> None:
    err = _error(tmp_path, "log_level: info\nchecks: &loop {xid: *loop}\n")
    assert err.line == 2 and "recursive YAML alias" in str(err)
    err = _error(tmp_path, "profile_dirs: " + "[" * 5000 + "]" * 5000 + "\n")
    assert err.line == 1 and "nested deeper than" in str(err)


def test_oversized_config_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "gpumon.yaml"
    with path.open("w") as fh:  # valid YAML: 50 MB of comments, which took 28 s and 818 MB to parse
        fh.write("log_level: info\n")
        line = "# " + "x" * 98 + "\n"
        fh.write(line * (50 * 10_000))
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path, CHECKS, site_file=tmp_path / "absent.yaml")
    assert time.monotonic() - start < 5
    assert info.value.file == str(path) and "larger than 1 MiB" in str(info.value)


def test_a_config_just_under_the_size_limit_loads(tmp_path: Path) -> None:
    text = "log_level: debug\n" + "#" * (MAX_FILE_BYTES - 100) + "\n"
    assert _load(tmp_path, text).log_level == "debug"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "line", "key"), [
    ("checks:\n  ib:\n    interval_s: .nan\n", 3, "checks.ib.interval_s"),  # ib never ran again
    ("checks:\n  ib:\n    timeout_s: .inf\n", 3, "checks.ib.timeout_s"),
    ("checks:\n  xid:\n    timeout_s: 1.0e+10\n", 3, "checks.xid.timeout_s"),  # OverflowError in the runner
    ("daemon:\n  jitter: .nan\n", 2, "daemon.jitter"),
    ("timeouts:\n  nvml_call_s: .nan\n", 2, "timeouts.nvml_call_s"),  # failed later, no file or line
    ("remediation:\n  interval_s: .inf\n", 2, "remediation.interval_s"),
    ("remediation:\n  breaker:\n    share: .NaN\n", 3, "remediation.breaker.share"),
    ("checks:\n  ib:\n    window_s: .nan\n", 3, "checks.ib.window_s"),  # passed min: 60
])
def test_nan_and_infinity_are_refused_with_file_line_key(tmp_path: Path, text: str, line: int,
                                                         key: str) -> None:
    err = _error(tmp_path, text)
    assert (err.file, err.line, err.key) == (str(tmp_path / "gpumon.yaml"), line, key), str(err)
    assert "finite" in str(err) or "positive number" in str(err) or "<=" in str(err)


def test_infinity_only_where_a_field_allows_it() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Rates:
        fail_per_s: float = dataclasses.field(default=1.0, metadata={"min": 0, "allow_inf": True})
        window_s: float = dataclasses.field(default=1.0, metadata={"min": 0})

    data, src = load_yaml("fail_per_s: .inf\n", "site.yaml")
    assert build(Rates, data, src).fail_per_s == math.inf
    for text in ("fail_per_s: .nan\n", "window_s: .inf\n"):
        data, src = load_yaml(text, "site.yaml")
        with pytest.raises(ConfigError, match="finite"):
            build(Rates, data, src)


@pytest.mark.parametrize(("text", "line"), [
    ("timeouts:\n  nvml_call_s: !!float fast\n", 2),
    ("log_level: !!python/name:os.system x\n", 1),
    ("daemon: &d {jitter: 0.2}\ntimeouts:\n  <<: *d\n", 3),
    ("state_dir: !!timestamp yesterday\n", 1),
])
def test_odd_yaml_tags_are_config_errors_not_tracebacks(tmp_path: Path, text: str, line: int) -> None:
    err = _error(tmp_path, text)
    assert err.line == line and "invalid YAML" in str(err)
