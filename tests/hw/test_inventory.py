"""The inventory on a host tree where one file never answers (issue 14 #3)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from gpumon.hw import Hardware
from gpumon.hw.inventory import collect


def _function(root: Path, bdf: str, vendor: str, device: str, pci_class: str) -> Path:
    path = root / "sys" / "bus" / "pci" / "devices" / bdf
    path.mkdir(parents=True)
    for name, text in (("vendor", vendor), ("device", device), ("class", pci_class)):
        (path / name).write_text(text + "\n")
    return path


def test_a_stuck_pci_file_leaves_the_inventory_partial_and_named(tmp_path: Path) -> None:
    """Before: the stuck vendor read held the one host-file worker, the next read (the
    InfiniBand listing) was refused and gpumon could not start (exit 3)."""
    stuck = _function(tmp_path, "0000:19:00.0", "0x10de", "0x2330", "0x030200") / "vendor"
    _function(tmp_path, "0000:3b:00.0", "0x10de", "0x2330", "0x030200")
    (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir(parents=True)
    stuck.unlink()
    os.mkfifo(stuck)
    try:
        fs = Hardware(tmp_path, fs_timeout=0.3).fs
        start = time.monotonic()
        inv = collect(None, fs)
        assert time.monotonic() - start < 1.0
        assert [d.bus_id for d in inv.pci_devices] == ["0000:3b:00.0"]
        assert inv.ib_devices == ["mlx5_0"]
        why = inv.read_errors["sys/bus/pci/devices/0000:19:00.0"]
        assert why.startswith("read(sys/bus/pci/devices/0000:19:00.0/vendor): ") and "0.3 s" in why
        # taken again while that read is still stuck: no wait, the same answer
        start = time.monotonic()
        again = collect(None, fs)
        assert time.monotonic() - start < 0.2
        assert again.pci_devices == inv.pci_devices
        assert "sys/bus/pci/devices/0000:19:00.0" in again.read_errors
    finally:
        with contextlib.suppress(OSError):  # ENXIO: no reader waits
            os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))
