"""Test hosts in Linux network namespaces, joined through a bridge (DESIGN.md, Testing without GPUs, 6).

::

    switch ns  {prefix}sw : br0 10.77.K.254/24, v0 v1 ... (switch-side veth ends, ports of br0)
    host ns    {prefix}h0 : lo, eth0 10.77.K.1/24   <-veth->  v0
    host ns    {prefix}h1 : lo, eth0 10.77.K.2/24   <-veth->  v1
    ...

Everything is created *inside* namespaces this class makes: the veth pairs are
created directly in the switch namespace with their peer moved straight into the
host namespace, so no interface, address or route is ever added to the root
namespace, and the 10.77.K.0/24 addresses exist only behind our own bridge
(nothing outside it can be reached from a host: there is no route out).

The prefix is ``gpmf<pid>n<seq>``: unique per instance, and recognisable, so a
new instance deletes the namespaces of an earlier run whose process is gone.

A missing capability (not root, ``ip``/``tc``/``unshare``/``nsenter`` missing,
``ip netns add`` refused, no bridge, veth or tbf support) is a skip with the reason on a
developer machine and a failure under CI (``CI`` set and not false), where the
tests must run.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import pytest

PREFIX_FAMILY = "gpmf"
_NS_RE = re.compile(rf"^{PREFIX_FAMILY}(\d+)n(\d+)(?:sw|h\d+)$")
# ip and tc live in /sbin or /usr/sbin, which a non-login PATH may lack
SBIN_PATH = os.pathsep.join(
    p for p in (os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin") if p)
HOST_IFNAME = "eth0"
BRIDGE = "br0"
SWITCH_OCTET = 254
SWITCH_NAME = "ctl"  # the switch namespace's name in the hosts file (and Slurm's controller)
MAX_HOSTS = 200
ETC_NETNS = Path("/etc/netns")
_seq = itertools.count()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """A capability the tests need is missing: fail under CI (it must run there), skip elsewhere."""
    if in_ci():
        pytest.fail(f"{reason} (CI must provide it: .ci/run runs as root and installs the Debian "
                    "packages the tests use)", pytrace=False)
    pytest.skip(reason)


def which(tool: str) -> str | None:
    return shutil.which(tool, path=SBIN_PATH)


def require_tools(tools: Sequence[str], packages: str) -> dict[str, str]:
    """Each tool's path; one missing is ``unavailable``, with the Debian packages that have them."""
    found = {t: which(t) for t in tools}
    missing = sorted(t for t, p in found.items() if p is None)
    if missing:
        unavailable(f"{', '.join(missing)} not installed (Debian packages {packages})")
    return {t: p for t, p in found.items() if p is not None}


