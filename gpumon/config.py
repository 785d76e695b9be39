"""Layered, strict configuration.

Layers, later wins: the defaults declared here (and, for a check's own options, on its ``Config``
dataclass), the node's SKU profile for the options it tunes, the site file
(``/etc/gpumon/gpumon.yaml``, or ``--config FILE`` instead), then command-line flags. Each value
is built once from the merged layers (``gpumon.schema.LayeredSource``), and an error names the
file and line of the layer that wrote the bad key. ``gpumon config`` prints the result and where
each value came from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.check import Check
from gpumon.errors import ConfigError
from gpumon.intake_protocol import DEFAULT_SOCKET as DEFAULT_INTAKE_SOCKET
from gpumon.profiles import Profile
from gpumon.schema import Layer, LayeredSource, Source, build, load_yaml_file

SITE_CONFIG = Path("/etc/gpumon/gpumon.yaml")


@dataclass(frozen=True)
class Timeouts:
    # NVML answers in microseconds-to-milliseconds when healthy; 5 s is far
    # beyond that yet short enough that a hung call is reported within a cycle.
    nvml_call_s: float = field(default=5.0, metadata={"min": 0.05, "max": 600,
                                                      "help": "one NVML call"})
    sysfs_read_s: float = field(default=2.0, metadata={"min": 0.05, "max": 600,
                                                       "help": "one sysfs/procfs read"})
    tool_default_s: float = field(default=120.0, metadata={"min": 1, "max": 86400,
                                                           "help": "an external tool without its own limit"})


@dataclass(frozen=True)
class DaemonSettings:
    jitter: float = field(default=0.1, metadata={
        "min": 0.0, "max": 0.5,
        "help": "+-10% on every periodic interval, so a fleet does not probe in lockstep"})
    kernel_log_poll_s: float = field(default=0.2, metadata={
        "min": 0.01, "max": 5, "help": "how often a regular-file kernel log is polled for new lines"})
    shutdown_grace_s: float = field(default=5.0, metadata={
        "min": 0, "max": 300, "help": "how long running checks get on SIGTERM"})
    intake_socket: str = field(default=DEFAULT_INTAKE_SOCKET, metadata={
        "help": "local processes (the in-job guard) hand documents to checks on this Unix socket; "
                "empty: none (gpumon.intake)",
        "source": "gpumon's choice: /run is the node's runtime directory, gone at a reboot like the "
                  "daemon's socket; the guard's default ($GPUMON_INTAKE_SOCKET unset) is the same path"})
    intake_per_uid_per_min: int = field(default=60, metadata={
        "min": 1, "max": 100000,
        "help": "requests one uid may send to the intake per minute; more are refused",
        "source": "argued: a job hands over one verdict per named rank per alarm (at most one per GPU, "
                  "8 on a node, at once); 60 a minute leaves a few alarms room, and keeps one runaway "
                  "or hostile user from filling the intake with documents the daemon must judge"})


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
    listen: str = field(default="0.0.0.0:9426", metadata={"help": "Prometheus /metrics"})
    web_config_file: str | None = field(default=None, metadata={
        "help": "exporter-toolkit web config: TLS and basic auth"})
    # ft_launcher --ft-node-health-check-endpoint names the same path
    nvhcd_socket: str | None = field(default=None, metadata={
        "help": "NVRx node health check (gRPC, nvhcd.proto) on this Unix socket, e.g. /var/run/nvhcd.sock"})

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
    node_name: str | None = field(default=None, metadata={
        "help": "default: $NODE_NAME, else node_name, else the host name"})
    kubeconfig: str | None = field(default=None, metadata={
        "help": "default: in-cluster, then $KUBECONFIG / ~/.kube/config"})
    node_selector: str = field(default="", metadata={
        "help": "label selector of the fleet the breaker counts"})
    request_timeout_s: float = field(default=10.0, metadata={"min": 0.1, "max": 300})


@dataclass(frozen=True)
class SlurmSettings:
    node_name: str | None = field(default=None, metadata={
        "help": "default: node_name, else the short host name"})
    scontrol: str = "scontrol"
    sinfo: str = "sinfo"
    timeout_s: float = field(default=30.0, metadata={"min": 1, "max": 600})
    slurm_conf: str | None = field(default=None, metadata={
        "help": "SLURM_CONF for scontrol/sinfo (containers without /etc/slurm)"})


@dataclass(frozen=True)
class RemediationSettings:
    backend: str = field(default="none", metadata={"choices": ("none", "kubernetes", "slurm")})
    mode: str = field(default="observe", metadata={
        "choices": ("observe", "enforce"), "help": "observe: report what would be done; enforce: do it"})
    interval_s: float = field(default=60.0, metadata={
        "min": 1, "help": "also stepped on every change of the node's health"})
    take_out_actions: list[str] = field(default_factory=lambda: [
        "check_cables", "confirm_sdc", "reset_gpu", "reboot_node", "inspect_hardware"])
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)

    def __post_init__(self) -> None:
        allowed = ("restart_app", "check_cables", "confirm_sdc", "reset_gpu", "reboot_node",
                   "inspect_hardware")
        for action in self.take_out_actions:
            if action not in allowed:
                raise ValueError(f"take_out_actions: {action!r} is not one of {', '.join(allowed)} "
                                 "('none' never takes a node out)")


@dataclass(frozen=True)
class BootstrapSettings:
    """What the bootstrap suite cannot pass without, on top of the profile's ``bootstrap.required``
    (docs/operators/bootstrap.md, "What the suite requires"). A required check that cannot run here
    (torch missing, perftest or DCGM not installed, a site check not installed) leaves the suite
    INCOMPLETE (exit 3):
    the unit that gates kubelet and slurmd keeps the node out, and no fault is cleared."""

    required: list[str] = field(default_factory=list, metadata={
        "help": "required here too, e.g. [rdma, dcgm_diag] where perftest and DCGM are installed"})
    optional: list[str] = field(default_factory=list, metadata={
        "help": "e.g. [host_bandwidth]: required by the profile, not on this site"})


@dataclass(frozen=True)
class CheckSettings:
    """Settings every check has; the check's own options live in ``options``."""

    enabled: bool = True
    interval_s: float = 60.0
    timeout_s: float = 30.0
    options: Any = None


