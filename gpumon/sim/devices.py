"""Simulated GPUs' compute: what the CPU worker standing in for a simulated GPU does differently.

A simulated node's GPUs exist for NVML through the injection library; for torch they are CPU
worker processes (gpumon/workers.py, "stand-ins"), placed by ``SimulatedDevices``, the simulated
node's ``Hardware.devices``. Scenario faults about compute are each
simulated GPU's **device model**, applied inside its worker to the kernels the worker really runs,
so the compute checks measure and judge them through the same code as on GPUs:

- ``compute_slow`` (``factor``): every GEMM and device copy takes 1/factor as long, as on a GPU
  held at a low clock or with a lost HBM stack: the checks time it;
- ``allreduce_corrupt`` (``count``): after each all-reduce completes on this GPU, ``count``
  elements of its result are off by one, as when a GPU's memory or NVLink receive path corrupts
  data: the checks count wrong elements;
- ``p2p_slow`` (``factor``, optional ``peer``): copies between this GPU and ``peer`` (every peer
  when absent) take 1/factor as long, as over a degraded NVLink;
- ``sdc`` (``dtype``, ``rate``): the GPU computes wrong bits without any error, as a marginal
  arithmetic unit does: the SDC canary's worker on it runs under the fault harness
  (gpumon/sdc/inject.py) with this spec.

The models travel to the workers inside ``SimulatedFaults`` (the placement's ``faults``); the worker
installs them with ``install`` (a ``TorchDispatchMode``, so it sees the ATen kernels the worker runs
without any change to the measuring code). Slowing is a busy wait after the kernel: the measured time
grows by the kernel's own time x (1/factor - 1), spent spinning.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon.errors import HwFailure
from gpumon.hw.placement import ComputeDevices, Placement, StandIn, cpu_placement, normalize_uuid

if TYPE_CHECKING:
    from gpumon.hw.inventory import Inventory

# ATen overload packets that are the GEMM work of the burn-in and the canaries
_COMPUTE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
_COPY_OPS = frozenset({"copy_"})
_ALLREDUCE_OPS = frozenset({"allreduce_"})

# Where the simulator writes the device models, under the simulated node's host root (a path no
# real host has: only ``SimulatedDevices`` reads it)
SIM_DEVICES_FILE = "run/gpumon-sim/devices.json"


@dataclass(frozen=True)
class DeviceModel:
    """One simulated GPU's compute behaviour (healthy: the defaults)."""

    speed: float = 1.0  # share of a healthy device's speed, 0 < speed <= 1
    allreduce_wrong: int = 0  # elements of each all-reduce result made wrong on this device
    links: Mapping[int, float] = field(default_factory=dict)  # peer index -> share of healthy copy speed
    all_links: float = 1.0  # share of healthy copy speed to every peer
    # silent data corruption: the SDC fault harness's spec without the worker ("dtype=float32,rate=1")
    # (gpumon/sdc/inject.py), applied by the canary to the worker on this GPU
    sdc: str = ""

    def link(self, peer: int) -> float:
        return min(self.all_links, self.links.get(peer, 1.0))

    @property
    def healthy(self) -> bool:
        return (self.speed >= 1.0 and not self.allreduce_wrong and self.all_links >= 1.0 and not self.links
                and not self.sdc)

    def to_json(self) -> dict[str, Any]:
        return {"speed": self.speed, "allreduce_wrong": self.allreduce_wrong,
                "links": {str(k): v for k, v in sorted(self.links.items())}, "all_links": self.all_links,
                "sdc": self.sdc}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceModel:
        """The model from ``to_json`` data; ValueError on anything else."""
        try:
            model = cls(speed=float(data.get("speed", 1.0)),
                        allreduce_wrong=int(data.get("allreduce_wrong", 0)),
                        links={int(k): float(v) for k, v in dict(data.get("links", {})).items()},
                        all_links=float(data.get("all_links", 1.0)), sdc=str(data.get("sdc", "")))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad device model {data!r}: {exc}") from exc
        shares = (model.speed, model.all_links, *model.links.values())
        if any(not 0.0 < s <= 1.0 for s in shares) or model.allreduce_wrong < 0:
            raise ValueError(f"bad device model {data!r}: shares must lie in (0, 1], counts >= 0")
        return model