def _sh(argv: Sequence[str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([which(argv[0]) or argv[0], *argv[1:]], capture_output=True, text=True,
                          timeout=timeout)


def _must(argv: Sequence[str], timeout: float = 20) -> str:
    proc = _sh(argv, timeout)
    if proc.returncode != 0:
        raise NetSetupError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


class NetSetupError(RuntimeError):
    """An ``ip``/``tc`` command that builds or changes the test network failed."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> list[int]:
    proc = _sh(["ip", "netns", "pids", ns], timeout=10)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def _kill_all(pids_of: Callable[[], list[int]], grace: float) -> None:
    """SIGTERM everything ``pids_of()`` lists, wait up to ``grace`` s, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = pids_of()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids_of():
            time.sleep(0.05)


def list_namespaces() -> list[str]:
    proc = _sh(["ip", "netns", "list"], timeout=10)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def delete_stale_namespaces() -> list[str]:
    """Delete namespaces of our prefix family whose creating process is gone; return their names."""
    stale = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    if stale:
        _kill_all(lambda: [p for ns in stale for p in _ns_pids(ns)], grace=1.0)
    for ns in stale:
        _sh(["ip", "netns", "del", ns])
    # hosts files of dead runs, also where the namespace itself is already gone
    for d in ETC_NETNS.glob(f"{PREFIX_FAMILY}*") if ETC_NETNS.is_dir() else ():
        m = _NS_RE.match(d.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    return stale


@dataclass(frozen=True)
class Host:
    """One test host: ``name`` (also its hostname when run with ``hostname=host.name``), its network
    namespace, its address on eth0, and the name of its veth's far end in the switch namespace."""

    index: int
    name: str
    netns: str
    ip: str
    ifname: str
    switch_port: str

    @property
    def namespace(self) -> str:
        return self.netns


class TestNet:
    """N test hosts in network namespaces behind one bridge. A context manager; ``close()`` is idempotent
    and also runs when setup fails half-way.

    ``hosts_file=True`` writes ``/etc/netns/<ns>/hosts`` for every namespace (``ip netns exec`` binds it
    over /etc/hosts for what it starts), so the host names resolve inside the namespaces; by default
    they do not resolve anywhere, as on a cluster whose node names are not in DNS.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, *, hosts_file: bool = False, name_format: str = "node{i}") -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"1..{MAX_HOSTS} hosts, not {n}")
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        self._namespaces: list[str] = []
        self._hosts_dirs: list[Path] = []
        self._paths: dict[int, dict[int, str]] = {}  # host -> other host -> rate (shape_path)
        seq = next(_seq)
        self.prefix = f"{PREFIX_FAMILY}{os.getpid()}n{seq}"
        # a separate subnet per instance of this process; instances are isolated from each other
        # anyway (each has its own bridge in its own namespace), this only keeps logs unambiguous
        net = f"10.77.{seq % 250 + 1}"
        self.subnet = f"{net}.0/24"
        self.switch_ns = f"{self.prefix}sw"
        self.switch_ip = f"{net}.{SWITCH_OCTET}"
        self.hosts: list[Host] = [
            Host(i, name_format.format(i=i), f"{self.prefix}h{i}", f"{net}.{i + 1}", HOST_IFNAME, f"v{i}")
            for i in range(n)]
        self._check_tools()
        try:
            delete_stale_namespaces()
            self._build(hosts_file)
        except NetSetupError as e:
            self.close()
            unavailable(f"cannot build test network namespaces: {e}")
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------

    @staticmethod
    def _check_tools() -> None:
        if os.geteuid() != 0:
            unavailable("network namespace tests need root (ip netns add, veth, bridge, tc)")
        missing = [t for t in ("ip", "tc", "unshare", "nsenter") if which(t) is None]
        if missing:
            unavailable(f"{', '.join(missing)} not installed (Debian packages iproute2, util-linux)")

    def _add_ns(self, ns: str) -> None:
        _must(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _must(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self, hosts_file: bool) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _must(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge",
               "stp_state", "0", "forward_delay", "0"])
        _must(["ip", "-n", sw, "addr", "add", f"{self.switch_ip}/24", "dev", BRIDGE])
        _must(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        for h in self.hosts:
            self._add_ns(h.netns)
            # created in the switch namespace, peer straight into the host's: never in the root namespace
            _must(["ip", "-n", sw, "link", "add", h.switch_port, "type", "veth",
                   "peer", "name", h.ifname, "netns", h.netns])
            _must(["ip", "-n", sw, "link", "set", h.switch_port, "master", BRIDGE])
            _must(["ip", "-n", sw, "link", "set", h.switch_port, "up"])
            _must(["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.ifname])
            _must(["ip", "-n", h.netns, "link", "set", h.ifname, "up"])
        if hosts_file:
            lines = ["127.0.0.1 localhost", f"{self.switch_ip} {SWITCH_NAME}",
                     *(f"{h.ip} {h.name}" for h in self.hosts), ""]
            for ns in self._namespaces:
                d = ETC_NETNS / ns
                d.mkdir(parents=True, exist_ok=True)
                self._hosts_dirs.append(d)
                (d / "hosts").write_text("\n".join(lines))

    # -- running things ------------------------------------------------------------------------

    def exec_argv(self, netns: str, argv: Sequence[str], hostname: str | None = None,
                  keep_mounts: bool = False) -> list[str]:
        """The command line that runs ``argv`` in ``netns`` (and in a UTS namespace of its own named
        ``hostname``, if given). ``ip netns exec``/``nsenter`` and ``unshare`` exec, they do not fork:
        the pid of the process started with it is the pid of ``argv``.

        By default ``ip netns exec``: a private mount namespace with /sys remounted for the network
        namespace (``/sys/class/net`` shows its interfaces) and ``/etc/netns/<ns>/*`` bound over /etc.
        That new /sys has no cgroup tree under it; ``keep_mounts=True`` enters only the network
        namespace (``nsenter --net``), keeping the caller's mounts (what slurmd needs: Slurm 22.05
        always initialises its cgroup plugin, even with proctrack/linuxproc and task/none)."""
        if keep_mounts:
            cmd = [which("nsenter") or "nsenter", f"--net=/run/netns/{netns}", "--"]
        else:
            cmd = [which("ip") or "ip", "netns", "exec", netns]
        if hostname is not None:
            cmd += [which("unshare") or "unshare", "--uts", "--", "/bin/sh", "-c",
                    'hostname "$1" && shift && exec "$@"', "sh", hostname]
        return [*cmd, *argv]

    def popen_ns(self, netns: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 hostname: str | None = None, keep_mounts: bool = False, **kw: Any) -> subprocess.Popen[Any]:
        if self._closed:
            raise RuntimeError("TestNet is closed")
        if netns not in self._namespaces:
            raise ValueError(f"{netns} is not one of this TestNet's namespaces")
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.exec_argv(netns, argv, hostname, keep_mounts),
            env=dict(env) if env is not None else None, **kw)
        self._procs.append(proc)
        return proc

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              hostname: str | None = None, keep_mounts: bool = False, **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in host ``i``'s namespace (``kw`` go to ``subprocess.Popen``; stdin defaults
        to /dev/null, and it gets a session of its own); ``close()`` kills it if still running."""
        return self.popen_ns(self.hosts[i].netns, argv, env=env, hostname=hostname,
                             keep_mounts=keep_mounts, **kw)

    def run_ns(self, netns: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               hostname: str | None = None, timeout: float = 30, input: str | None = None,
               keep_mounts: bool = False) -> subprocess.CompletedProcess[str]:
        proc = self.popen_ns(netns, argv, env=env, hostname=hostname, keep_mounts=keep_mounts, text=True,
                             stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            hostname: str | None = None, timeout: float = 30, input: str | None = None,
            keep_mounts: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``i``'s namespace to completion (text output captured); on timeout it
        is killed and ``subprocess.TimeoutExpired`` raised."""
        return self.run_ns(self.hosts[i].netns, argv, env=env, hostname=hostname, timeout=timeout,
                           input=input, keep_mounts=keep_mounts)

    # -- faults --------------------------------------------------------------------------------

    def shape(self, i: int, rate: str = "20mbit", burst: str = "32kb", latency: str = "100ms") -> None:
        """Limit host ``i``'s link for real with tbf on both ends of its veth (its eth0 egress: what it
        sends; the switch-side end's egress: what it receives). Replaces an earlier shape."""
        h = self.hosts[i]
        for ns, dev in ((h.netns, h.ifname), (self.switch_ns, h.switch_port)):
            proc = _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", burst, "latency", latency])
            if proc.returncode != 0:
                if "Unknown qdisc" in proc.stderr or "No such file" in proc.stderr:
                    unavailable(f"tc tbf not available: {proc.stderr.strip()}")
                raise NetSetupError(f"tc qdisc replace dev {dev} tbf: {proc.stderr.strip()}")

    def unshape(self, i: int) -> None:
        h = self.hosts[i]
        for ns, dev in ((h.netns, h.ifname), (self.switch_ns, h.switch_port)):
            _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])

    def qdiscs(self, i: int) -> str:
        """``tc qdisc show`` of both ends of host ``i``'s veth (for assertions and failure messages)."""
        h = self.hosts[i]
        return (_must(["tc", "-n", h.netns, "qdisc", "show", "dev", h.ifname])
                + _must(["tc", "-n", self.switch_ns, "qdisc", "show", "dev", h.switch_port]))

    def shape_path(self, i: int, j: int, rate: str) -> None:
        """Limit only the path between hosts ``i`` and ``j`` (both directions): htb on each one's eth0
        with a class for the other's address (a slow switch path; other traffic of both is untouched)."""
        self._paths.setdefault(i, {})[j] = rate
        self._paths.setdefault(j, {})[i] = rate
        self._apply_paths(i)
        self._apply_paths(j)

    def unshape_path(self, i: int, j: int) -> None:
        self._paths.get(i, {}).pop(j, None)
        self._paths.get(j, {}).pop(i, None)
        self._apply_paths(i)
        self._apply_paths(j)

    def _apply_paths(self, i: int) -> None:
        h = self.hosts[i]
        _sh(["tc", "-n", h.netns, "qdisc", "del", "dev", h.ifname, "root"])
        paths = self._paths.get(i, {})
        if not paths:
            return
        tc = ["tc", "-n", h.netns]
        _must([*tc, "qdisc", "add", "dev", h.ifname, "root", "handle", "1:", "htb", "default", "1"])
        _must([*tc, "class", "add", "dev", h.ifname, "parent", "1:", "classid", "1:1", "htb",
               "rate", "10gbit"])
        for j, rate in sorted(paths.items()):
            cls = f"1:{100 + j}"
            _must([*tc, "class", "add", "dev", h.ifname, "parent", "1:", "classid", cls, "htb", "rate", rate,
                   "ceil", rate])
            _must([*tc, "filter", "add", "dev", h.ifname, "parent", "1:", "protocol", "ip", "prio", "1",
                   "u32", "match", "ip", "dst", f"{self.hosts[j].ip}/32", "flowid", cls])

    def link_down(self, i: int) -> None:
        """Cut host ``i`` off: its switch-side veth end goes down (its eth0 loses carrier)."""
        _must(["ip", "-n", self.switch_ns, "link", "set", self.hosts[i].switch_port, "down"])

    def link_up(self, i: int) -> None:
        _must(["ip", "-n", self.switch_ns, "link", "set", self.hosts[i].switch_port, "up"])

    # -- lifetime ------------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return list(self._namespaces)

    def pids(self) -> list[int]:
        """Every process still running in any of this TestNet's namespaces."""
        return sorted({p for ns in self._namespaces for p in _ns_pids(ns)})

    def close(self, grace: float = 3.0) -> None:
        """Kill everything in the namespaces (SIGTERM, then SIGKILL after ``grace`` s), reap what we
        started, delete the namespaces. Safe to call twice and after a failed setup."""
        if self._closed:
            return
        self._closed = True
        try:
            _kill_all(self.pids, grace)
            for proc in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
        finally:
            for ns in reversed(self._namespaces):
                _sh(["ip", "netns", "del", ns])
            for d in self._hosts_dirs:
                shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> TestNet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TestNet({self.prefix}, {self.subnet}, {[h.name for h in self.hosts]})"
