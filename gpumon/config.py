"""Layered, strict configuration.

Layers, later wins: the defaults shipped in ``config/gpumon.yaml``, then the
site file (``/etc/gpumon/gpumon.yaml``, or ``--config FILE`` instead), then
command-line flags. Each file is validated on its own before merging, so an
error names the file and line where the bad key was written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gpumon.check import Check
from gpumon.errors import ConfigError
from gpumon.profiles import Profile
from gpumon.schema import Source, build, deep_merge, load_yaml, load_yaml_file

SITE_CONFIG = Path("/etc/gpumon/gpumon.yaml")


@dataclass(frozen=True)
class Timeouts:
    # NVML answers in microseconds-to-milliseconds when healthy; 5 s is far
    # beyond that yet short enough that a hung call is reported within a cycle.
    nvml_call_s: float = field(default=5.0, metadata={"min": 0.05, "max": 600})
    sysfs_read_s: float = field(default=2.0, metadata={"min": 0.05, "max": 600})
    tool_default_s: float = field(default=120.0, metadata={"min": 1, "max": 86400})


@dataclass(frozen=True)
class DaemonSettings:
    jitter: float = field(default=0.1, metadata={"min": 0.0, "max": 0.5})
    kernel_log_poll_s: float = field(default=0.2, metadata={"min": 0.01, "max": 5})
    shutdown_grace_s: float = field(default=5.0, metadata={"min": 0, "max": 300})


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass(frozen=True)
class ExporterSettings:
    enabled: bool = True
    # 9426: dcgm-exporter has 9400 and node_exporter 9100; 9426 is free on the
    # nodes we know of. Override when it is not.
    listen: str = "0.0.0.0:9426"
    web_config_file: str | None = None
    # NVIDIA Resiliency Extension's node health check (nvhcd.proto) on this Unix socket; None: not
    # served (ft_launcher --ft-node-health-check-endpoint names the same path; /var/run/nvhcd.sock)
    nvhcd_socket: str | None = None

    def __post_init__(self) -> None:
        split_listen(self.listen)


@dataclass(frozen=True)
class BreakerSettings:
    # NVSentinel's breaker trips at 50 % in 5 min; a training fleet loses whole jobs per node
    # taken out, so gpumon stops earlier: 20 % of the fleet within 10 min (the default).
    share: float = field(default=0.2, metadata={"min": 0.0, "max": 1.0})
    window_s: float = field(default=600.0, metadata={"min": 1})


@dataclass(frozen=True)
class KubernetesSettings:
    node_name: str | None = None  # default: $NODE_NAME, else node_name, else the host name
    kubeconfig: str | None = None  # default: in-cluster, then $KUBECONFIG / ~/.kube/config
    node_selector: str = ""  # label selector of the fleet the breaker counts
    request_timeout_s: float = field(default=10.0, metadata={"min": 0.1, "max": 300})


@dataclass(frozen=True)
class SlurmSettings:
    node_name: str | None = None  # default: node_name, else the short host name
    scontrol: str = "scontrol"
    sinfo: str = "sinfo"
    timeout_s: float = field(default=30.0, metadata={"min": 1, "max": 600})
    slurm_conf: str | None = None  # SLURM_CONF for scontrol/sinfo (containers without /etc/slurm)


@dataclass(frozen=True)
class RemediationSettings:
    backend: str = field(default="none", metadata={"choices": ("none", "kubernetes", "slurm")})
    mode: str = field(default="observe", metadata={"choices": ("observe", "enforce")})
    interval_s: float = field(default=60.0, metadata={"min": 1})
    take_out_actions: list[str] = field(default_factory=lambda: [
        "check_cables", "reset_gpu", "reboot_node", "inspect_hardware"])
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)

    def __post_init__(self) -> None:
        allowed = ("restart_app", "check_cables", "reset_gpu", "reboot_node", "inspect_hardware")
        for action in self.take_out_actions:
            if action not in allowed:
                raise ValueError(f"take_out_actions: {action!r} is not one of {', '.join(allowed)} "
                                 "('none' never takes a node out)")


@dataclass(frozen=True)
class BootstrapSettings:
    """What the bootstrap suite cannot pass without, on top of the profile's ``bootstrap.required``
    (README, "What the suite requires"). A required check that cannot run here (torch missing,
    perftest or DCGM not installed, a site check not installed) leaves the suite INCOMPLETE (exit 3):
    the unit that gates kubelet and slurmd keeps the node out, and no fault is cleared."""

    required: list[str] = field(default_factory=list)  # required here too (rdma, dcgm_diag, a site check)
    optional: list[str] = field(default_factory=list)  # required by the profile, but not on this site


@dataclass(frozen=True)
class CheckSettings:
    """Settings every check has; the check's own options live in ``params``."""

    enabled: bool = True
    interval_s: float = 60.0
    timeout_s: float = 30.0
    params: Any = None


