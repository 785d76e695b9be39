"""Simulated-node scenarios: a SKU, a GPU count and faults on a timeline.

```yaml
name: faulty-8xh100
sku: h100-sxm            # a profile name: GPU name, PCI ids, NVLink count come from it
gpus: 8
faults:
  - {at_s: 30, kind: xid, gpu: 3, code: 79}
  - {at_s: 10, kind: throttle, gpu: 1, reasons: [hw_slowdown]}
  - {at_s: 60, kind: ib_down, device: mlx5_2, port: 1, duration_s: 9}
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpumon.errors import ConfigError
from gpumon.schema import Source, build, load_yaml, load_yaml_file

FAULT_KINDS = ("xid", "throttle", "ib_down", "nvml_error", "nvml_hang", "aer", "kernel_line",
               "temperature", "nvlink_down", "nvlink_errors", "ecc", "remap", "fabric", "pcie_link",
               "gpu_missing", "ib_rate", "ib_errors", "sxid", "utilization", "activity", "fm_log",
               # compute faults: the simulated GPU's device model (gpumon/sim/devices.py)
               "compute_slow", "allreduce_corrupt", "p2p_slow", "sdc",
               # a process holding the GPU (the SDC canary's idle gate)
               "compute_process")

# Which optional fields each kind may use (besides at_s, duration_s, kind).
_FIELDS = {
    "xid": {"gpu", "code", "message"},
    "throttle": {"gpu", "reasons"},
    "ib_down": {"device", "port"},
    "nvml_error": {"gpu", "function", "error"},
    "nvml_hang": {"gpu", "function", "seconds"},
    "aer": {"gpu", "severity", "count", "per_s"},
    "kernel_line": {"text"},
    "temperature": {"gpu", "core_c", "hbm_c"},
    "nvlink_down": {"gpu", "link"},
    "nvlink_errors": {"gpu", "link", "counter", "count", "per_s"},
    "ecc": {"gpu", "corrected", "uncorrected"},
    "remap": {"gpu", "pending", "failure", "corrected", "uncorrected", "banks_low", "banks_none"},
    "fabric": {"gpu", "state", "status"},
    "pcie_link": {"gpu", "width", "gen"},
    "gpu_missing": {"gpu"},
    "ib_rate": {"device", "port", "rate_gbps"},
    "ib_errors": {"device", "port", "counter", "count", "per_s"},
    "sxid": {"switch", "code", "fatal", "link", "message"},
    "utilization": {"gpu", "pct"},
    # what NVML says a GPU is doing: utilization, memory activity, board power, PCIe traffic
    "activity": {"gpu", "pct", "memory_pct", "power_w", "pcie_mbps"},
    "fm_log": {"text"},
    "compute_slow": {"gpu", "factor"},
    "allreduce_corrupt": {"gpu", "count"},
    "p2p_slow": {"gpu", "peer", "factor"},
    "sdc": {"gpu", "dtype", "rate"},
    "compute_process": {"gpu", "pid", "memory_mib"},
}
_REQUIRED = {
    "xid": {"gpu", "code"},
    "throttle": {"gpu", "reasons"},
    "ib_down": {"device"},
    "nvml_error": {"gpu", "function", "error"},
    "nvml_hang": {"gpu", "function", "seconds"},
    "aer": {"gpu", "severity"},
    "kernel_line": {"text"},
    "temperature": {"gpu"},
    "nvlink_down": {"gpu", "link"},
    "nvlink_errors": {"gpu", "link", "counter"},
    "ecc": {"gpu"},
    "remap": {"gpu"},
    "fabric": {"gpu", "state"},
    "pcie_link": {"gpu"},
    "gpu_missing": {"gpu"},
    "ib_rate": {"device", "rate_gbps"},
    "ib_errors": {"device", "counter"},
    "sxid": {"switch", "code"},
    "utilization": {"gpu", "pct"},
    "activity": {"gpu"},
    "fm_log": {"text"},
    "compute_slow": {"gpu", "factor"},
    "allreduce_corrupt": {"gpu"},
    "p2p_slow": {"gpu", "factor"},
    "sdc": {"gpu"},
    "compute_process": {"gpu", "pid"},
}
NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")
IB_COUNTERS = ("symbol_error", "link_error_recovery", "port_rcv_errors", "local_link_integrity_errors",
               "excessive_buffer_overrun_errors", "port_xmit_discards", "port_rcv_remote_physical_errors",
               "link_downed")
THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                    "sw_thermal_slowdown", "sw_power_cap", "gpu_idle")
# dtypes the SDC fault harness flips bits in (gpumon/sdc/inject.py)
SDC_DTYPES = ("float64", "float32", "float16", "bfloat16")
NVML_ERRORS = {"gpu_is_lost": 15, "not_supported": 3, "unknown": 999, "timeout": 10,
               "no_permission": 4}


@dataclass(frozen=True)
class Fault:
    kind: str = field(metadata={"choices": FAULT_KINDS})
    at_s: float = field(default=0.0, metadata={"min": 0})
    duration_s: float | None = field(default=None, metadata={"min": 0})
    gpu: int | None = field(default=None, metadata={"min": 0})
    code: int | None = field(default=None, metadata={"min": 1})
    message: str | None = None
    reasons: list[str] = field(default_factory=list)
    device: str | None = None
    port: int = field(default=1, metadata={"min": 1})
    function: str | None = None
    error: str | None = field(default=None, metadata={"choices": (*NVML_ERRORS, None)})
    seconds: float | None = field(default=None, metadata={"min": 0})
    severity: str | None = field(default=None, metadata={"choices": ("correctable", "nonfatal", "fatal",
                                                                      None)})
    count: int | None = field(default=None, metadata={"min": 0})
    text: str | None = None
    core_c: float | None = None
    hbm_c: float | None = None
    link: int | None = field(default=None, metadata={"min": 0})
    counter: str | None = None
    per_s: float | None = field(default=None, metadata={"min": 0})
    corrected: int | None = field(default=None, metadata={"min": 0})
    uncorrected: int | None = field(default=None, metadata={"min": 0})
    pending: bool | None = None
    failure: bool | None = None
    banks_low: int | None = field(default=None, metadata={"min": 0})
    banks_none: int | None = field(default=None, metadata={"min": 0})
    state: int | None = field(default=None, metadata={"min": 0, "max": 3})
    status: int | None = field(default=None, metadata={"min": 0})
    width: int | None = field(default=None, metadata={"min": 1, "max": 32})
    gen: int | None = field(default=None, metadata={"min": 1, "max": 6})
    rate_gbps: float | None = field(default=None, metadata={"min": 0})
    switch: int | None = field(default=None, metadata={"min": 0})
    fatal: bool | None = None
    pct: int | None = field(default=None, metadata={"min": 0, "max": 100})
    memory_pct: int | None = field(default=None, metadata={"min": 0, "max": 100})
    power_w: float | None = field(default=None, metadata={"min": 0, "max": 4000})
    pcie_mbps: float | None = field(default=None, metadata={"min": 0, "max": 4_000_000})  # each direction
    factor: float | None = field(default=None, metadata={"min": 0.001, "max": 1.0})
    peer: int | None = field(default=None, metadata={"min": 0})
    pid: int | None = field(default=None, metadata={"min": 1, "max": 0xFFFFFFFF})
    memory_mib: int | None = field(default=None, metadata={"min": 0})  # None: NVML reports "not available"
    dtype: str | None = field(default=None, metadata={"choices": (*SDC_DTYPES, None)})
    rate: float | None = field(default=None, metadata={"min": 0.0, "max": 1.0})

    def __post_init__(self) -> None:
        allowed = _FIELDS[self.kind]
        for name in ("gpu", "code", "message", "device", "function", "error", "seconds", "severity",
                     "text", "core_c", "hbm_c", "link", "counter", "per_s", "corrected", "uncorrected",
                     "pending", "failure", "banks_low", "banks_none", "state", "status", "width", "gen",
                     "rate_gbps", "switch", "fatal", "pct", "memory_pct", "power_w", "pcie_mbps", "factor",
                     "peer", "pid", "memory_mib", "dtype", "rate"):
            if getattr(self, name) is not None and name not in allowed:
                raise ValueError(f"a {self.kind} fault takes no {name!r}")
        if self.reasons and "reasons" not in allowed:
            raise ValueError(f"a {self.kind} fault takes no 'reasons'")
        if self.count is not None and "count" not in allowed:
            raise ValueError(f"a {self.kind} fault takes no 'count'")
        for name in _REQUIRED[self.kind]:
            if name == "reasons":
                if not self.reasons:
                    raise ValueError("a throttle fault needs 'reasons'")
            elif getattr(self, name) is None:
                raise ValueError(f"a {self.kind} fault needs {name!r}")
        if self.peer is not None and self.peer == self.gpu:
            raise ValueError("peer must be another GPU")
        if self.kind == "nvlink_errors" and self.counter not in NVLINK_COUNTERS:
            raise ValueError(f"counter must be one of {', '.join(NVLINK_COUNTERS)}")
        if self.kind == "ib_errors" and self.counter not in IB_COUNTERS:
            raise ValueError(f"counter must be one of {', '.join(IB_COUNTERS)}")
        for reason in self.reasons:
            if reason not in THROTTLE_REASONS:
                raise ValueError(f"unknown throttle reason {reason!r} "
                                 f"(known: {', '.join(THROTTLE_REASONS)})")

    def amount(self, t: float) -> int:
        """A counter fault's contribution at ``t``: ``count`` at the start, plus ``per_s`` while active."""
        if t < self.at_s:
            return 0
        step = self.count if self.count is not None else (0 if self.per_s else 1)
        end = self.end_s if self.end_s is not None else t
        return step + int((min(t, end) - self.at_s) * (self.per_s or 0.0))

    @property
    def end_s(self) -> float | None:
        return None if self.duration_s is None else self.at_s + self.duration_s

    def active(self, t: float) -> bool:
        end = self.end_s
        return self.at_s <= t and (end is None or t < end)


