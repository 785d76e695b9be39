"""The pcie check's options (``PcieCheck.Config``, ``checks.pcie.*`` in the config), each default with
its source. Here rather than in ``check`` so that the judging (``judge``), which the check builds on,
can take them without importing the check."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PcieConfig:
    correctable_per_hour: float = field(default=480.0, metadata={
        "min": 0,
        "source": "NVIDIA/DCGM common/DcgmGPUHardwareLimits.h @ 28bfbd4c97413d4aec249cdd9543a67d24f95b78: "
                  "DCGM_LIMIT_MAX_PCIREPLAY_RATE 8, '8 replays per minute is the maximum recommended by RM'; "
                  "a replay is the link-level retry that follows a correctable error (bad TLP/DLLP, replay "
                  "timeout), so 8/min = 480/h correctable errors is the same limit in AER terms"})
    correctable_window_s: float = field(default=3600.0, metadata={
        "min": 60,
        "source": "design: the rate is per hour; judged over the last hour so that one burst averages out "
                  "while a sustained rate at DCGM's limit still shows"})
    correctable_min_span_s: float = field(default=60.0, metadata={
        "min": 1,
        "source": "DCGM's replay limit is per minute (DcgmGPUHardwareLimits.h, as above): no rate is "
                  "judged over less than one minute of readings"})
    load_utilization_pct: int = field(default=50, metadata={
        "min": 0, "max": 100,
        "source": "nvidia-smi --help-query-gpu, pcie.link.gen.current: 'These may be reduced when the GPU "
                  "is not in use'; measurement: 8x RTX 4090 and a Titan V at 0 % utilization report link "
                  "generation Current 1 with Max 4 / 3 "
                  "(shared/realdata/nvidia-smi-q/rtx4090x8_535.154.05.txt, titanv_x1_560.35.03.txt). "
                  "Utilization is the share of the sample period with a kernel "
                  "running (nvmlUtilization_t.gpu); above half of it the GPU is unambiguously in use"})