@dataclass(frozen=True)
class Config:
    node_name: str | None = None
    host_root: str = "/"
    kmsg_path: str | None = None
    state_dir: str = "/var/lib/gpumon"
    profile: str = "auto"
    profile_dirs: list[str] = field(default_factory=lambda: ["/etc/gpumon/profiles"])
    log_level: str = field(default="info", metadata={"choices": ("debug", "info", "warning", "error")})
    timeouts: Timeouts = field(default_factory=Timeouts)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    exporter: ExporterSettings = field(default_factory=ExporterSettings)
    remediation: RemediationSettings = field(default_factory=RemediationSettings)
    bootstrap: BootstrapSettings = field(default_factory=BootstrapSettings)
    # raw per-check sections; validated against the registered checks by load_config
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    check_settings: dict[str, CheckSettings] = field(default_factory=dict, compare=False)
    files: list[str] = field(default_factory=list, compare=False)

    def settings(self, check: type[Check]) -> CheckSettings:
        found = self.check_settings.get(check.name)
        if found is not None:
            return found
        return CheckSettings(interval_s=check.interval, timeout_s=check.timeout,
                             params=check.Config() if check.Config is not None else None)


_COMMON = {"enabled", "interval_s", "timeout_s"}


def _check_sections(data: Mapping[str, Any], src: Source, checks: Mapping[str, type[Check]],
                    not_loaded: Collection[str] = ()) -> None:
    """Validate the ``checks:`` section of one file against the registered checks (the section of
    a check that did not load is kept as written: there is no class to validate it with, and the
    check is reported as not loaded rather than the config refused)."""
    sections = data.get("checks") or {}
    for name, section in sections.items():
        path = ("checks", name)
        if name in not_loaded:
            continue
        if name not in checks:
            raise src.error(path, f"unknown check (registered: {', '.join(sorted(checks))})")
        if section is None:
            continue
        if not isinstance(section, Mapping):
            raise src.error(path, "expected a mapping of settings")
        cls = checks[name]
        common = {k: v for k, v in section.items() if k in _COMMON}
        own = {k: v for k, v in section.items() if k not in _COMMON}
        _validate_common(common, src, path)
        if own and cls.Config is None:
            key = next(iter(own))
            raise src.error((*path, key), f"unknown key (check {name} takes only "
                                          f"{', '.join(sorted(_COMMON))})")
        if cls.Config is not None:
            build(cls.Config, own, src, path)


# A check's timeout becomes a thread wait; past ~292 years of nanoseconds that wait raises
# OverflowError in the runner. A day is beyond any check gpumon runs (the longest default is 1 h).
MAX_CHECK_TIMEOUT_S = 86400.0


def _validate_common(common: Mapping[str, Any], src: Source, path: tuple[str, ...]) -> None:
    for key, value in common.items():
        if key == "enabled":
            if not isinstance(value, bool):
                raise src.error((*path, key), "expected true or false")
        # not math.isfinite: .nan is not <= 0 and would pass, and a check with an
        # interval of .nan or .inf is never run again, silently
        elif (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
              or value <= 0):
            raise src.error((*path, key), f"expected a positive number of seconds, got {value!r}")
        elif key == "timeout_s" and value > MAX_CHECK_TIMEOUT_S:
            raise src.error((*path, key), f"must be <= {MAX_CHECK_TIMEOUT_S:g} s, got {value!r}")


