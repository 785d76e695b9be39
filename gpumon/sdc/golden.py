"""Golden fingerprints, the key they are valid under, and how two runs are compared.

Bit-exactness holds only for the same computation on the same software and hardware: the same
workload (and sizes), GPU model, driver, CUDA, torch version and device kind. A golden is stored
and looked up under exactly that key; a key with no golden is reported as such, never matched
against a neighbouring one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpumon.atomic import write_atomic
from gpumon.errors import ConfigError
from gpumon.sdc.workloads import Point

FORMAT = "gpumon-sdc-golden/2"  # /2: 64-bit words mixed by splitmix64 (gpumon.sdc.fingerprint)


@dataclass(frozen=True, order=True)
class DeviceKey:
    """What a device's bits depend on besides the workload."""

    device_model: str
    driver: str
    cuda: str
    torch: str
    device_kind: str

    def describe(self) -> str:
        return (f"{self.device_model}, driver {self.driver}, CUDA {self.cuda}, torch {self.torch}, "
                f"{self.device_kind}")


@dataclass(frozen=True, order=True)
class GoldenKey:
    workload: str
    params: str
    device: DeviceKey

    def to_json(self) -> dict[str, str]:
        return {"workload": self.workload, "params": self.params, **asdict(self.device)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GoldenKey:
        try:
            device = DeviceKey(str(data["device_model"]), str(data["driver"]), str(data["cuda"]),
                               str(data["torch"]), str(data["device_kind"]))
            return cls(str(data["workload"]), str(data["params"]), device)
        except KeyError as exc:
            raise ValueError(f"golden key lacks {exc.args[0]!r}") from None


@dataclass(frozen=True)
class Diff:
    """Where two runs of one workload part: the first differing point (index into the lists)."""

    index: int
    name: str
    expected: Point | None
    observed: Point | None

    def describe(self) -> str:
        if self.observed is None:
            return f"ended before {self.name!r} (point {self.index})"
        if self.expected is None:
            return f"extra point {self.name!r} (point {self.index})"
        if (self.expected.dtype, self.expected.shape) != (self.observed.dtype, self.observed.shape):
            return (f"{self.name!r} is {self.observed.dtype}{list(self.observed.shape)}, expected "
                    f"{self.expected.dtype}{list(self.expected.shape)}")
        return f"{self.name!r}: {self.observed.fp.hex()}, expected {self.expected.fp.hex()}"


def first_difference(expected: Sequence[Point], observed: Sequence[Point]) -> Diff | None:
    """The first point, in recording (= computation) order, where two runs differ; None if none."""
    for i, (e, o) in enumerate(zip(expected, observed, strict=False)):
        if not e.same(o):
            return Diff(i, o.name if o.name == e.name else e.name, e, o)
    if len(observed) < len(expected):
        return Diff(len(observed), expected[len(observed)].name, expected[len(observed)], None)
    if len(observed) > len(expected):
        return Diff(len(expected), observed[len(expected)].name, None, observed[len(expected)])
    return None


class Golden:
    """A set of golden runs, one per key. Loaded from and saved to a JSON file."""

    def __init__(self, entries: Mapping[GoldenKey, Sequence[Point]] | None = None,
                 meta: Mapping[GoldenKey, Mapping[str, Any]] | None = None) -> None:
        self.entries: dict[GoldenKey, list[Point]] = {k: list(v) for k, v in (entries or {}).items()}
        self.meta: dict[GoldenKey, dict[str, Any]] = {k: dict(v) for k, v in (meta or {}).items()}

    def get(self, key: GoldenKey) -> list[Point] | None:
        return self.entries.get(key)

    def put(self, key: GoldenKey, points: Sequence[Point], **meta: Any) -> None:
        self.entries[key] = list(points)
        self.meta[key] = {"recorded_at": time.time(), **meta}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "entries": [{"key": k.to_json(), **self.meta.get(k, {}),
                         "points": [p.to_json() for p in pts]}
                        for k, pts in sorted(self.entries.items())],
        }

    def dumps(self) -> str:
        """JSON with one point per line: diffable, and readable by people comparing two goldens."""
        doc = self.to_json()
        entries = []
        for entry in doc["entries"]:
            head = {k: v for k, v in entry.items() if k != "points"}
            rows = ",\n".join("    " + json.dumps(p) for p in entry["points"])
            entries.append("  " + json.dumps(head)[:-1] + ', "points": [\n' + rows + "\n  ]}")
        return ('{"format": ' + json.dumps(doc["format"]) + ', "entries": [\n' + ",\n".join(entries)
                + "\n]}\n")

    @classmethod
    def from_json(cls, data: Any, source: str = "<golden>") -> Golden:
        if isinstance(data, Mapping) and data.get("format") == "gpumon-sdc-golden/1":
            raise ConfigError("golden file of format gpumon-sdc-golden/1: its fingerprints of 64-bit "
                              "tensors used an older, weaker scheme; record it again with `gpumon canary "
                              "record`", file=source)
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ConfigError(f"not a gpumon golden file (want format {FORMAT!r})", file=source)
        golden = cls()
        for i, entry in enumerate(data.get("entries") or []):
            try:
                key = GoldenKey.from_json(entry["key"])
                points = [Point.from_json(row) for row in entry["points"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"bad entry: {exc}", file=source, key=f"entries[{i}]") from None
            golden.entries[key] = points
            golden.meta[key] = {k: v for k, v in entry.items() if k not in ("key", "points")}
        return golden

    @classmethod
    def load(cls, path: Path) -> Golden:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read golden file: {exc.strerror or exc}", file=str(path)) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"golden file is not JSON: {exc}", file=str(path), line=exc.lineno) from None
        return cls.from_json(data, str(path))

    def save(self, path: Path) -> None:
        """Write atomically: a golden file half written is worse than the old one."""
        write_atomic(path, self.dumps())


def majority(groups: Iterable[tuple[int, Any]]) -> tuple[Any | None, dict[Any, list[int]]]:
    """(value held by a strict majority of workers or None, value -> workers)."""
    split: dict[Any, list[int]] = {}
    total = 0
    for worker, value in groups:
        split.setdefault(value, []).append(worker)
        total += 1
    for value, workers in split.items():
        if 2 * len(workers) > total:
            return value, split
    return None, split


def device_key(device: torch.device, *, driver: str | None = None, cpu_model: str | None = None) -> DeviceKey:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return DeviceKey(device_model=torch.cuda.get_device_name(device), driver=driver or "unknown",
                         cuda=str(torch.version.cuda), torch=torch.__version__,
                         device_kind=f"cuda sm_{major}{minor}")
    # CPU kernels are chosen by instruction set: AVX2 and AVX-512 builds round differently
    capability = torch.backends.cpu.get_cpu_capability()
    return DeviceKey(device_model=f"{cpu_model or 'unknown CPU'} [{capability}]", driver="none",
                     cuda="none", torch=torch.__version__, device_kind="cpu")


def cpu_model_of(cpuinfo: str) -> str:
    """The CPU's model name in /proc/cpuinfo (the "GPU model" of a CPU stand-in)."""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"
