"""A PCI function in a host-root tree, as sysfs shows it: identity, link speed and width, zeroed AER
counters, and its /sys/bus/pci/devices link (for tests that judge PCIe lines against the tree)."""

from __future__ import annotations

from pathlib import Path


def add_function(root: Path, path: str, vendor: str, cls: str, *, device: str,
                 speed: str = "16.0 GT/s PCIe") -> None:
    """``path``: below sys/devices, e.g. ``pci0000:00/0000:00:03.0/0000:03:00.0``."""
    bdf = path.rsplit("/", 1)[-1]
    d = root / "sys/devices" / path
    d.mkdir(parents=True)
    files = {"vendor": vendor, "device": device, "class": cls,
             "current_link_speed": speed, "max_link_speed": speed,
             "current_link_width": "16", "max_link_width": "16",
             "aer_dev_correctable": "RxErr 0\nTOTAL_ERR_COR 0",
             "aer_dev_nonfatal": "DLP 0\nTOTAL_ERR_NONFATAL 0", "aer_dev_fatal": "DLP 0\nTOTAL_ERR_FATAL 0"}
    for name, text in files.items():
        (d / name).write_text(text + "\n")
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / bdf).symlink_to(f"../../../devices/{path}")
