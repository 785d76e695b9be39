"""Every option's default is declared once, on its dataclass: ``gpumon config --defaults`` prints
them all (the reference a site file starts from), each option is built once from its layers, and
an error names the layer (file and line) that wrote the bad value."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from conftest import run_gpumon
from gpumon.check import Check, CheckContext
from gpumon.config import COMMON_SETTINGS, Config, load_config, with_profile
from gpumon.errors import ConfigError
from gpumon.model import Finding, Phase
from gpumon.profiles import GENERIC, builtin_profiles, load_profile_file
from gpumon.registry import load_checks

CHECKS = load_checks()
REPO = Path(__file__).resolve().parent.parent


def _leaves(data: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path


def _declared(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for f in dataclasses.fields(cls):
        if not f.init or (cls is Config and f.name in {"checks", "check_settings", "layers"}):
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if dataclasses.is_dataclass(default):
            yield from _declared(type(default), (*path, f.name))
        elif isinstance(default, dict) and default:
            yield from _leaves(default, (*path, f.name))
        else:
            yield (*path, f.name)


def test_the_printed_defaults_are_every_declared_option_and_load_back_unchanged(tmp_path: Path) -> None:
    proc = run_gpumon("config", "--defaults")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    want = set(_declared(Config))
    for name, cls in CHECKS.items():
        want |= {("checks", name, key) for key in COMMON_SETTINGS}
        if cls.Config is not None:
            want |= {("checks", name, *p) for p in _declared(cls.Config)}
    assert set(_leaves(printed)) == want
    # the printed file is a site file that changes nothing
    site = tmp_path / "gpumon.yaml"
    site.write_text(proc.stdout)
    loaded, defaults = load_config(site, CHECKS), load_config(None, CHECKS, site_file=None)
    assert dataclasses.replace(loaded, checks={}) == defaults  # checks: the raw sections as written
    for cls in CHECKS.values():
        assert loaded.settings(cls) == defaults.settings(cls), cls.name


def test_no_defaults_file_is_read_at_run_time() -> None:
    # the defaults were written twice (config/gpumon.yaml and the dataclasses) with nothing
    # checking they agreed; now the dataclasses are the only place
    assert not (REPO / "config" / "gpumon.yaml").exists()
    assert 'joinpath("gpumon.yaml")' not in (REPO / "gpumon" / "config.py").read_text()


# ------------------------------------------------------------------------------------ built once

@dataclasses.dataclass(frozen=True)
class CountedConfig:
    built: ClassVar[list[dict[str, Any]]] = []
    limit: int = dataclasses.field(default=5, metadata={"min": 1, "max": 100})
    window_s: float = 60.0

    def __post_init__(self) -> None:
        CountedConfig.built.append(dataclasses.asdict(self))
        if self.limit > self.window_s:
            raise ValueError("limit must not exceed window_s")


class CountedCheck(Check):
    name = "counted"
    phase = Phase.CONTINUOUS
    description = "counts how often its options are built"
    Config = CountedConfig

    def run(self, ctx: CheckContext) -> list[Finding]:
        return []


def _profile(tmp_path: Path, options: str) -> Path:
    path = tmp_path / "profiles" / "test-sku.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"name: test-sku\nmatch: ['TEST']\nchecks:\n  counted:\n{options}")
    return path


def test_a_checks_options_are_built_once_from_all_their_layers(tmp_path: Path) -> None:
    checks = {"counted": CountedCheck}
    site = tmp_path / "gpumon.yaml"
    site.write_text("checks:\n  counted:\n    limit: 7\n")
    CountedConfig.built.clear()
    config = load_config(site, checks)
    assert CountedConfig.built == [{"limit": 7, "window_s": 60.0}]
    # a profile that tunes another check leaves this one as it was built
    assert with_profile(config, checks, GENERIC).settings(CountedCheck) == config.settings(CountedCheck)
    assert len(CountedConfig.built) == 1
    # the profile is known only once the GPUs are: a check it tunes is built once more, from the
    # profile beneath the site (the site's limit wins, the profile's window stays)
    note = 'source: "test profile, tests"'
    profile = load_profile_file(_profile(tmp_path, f"    window_s: {{value: 30, {note}}}\n"
                                                   f"    limit: {{value: 3, {note}}}\n"))
    tuned = with_profile(config, checks, profile)
    assert tuned.settings(CountedCheck).options == CountedConfig(limit=7, window_s=30.0)
    assert CountedConfig.built[1:] == [{"limit": 7, "window_s": 30.0}, {"limit": 7, "window_s": 30.0}]


def test_a_check_reads_its_options_by_one_name_and_a_0_1_check_still_reads_them() -> None:
    options = CountedConfig(limit=7, window_s=30.0)
    ctx = CheckContext(hw=None, inventory=None, profile=GENERIC, options=options,  # type: ignore[arg-type]
                       state={}, kernel_log=None)  # type: ignore[arg-type]
    assert ctx.options_as(CountedConfig) is options
    assert ctx.params is options and ctx.params_as(CountedConfig) is options
    with pytest.raises(TypeError, match="CountedConfig, not Config"):
        ctx.options_as(Config)
    # a context handed no options (a test's own) reads the check's defaults
    bare = dataclasses.replace(ctx, options=None)
    assert bare.options_as(CountedConfig) == CountedConfig()


def test_an_error_names_the_layer_that_wrote_the_value(tmp_path: Path) -> None:
    checks = {"counted": CountedCheck}
    site = tmp_path / "gpumon.yaml"
    site.write_text("log_level: info\nchecks:\n  counted:\n    limit: 700\n")
    with pytest.raises(ConfigError) as err:
        load_config(site, checks)
    assert (err.value.file, err.value.line, err.value.key) == (str(site), 4, "checks.counted.limit")
    # a value the profile wrote, not overridden by the site: the profile's file and line
    site.write_text("checks:\n  counted:\n    limit: 50\n")
    path = _profile(tmp_path, "    window_s: {value: 20, source: \"test profile, tests\"}\n")
    with pytest.raises(ConfigError, match="limit must not exceed window_s") as err:
        with_profile(load_config(site, checks), checks, load_profile_file(path))
    # a rule over two keys that two layers wrote: reported at the top layer that wrote the section
    assert (err.value.file, err.value.key) == (str(site), "checks.counted")
    site.write_text("log_level: info\n")
    path = _profile(tmp_path, "    limit: {value: 0, source: \"test profile, tests\"}\n")
    with pytest.raises(ConfigError, match="must be >= 1") as err:
        with_profile(load_config(site, checks), checks, load_profile_file(path))
    assert (err.value.file, err.value.line, err.value.key) == (str(path), 5, "checks.counted.limit")
    # a flag: the command line
    with pytest.raises(ConfigError, match="HOST:PORT") as err:
        load_config(site, checks, overrides={"exporter": {"listen": "nowhere"}})
    assert err.value.file == "command line"


# ------------------------------------------------------------------------------- gpumon config

def test_gpumon_config_says_where_each_value_came_from(tmp_path: Path) -> None:
    site = tmp_path / "gpumon.yaml"
    site.write_text("timeouts:\n  nvml_call_s: 2.5\nchecks:\n  thermal:\n    core_margin_c: 4\n")
    proc = run_gpumon("config", "--config", str(site), "--host-root", str(tmp_path), "--profile", "h100-sxm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def line_of(key: str) -> str:
        return next(line for line in lines if re.match(rf"\s*{key}:", line))

    assert line_of("nvml_call_s").startswith("  nvml_call_s: 2.5  # one NVML call") and \
        line_of("nvml_call_s").endswith(f"{site}:2")
    assert line_of("sysfs_read_s").endswith("; default")
    assert line_of("host_root").startswith(f"host_root: {tmp_path}")
    assert line_of("host_root").endswith("command line")
    assert line_of("core_margin_c").startswith("    core_margin_c: 4.0")
    assert line_of("core_margin_c").endswith(f"{site}:5")
    hung = line_of("max_power_w")
    assert hung.startswith("    max_power_w: 160.0") and "profile, " in hung and "h100-sxm.yaml:" in hung
    assert "# SKU profile: h100-sxm" in proc.stdout
    # what it prints loads back as the same configuration
    again = tmp_path / "again.yaml"
    again.write_text(proc.stdout)
    h100 = builtin_profiles()["h100-sxm"]
    shown = with_profile(load_config(site, CHECKS, overrides={"host_root": str(tmp_path),
                                                            "profile": "h100-sxm"}), CHECKS, h100)
    back = with_profile(load_config(again, CHECKS), CHECKS, h100)
    assert dataclasses.replace(back, checks={}) == dataclasses.replace(shown, checks={})
    for cls in CHECKS.values():
        assert back.settings(cls) == shown.settings(cls), cls.name


def test_gpumon_config_refuses_a_bad_site_file_like_every_command(tmp_path: Path) -> None:
    site = tmp_path / "gpumon.yaml"
    site.write_text("daemon:\n  jitter: 0.9\n")
    proc = run_gpumon("config", "--config", str(site))
    assert proc.returncode == 3 and f"{site}:2: daemon.jitter: must be <= 0.5" in proc.stderr


# ------------------------------------------------ the options table of docs/operators/configuration.md

CONFIG_PAGE = REPO / "docs" / "operators" / "configuration.md"


def _page_rows() -> Iterator[tuple[list[str], list[str]]]:
    text = CONFIG_PAGE.read_text()
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = [k.strip().strip("`") for k in cells[0].split(" / ")]
        first = keys[0]
        parent = first.rpartition(".")[0]
        full = [first] + [f"{parent}.{k}" if parent else k for k in keys[1:]]
        yield full, [d.strip() for d in cells[1].split(" / ")]


def _lookup(data: Any, dotted: str) -> tuple[bool, Any]:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def test_the_configuration_page_table_names_declared_options_with_their_defaults() -> None:
    printed = yaml.safe_load(run_gpumon("config", "--defaults").stdout)
    compared = 0
    for keys, defaults in _page_rows():
        for i, key in enumerate(keys):
            if "<" in key or "…" in key:  # a pattern (checks.<name>.enabled, <counter>_warn_per_s), "…"
                continue
            found, value = _lookup(printed, key)
            assert found, f"{CONFIG_PAGE.name} names {key}, which is not an option"
            if len(defaults) != len(keys):
                continue
            cell = defaults[i]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if re.fullmatch(r"-?[0-9.]+", cell) and number:
                assert float(cell) == value, (key, cell, value)
                compared += 1
            elif cell in ("true", "false"):
                assert value is (cell == "true"), key
                compared += 1
            elif re.fullmatch(r"`[^`]*`", cell) and isinstance(value, str):
                assert cell.strip("`") == value, (key, cell, value)
                compared += 1
    assert compared >= 30