def _busy(seconds: float) -> None:
    """Spin for ``seconds`` of this thread's CPU time: a slow device is busy for longer, so the extra
    time shows on the worker's CPU clock (stand-ins time their GEMMs by it) and on the wall clock."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def link_share(models: Mapping[int, DeviceModel], src: int, dst: int) -> float:
    """Share of healthy copy speed between two simulated GPUs: a link is as slow as its slower end."""
    a, b = models.get(src, DeviceModel()), models.get(dst, DeviceModel())
    return min(a.link(dst), b.link(src))


class _Installed:
    """The state of the installed mode, for ``WorkerContext.link``."""

    link: tuple[int, int] | None = None


_STATE = _Installed()


def install(models: Mapping[int, DeviceModel], own: int | None) -> Any:
    """Enter the device mode for this worker process (it stays for the process's life).

    ``own``: the simulated GPU this worker stands in for (None: a worker driving every device, as
    the peer-copy worker does; then only links apply). Returns the entered mode.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    mine = models.get(own, DeviceModel()) if own is not None else DeviceModel()

    # torch leaves TorchDispatchMode's methods unannotated
    class DeviceMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.allreduce_calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            t0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            share = 1.0
            if name in _COMPUTE_OPS:
                share = mine.speed
            elif name in _COPY_OPS:
                share = link_share(models, *_STATE.link) if _STATE.link is not None else mine.speed
            elif name in _ALLREDUCE_OPS and mine.allreduce_wrong:
                self._corrupt(out)
            if share < 1.0:
                _busy((time.thread_time() - t0) * (1.0 / share - 1.0))
            return out

        def _corrupt(self, out: Any) -> None:
            tensors, work = out
            work.wait()  # the result is complete only now; the caller's wait() returns at once
            self.allreduce_calls += 1
            for t in tensors:
                flat = t.view(-1)
                n = flat.numel()
                for k in range(min(mine.allreduce_wrong, n)):
                    # different elements on each call: a fault, not a fixed address
                    flat[(self.allreduce_calls * 7919 + k * 104729) % n] += 1

    mode = DeviceMode()
    mode.__enter__()  # type: ignore[no-untyped-call]
    return mode


@contextlib.contextmanager
def link(src: int, dst: int) -> Iterator[None]:
    """Copies inside the block run over the simulated link src -> dst."""
    _STATE.link = (src, dst)
    try:
        yield
    finally:
        _STATE.link = None


@dataclass(frozen=True)
class SimulatedFaults:
    """The placement's fault model (``DeviceFaults``): pickled to each stand-in worker."""

    models: Mapping[int, DeviceModel]

    def install(self, own: int | None) -> None:
        install(self.models, own)

    def link(self, src: int, dst: int) -> contextlib.AbstractContextManager[None]:
        return link(src, dst)


class SimulatedDevices(ComputeDevices):
    """A simulated node's compute devices: a CPU worker stands in for each simulated GPU and behaves
    as its device model says. Never CUDA, even on a machine that has GPUs: a simulation must not
    measure real hardware and report it under simulated GPUs' names."""

    def __init__(self, host_root: Path) -> None:
        self.path = host_root / SIM_DEVICES_FILE

    def models(self) -> dict[int, DeviceModel]:
        """The simulated GPUs' device models by index; healthy GPUs may be absent."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}  # not rendered: every simulated GPU healthy
        except OSError as exc:
            raise HwFailure(f"simulated device models {SIM_DEVICES_FILE}: {exc}",
                            call=f"read {SIM_DEVICES_FILE}") from exc
        try:
            data = json.loads(text)
            return {int(k): DeviceModel.from_json(v) for k, v in dict(data).items()}
        except (ValueError, TypeError) as exc:
            raise HwFailure(f"simulated device models {SIM_DEVICES_FILE}: {exc}",
                            call=f"read {SIM_DEVICES_FILE}") from exc

    def place(self, inventory: Inventory, cpu_devices: int) -> Placement:
        stand_ins = self.stand_ins(inventory)
        if not stand_ins:
            return cpu_placement("simulated node", cpu_devices)
        return Placement("cpu", len(stand_ins),
                         f"simulated node: {len(stand_ins)} CPU worker processes stand in for the simulated "
                         "GPUs (device cpu)", stand_ins, SimulatedFaults(self.models()))

    def stand_ins(self, inventory: Inventory) -> tuple[StandIn, ...]:
        models = self.models()
        return tuple(StandIn(g.index, normalize_uuid(g.uuid), g.name,
                             models[g.index].sdc if g.index in models else "")
                     for g in sorted(inventory.gpus, key=lambda g: g.index))

    def describe(self) -> str:
        return "simulated node"

    @property
    def only_device(self) -> str | None:
        return "cpu"

    @property
    def tools_measure_gpus(self) -> bool:
        return False