@dataclass(frozen=True)
class Config:
    node_name: str | None = field(default=None, metadata={"help": "default: the host name"})
    host_root: str = field(default="/", metadata={"help": "the host's /, e.g. /host in a container"})
    kmsg_path: str | None = field(default=None, metadata={"help": "default: <host_root>/dev/kmsg"})
    state_dir: str = "/var/lib/gpumon"
    profile: str = field(default="auto", metadata={
        "help": "or a profile name (gpumon config --profile NAME)"})
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
    # what each value was built from: the site file, the flags, the profile (``gpumon config``)
    layers: LayeredSource = field(default_factory=LayeredSource, compare=False, repr=False)

    def settings(self, check: type[Check]) -> CheckSettings:
        found = self.check_settings.get(check.name)
        if found is not None:
            return found
        return CheckSettings(interval_s=check.interval, timeout_s=check.timeout,
                             options=check.Config() if check.Config is not None else None)


# the settings every check has, beside its own options
COMMON_SETTINGS = ("enabled", "interval_s", "timeout_s")
_COMMON = frozenset(COMMON_SETTINGS)


def _check_sections(data: Mapping[str, Any], src: Source, checks: Mapping[str, type[Check]],
                    not_loaded: Collection[str] = ()) -> None:
    """Refuse, where it is written, a section of the ``checks:`` mapping that names no registered
    check or is not a mapping (the section of a check that did not load is kept as written: there
    is no class to validate it with, and the check is reported as not loaded rather than the config
    refused)."""
    for name, section in (data.get("checks") or {}).items():
        path = ("checks", name)
        if name in not_loaded:
            continue
        if name not in checks:
            raise src.error(path, f"unknown check (registered: {', '.join(sorted(checks))})")
        if section is not None and not isinstance(section, Mapping):
            raise src.error(path, "expected a mapping of settings")


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


