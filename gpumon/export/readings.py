"""What each reading of gpumon's own checks means on ``/metrics``: its HELP text and metric type.

A check publishes readings as ``gpumon.model.reading(name, value, **labels)`` in a finding's
``evidence["readings"]``; the exporter turns each name into the family ``gpumon_<name>`` with the
labels ``check``, ``component`` and the reading's own. This table is the one place that says, for
every name a built-in check publishes, what the number counts or measures, in which unit, and where
gpumon got it (NVML function, sysfs file, kernel log, an external tool, or gpumon's own measurement
or judgement), so that an operator reading ``/metrics`` or building a dashboard needs nothing else.

A name ending in ``_total`` is a counter, every other name a gauge (``gpumon.model.reading``'s rule;
tests/export/test_readings.py holds the table to it and checks that every ``reading("...")`` in
checks/ and gpumon/ has an entry). A name that is not in the table (a site's own check) is still
exported, with :func:`generic_help`, which names the check(s) that published it.

Readings of bootstrap checks (``burnin``, ``host_bandwidth``, ``nccl``, ``p2p``, ``rdma``) are in the
table too: they are on ``/metrics`` wherever their findings are in the exported snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True)
class ReadingDoc:
    kind: Kind
    help: str
    checks: tuple[str, ...]  # the built-in checks that publish it


# base unit on /metrics; the checks' evidence and messages keep GB/s (Grafana unit "Bps" shows it)
_BPS = "bytes per second (the check's evidence and messages say GB/s: 1 GB/s = 1e9 bytes per second)"

READINGS: Mapping[str, ReadingDoc] = MappingProxyType({
    # -- continuous checks ---------------------------------------------------------------------
    "ecc_volatile_errors_total": ReadingDoc(
        "counter",
        "ECC errors counted by this GPU's memory since the last GPU reset or driver load (label kind: "
        "corrected, uncorrected); the reset or driver load sets it back to 0, an ordinary counter reset "
        "for rate() and increase(). Unit: errors. Source: NVML nvmlDeviceGetTotalEccErrors "
        "(NVML_VOLATILE_ECC). A volatile uncorrected error fails the GPU (reset_gpu). Published by the "
        "memory check (and the bootstrap's memory_headroom).",
        ("memory",)),
    "ecc_aggregate_errors_total": ReadingDoc(
        "counter",
        "ECC errors counted by this GPU's memory over its life, kept in its InfoROM across resets and "
        "reboots (label kind: corrected, uncorrected); includes the volatile count's errors, so never "
        "add the two. Unit: errors. Source: NVML nvmlDeviceGetTotalEccErrors (NVML_AGGREGATE_ECC). "
        "Evidence only in the memory check; the bootstrap's memory_headroom fails a GPU above its "
        "aggregate_errors_fail.",
        ("memory",)),
    "remapped_rows": ReadingDoc(
        "gauge",
        "HBM rows of this GPU replaced by spare rows over its life (label kind: correctable, "
        "uncorrectable = remapped after a correctable or an uncorrectable error); kept in the InfoROM, "
        "survives resets and reboots. Unit: rows. Source: NVML nvmlDeviceGetRemappedRows (Ampere and "
        "later).",
        ("memory",)),
    "remapped_rows_pending": ReadingDoc(
        "gauge",
        "1 while a row remap of this GPU waits for a GPU reset to take effect, else 0 (a flag, not a "
        "count of rows). Source: NVML nvmlDeviceGetRemappedRows isPending. Fails the GPU (reset_gpu).",
        ("memory",)),
    "remapped_rows_failure": ReadingDoc(
        "gauge",
        "1 once a row remap of this GPU has failed (NVIDIA's RMA criterion for GPU memory), else 0 (a "
        "flag). Source: NVML nvmlDeviceGetRemappedRows failureOccurred. Fails the GPU "
        "(inspect_hardware).",
        ("memory",)),
    "gpu_temperature_celsius": ReadingDoc(
        "gauge",
        "GPU core (die) temperature at the thermal check's last run. Unit: degrees Celsius. Source: "
        "NVML nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU); judged against the GPU's own "
        "nvmlDeviceGetTemperatureThreshold limits.",
        ("thermal",)),
    "hbm_temperature_celsius": ReadingDoc(
        "gauge",
        "GPU memory (HBM) temperature at the thermal check's last run; absent on GPUs without an HBM "
        "sensor. Unit: degrees Celsius. Source: NVML field NVML_FI_DEV_MEMORY_TEMP "
        "(nvmlDeviceGetFieldValues).",
        ("thermal",)),
    "throttle_active_ratio": ReadingDoc(
        "gauge",
        "Share of the throttle check's window (window_s, default 600 s) during which a clock-event "
        "(throttle) reason held this GPU's clocks (label reason, by default: hw_slowdown, "
        "hw_thermal_slowdown, hw_power_brake_slowdown, sw_thermal_slowdown, sw_power_cap). Unit: "
        "ratio 0..1. Source: NVML nvmlDeviceGetCurrentClocksEventReasons sampled on every run, "
        "time-weighted, and the thermal violation counter of nvmlDeviceGetViolationStatus.",
        ("throttle",)),
    "gpu_collective_hang": ReadingDoc(
        "gauge",
        "1 while this GPU has shown the hung-collective signature without a break for at least hold_s "
        "(default 60 s), else 0 (a flag): a compute process on it, utilization above "
        "min_utilization_pct (95 %), board power below max_power_w (the SKU profile's: 160 W on "
        "H100/H200 SXM, 100 W on A100 and H100 PCIe), memory utilization below 5 % and PCIe below "
        "300 MB/s each way, i.e. a kernel spinning in a collective that will not complete (scitix/"
        "sichek's GPUHang rule). Source: NVML nvmlDeviceGetUtilizationRates, nvmlDeviceGetPowerUsage, "
        "nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetPcieThroughput, sampled every run of the "
        "collective_hang check (10 s). The GPUs showing it wait; a node of the same job whose GPUs "
        "show 0 meanwhile is the one to look at.",
        ("collective_hang",)),
    "gpu_collective_hang_seconds": ReadingDoc(
        "gauge",
        "How long this GPU's current unbroken run of hung-collective signature samples had lasted at "
        "the collective_hang check's last run: 0 when that sample did not show it; gpu_collective_hang "
        "turns 1 when it reaches hold_s (default 60 s). Unit: seconds. Source: gpumon's timing of the "
        "check's NVML samples (any sample without the signature, or a gap over max_sample_gap_s, "
        "starts it again from 0).",
        ("collective_hang",)),
    "guard_pace_score": ReadingDoc(
        "gauge",
        "In-job pace of this node's GPU (label gpu: its index) in the latest window of a guarded "
        "training job (gpumon.guard): the job's median compute per step over all ranks divided by "
        "this GPU's rank's own (forward to its last gradient bucket, plus optimizer.step(); waiting "
        "for other ranks excluded). 1 is the group's pace, 0.5 half speed; below 0.75 (NVIDIA "
        "Resiliency Extension's straggler threshold) in 3 of 5 windows the job names it a straggler. "
        "Unit: ratio. Source: the job's pace file in the guard spool, exported while under "
        "pace_max_age_s (15 min) old.",
        ("guard",)),
    "guard_pace_slowest_score": ReadingDoc(
        "gauge",
        "The lowest guard_pace_score of this node's GPUs: how far the slowest GPU of this node holds "
        "back its guarded training job (1: at the group's pace). Unit: ratio. Source: as "
        "guard_pace_score.",
        ("guard",)),
    "xid_events_total": ReadingDoc(
        "counter",
        "NVIDIA Xid error events on this component since boot, per root Xid code (label code; an Xid 45 "
        "counts under the Xid it cleans up after; component: the GPU, nvlink/<gpu>/<link> for NVLink "
        "Xids, node when the GPU is unknown). Unit: events. Source: the kernel log's NVRM Xid lines and "
        "NVML Xid events (nvmlEventSetWait), one event when both report it. Resets at reboot; an "
        "application Xid's series ends recent_window_s after its last event.",
        ("xid",)),
    "pcie_aer_errors_total": ReadingDoc(
        "counter",
        "PCIe AER errors reported by this PCI function (a GPU, RDMA NIC, NVSwitch, or a bridge or switch "
        "port above them) since boot (label aer_severity: correctable, nonfatal, fatal). Unit: errors. "
        "Source: sysfs /sys/bus/pci/devices/<bdf>/aer_dev_correctable, aer_dev_nonfatal, aer_dev_fatal "
        "(TOTAL_ERR_*), which the kernel resets only at boot.",
        ("pcie",)),
    "ib_downtime_seconds": ReadingDoc(
        "gauge",
        "Time this InfiniBand/RoCE port was down within the ib check's sliding window (window_s, "
        "default 24 h), an ongoing outage included. Unit: seconds. Source: gpumon's timing of sysfs "
        "/sys/class/infiniband/<dev>/ports/<port>/state and phys_state, sampled every second by "
        "default.",
        ("ib",)),
    "ib_outages": ReadingDoc(
        "gauge",
        "Outages of this InfiniBand/RoCE port within the ib check's sliding window (window_s, default "
        "24 h), an ongoing one included; falls as outages leave the window, so a gauge, not a counter. "
        "Unit: outages. Source: sysfs /sys/class/infiniband/<dev>/ports/<port>/state and phys_state "
        "samples, plus link_downed counter rises for outages shorter than the sampling interval.",
        ("ib",)),
    "ib_longest_outage_seconds": ReadingDoc(
        "gauge",
        "Longest single outage of this InfiniBand/RoCE port within the ib check's sliding window "
        "(window_s, default 24 h), an ongoing one included; above outage_fail_s the port fails "
        "(check_cables). Unit: seconds. Source: gpumon's timing of sysfs "
        "/sys/class/infiniband/<dev>/ports/<port>/state and phys_state samples.",
        ("ib",)),
    "fabric_busbw_bytes_per_second": ReadingDoc(
        "gauge",
        "Bus bandwidth in the last multi-node fabric probe (gpumon probe-fabric) that judged this node: "
        "per collective (label op: all_reduce, all_gather, reduce_scatter, alltoall; sendrecv = the "
        "median of this node's pair exchanges) and size class (label size_class: small, mid, large), "
        "the best over the class's sizes. Unit: " + _BPS + ". Source: gpumon's own timing of the "
        "collectives (the slowest rank's median), busbw as nccl-tests defines it.",
        ("fabric",)),
    "fabric_latency_p95_seconds": ReadingDoc(
        "gauge",
        "95th-percentile time of one operation in the last fabric probe that judged this node, the "
        "worst over the size class's sizes and ranks (labels op and size_class as "
        "fabric_busbw_bytes_per_second; sendrecv: the median of this node's pair exchanges, small "
        "messages). Unit: seconds. Source: gpumon's own timing of the probe's operations.",
        ("fabric",)),
    "fabric_last_probe_timestamp_seconds": ReadingDoc(
        "gauge",
        "When the last fabric probe that judged this node ran. Unit: Unix time in seconds. Source: the "
        "probe's group report (gpumon probe-fabric, rank 0).",
        ("fabric",)),
    "fabric_last_probe_passed": ReadingDoc(
        "gauge",
        "1 if the last fabric probe completed and found nothing wrong with this node, else 0 (a flag). "
        "Source: gpumon's judgement of the probe (gpumon probe-fabric, rank 0).",
        ("fabric",)),
    # -- bootstrap checks ----------------------------------------------------------------------
    "burnin_gemm_flop_per_second": ReadingDoc(
        "gauge",
        "GEMM throughput this device sustained in the last burn-in, per data type (label dtype): 2n^3 "
        "floating-point operations per n x n GEMM over the GEMMs' device time. Unit: floating-point "
        "operations per second (FLOP/s; 1e12 = 1 TFLOP/s). Source: gpumon's burn-in workers (torch "
        "GEMMs on each GPU; CPU stand-ins on a simulated node).",
        ("burnin",)),
    "burnin_memory_copy_bytes_per_second": ReadingDoc(
        "gauge",
        "Device-to-device memory copy bandwidth of this GPU in the last burn-in, bytes read plus "
        "written (as CUDA's bandwidthTest counts), the better of two measurements. Unit: " + _BPS
        + ". Source: gpumon's burn-in workers (a torch copy within the GPU's memory).",
        ("burnin",)),
    "host_bandwidth_bytes_per_second": ReadingDoc(
        "gauge",
        "Pinned host memory <-> this GPU copy bandwidth in the last host_bandwidth run (label "
        "direction: h2d, d2h), one direction's bytes, the best of the attempts, from CPUs local to "
        "the GPU. Unit: " + _BPS + ". Source: gpumon's CUDA copy worker (torch), as nvbandwidth's "
        "memcpy_ce tests measure.",
        ("host_bandwidth",)),
    "p2p_copy_bytes_per_second": ReadingDoc(
        "gauge",
        "Copy bandwidth from this GPU to GPU <peer> (label peer: the peer's NVML index) in the last p2p "
        "run, one direction's bytes. Unit: " + _BPS + ". Source: gpumon's CUDA peer-copy worker "
        "(torch), one ordered pair at a time.",
        ("p2p",)),
    "nccl_allreduce_busbw_bytes_per_second": ReadingDoc(
        "gauge",
        "All-reduce bus bandwidth over every local GPU at the largest size of the last nccl run (label "
        "message_bytes: that message size in bytes); busbw = algbw x 2(n-1)/n as nccl-tests defines it. "
        "Unit: " + _BPS + ". Source: gpumon's torch.distributed all-reduce sweep, or nccl-tests' "
        "all_reduce_perf where it is used.",
        ("nccl",)),
    "rdma_loopback_bytes_per_second": ReadingDoc(
        "gauge",
        "RDMA write bandwidth of a loopback through one NIC port in the last rdma run, perftest's "
        "average at message_size (default 8 MiB) (label kind: host = host memory to host memory, on "
        "component ib/<dev>/<port>; gdr = GPUDirect RDMA to and from this GPU's memory through a NIC "
        "below its PCIe switch, on component gpu/<i>; labels device and port: the NIC's RDMA device "
        "and port, which tell apart the NICs that share a GPU's switch). Unit: bytes per second (the "
        "check's evidence and messages say Gbit/s, as perftest: 1 Gbit/s = 1.25e8 bytes per second). "
        "Source: perftest ib_write_bw --report_gbits.",
        ("rdma",)),
})


def generic_help(name: str, checks: Iterable[str]) -> str:
    """HELP for a reading no built-in check publishes: say who published it."""
    who = ", ".join(sorted(set(checks))) or "an unknown check"
    return (f"Reading {name} published by check {who}: not a built-in gpumon reading, see that check's "
            "documentation for its meaning and unit")


def is_generic(help_text: str) -> bool:
    return "not a built-in gpumon reading" in help_text


def help_for(name: str, checks: Iterable[str]) -> str:
    doc = READINGS.get(name)
    return doc.help if doc is not None else generic_help(name, checks)


def kind_of(name: str) -> Kind:
    doc = READINGS.get(name)
    if doc is not None:
        return doc.kind
    return "counter" if name.endswith("_total") else "gauge"
