"""Who a rank is, down to the GPU: rank, host, scheduler node name, local rank, device, NVML UUID and PCI
bus id. The GPU is named through ``gpumon.hw`` (NVML, every call bounded), matched by UUID: CUDA's
device numbers change with CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, the UUID does not.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from gpumon.guard.verdict import Identity, host_name

log = logging.getLogger("gpumon.guard")

# Slurm's name for the node runs first: on Kubernetes NODE_NAME comes from the downward API
# (spec.nodeName), which a pod spec must ask for; Slurm sets SLURMD_NODENAME in every step.
NODE_NAME_ENVS = ("SLURMD_NODENAME", "NODE_NAME")


@dataclass(frozen=True)
class GpuName:
    uuid: str | None
    pci_bus_id: str | None
    index: int | None
    note: str


def node_name() -> tuple[str | None, str | None]:
    """(the scheduler's node name, the env variable it came from), or (None, None)."""
    for env in NODE_NAME_ENVS:
        value = os.environ.get(env)
        if value:
            return value, env
    return None, None


def local_rank() -> int | None:
    for env in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(env)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return None


def resolve_gpu(uuid: str | None, nvml_timeout_s: float = 5.0) -> GpuName:
    """The GPU with this UUID (torch's ``1a2b...`` or NVML's ``GPU-1a2b...``) as NVML names it:
    NVML's UUID, PCI bus id and index. Never raises: what could not be resolved is said in ``note``."""
    from gpumon.errors import GpumonError, HwCondition
    from gpumon.hw.calls import BoundedCaller
    from gpumon.hw.nvml import Nvml
    from gpumon.hw.placement import normalize_uuid

    key = normalize_uuid(uuid)
    if key is None:
        return GpuName(None, None, None, "the CUDA device reports no UUID")
    nvml = Nvml(BoundedCaller(), nvml_timeout_s)
    try:
        nvml.init()
        for index in range(nvml.device_count()):
            info = nvml.info(index)
            if normalize_uuid(info.uuid) == key:
                return GpuName(info.uuid, info.pci_bus_id, index, "resolved through NVML by UUID")
    except (HwCondition, GpumonError) as exc:
        return GpuName(f"GPU-{key}", None, None, f"UUID from CUDA; NVML could not name it: {exc}")
    finally:
        nvml.shutdown()
    return GpuName(f"GPU-{key}", None, None, "UUID from CUDA; no GPU with it among NVML's")


def cuda_uuid(device: Any) -> str | None:
    """The UUID CUDA reports for a torch CUDA device."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else None


def identify(rank: int, world_size: int, device: Any) -> Identity:
    """This rank's identity on ``device`` (a torch.device)."""
    name, source = node_name()
    text = str(device)
    if getattr(device, "type", "cpu") == "cuda":
        try:
            gpu = resolve_gpu(cuda_uuid(device))
        except Exception as exc:  # a broken CUDA runtime must not stop the training here
            gpu = GpuName(None, None, None, f"CUDA could not say its UUID: {exc}")
    else:
        gpu = GpuName(None, None, None, f"device {text}: no GPU")
    return Identity(rank=rank, world_size=world_size, host=host_name(), node_name=name,
                    node_name_source=source, local_rank=local_rank(), device=text, gpu_uuid=gpu.uuid,
                    gpu_pci_bus_id=gpu.pci_bus_id, gpu_index=gpu.index, gpu_note=gpu.note)
