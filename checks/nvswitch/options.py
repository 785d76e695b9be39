"""The nvswitch check's options (``NvswitchCheck.Config``, ``checks.nvswitch.*`` in the config), each
default with its source. Here rather than in ``check`` so that the readings (``sxid``,
``fabric_state``, ``fm_log``), which the check builds on, can take them without importing the check."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumon.bootstate import REPEAT_WINDOW_S, REPEAT_WINDOW_SOURCE


def _timezone_ok(name: str) -> bool:
    if name in ("UTC", "host"):
        return True
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo(name)
    except (KeyError, ValueError, OSError):  # ZoneInfoNotFoundError is a KeyError
        return False
    return True


@dataclass(frozen=True)
class NvswitchConfig:
    event_gap_s: float = field(default=1.0, metadata={
        "min": 0, "source": "real capture tests/data/kmsg-xid/dmesg_xid79-fallen-off-bus_plus_sxid20034-"
        "ltssm-fault-up.log: the lines of one SXid event (Fatal, Severity, Data) span 9 ms; 1 s keeps "
        "them together with a wide margin and still separates events seconds apart"})
    recent_window_s: float = field(default=3600.0, metadata={
        "min": 0, "source": "gpumon's expiry of application-level faults, the same as xid.recent_window_s"})
    repeat_window_s: float = field(default=REPEAT_WINDOW_S, metadata={
        "min": 0, "source": REPEAT_WINDOW_SOURCE})
    fabric_grace_s: float = field(default=600.0, metadata={
        "min": 0, "source": "real captures: fabric manager opens the NVSwitches 197 s after the "
        "kernel starts (tests/data/kmsg-xid/dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log: first "
        "line 15:36:15, 'nvidia-nvswitch0: open' 15:39:32) and at uptime 206.8 s (dev-kmsg-raw_"
        "nvswitch-open.log); 600 s is about three times that"})
    # under the host root (a leading / is dropped); None: var/log/fabricmanager.log, and missing = skipped
    fm_log_path: str | None = None
    # Zone of the log's stamps, which fabric manager prints in local time without a zone: "UTC"
    # (the kernel-log convention, see gpumon/hw/kmsg.py), "host" (<host-root>/etc/localtime) or a
    # zone name. Used only to skip entries from before this boot.
    fm_log_timezone: str = "UTC"
    fm_log_max_read_bytes: int = field(default=4 << 20, metadata={
        "min": 65536, "source": "gpumon's bound on one run's read, so that a long log is read over "
        "several runs: 4 MiB is about 23,000 entries at the real captures' 183 bytes per entry "
        "(tests/data/fabricmanager Dec 2024: 292 entries in 53,381 bytes)"})
    fm_log_initial_tail_bytes: int = field(default=1 << 20, metadata={
        "min": 0, "source": "gpumon's choice for the first look at an existing log: its last MiB, "
        "about 5,700 entries at the real captures' 183 bytes per entry; the log is appended across "
        "boots, so what lies before is mostly earlier boots, which are skipped anyway"})
    expected_nvswitches: int | None = field(default=None, metadata={"min": 0})  # from the SKU profile
    ignore_codes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _timezone_ok(self.fm_log_timezone):
            raise ValueError(f"fm_log_timezone: unknown time zone {self.fm_log_timezone!r} "
                             "(UTC, host, or a zone name such as Europe/Berlin)")
