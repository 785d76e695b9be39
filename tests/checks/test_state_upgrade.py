"""A node upgraded keeps its check state: the state files the ib and xid checks saved before their
state was declared on the check (``Check.State``, commit aa7f0ba) load into this code, which goes
on from them as that code did, and this code saves the same JSON.

``tests/data/checkstate/main-files.json`` was written by running this module as a script under
aa7f0ba's code (``git archive aa7f0ba`` unpacked, with its ``gpumon`` and ``checks`` first on
``sys.path``): per check, the state file its ``CheckStateStore`` saved after :data:`SAVED_AT` runs,
and the findings of the next run on it (made from the file, as a restarted daemon reads it). The
scenario uses only what both versions share: a store, a context, ``check.run``, ``store.save``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = TESTS / "data" / "checkstate" / "main-files.json"
IB_TREE = TESTS / "data" / "ibstat-sysfs" / "sys-class-infiniband_h100"
XID_LOG = TESTS / "data" / "kmsg-xid" / "dmesg-ctime_xid119_gsp-rpc-timeout.log"
T0 = 1_800_000_000.0
SAVED_AT = 4  # runs before the file is saved; the next run is made on it


def _host(root: Path) -> None:
    ib = root / "sys" / "class" / "infiniband"
    if not ib.exists():
        shutil.copytree(IB_TREE, ib, ignore=shutil.ignore_patterns("hw_counters"))
    boot = root / "proc" / "sys" / "kernel" / "random" / "boot_id"
    boot.parent.mkdir(parents=True, exist_ok=True)
    boot.write_text("boot-1\n")


def _port(root: Path, dev: str, up: bool) -> None:
    port = root / "sys" / "class" / "infiniband" / dev / "ports" / "1"
    (port / "state").write_text("4: ACTIVE\n" if up else "1: DOWN\n")
    (port / "phys_state").write_text("5: LinkUp\n" if up else "2: Polling\n")


def _run(name: str, root: Path, state: Any, step: int) -> list[dict[str, Any]]:
    """Run ``name``'s check once, as step ``step`` of the scenario, on ``state`` (a store's)."""
    from gpumon.check import CheckContext, KernelLog
    from gpumon.hw import Hardware
    from gpumon.hw.inventory import Inventory, PciDevice
    from gpumon.hw.nvml import GpuInfo
    from gpumon.hw.nvrm import parse_file
    from gpumon.profiles import GENERIC, builtin_profiles

    hw = Hardware(root)
    if name == "ib":
        from gpumon_checks.ib import IbCheck, IbConfig

        # mlx5_8 down at steps 1-2, back at 3; mlx5_9 down from step 3 on (open at the save)
        _port(root, "mlx5_8", step not in (1, 2))
        _port(root, "mlx5_9", step < 3)
        devices = sorted(p.name for p in (root / "sys" / "class" / "infiniband").iterdir())
        ctx = CheckContext(hw=hw, inventory=Inventory(ib_devices=devices),
                           profile=builtin_profiles()["h100-sxm"], options=IbConfig(), state=state,
                           kernel_log=KernelLog(), clock=lambda: T0 + step)
        found = IbCheck().run(ctx)
    else:
        from gpumon_checks.xid import XidCheck, XidConfig

        pci = "0000:9b:00.0"
        inv = Inventory(gpus=[GpuInfo(0, "GPU-0", None, pci, "NVIDIA H100 80GB HBM3", "hopper", 18, 0)],
                        pci_devices=[PciDevice(pci, "0x10de", "0x2330", "0x030200")])
        # the capture's lines at the first run, nothing new after (the daemon hands new lines only)
        events = parse_file(XID_LOG) if step == 0 else []
        ctx = CheckContext(hw=hw, inventory=inv, profile=GENERIC, options=XidConfig(), state=state,
                           kernel_log=KernelLog(events=events, source="t", boot_time=1_700_000_000.0),
                           clock=lambda: T0 + 60 * step)
        # the node finding names when this instance's NVML event set opened: not the state's doing
        found = [f for f in XidCheck().run(ctx) if f.component != "node"]
    return [f.to_json() for f in found]


def scenario(name: str, root: Path) -> dict[str, Any]:
    """The state file after :data:`SAVED_AT` runs, and the next run's findings on that file."""
    from gpumon.checkstate import CheckStateStore

    _host(root)
    store = CheckStateStore(root / "state")
    state = store.get(name)
    for step in range(SAVED_AT):
        _run(name, root, state, step)
    assert store.save(name)
    saved = json.loads((root / "state" / f"{name}.json").read_text())
    restarted = CheckStateStore(root / "state").get(name)
    return {"file": saved, "next_findings": _run(name, root, restarted, SAVED_AT)}


def test_state_files_of_the_previous_release_load_and_go_on_as_it_did(tmp_path: Path) -> None:
    from gpumon.checkstate import CheckStateStore

    golden = json.loads(GOLDEN.read_text())
    assert golden["ib"]["file"]["ports"]["mlx5_9/1"]["down_since"] == T0 + 3  # an outage open at the save
    assert golden["xid"]["file"]["groups"]  # an Xid history
    for name in ("ib", "xid"):
        root = tmp_path / name
        _host(root)
        (root / "state").mkdir()
        (root / "state" / f"{name}.json").write_text(json.dumps(golden[name]["file"]))
        state = CheckStateStore(root / "state").get(name)
        if name == "ib":  # the ports as they were at the save
            for step in range(SAVED_AT):
                _port(root, "mlx5_8", step not in (1, 2))
                _port(root, "mlx5_9", step < 3)
        assert _run(name, root, state, SAVED_AT) == golden[name]["next_findings"], name
        # and this code writes the JSON the previous one wrote
        assert scenario(name, tmp_path / f"{name}-now") == golden[name], name


if __name__ == "__main__":  # python tests/checks/test_state_upgrade.py OUT.json, under the old code
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = {name: scenario(name, Path(tmp) / name) for name in ("ib", "xid")}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
