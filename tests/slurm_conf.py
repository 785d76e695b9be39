"""The slurm.conf lines every test cluster shares: root daemons, munge on our own socket, every file
under the test's directory, no accounting unless a slurmdbd is named, no cgroups (a test runs in a
container or a network namespace), and nodes that come back to service by themselves once they
register again."""

from __future__ import annotations

from pathlib import Path


def common_lines(base: Path, munge_socket: Path, slurmdbd: tuple[str, int] | None = None) -> list[str]:
    """``slurmdbd``: (address, port) of the accounting daemon; None: no accounting storage."""
    accounting = ["AccountingStorageType=accounting_storage/none"] if slurmdbd is None else [
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={slurmdbd[0]}",
        f"AccountingStoragePort={slurmdbd[1]}",
        # the munge socket for slurmdbd connections (slurm.conf(5)): AuthInfo's is not used for them
        f"AccountingStoragePass={munge_socket}",
    ]
    return [
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # our own munged, so the host's munge (if any) is not used or needed
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}/%n",
        f"SlurmctldPidFile={base / 'slurmctld.pid'}",
        f"SlurmdPidFile={base}/slurmd-%n.pid",
        f"SlurmctldLogFile={base / 'slurmctld.log'}",
        f"SlurmdLogFile={base}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        *accounting,
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        # a node that registers again after a DOWN goes back to service by itself
        "ReturnToService=2",
    ]
