"""The systemd units in systemd/: verified by systemd's own analyzer on a root tree.

``systemd-analyze verify`` exits 0 on unknown keys and bad values (it only
warns), so any line on stderr is a failure; it also needs the ExecStart binary
to exist, hence a root tree with the units, a stub ``/opt/gpumon/bin/gpumon``
and a copy of the host's own unit directory (sysinit.target & co., which every
service depends on by default); tests/test_install_layout.py verifies them
against the real venv of docs/operators/install.md instead of the stub.
``systemd-analyze security --offline=yes`` scores the daemon's sandbox; the
score is reported in docs/operators/deploy.md ("systemd").

What this does not prove: that the sandbox lets gpumon work on a real GPU node
(NVML through /dev/nvidia*, /dev/kmsg with CAP_SYSLOG only); no systemd runs
here as PID 1 and no GPU is present.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = ("gpumon.service", "gpumon-bootstrap.service")
# 2.3 when written (systemd 252): root user, host network and /dev/nvidia* are what is left.
EXPOSURE_BOUND = 2.5


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze missing: .ci/run must install the Debian package systemd")
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    return tool


def _unit_dir() -> Path:
    for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if (d / "sysinit.target").exists():
            return d
    pytest.fail("systemd-analyze is installed but no sysinit.target in /usr/lib/systemd/system")


def _tree(tmp_path: Path, units: dict[str, str] | None = None, stub: bool = True) -> Path:
    root = tmp_path / "root"
    shutil.copytree(_unit_dir(), root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    (root / "lib").symlink_to("usr/lib")  # absolute links in the copy point at /lib/systemd/...
    etc = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True)
    for name in UNITS:
        text = (units or {}).get(name, (ROOT / "systemd" / name).read_text())
        (etc / name).write_text(text)
    if stub:
        binary = root / "opt" / "gpumon" / "bin" / "gpumon"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(0o755)
    return root


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_analyze(), "verify", f"--root={root}", *UNITS], capture_output=True, text=True,
                          timeout=120)


def _directives(name: str) -> dict[str, list[str]]:
    """``Section.Key`` -> values in order (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (ROOT / "systemd" / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_units_verify_without_a_single_warning(tmp_path: Path) -> None:
    proc = _verify(_tree(tmp_path))
    assert proc.returncode == 0 and proc.stderr.strip() == "" and proc.stdout.strip() == "", (
        proc.stdout + proc.stderr)


def test_verify_warnings_are_caught(tmp_path: Path) -> None:
    """The check above is not vacuous: a misspelt key exits 0 and only warns on stderr."""
    text = (ROOT / "systemd" / "gpumon.service").read_text().replace("WatchdogSec=", "WatchdogSecs=")
    proc = _verify(_tree(tmp_path, {"gpumon.service": text}))
    assert proc.returncode == 0
    assert "Unknown key 'WatchdogSecs'" in proc.stderr


def test_verify_needs_the_binary(tmp_path: Path) -> None:
    proc = _verify(_tree(tmp_path, stub=False))
    assert "/opt/gpumon/bin/gpumon is not executable" in proc.stderr


def test_daemon_sandbox_exposure(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    proc = subprocess.run([_analyze(), "security", "--offline=yes", f"--root={root}", "gpumon.service"],
                          capture_output=True, text=True, timeout=120)
    m = re.search(r"Overall exposure level for gpumon\.service: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    score = float(m[1])
    print(f"systemd-analyze security --offline=yes gpumon.service: exposure {score}")
    assert score <= EXPOSURE_BOUND, proc.stdout


def test_daemon_unit_settings() -> None:
    d = _directives("gpumon.service")
    one = {k: v[-1] for k, v in d.items()}
    assert one["Service.Type"] == "notify"
    assert one["Service.NotifyAccess"] == "main"
    assert one["Service.Restart"] == "on-failure"
    assert one["Service.ExecStart"] == "/opt/gpumon/bin/gpumon daemon"
    # the daemon pings every 5 s; systemd's own advice is to ping at least every half interval
    watchdog = one["Service.WatchdogSec"]
    assert watchdog.endswith("s") and float(watchdog[:-1]) >= 2 * 5.0
    assert one["Service.ProtectSystem"] == "strict"
    assert d["Service.ReadWritePaths"] == ["/var/lib/gpumon"]
    assert one["Service.StateDirectory"] == "gpumon"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "ProtectControlGroups",
                "ProtectKernelTunables"):
        assert one[f"Service.{key}"] == "yes", key
    assert one["Service.CapabilityBoundingSet"] == "CAP_SYSLOG"
    assert one["Service.RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    # what gpumon must still reach: the GPUs and the kernel log
    assert "Service.PrivateDevices" not in d
    assert one.get("Service.ProtectKernelLogs", "no") == "no"
    assert one["Service.DevicePolicy"] == "closed"
    allowed = d["Service.DeviceAllow"]
    for device in ("char-nvidia-frontend rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw", "/dev/kmsg r"):
        assert device in allowed, device


def test_bootstrap_unit_keeps_the_node_out_on_failure() -> None:
    d = _directives("gpumon-bootstrap.service")
    one = {k: v[-1] for k, v in d.items()}
    assert one["Service.Type"] == "oneshot"
    assert one["Service.ExecStart"] == "/opt/gpumon/bin/gpumon run-bootstrap"
    assert one["Service.TimeoutStartSec"]
    # ordered before the schedulers' agents, and required by them once enabled
    assert {"kubelet.service", "slurmd.service"} <= set(" ".join(d["Unit.Before"]).split())
    assert {"kubelet.service", "slurmd.service"} <= set(" ".join(d["Install.RequiredBy"]).split())


def test_enabling_the_bootstrap_makes_kubelet_and_slurmd_require_it(tmp_path: Path) -> None:
    """``systemctl enable`` (offline, on the tree) wires RequiredBy= as <unit>.requires/ links.

    That kubelet/slurmd then do not start after a failed bootstrap is systemd's documented
    Requires= + After= semantics; no service manager runs here to show it happening.
    """
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        if os.environ.get("CI"):
            pytest.fail("systemctl missing: .ci/run must install the Debian package systemd")
        pytest.skip("systemctl not installed (Debian package systemd)")
    root = _tree(tmp_path)
    etc = root / "etc" / "systemd" / "system"
    for agent in ("kubelet.service", "slurmd.service"):
        (etc / agent).write_text(f"[Unit]\nDescription=stub {agent}\n"
                                 "[Service]\nExecStart=/opt/gpumon/bin/gpumon\n")
    proc = subprocess.run([systemctl, f"--root={root}", "enable", *UNITS], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    for agent in ("kubelet.service", "slurmd.service"):
        link = etc / f"{agent}.requires" / "gpumon-bootstrap.service"
        assert link.is_symlink() and os.readlink(link) == "/etc/systemd/system/gpumon-bootstrap.service"
    assert (etc / "multi-user.target.wants" / "gpumon.service").is_symlink()
    verify = subprocess.run([_analyze(), "verify", f"--root={root}", "kubelet.service", "slurmd.service"],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
