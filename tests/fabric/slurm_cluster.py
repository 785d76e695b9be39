"""A real multi-node Slurm 22.05 cluster on the test hosts of a TestNet.

::

    switch ns (hostname ctl, 10.77.K.254 on the bridge): munged, slurmctld, and every client
                                                         command the test runs (srun, scontrol, sinfo)
    host ns i (hostname node<i>, 10.77.K.<i+1> on eth0): slurmd -N node<i>, and the job's tasks

* One munged for all, in the switch namespace: its socket is a Unix socket on the file system,
  which a process in any network namespace can connect to (``AuthInfo=socket=...``).
* ``SlurmctldHost=ctl(<switch ip>)``; slurmctld runs with hostname ``ctl`` in its own UTS namespace
  (slurmctld refuses to start on a host whose name is not a SlurmctldHost).
* ``NodeName=node<i> NodeAddr=<its ip> NodeHostname=node<i>``: Slurm talks to each slurmd at its
  address, and no name needs to resolve anywhere. Every slurmd listens on the default port 6818 in its
  own namespace; spool, pid and log files carry ``%n``.
* srun runs in the switch namespace (it reaches slurmctld there and every slurmd through the bridge;
  slurmstepd connects back to srun's address as slurmctld and slurmd saw it, the bridge address).
* ``accounting=True``: a MariaDB server and slurmdbd beside slurmctld (tests/fabric/slurm_accounting.py),
  so that sacct and sacctmgr work; without it there is no accounting storage.
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups. CPUs and the socket
  layout of each node are those ``slurmd -C`` reports for this machine.

Everything (config, munge key and socket, state, spool, logs) is under one temporary directory; nothing
global is touched and nothing listens outside the namespaces. Missing Slurm or munge: a failure under
CI, a skip elsewhere (netns.unavailable).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurm_conf import common_lines

from .netns import SBIN_PATH, SWITCH_NAME, TestNet, require_tools
from .slurm_accounting import Accounting

CONTROLLER_NAME = SWITCH_NAME
PARTITION = "fabric"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "slurmstepd", "srun", "scontrol", "sinfo", "squeue",
               "scancel")


def slurm_env() -> dict[str, str]:
    """The test's environment without Slurm's job variables (pytest itself may run inside a Slurm job:
    an inherited SLURM_JOB_ID would make srun join that job instead of allocating on our cluster)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))}


def require_slurm() -> dict[str, str]:
    return require_tools(SLURM_TOOLS, "slurm-wlm and munge: apt-get install slurm-wlm munge")


