"""Which compute device stands for which GPU: the placement of the compute checks' workers.

``ComputeDevices`` is the node's provider: CUDA devices when torch sees any (matched to NVML's GPUs
by UUID), CPU worker processes on a machine without GPUs, and ``NoCudaOnGpuNode`` where NVML sees
GPUs that torch cannot use. Whoever builds the ``Hardware`` may hand in another provider (the
simulator does: CPU workers standing in for its GPUs, each applying a fault model); checks and the
worker pool see only this interface.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumon.errors import GpumonError

if TYPE_CHECKING:
    from gpumon.hw.inventory import Inventory


class DeviceFaults(Protocol):
    """What the workers standing in for GPUs apply to the kernels they run. It is pickled to each
    worker process, so it must be plain data with methods."""

    def install(self, own: int | None) -> None:
        """Enter the fault model in this worker, standing in for GPU ``own`` (None: every GPU)."""

    def link(self, src: int, dst: int) -> contextlib.AbstractContextManager[None]:
        """Copies inside the block go over the link from GPU ``src`` to GPU ``dst``."""


@dataclass(frozen=True)
class StandIn:
    """A GPU that a CPU worker stands in for."""

    index: int  # the GPU's NVML index
    uuid: str | None  # normalized
    name: str
    # the SDC fault harness spec (gpumon/sdc/inject.py, without the worker) that the canary's worker
    # on this GPU computes under; "" computes right
    sdc: str = ""


@dataclass(frozen=True)
class Placement:
    """Where the workers run: ``cuda`` devices, or ``cpu`` workers.

    CPU workers may stand in for GPUs (``stand_ins``, one worker each): findings then name those
    GPUs with the actions a GPU would get, while sizes and thresholds stay the CPU ones (``is_cuda``
    is false: nothing is compared with a datasheet). ``faults``: what those workers apply.
    """

    kind: str  # "cuda" | "cpu"
    devices: int  # CUDA devices torch sees, or CPU workers
    note: str
    stand_ins: tuple[StandIn, ...] = ()
    faults: DeviceFaults | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def names_gpus(self) -> bool:
        """Findings go to GPUs (``gpu/<i>``, GPU actions): CUDA devices or GPUs stood in for."""
        return self.is_cuda or bool(self.stand_ins)


class NoCudaOnGpuNode(GpumonError):
    """NVML sees GPUs but torch sees no CUDA device: a CPU worker would prove nothing here."""


def cuda_device_count() -> int:
    """CUDA devices torch sees (0 without CUDA). Imports torch and initializes the CUDA driver in this
    process, but creates no context on any GPU (the workers do that)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def normalize_uuid(uuid: str | None) -> str | None:
    """NVML's ``GPU-1a2b...`` and torch's ``1a2b...`` as one key."""
    if not uuid:
        return None
    text = str(uuid).strip().lower()
    return text.removeprefix("gpu-") or None


class ComputeDevices:
    """This machine's compute devices, as torch sees them."""

    def place(self, inventory: Inventory, cpu_devices: int) -> Placement:
        """CUDA devices when torch sees any; else ``cpu_devices`` CPU workers.

        Where NVML sees GPUs, torch without CUDA (a CPU-only build, an empty CUDA_VISIBLE_DEVICES, a
        broken driver/runtime pair) raises ``NoCudaOnGpuNode``: burning CPUs there would report the
        node healthy without touching a GPU.
        """
        count = cuda_device_count()
        if count > 0:
            return Placement("cuda", count, f"{count} CUDA device(s) visible to torch")
        if inventory.gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise NoCudaOnGpuNode(f"NVML sees {len(inventory.gpus)} GPU(s) but torch sees no CUDA "
                                  f"device{why}: a CPU-only torch build or a broken CUDA runtime")
        return cpu_placement("no GPU", cpu_devices)

    def stand_ins(self, inventory: Inventory) -> tuple[StandIn, ...]:
        """The GPUs that CPU workers stand in for; none here: GPUs are measured on themselves."""
        return ()

    def describe(self) -> str:
        """What the node is, for messages about what could not be measured ("" for a real node)."""
        return ""

    @property
    def only_device(self) -> str | None:
        """The one torch device the workers may use (None: the GPUs torch sees, or the CPU)."""
        return None

    @property
    def tools_measure_gpus(self) -> bool:
        """External tools that load the GPUs (nccl-tests) measure the GPUs NVML reports."""
        return True


def cpu_placement(where: str, workers: int) -> Placement:
    """``workers`` CPU workers standing in for no GPU in particular (findings go to the node)."""
    return Placement("cpu", workers,
                     f"{where}: {workers} CPU worker processes stand in for GPUs (device cpu)")