def _load_layer(data: Any, src: Source, checks: Mapping[str, type[Check]],
                not_loaded: Collection[str] = ()) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise src.error((), "the config file must be a mapping of settings")
    build(Config, data, src)  # strict validation of every non-check key, with lines
    _check_sections(data, src, checks, not_loaded)
    _bootstrap_names(data, src, {**checks, **dict.fromkeys(not_loaded)})
    return dict(data)


def _bootstrap_names(data: Mapping[str, Any], src: Source, checks: Mapping[str, object]) -> None:
    """A misspelt name in ``bootstrap.optional`` would leave the check required, one in
    ``bootstrap.required`` would require nothing: both are refused where they are written."""
    section = data.get("bootstrap") or {}
    for key in ("required", "optional"):
        for i, name in enumerate(section.get(key) or []):
            if name not in checks:
                raise src.error(("bootstrap", key, i), f"unknown check {name!r} (registered: "
                                                        f"{', '.join(sorted(checks))})")


def with_profile(config: Config, checks: Mapping[str, type[Check]], profile: Profile, *,
                 not_loaded: Collection[str] = ()) -> Config:
    """Per-check options: the check's defaults <- the profile's SKU thresholds <- the site config."""
    src = profile.origin or Source(f"profile {profile.name}")
    for name in profile.checks:
        if name not in checks and name not in not_loaded:
            raise src.error(("checks", name), f"unknown check (registered: {', '.join(sorted(checks))})")
    settings = dict(config.check_settings)
    for name, cls in checks.items():
        sku = {k: v["value"] for k, v in profile.checks.get(name, {}).items()}
        if not sku or cls.Config is None:
            if sku:
                raise src.error(("checks", name), f"check {name} takes no options")
            continue
        build(cls.Config, sku, src, ("checks", name))  # report a bad profile value where it is written
        site = {k: v for k, v in (config.checks.get(name) or {}).items() if k not in _COMMON}
        params = build(cls.Config, {**sku, **site}, Source("<merged>"), ("checks", name))
        settings[name] = dataclasses.replace(config.settings(cls), params=params)
    return dataclasses.replace(config, check_settings=settings)


def load_config(path: Path | None, checks: Mapping[str, type[Check]], *,
                overrides: Mapping[str, Any] | None = None, site_file: Path = SITE_CONFIG,
                not_loaded: Collection[str] = ()) -> Config:
    """Defaults <- site file (or ``path``) <- ``overrides`` (from CLI flags). ``not_loaded``: the
    checks that did not load (gpumon.registry), whose sections are not refused."""
    text = resources.files("gpumon_config").joinpath("gpumon.yaml").read_text(encoding="utf-8")
    data, src = load_yaml(text, "config/gpumon.yaml (built-in)")
    merged = _load_layer(data, src, checks, not_loaded)
    files = [src.file]
    chosen = path if path is not None else (site_file if site_file.is_file() else None)
    if path is not None and not path.is_file():
        raise ConfigError("config file not found", file=str(path))
    if chosen is not None:
        data, src = load_yaml_file(chosen)
        merged = deep_merge(merged, _load_layer(data, src, checks, not_loaded))
        files.append(str(chosen))
    if overrides:
        merged = deep_merge(merged, {k: v for k, v in overrides.items() if v is not None})
    final = build(Config, merged, Source("<merged>"))
    settings: dict[str, CheckSettings] = {}
    for name, cls in checks.items():
        section = dict(final.checks.get(name) or {})
        common = {k: section.pop(k) for k in list(section) if k in _COMMON}
        params = build(cls.Config, section, Source("<merged>"), ("checks", name)) if cls.Config else None
        settings[name] = CheckSettings(
            enabled=bool(common.get("enabled", True)),
            interval_s=float(common.get("interval_s", cls.interval)),
            timeout_s=float(common.get("timeout_s", cls.timeout)),
            params=params,
        )
    return dataclasses.replace(final, check_settings=settings, files=files)