def _bootstrap_names(data: Mapping[str, Any], src: Source, checks: Mapping[str, object]) -> None:
    """A misspelt name in ``bootstrap.optional`` would leave the check required, one in
    ``bootstrap.required`` would require nothing: both are refused where they are written."""
    section = data.get("bootstrap") or {}
    for key in ("required", "optional"):
        for i, name in enumerate(section.get(key) or []):
            if name not in checks:
                raise src.error(("bootstrap", key, i), f"unknown check {name!r} (registered: "
                                                        f"{', '.join(sorted(checks))})")


def _check_options(cls: type[Check], layers: LayeredSource) -> Any:
    """The check's options, built once from every layer that sets one (its defaults, the profile's
    SKU values, the site file): a bad value is reported in the file and on the line that wrote it."""
    if cls.Config is None:
        for layer in layers.layers:
            own = [k for k in (_section(layer.data, cls.name) or {}) if k not in _COMMON]
            if own:
                what = "takes no options" if layer.what == "profile" else \
                    f"takes only {', '.join(sorted(_COMMON))}"
                raise layer.source.error(("checks", cls.name, own[0]),
                                         f"unknown key (check {cls.name} {what})")
        return None
    options = {k: v for k, v in (_section(layers.merged, cls.name) or {}).items() if k not in _COMMON}
    return build(cls.Config, options, layers, ("checks", cls.name))


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    section = (data.get("checks") or {}).get(name)
    return section if isinstance(section, Mapping) else None


def _settings(cls: type[Check], layers: LayeredSource) -> CheckSettings:
    common = {k: v for k, v in (_section(layers.merged, cls.name) or {}).items() if k in _COMMON}
    _validate_common(common, layers, ("checks", cls.name))
    return CheckSettings(enabled=bool(common.get("enabled", True)),
                         interval_s=float(common.get("interval_s", cls.interval)),
                         timeout_s=float(common.get("timeout_s", cls.timeout)),
                         options=_check_options(cls, layers))


def load_config(path: Path | None, checks: Mapping[str, type[Check]], *,
                overrides: Mapping[str, Any] | None = None, site_file: Path | None = SITE_CONFIG,
                not_loaded: Collection[str] = ()) -> Config:
    """The declared defaults <- the site file (``path``, else ``site_file`` when it exists; None:
    none) <- ``overrides`` (from CLI flags), each option built once from those layers.
    ``not_loaded``: the checks that did not load (gpumon.registry), whose sections are not refused."""
    if path is None and site_file is not None and site_file.is_file():
        path = site_file
    elif path is not None and not path.is_file():
        raise ConfigError("config file not found", file=str(path))
    layers = LayeredSource()
    if path is not None:
        data, src = load_yaml_file(path)
        if not isinstance(data, Mapping):
            raise src.error((), "the config file must be a mapping of settings")
        layers = layers.add(Layer("site", src, data))
    if overrides:
        layers = layers.add(Layer("flags", Source("command line"),
                                  {k: v for k, v in overrides.items() if v is not None}))
    config = build(Config, layers.merged, layers)
    _check_sections(layers.merged, layers, checks, not_loaded)
    _bootstrap_names(layers.merged, layers, {**checks, **dict.fromkeys(not_loaded)})
    settings = {name: _settings(cls, layers) for name, cls in checks.items()}
    return dataclasses.replace(config, check_settings=settings, layers=layers)


def with_profile(config: Config, checks: Mapping[str, type[Check]], profile: Profile, *,
                 not_loaded: Collection[str] = ()) -> Config:
    """Each check's options again with the profile's SKU values beneath the site's: the check's
    defaults <- the profile <- the site file <- flags. Only a check the profile tunes is built
    again (the profile is known once the GPUs are; a bad site value was refused at load)."""
    src = profile.origin or Source(f"profile {profile.name}")
    for name in profile.checks:
        if name not in checks and name not in not_loaded:
            raise src.error(("checks", name), f"unknown check (registered: {', '.join(sorted(checks))})")
    sku = {name: {k: v["value"] for k, v in options.items()}
           for name, options in profile.checks.items() if name in checks and options}
    if not sku:
        return config
    layers = config.layers.add(Layer("profile", src, {"checks": sku}), below=True)
    settings = dict(config.check_settings)
    for name in sku:
        settings[name] = dataclasses.replace(config.settings(checks[name]),
                                             options=_check_options(checks[name], layers))
    return dataclasses.replace(config, check_settings=settings, layers=layers)
