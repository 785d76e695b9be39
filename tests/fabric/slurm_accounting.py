"""Accounting storage for a test Slurm cluster: a MariaDB server and slurmdbd, both in the switch
namespace beside slurmctld, as on a real controller.

* mariadbd: its data directory made by ``mariadb-install-db`` under the cluster's directory, listening
  on 127.0.0.1 of the switch namespace only (each namespace has its own loopback), started with an
  ``--init-file`` that creates slurmdbd's user (no client needed). Run as root (``--user=root``): the
  test's processes are root.
* slurmdbd: ``DbdHost=ctl`` (it refuses to start on a host of another name, as slurmctld does),
  listening on the bridge address, reached by slurmctld and every client command there; munge is the
  cluster's own. Its config file, slurmdbd.conf beside slurm.conf (where slurmdbd looks for it), is
  mode 600, which slurmdbd requires (it holds the database password).

Missing packages: a failure under CI, a skip elsewhere (netns.unavailable), as for Slurm itself.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .netns import require_tools

ACCOUNTING_TOOLS = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db")
DBD_PORT = 6819  # slurmdbd's default
DB_PORT = 3306  # MariaDB's default, on the switch namespace's own loopback
DB_NAME = "slurm_acct_db"


def require_accounting() -> dict[str, str]:
    return require_tools(ACCOUNTING_TOOLS, "slurmdbd, mariadb-server-core and mariadb-client-core")


class Accounting:
    """What SlurmCluster starts before slurmctld when asked for accounting. ``daemon(argv, log)``
    starts a process in the switch namespace as host ``ctl`` (the cluster's, so that it is stopped
    with the cluster's daemons)."""

    def __init__(self, base: Path, dbd_host: str, dbd_addr: str, munge_socket: Path) -> None:
        self.exe = require_accounting()
        self.base = base
        self.addr = dbd_addr
        self.port = DBD_PORT
        self.data = base / "mysql"
        self.db_socket = base / "mysql.sock"
        self.password = secrets.token_hex(12)
        self.conf = base / "slurmdbd.conf"
        self.conf.write_text("\n".join([
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge_socket}",
            f"DbdHost={dbd_host}",
            f"DbdAddr={dbd_addr}",
            f"DbdPort={DBD_PORT}",
            "SlurmUser=root",
            f"LogFile={base / 'slurmdbd.log'}",
            f"PidFile={base / 'slurmdbd.pid'}",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={DB_PORT}",
            "StorageUser=slurm",
            f"StoragePass={self.password}",
            f"StorageLoc={DB_NAME}",
            "",
        ]))
        self.conf.chmod(0o600)

    def start(self, daemon: Callable[[list[str], str], subprocess.Popen[Any]],
              in_ns: Callable[[list[str]], subprocess.CompletedProcess[str]], timeout: float = 60) -> None:
        made = subprocess.run([self.exe["mariadb-install-db"], "--no-defaults", f"--datadir={self.data}",
                               "--user=root", "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True, timeout=120)
        if made.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed:\n{made.stdout[-2000:]}\n{made.stderr[-2000:]}")
        init = self.base / "mysql-init.sql"
        init.write_text(f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.password}';\n"
                        f"GRANT ALL ON {DB_NAME}.* TO 'slurm'@'127.0.0.1';\n")
        db = daemon([self.exe["mariadbd"], "--no-defaults", f"--datadir={self.data}", "--user=root",
                     "--bind-address=127.0.0.1", f"--port={DB_PORT}", f"--socket={self.db_socket}",
                     f"--pid-file={self.base / 'mariadbd.pid'}", "--skip-name-resolve", "--skip-log-bin",
                     f"--init-file={init}", "--innodb-buffer-pool-size=16M",
                     f"--log-error={self.base / 'mariadbd.log'}"], "mariadbd.out.log")
        self._wait(db, lambda: "ready for connections" in self._read("mariadbd.log"), "mariadbd", timeout)
        dbd = daemon([self.exe["slurmdbd"], "-D", "-s"], "slurmdbd.out.log")
        probe = [sys.executable, "-c",
                 "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)",
                 self.addr, str(self.port)]
        self._wait(dbd, lambda: in_ns(probe).returncode == 0, "slurmdbd", timeout)

    def _read(self, name: str) -> str:
        path = self.base / name
        return path.read_text(errors="replace") if path.exists() else ""

    def _wait(self, proc: subprocess.Popen[Any], ready: Callable[[], bool], what: str,
              timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                names = ("mariadbd.log", "mariadbd.out.log", "slurmdbd.log", "slurmdbd.out.log")
                logs = "\n".join(f"--- {n}\n{self._read(n)[-3000:]}" for n in names)
                raise RuntimeError(f"{what} did not start:\n{logs}")
            time.sleep(0.1)