@dataclass(frozen=True)
class Scenario:
    name: str
    sku: str
    description: str = ""
    gpus: int | None = field(default=None, metadata={"min": 1, "max": 64})
    ib_devices: int | None = field(default=None, metadata={"min": 0, "max": 64})
    driver_version: str = "550.90.07"
    cuda_driver_version: int = 12040
    faults: list[Fault] = field(default_factory=list)
    file: str = field(default="", compare=False)

    def changes_between(self, t0: float, t1: float) -> bool:
        """Whether the node looks different at t1 than at t0 (a fault starts or ends, or a counter ramps)."""
        for f in self.faults:
            if t0 < f.at_s <= t1:
                return True
            end = f.end_s
            if end is not None and t0 < end <= t1:
                return True
            if f.per_s and f.active(t1):
                return True
        return False

    def replay_times(self, until: float) -> list[float]:
        """When a one-shot ``gpumon check`` runs its checks to see the node at ``until``: at 0 and at
        every fault's start and end before ``until``, then at ``until``. A fault that has ended
        (an IB port that went down and came back) or a counter that moved is seen only by a
        check that read the node before it; a timeline on which nothing changes is read once."""
        if not self.changes_between(0.0, until):
            return [until]
        times = {0.0, until}
        for f in self.faults:
            times.update(t for t in (f.at_s, f.end_s) if t is not None and t < until)
        return sorted(times)

    @property
    def horizon_s(self) -> float:
        """A time by which every fault has started and every timed fault has ended."""
        t = 0.0
        for f in self.faults:
            t = max(t, f.at_s, f.end_s or 0.0)
        return t + 1.0


def builtin_scenarios() -> list[str]:
    root = resources.files("gpumon_config").joinpath("scenarios")
    return sorted(e.name.removesuffix(".yaml") for e in root.iterdir() if e.name.endswith(".yaml"))


def load_scenario(spec: str) -> Scenario:
    """``spec`` is a path to a YAML file or the name of a shipped scenario."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError("scenario file not found", file=spec)
        data, src = load_yaml_file(path)
    else:
        res = resources.files("gpumon_config").joinpath("scenarios").joinpath(f"{spec}.yaml")
        if not res.is_file():
            raise ConfigError(f"no scenario named {spec!r} (shipped: {', '.join(builtin_scenarios())})",
                              key="--simulate")
        data, src = load_yaml(res.read_text(encoding="utf-8"), f"config/scenarios/{spec}.yaml")
    return _build(data, src)


def _build(data: object, src: Source) -> Scenario:
    scenario = build(Scenario, data, src)
    return Scenario(**{**scenario.__dict__, "file": src.file})
