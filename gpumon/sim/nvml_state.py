"""State of a simulated NVML node, written by Python and served by the NVML injection library.

The C library in ``gpumon/sim/nvml_inject/nvml_inject.c`` implements the NVML entry points gpumon
uses and answers them from the state file named by ``$GPUMON_NVML_INJECT_STATE``. It re-reads the file
whenever its (inode, size, mtime, ctime) changes, so a simulator advances a fault timeline simply by
calling :func:`write_state` again (the write is atomic: gpumon.atomic).

State file format (version 1)
-----------------------------
Printable ASCII text, one record per line, ``\\n`` line ends (control characters and non-ASCII bytes
are rejected: real NVML strings are ASCII and pynvml decodes them). The first line is the magic
``gpumon-nvml-inject-state 1``; the last non-blank line is ``end`` (a truncated file is rejected).
Blank lines and lines starting with ``#`` are ignored. Every other line is ``KEY VALUE``: the key is
everything up to the first space. For string keys (``driver_version``, ``nvml_version``, ``name``,
``uuid``, ``serial``) the value is the rest of the line verbatim, spaces included. For every other key
the value is a list of tokens separated by single spaces: unsigned decimal integers, ``-`` for "not
available", PCI bus ids, hex UUIDs and NVML symbol names. Any unknown key, bad number, out-of-range value
or over-long line makes the library reject the whole file (``nvmlInit`` then returns
``NVML_ERROR_DRIVER_NOT_LOADED`` and the reason goes to stderr once).

Node section (before the first ``gpu`` line)::

    driver_version 550.90.07
    nvml_version 12.550.90.07
    cuda_driver_version 12040
    init_error 0                     # nvmlReturn_t returned by nvmlInit*; 0 = success
    call <symbol|*> <nvmlReturn_t> <hang_us>   # node-level injection (system functions)

GPU sections, one per GPU, in index order (``gpu N`` starts GPU N; N must be 0, 1, 2, ...)::

    gpu 0
    name NVIDIA H100 80GB HBM3
    uuid GPU-566e6f65-c38e-b12f-4824-6944218668b9
    serial 1655022005478
    pci 00000000:19:00.0 <pciDeviceId> <pciSubSystemId>
    minor_number 0
    architecture 9
    brand 14
    cuda_cc 9 0
    numa_node 0
    memory <total_bytes> <used_bytes> <reserved_bytes>
    nvlink <link> <active 0|1> <replay> <recovery> <crc_flit> <crc_data> <remote bus id|->
    clocks_event_reasons <current mask> <supported mask>
    violation <perf policy id> <violation time ns>
    temperature <gpu C> <memory C|->
    thresholds <shutdown C> <slowdown C> <mem max C> <gpu max C>
    clocks <sm> <mem> <video> <max sm> <max mem> <max video>       # MHz
    power <usage mW> <enforced limit mW>
    pcie <current gen> <max gen> <current width> <max width>
    utilization <gpu %> <memory %>
    pcie_throughput <tx KB/s> <rx KB/s>   # nvmlDeviceGetPcieThroughput (TX_BYTES, RX_BYTES)
    ecc_mode <current 0|1> <pending 0|1>
    ecc_errors <volatile corrected> <volatile uncorrected> <aggregate corrected> <aggregate uncorrected>
    remapped_rows <corrected> <uncorrected> <pending 0|1> <failure 0|1>
    remap_histogram <max> <high> <partial> <low> <none>
    retired_pages <sbe|-> <dbe|-> <pending 0|1>
    fabric <state> <status> <clique id> <cluster uuid, 32 hex digits> <health mask> <health summary>
    supported_events <event type mask>
    p2p <peer index> <nvmlGpuP2PStatus_t>
    topology <peer index> <nvmlGpuTopologyLevel_t>
    xid <code> <seq>
    process <pid> <used GPU memory bytes|->    # one per compute process
    call <symbol|*> <nvmlReturn_t> <hang_us>
    end

``nvlink`` lines appear once per link, link 0 first. ``process`` lines are what
nvmlDeviceGetComputeRunningProcesses lists, in order; pids are unique per GPU; ``-`` is
NVML_VALUE_NOT_AVAILABLE (pynvml then gives ``usedGpuMemory = None``). ``call`` lines inside a GPU
section inject into that GPU's functions: the library sleeps ``hang_us`` microseconds (without holding
its lock), then returns the error if it is not 0; ``*`` matches every function the exact name does not.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpumon.atomic import write_atomic

__all__ = [
    "FORMAT_MAGIC",
    "GpuState",
    "InjectedCall",
    "NvLinkErrorCounters",
    "NvmlNodeState",
    "StateFormatError",
    "read_state",
    "render_state",
    "write_state",
]

FORMAT_MAGIC = "gpumon-nvml-inject-state 1"

# Limits shared with nvml_inject.c (the library rejects a file that exceeds them).
MAX_GPUS = 64
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS
MAX_CALLS = 32  # per node and per GPU
MAX_XIDS = 256  # per GPU
MAX_MAP_ENTRIES = 32  # violation / p2p / topology entries per GPU
MAX_PROCESSES = 64  # compute processes per GPU
MAX_LINE = 1024
_STRING_LIMITS = {  # key -> longest value (bytes), one less than the NVML buffer size
    "driver_version": 79,
    "nvml_version": 79,
    "name": 95,
    "uuid": 95,
    "serial": 29,
}
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_PERF_POLICY_COUNT = 12  # NVML_PERF_POLICY_COUNT

# Bus ids of an HGX H100 8-GPU baseboard, from realdata/nvidia-smi-q/nvidia-smi-table_550.90.07.txt.
_HGX_BUS_IDS = ("19", "3B", "4C", "5D", "9B", "BB", "CB", "DB")
_UUID_NAMESPACE = uuidlib.UUID("6a4b1f0e-93c1-4c35-9d2f-3f6d0b5e7a11")
_SYMBOL_RE = re.compile(r"^(\*|nvml[A-Za-z0-9_]{1,59})$")
_BUS_ID_RE = re.compile(r"^([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])$")



class StateFormatError(ValueError):
    """A state (or state file) that the injection library would reject."""


@dataclass
class InjectedCall:
    """Per-function fault: sleep ``hang_s`` seconds, then return ``error`` (an nvmlReturn_t) if not 0.

    ``function`` is the NVML C symbol (``nvmlDeviceGetTemperature``, ``nvmlDeviceGetCount_v2``...), or
    ``*`` for every function of the scope that has no exact entry.
    """

    function: str
    error: int = 0
    hang_s: float = 0.0


@dataclass
class NvLinkErrorCounters:
    """nvmlDeviceGetNvLinkErrorCounter values of one link (DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT/DATA)."""

    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0


def _default_nvlinks() -> list[int]:
    return [1] * 18  # H100 SXM: 18 NVLink4 links


@dataclass
class GpuState:
    """One simulated GPU. Defaults describe a healthy, idle H100 80GB HBM3 SXM on an HGX board.

    Empty ``uuid`` / ``serial`` / ``pci_bus_id`` and ``minor_number = -1`` are filled from ``index``;
    ``nvlink_error_counters`` and ``nvlink_remote_pci_bus_ids`` are padded to one entry per link.
    ``None`` for ``memory_temperature_c`` or a retired-pages count means the reading is not available
    (NVML_ERROR_NOT_SUPPORTED, as for retired pages on Ampere and later).
    """

    index: int
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    serial: str = ""
    pci_bus_id: str = ""  # NVML form "00000000:19:00.0"
    pci_device_id: int = 0x233010DE
    pci_subsystem_id: int = 0x16C110DE
    minor_number: int = -1
    architecture: int = 9  # NVML_DEVICE_ARCH_HOPPER
    brand: int = 14  # NVML_BRAND_NVIDIA
    cuda_compute_capability: tuple[int, int] = (9, 0)
    numa_node: int = 0
    memory_total_bytes: int = 81559 * 1024 * 1024
    memory_used_bytes: int = 0
    memory_reserved_bytes: int = 551 * 1024 * 1024
    nvlink_states: list[int] = field(default_factory=_default_nvlinks)
    nvlink_error_counters: list[NvLinkErrorCounters] = field(default_factory=list)
    nvlink_remote_pci_bus_ids: list[str] = field(default_factory=list)  # "" = unknown
    clocks_event_reasons: int = 0
    supported_clocks_event_reasons: int = 0x1FF
    violation_ns: dict[int, int] = field(default_factory=dict)
    temperature_c: int = 35
    memory_temperature_c: int | None = 42
    temp_shutdown_c: int = 92
    temp_slowdown_c: int = 89
    temp_mem_max_c: int = 95
    temp_gpu_max_c: int = 87
    sm_clock_mhz: int = 345
    mem_clock_mhz: int = 2619
    video_clock_mhz: int = 765
    max_sm_clock_mhz: int = 1980
    max_mem_clock_mhz: int = 2619
    max_video_clock_mhz: int = 1545
    power_usage_mw: int = 72000
    enforced_power_limit_mw: int = 700000
    pcie_gen_current: int = 5
    pcie_gen_max: int = 5
    pcie_width_current: int = 16
    pcie_width_max: int = 16
    utilization_gpu: int = 0
    utilization_memory: int = 0
    # nvmlDeviceGetPcieThroughput, KB/s as NVML reports it (the driver's 20 ms window)
    pcie_tx_kbps: int = 0
    pcie_rx_kbps: int = 0
    ecc_mode_current: bool = True
    ecc_mode_pending: bool = True
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    remapped_rows_corrected: int = 0
    remapped_rows_uncorrected: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    remap_histogram_max: int = 2560
    remap_histogram_high: int = 0
    remap_histogram_partial: int = 0
    remap_histogram_low: int = 0
    remap_histogram_none: int = 0
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool = False
    fabric_state: int = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
    fabric_status: int = 0  # nvmlReturn_t
    fabric_clique_id: int = 0
    fabric_cluster_uuid: str = "00000000-0000-0000-0000-000000000000"
    fabric_health_mask: int = 0
    fabric_health_summary: int = 0
    supported_event_types: int = 0xC1F  # ECC SBE/DBE, PState, Xid, Clock, DRAM retirement event/failure
    p2p_status: dict[int, int] = field(default_factory=dict)  # peer index -> nvmlGpuP2PStatus_t
    topology: dict[int, int] = field(default_factory=dict)  # peer index -> nvmlGpuTopologyLevel_t
    xid_events: list[tuple[int, int]] = field(default_factory=list)  # (xid code, seq)
    # (pid, used GPU memory bytes or None = not available) of each process with a compute context
    compute_processes: list[tuple[int, int | None]] = field(default_factory=list)
    calls: list[InjectedCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'gpu-{self.index}')}"
        if not self.serial:
            self.serial = str(1655022005470 + self.index)
        if not self.pci_bus_id:
            if 0 <= self.index < len(_HGX_BUS_IDS):
                self.pci_bus_id = f"00000000:{_HGX_BUS_IDS[self.index]}:00.0"
            else:
                self.pci_bus_id = f"00000001:{self.index & 0xFF:02X}:00.0"
        if self.minor_number == -1:
            self.minor_number = self.index
        self.pci_bus_id = _normalize_bus_id(self.pci_bus_id)
        self.fabric_cluster_uuid = str(uuidlib.UUID(self.fabric_cluster_uuid))
        self._pad_links()

    def _pad_links(self) -> None:
        n = len(self.nvlink_states)
        while len(self.nvlink_error_counters) < n:
            self.nvlink_error_counters.append(NvLinkErrorCounters())
        while len(self.nvlink_remote_pci_bus_ids) < n:
            self.nvlink_remote_pci_bus_ids.append("")


@dataclass
class NvmlNodeState:
    """The whole simulated node: driver identity, nvmlInit outcome, node-level faults and the GPUs."""

    gpus: list[GpuState] = field(default_factory=list)
    driver_version: str = "550.90.07"
    nvml_version: str = "12.550.90.07"
    cuda_driver_version: int = 12040
    init_error: int = 0
    calls: list[InjectedCall] = field(default_factory=list)

    @classmethod
    def hgx(cls, n_gpus: int = 8, **gpu_fields: object) -> NvmlNodeState:
        """A healthy node of ``n_gpus`` default GPUs (``gpu_fields`` are applied to every GPU)."""
        return cls(gpus=[GpuState(index=i, **gpu_fields) for i in range(n_gpus)])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- writing


def _normalize_bus_id(bus_id: str) -> str:
    m = _BUS_ID_RE.match(bus_id)
    if not m:
        raise StateFormatError(f"bad PCI bus id {bus_id!r} (want NVML form like 00000000:19:00.0)")
    dom, bus, dev, fn = (int(g, 16) for g in m.groups())
    return f"{dom:08X}:{bus:02X}:{dev:02X}.{fn}"


def _num(value: int | bool, what: str, limit: int = _U32) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, int) or not 0 <= value <= limit:
        raise StateFormatError(f"{what}: {value!r} is not an integer in 0..{limit}")
    return str(value)


def _opt(value: int | None, what: str) -> str:
    return "-" if value is None else _num(value, what)


def _text(key: str, value: str) -> str:
    limit = _STRING_LIMITS[key]
    if not isinstance(value, str):
        raise StateFormatError(f"{key}: {value!r} is not a string")
    if len(value) > limit:
        raise StateFormatError(f"{key}: {value!r} is longer than {limit} characters")
    if not all(" " <= c <= "~" for c in value):
        raise StateFormatError(f"{key}: {value!r} must be printable ASCII (as NVML strings are)")
    return f"{key} {value}"


def _call_lines(calls: list[InjectedCall], where: str) -> Iterator[str]:
    if len(calls) > MAX_CALLS:
        raise StateFormatError(f"{where}: more than {MAX_CALLS} injected calls")
    for c in calls:
        if not _SYMBOL_RE.match(c.function):
            raise StateFormatError(f"{where}: bad NVML symbol name {c.function!r}")
        if not c.hang_s >= 0.0:
            raise StateFormatError(f"{where}: hang_s must be >= 0, got {c.hang_s!r}")
        hang_us = round(c.hang_s * 1_000_000)
        yield f"call {c.function} {_num(c.error, where + ' error')} {_num(hang_us, where + ' hang', _U64)}"


def _map_lines(key: str, mapping: dict[int, int], where: str, key_limit: int,
               val_limit: int) -> Iterator[str]:
    if len(mapping) > MAX_MAP_ENTRIES:
        raise StateFormatError(f"{where}: more than {MAX_MAP_ENTRIES} {key} entries")
    for k in sorted(mapping):
        what = f"{where} {key}"
        yield f"{key} {_num(k, what + ' key', key_limit)} {_num(mapping[k], what, val_limit)}"


def _gpu_lines(g: GpuState, position: int) -> Iterator[str]:
    w = f"gpu {position}"
    if g.index != position:
        raise StateFormatError(f"{w}: GpuState.index is {g.index}; GPUs must be listed in index order")
    yield f"gpu {position}"
    yield _text("name", g.name)
    yield _text("uuid", g.uuid)
    yield _text("serial", g.serial)
    yield f"pci {_normalize_bus_id(g.pci_bus_id)} {_num(g.pci_device_id, w)} {_num(g.pci_subsystem_id, w)}"
    yield f"minor_number {_num(g.minor_number, w + ' minor_number')}"
    yield f"architecture {_num(g.architecture, w + ' architecture')}"
    yield f"brand {_num(g.brand, w + ' brand')}"
    major, minor = g.cuda_compute_capability
    yield f"cuda_cc {_num(major, w + ' cuda cc', 0x7FFFFFFF)} {_num(minor, w + ' cuda cc', 0x7FFFFFFF)}"
    yield f"numa_node {_num(g.numa_node, w + ' numa_node')}"
    mem = (g.memory_total_bytes, g.memory_used_bytes, g.memory_reserved_bytes)
    if mem[1] + mem[2] > mem[0]:
        raise StateFormatError(f"{w}: used + reserved memory exceeds total")
    yield "memory " + " ".join(_num(v, w + " memory", _U64) for v in mem)
    n = len(g.nvlink_states)
    if n > MAX_LINKS:
        raise StateFormatError(f"{w}: more than {MAX_LINKS} NVLinks")
    if len(g.nvlink_error_counters) > n or len(g.nvlink_remote_pci_bus_ids) > n:
        raise StateFormatError(f"{w}: more NVLink counters / remote bus ids than nvlink_states")
    for link, active in enumerate(g.nvlink_states):
        c = g.nvlink_error_counters[link] if link < len(g.nvlink_error_counters) else NvLinkErrorCounters()
        remote = g.nvlink_remote_pci_bus_ids[link] if link < len(g.nvlink_remote_pci_bus_ids) else ""
        counters = " ".join(_num(v, f"{w} link {link}", _U64)
                            for v in (c.replay, c.recovery, c.crc_flit, c.crc_data))
        yield (f"nvlink {link} {_num(active, f'{w} link {link} state', 1)} {counters} "
               f"{_normalize_bus_id(remote) if remote else '-'}")
    yield (f"clocks_event_reasons {_num(g.clocks_event_reasons, w, _U64)} "
           f"{_num(g.supported_clocks_event_reasons, w, _U64)}")
    yield from _map_lines("violation", g.violation_ns, w, _PERF_POLICY_COUNT - 1, _U64)
    yield f"temperature {_num(g.temperature_c, w + ' temperature')} {_opt(g.memory_temperature_c, w)}"
    yield "thresholds " + " ".join(_num(v, w + " thresholds") for v in (
        g.temp_shutdown_c, g.temp_slowdown_c, g.temp_mem_max_c, g.temp_gpu_max_c))
    yield "clocks " + " ".join(_num(v, w + " clocks") for v in (
        g.sm_clock_mhz, g.mem_clock_mhz, g.video_clock_mhz,
        g.max_sm_clock_mhz, g.max_mem_clock_mhz, g.max_video_clock_mhz))
    yield f"power {_num(g.power_usage_mw, w + ' power')} {_num(g.enforced_power_limit_mw, w + ' power')}"
    yield "pcie " + " ".join(_num(v, w + " pcie") for v in (
        g.pcie_gen_current, g.pcie_gen_max, g.pcie_width_current, g.pcie_width_max))
    yield f"utilization {_num(g.utilization_gpu, w, 100)} {_num(g.utilization_memory, w, 100)}"
    yield f"pcie_throughput {_num(g.pcie_tx_kbps, w + ' pcie tx')} {_num(g.pcie_rx_kbps, w + ' pcie rx')}"
    yield f"ecc_mode {_num(g.ecc_mode_current, w)} {_num(g.ecc_mode_pending, w)}"
    yield "ecc_errors " + " ".join(_num(v, w + " ecc_errors", _U64) for v in (
        g.ecc_volatile_corrected, g.ecc_volatile_uncorrected,
        g.ecc_aggregate_corrected, g.ecc_aggregate_uncorrected))
    yield "remapped_rows " + " ".join(_num(v, w + " remapped_rows") for v in (
        g.remapped_rows_corrected, g.remapped_rows_uncorrected,
        g.remapped_rows_pending, g.remapped_rows_failure))
    yield "remap_histogram " + " ".join(_num(v, w + " remap_histogram") for v in (
        g.remap_histogram_max, g.remap_histogram_high, g.remap_histogram_partial,
        g.remap_histogram_low, g.remap_histogram_none))
    yield (f"retired_pages {_opt(g.retired_pages_sbe, w)} {_opt(g.retired_pages_dbe, w)} "
           f"{_num(g.retired_pages_pending, w)}")
    cluster = uuidlib.UUID(g.fabric_cluster_uuid).hex
    yield (f"fabric {_num(g.fabric_state, w)} {_num(g.fabric_status, w)} {_num(g.fabric_clique_id, w)} "
           f"{cluster} {_num(g.fabric_health_mask, w)} {_num(g.fabric_health_summary, w, 0xFF)}")
    yield f"supported_events {_num(g.supported_event_types, w, _U64)}"
    yield from _map_lines("p2p", g.p2p_status, w, MAX_GPUS - 1, _U32)
    yield from _map_lines("topology", g.topology, w, MAX_GPUS - 1, _U32)
    if len(g.xid_events) > MAX_XIDS:
        raise StateFormatError(f"{w}: more than {MAX_XIDS} xid events")
    if len({seq for _, seq in g.xid_events}) != len(g.xid_events):
        raise StateFormatError(f"{w}: xid seq numbers must be unique per GPU")
    for code, seq in g.xid_events:
        yield f"xid {_num(code, w + ' xid code', _U64)} {_num(seq, w + ' xid seq', _U64)}"
    yield from _process_lines(g.compute_processes, w)
    yield from _call_lines(g.calls, w)


def _process_lines(processes: list[tuple[int, int | None]], where: str) -> Iterator[str]:
    if len(processes) > MAX_PROCESSES:
        raise StateFormatError(f"{where}: more than {MAX_PROCESSES} compute processes")
    if len({pid for pid, _ in processes}) != len(processes):
        raise StateFormatError(f"{where}: compute process pids must be unique per GPU")
    for pid, used in processes:
        # all ones is NVML_VALUE_NOT_AVAILABLE: written as '-', so a byte count must stay below it
        used_text = "-" if used is None else _num(used, f"{where} process {pid} memory", _U64 - 1)
        yield f"process {_num(pid, where + ' process pid')} {used_text}"


def render_state(state: NvmlNodeState) -> str:
    """The state file text for ``state``; raises :class:`StateFormatError` if the library would reject it."""
    if len(state.gpus) > MAX_GPUS:
        raise StateFormatError(f"more than {MAX_GPUS} GPUs")
    lines = [
        FORMAT_MAGIC,
        _text("driver_version", state.driver_version),
        _text("nvml_version", state.nvml_version),
        f"cuda_driver_version {_num(state.cuda_driver_version, 'cuda_driver_version', 0x7FFFFFFF)}",
        f"init_error {_num(state.init_error, 'init_error')}",
        *_call_lines(state.calls, "node"),
    ]
    uuids: set[str] = set()
    bus_ids: set[str] = set()
    for position, gpu in enumerate(state.gpus):
        if gpu.uuid in uuids or _normalize_bus_id(gpu.pci_bus_id) in bus_ids:
            raise StateFormatError(f"gpu {position}: duplicate UUID or PCI bus id")
        uuids.add(gpu.uuid)
        bus_ids.add(_normalize_bus_id(gpu.pci_bus_id))
        lines.extend(_gpu_lines(gpu, position))
    lines.append("end")
    for line in lines:
        if len(line.encode("utf-8")) >= MAX_LINE:
            raise StateFormatError(f"line longer than {MAX_LINE - 1} bytes: {line[:40]!r}...")
    return "\n".join(lines) + "\n"


def write_state(state: NvmlNodeState, path: Path) -> None:
    """Atomically replace ``path`` with ``state`` (readers: the injection library, in other processes)."""
    write_atomic(Path(path), render_state(state), durable=False)


# --------------------------------------------------------------------------------------------- reading


def _ints(tokens: list[str], count: int, where: str) -> list[int]:
    if len(tokens) != count or not all(t.isdigit() and t.isascii() for t in tokens):
        raise StateFormatError(f"{where}: expected {count} unsigned integers, got {tokens!r}")
    return [int(t) for t in tokens]


def _opt_int(token: str, where: str) -> int | None:
    return None if token == "-" else _ints([token], 1, where)[0]


def _parse_call(tokens: list[str], where: str) -> InjectedCall:
    if len(tokens) != 3 or not _SYMBOL_RE.match(tokens[0]):
        raise StateFormatError(f"{where}: bad call line {tokens!r}")
    error, hang_us = _ints(tokens[1:], 2, where)
    return InjectedCall(tokens[0], error, hang_us / 1_000_000)


def _apply_gpu_line(g: dict[str, object], key: str, value: str, where: str) -> None:
    t = value.split(" ")
    links = g.setdefault("_links", [])
    assert isinstance(links, list)
    if key in ("name", "uuid", "serial"):
        g[key] = value
    elif key == "pci":
        if len(t) != 3:
            raise StateFormatError(f"{where}: bad pci line")
        g["pci_bus_id"] = _normalize_bus_id(t[0])
        g["pci_device_id"], g["pci_subsystem_id"] = _ints(t[1:], 2, where)
    elif key in ("minor_number", "architecture", "brand", "numa_node"):
        (g[key],) = _ints(t, 1, where)
    elif key == "supported_events":
        (g["supported_event_types"],) = _ints(t, 1, where)
    elif key == "cuda_cc":
        g["cuda_compute_capability"] = tuple(_ints(t, 2, where))
    elif key == "memory":
        g["memory_total_bytes"], g["memory_used_bytes"], g["memory_reserved_bytes"] = _ints(t, 3, where)
    elif key == "nvlink":
        if len(t) != 7:
            raise StateFormatError(f"{where}: bad nvlink line")
        link, active, *counters = _ints(t[:6], 6, where)
        if link != len(links):
            raise StateFormatError(f"{where}: nvlink {link} out of order")
        links.append((active, NvLinkErrorCounters(*counters), "" if t[6] == "-" else _normalize_bus_id(t[6])))
    elif key == "clocks_event_reasons":
        g["clocks_event_reasons"], g["supported_clocks_event_reasons"] = _ints(t, 2, where)
    elif key in ("violation", "p2p", "topology"):
        k, v = _ints(t, 2, where)
        name = {"violation": "violation_ns", "p2p": "p2p_status", "topology": "topology"}[key]
        mapping = g.setdefault(name, {})
        assert isinstance(mapping, dict)
        mapping[k] = v
    elif key == "temperature":
        if len(t) != 2:
            raise StateFormatError(f"{where}: bad temperature line")
        (g["temperature_c"],) = _ints(t[:1], 1, where)
        g["memory_temperature_c"] = _opt_int(t[1], where)
    elif key == "thresholds":
        (g["temp_shutdown_c"], g["temp_slowdown_c"], g["temp_mem_max_c"],
         g["temp_gpu_max_c"]) = _ints(t, 4, where)
    elif key == "clocks":
        (g["sm_clock_mhz"], g["mem_clock_mhz"], g["video_clock_mhz"], g["max_sm_clock_mhz"],
         g["max_mem_clock_mhz"], g["max_video_clock_mhz"]) = _ints(t, 6, where)
    elif key == "power":
        g["power_usage_mw"], g["enforced_power_limit_mw"] = _ints(t, 2, where)
    elif key == "pcie":
        (g["pcie_gen_current"], g["pcie_gen_max"], g["pcie_width_current"],
         g["pcie_width_max"]) = _ints(t, 4, where)
    elif key == "utilization":
        g["utilization_gpu"], g["utilization_memory"] = _ints(t, 2, where)
    elif key == "pcie_throughput":
        g["pcie_tx_kbps"], g["pcie_rx_kbps"] = _ints(t, 2, where)
    elif key == "ecc_mode":
        cur, pend = _ints(t, 2, where)
        g["ecc_mode_current"], g["ecc_mode_pending"] = bool(cur), bool(pend)
    elif key == "ecc_errors":
        (g["ecc_volatile_corrected"], g["ecc_volatile_uncorrected"], g["ecc_aggregate_corrected"],
         g["ecc_aggregate_uncorrected"]) = _ints(t, 4, where)
    elif key == "remapped_rows":
        corr, unc, pend, fail = _ints(t, 4, where)
        g["remapped_rows_corrected"], g["remapped_rows_uncorrected"] = corr, unc
        g["remapped_rows_pending"], g["remapped_rows_failure"] = bool(pend), bool(fail)
    elif key == "remap_histogram":
        (g["remap_histogram_max"], g["remap_histogram_high"], g["remap_histogram_partial"],
         g["remap_histogram_low"], g["remap_histogram_none"]) = _ints(t, 5, where)
    elif key == "retired_pages":
        if len(t) != 3:
            raise StateFormatError(f"{where}: bad retired_pages line")
        g["retired_pages_sbe"] = _opt_int(t[0], where)
        g["retired_pages_dbe"] = _opt_int(t[1], where)
        g["retired_pages_pending"] = bool(_ints(t[2:], 1, where)[0])
    elif key == "fabric":
        if len(t) != 6:
            raise StateFormatError(f"{where}: bad fabric line")
        g["fabric_state"], g["fabric_status"], g["fabric_clique_id"] = _ints(t[:3], 3, where)
        try:
            g["fabric_cluster_uuid"] = str(uuidlib.UUID(hex=t[3]))
        except ValueError as e:
            raise StateFormatError(f"{where}: bad cluster uuid {t[3]!r}") from e
        g["fabric_health_mask"], g["fabric_health_summary"] = _ints(t[4:], 2, where)
    elif key == "xid":
        code, seq = _ints(t, 2, where)
        xids = g.setdefault("xid_events", [])
        assert isinstance(xids, list)
        xids.append((code, seq))
    elif key == "process":
        if len(t) != 2:
            raise StateFormatError(f"{where}: bad process line")
        (pid,) = _ints(t[:1], 1, where)
        procs = g.setdefault("compute_processes", [])
        assert isinstance(procs, list)
        procs.append((pid, _opt_int(t[1], where)))
    elif key == "call":
        calls = g.setdefault("calls", [])
        assert isinstance(calls, list)
        calls.append(_parse_call(t, where))
    else:
        raise StateFormatError(f"{where}: unknown key {key!r}")


def _build_gpu(index: int, fields: dict[str, object]) -> GpuState:
    links = fields.pop("_links", [])
    assert isinstance(links, list)
    fields["nvlink_states"] = [a for a, _, _ in links]
    fields["nvlink_error_counters"] = [c for _, c, _ in links]
    fields["nvlink_remote_pci_bus_ids"] = [r for _, _, r in links]
    return GpuState(index=index, **fields)  # type: ignore[arg-type]


def read_state(path: Path) -> NvmlNodeState:
    """Parse a state file written by :func:`write_state` (raises :class:`StateFormatError`)."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise StateFormatError(f"{path}: not ASCII text") from e
    lines = text.split("\n")
    if not text.endswith("\n") or lines[0] != FORMAT_MAGIC:
        raise StateFormatError(f"{path}: not a gpumon NVML injection state file")
    node = NvmlNodeState(gpus=[])
    gpu_fields: list[dict[str, object]] = []
    ended = False
    for lineno, line in enumerate(lines[1:-1], start=2):
        where = f"{path}:{lineno}"
        if not line or line.startswith("#"):
            continue
        if ended:
            raise StateFormatError(f"{where}: text after 'end'")
        key, _, value = line.partition(" ")
        if key == "end" and not value:
            ended = True
        elif key == "gpu":
            if _ints([value], 1, where)[0] != len(gpu_fields):
                raise StateFormatError(f"{where}: GPU sections must be numbered 0, 1, 2, ...")
            gpu_fields.append({})
        elif gpu_fields:
            _apply_gpu_line(gpu_fields[-1], key, value, where)
        elif key in ("driver_version", "nvml_version"):
            setattr(node, key, value)
        elif key in ("cuda_driver_version", "init_error"):
            setattr(node, key, _ints([value], 1, where)[0])
        elif key == "call":
            node.calls.append(_parse_call(value.split(" "), where))
        else:
            raise StateFormatError(f"{where}: unknown key {key!r}")
    if not ended:
        raise StateFormatError(f"{path}: missing 'end' line (truncated file?)")
    node.gpus = [_build_gpu(i, f) for i, f in enumerate(gpu_fields)]
    return node