def node_hardware(slurmd: str) -> str:
    """This machine's ``CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=..`` as
    ``slurmd -C`` reports it (every test node runs on the same machine)."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    fields = [f for f in out.split() if f.split("=", 1)[0] in keep]
    return " ".join(fields) if fields else "CPUs=1"


class SlurmCluster:
    """slurmctld + one slurmd per TestNet host, started in the constructor (it returns once every node
    is idle) and stopped by ``close()``, which does not close the TestNet."""

    def __init__(self, net: TestNet, *, ready_timeout: float = 60.0, extra_conf: Sequence[str] = (),
                 accounting: bool = False) -> None:
        self.exe = require_slurm()
        self.net = net
        self.nodes = [h.name for h in net.hosts]
        self.dir = Path(tempfile.mkdtemp(prefix="gpmf-slurm-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.conf = self.dir / "slurm.conf"
        self.env: dict[str, str] = {**slurm_env(), "SLURM_CONF": str(self.conf), "PATH": SBIN_PATH}
        self._procs: list[subprocess.Popen[Any]] = []
        self._closed = False
        self.accounting: Accounting | None = None
        try:
            self._write_conf(extra_conf, accounting)
            self._start(ready_timeout)
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------

    def _write_conf(self, extra_conf: Sequence[str], accounting: bool) -> None:
        base = self.dir
        for sub in ("state", "spool"):  # slurmd creates spool/<node> but not its parent
            (base / sub).mkdir()
        munge_dir = base / "munge"
        munge_dir.mkdir(mode=0o755)
        self.munge_key = munge_dir / "munge.key"
        self.munge_key.write_bytes(os.urandom(1024))
        self.munge_key.chmod(0o400)  # munged refuses a key others can read
        self.munge_socket = munge_dir / "munge.socket"
        hw = node_hardware(self.exe["slurmd"])
        if accounting:
            self.accounting = Accounting(base, CONTROLLER_NAME, self.net.switch_ip, self.munge_socket)
            self.exe.update(self.accounting.exe)
        dbd = (self.accounting.addr, self.accounting.port) if self.accounting else None
        self.conf.write_text("\n".join([
            "ClusterName=gpmfabric",
            f"SlurmctldHost={CONTROLLER_NAME}({self.net.switch_ip})",
            *common_lines(base, self.munge_socket, dbd),
            "SelectTypeParameters=CR_Core",
            # short waits: a test kills steps and restarts nodes, and must not sit in Slurm's defaults
            "KillWait=2",
            "MessageTimeout=5",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            *extra_conf,
            *(f"NodeName={h.name} NodeAddr={h.ip} NodeHostname={h.name} {hw} RealMemory=100 State=UNKNOWN"
              for h in self.net.hosts),
            f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES State=UP MaxTime=INFINITE",
            "",
        ]))

    def _daemon(self, netns: str, argv: Sequence[str], log: str, hostname: str) -> subprocess.Popen[Any]:
        with open(self.dir / log, "wb") as out:
            proc = self.net.popen_ns(netns, argv, env=self.env, hostname=hostname, keep_mounts=True,
                                     stdout=out, stderr=subprocess.STDOUT)
        self._procs.append(proc)
        return proc

    def _start(self, ready_timeout: float) -> None:
        sw = self.net.switch_ns
        munge_dir = self.munge_socket.parent
        munged = self._daemon(sw, [
            self.exe["munged"], "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={self.munge_key}", f"--log-file={self.dir / 'munged-file.log'}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--seed-file={munge_dir / 'munged.seed'}"],
            "munged.log", CONTROLLER_NAME)
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start:\n" + self.logs())
            time.sleep(0.05)
        if self.accounting is not None:
            self.accounting.start(lambda argv, log: self._daemon(sw, argv, log, CONTROLLER_NAME),
                                  lambda argv: self.client(argv, timeout=10))
        self._daemon(sw, [self.exe["slurmctld"], "-D", "-i", "-f", str(self.conf)], "slurmctld.out.log",
                     CONTROLLER_NAME)
        for h in self.net.hosts:
            self._daemon(h.netns, [self.exe["slurmd"], "-D", "-N", h.name, "-f", str(self.conf)],
                         f"slurmd-{h.name}.out.log", h.name)
        self.wait_idle(timeout=ready_timeout)

    # -- client commands (run in the switch namespace, next to slurmctld) ----------------------

    def client(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 30,
               ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (or anything else) in the switch namespace as host ``ctl``,
        with ``SLURM_CONF`` set; ``env`` adds to the cluster's environment."""
        return self.net.run_ns(self.net.switch_ns, argv, env={**self.env, **(env or {})},
                               hostname=CONTROLLER_NAME, timeout=timeout)

    def client_popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                     **kw: Any) -> subprocess.Popen[Any]:
        """Start a client command in the switch namespace (e.g. an srun to kill half-way)."""
        return self.net.popen_ns(self.net.switch_ns, argv, env={**self.env, **(env or {})},
                                 hostname=CONTROLLER_NAME, **kw)

    def srun_argv(self, args: Sequence[str], nodes: int = 2, ntasks_per_node: int = 1,
                  time_limit_min: int = 2) -> list[str]:
        return [self.exe["srun"], f"--nodes={nodes}", f"--ntasks-per-node={ntasks_per_node}",
                f"--partition={PARTITION}", f"--time={time_limit_min}", "--kill-on-bad-exit=1", *args]

    def srun(self, args: Sequence[str], nodes: int = 2, ntasks_per_node: int = 1,
             env: Mapping[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``srun -N nodes --ntasks-per-node=.. args`` from the switch namespace. The tasks inherit
        srun's environment (``--export=ALL``): the cluster's plus ``env``. On timeout the srun is
        killed, every job cancelled (``cancel_all``), and ``subprocess.TimeoutExpired`` raised."""
        try:
            return self.client(self.srun_argv(args, nodes, ntasks_per_node), env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cancel_all()
            raise

    def srun_popen(self, args: Sequence[str], nodes: int = 2, ntasks_per_node: int = 1,
                   env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
        """The same srun, started and not waited for (``kw`` go to ``subprocess.Popen``); kill it and
        ``cancel_all()`` to stop the job half-way."""
        return self.client_popen(self.srun_argv(args, nodes, ntasks_per_node), env=env, **kw)

    def jobs(self) -> list[str]:
        """Ids of the jobs slurmctld still knows as pending or running."""
        proc = self.client([self.exe["squeue"], "-h", "-o", "%i", "-t", "PD,R,CG,S"])
        return proc.stdout.split()

    def cancel_all(self, timeout: float = 20) -> None:
        """scancel every job and wait until none is left (a killed srun leaves its job behind)."""
        ids = self.jobs()
        if ids:
            self.client([self.exe["scancel"], "--full", "--quiet", *ids])
        deadline = time.monotonic() + timeout
        while self.jobs():
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs left after scancel: {self.jobs()}\n{self.logs()}")
            time.sleep(0.2)

    def scontrol(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return self.client([self.exe["scontrol"], *args], timeout=timeout)

    def hostnames(self, nodelist: str) -> list[str]:
        return self.scontrol("show", "hostnames", nodelist).stdout.split()

    def node_states(self) -> dict[str, str]:
        """node -> sinfo's state (``idle``, ``drained``, ``down*`` ...); {} if sinfo failed."""
        proc = self.client([self.exe["sinfo"], "-h", "-N", "-o", "%N|%T"])
        if proc.returncode != 0:
            return {}
        return dict(line.split("|", 1) for line in proc.stdout.split())

    def sinfo_reasons(self) -> dict[str, tuple[str, str]]:
        """``sinfo -R -h -o '%N|%T|%E'`` read back as DESIGN.md does: node -> (state, reason)."""
        proc = self.client([self.exe["sinfo"], "-R", "-h", "-o", "%N|%T|%E"])
        if proc.returncode != 0:
            raise RuntimeError(f"sinfo -R: {proc.stderr.strip()}")
        out: dict[str, tuple[str, str]] = {}
        for line in proc.stdout.splitlines():
            names, state, reason = line.split("|", 2)
            for name in self.hostnames(names):
                out[name] = (state, reason)
        return out

    def wait_idle(self, nodes: Sequence[str] | None = None, timeout: float = 30) -> None:
        want = list(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a Slurm daemon exited: {dead}\n{self.logs()}")
            states = self.node_states()
            if all(states.get(n) == "idle" for n in want):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout} s: {states}\n{self.logs()}")
            time.sleep(0.3)

    def resume(self, *nodes: str) -> None:
        """Back to idle with no reason, whoever drained it (no-op for an idle node)."""
        states = self.node_states()
        todo = [n for n in nodes if states.get(n, "").rstrip("*~#") != "idle"]
        for n in todo:
            self.scontrol("update", f"NodeName={n}", "State=RESUME")
        if todo:
            self.wait_idle(todo)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.dir.glob("*.log")))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the slurmds, then slurmctld, then slurmdbd and mariadbd if any, then munged (SIGTERM,
        SIGKILL after 5 s), and remove the directory. Job tasks still running are left to
        ``TestNet.close()``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for proc in reversed(self._procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.wait(timeout=5)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
