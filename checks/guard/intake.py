"""The guard check's intake: a verdict a job hands to the daemon over its socket (``gpumon.intake``),
attested by who sent it.

A spool file says only what its writer wrote, and the spool is world-writable: any user on the node
could claim any GPU is bad. Over the socket the kernel names the sender (``SO_PEERCRED``), and the
verdict is **attested** when that process holds a compute context on the GPU the verdict names,
by NVML's list of the GPU's running compute processes at that moment: the guard hands its verdict
over from the training process itself, which has its own GPU open. Not attested, and said why: a
verdict that names no GPU (a CPU rank's), a GPU this node does not have, a sender whose pid is 0 to
the daemon (it is in a PID namespace the daemon cannot see: the daemon must run in the host's PID
namespace, ``hostPID: true`` in its DaemonSet), a process list NVML would not give (hung call, lost
GPU), a sender not in that list, or a sender that has exited by the time the list was read (where the
kernel gives the sender's pidfd, Linux 6.5: its pid may be a new process's by then). A verdict that
is not one (``gpumon.guard.verdict.validate``) is refused.

Every verdict taken is put into the guard spool, where the check judges it like any other file,
and **who owns the file carries the attestation**: an attested verdict is written owned by root (the
check trusts a root-owned file), one that is not is written owned by its sender's uid and gid, so
that it counts exactly as a file that user wrote into the spool (a warning that says it is not
attested, within that uid's cap). No user can make a root-owned file in the spool (a sticky,
world-writable directory: they can neither create one nor rename one of root's). The file is the
verdict with an ``attestation`` member added (``{"attested", "why", "peer": {"pid", "uid", "gid",
"user"}, "gpu_index", "processes": [{"pid", "used_memory_bytes"}], "time"}``), which the check shows
as evidence on a root-owned file and ignores on any other. Written without following links:
a temporary file of a random name made with ``O_EXCL`` (``mkstemp``), its owner and mode set through
its descriptor, then renamed over ``<id>.json``. A verdict whose id is already in the spool, owned by
root, is not written again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from gpumon.check import CheckContext
from gpumon.guard import verdict as vf
from gpumon.hw.nvml import ComputeProcess
from gpumon.hw.placement import normalize_uuid
from gpumon.intake_protocol import IntakeReply, Peer, refused

from .options import GuardConfig, spool_of

# the id names the file: what new_id makes (time, host made safe, pid, rank, random), nothing that
# could leave the directory or hide in it
_SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")


def intake(document: dict[str, Any], peer: Peer, ctx: CheckContext) -> IntakeReply:
    """The guard check's ``Check.intake``: judge, attest and store one verdict handed over."""
    try:
        vf.validate(document)
        verdict = vf.Verdict.from_json(document)
    except vf.VerdictError as exc:
        return refused(f"not a guard verdict this daemon reads: {exc}")
    if not _SAFE_ID.fullmatch(verdict.id):
        return refused(f"verdict id {verdict.id[:80]!r} names no file: letters, digits, '_', '.' and '-' "
                       "only, at most 200, not starting with '.'")
    spool = spool_of(ctx.options_as(GuardConfig), ctx)
    path = spool / f"{verdict.id}.json"
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        before = None
    except OSError as exc:
        return refused(f"cannot look at {path}: {exc.strerror or exc}")
    if before is not None and stat.S_ISREG(before.st_mode) and before.st_uid == 0:
        return IntakeReply(True, True, f"verdict {verdict.id} was handed over before (attested)")
    attested, why, index, processes = attest(verdict, peer, ctx)
    record = {**document, "attestation": {
        "attested": attested, "why": why, "peer": peer.to_json(), "gpu_index": index,
        "processes": [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes} for p in processes],
        "time": ctx.clock()}}
    owner = (0, 0) if attested else (peer.uid, peer.gid)
    try:
        _put(spool, path, json.dumps(record, indent=1, sort_keys=True) + "\n", owner)
    except OSError as exc:
        return refused(f"cannot put the verdict into the spool {spool}: {exc.strerror or exc}")
    return IntakeReply(True, attested, why)


def _put(spool: Path, path: Path, text: str, owner: tuple[int, int]) -> None:
    """``text`` as ``path`` in a directory every user can write, as root: never through a link a
    user placed (a fresh temporary name, O_EXCL), owned by ``owner``, 0644, then renamed."""
    try:
        st = os.lstat(spool)
    except FileNotFoundError:  # the first verdict of a node: the spool as the jobs need it, like /tmp
        spool.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(spool, 0o700)
            os.chmod(spool, 0o1777)
        st = os.lstat(spool)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory (a symbolic link is not followed)")
    fd, tmp = tempfile.mkstemp(dir=spool, prefix=".intake-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchown(fh.fileno(), *owner)
            os.fchmod(fh.fileno(), 0o644)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def attest(verdict: vf.Verdict, peer: Peer, ctx: CheckContext) -> tuple[bool, str, int | None,
                                                                        list[ComputeProcess]]:
    """(attested, why, the GPU's index on this node or None, NVML's compute processes of it)."""
    s = verdict.subject
    key = normalize_uuid(s.gpu_uuid)
    if key is None:
        where = s.gpu_note or f"device {s.device}"
        return False, f"the verdict names no GPU ({where}): a CPU rank's verdict cannot be attested", None, []
    index = next((g.index for g in ctx.inventory.gpus if normalize_uuid(g.uuid) == key), None)
    if index is None:
        return False, f"GPU {s.gpu_uuid} is not one of this node's GPUs", None, []
    if peer.pid == 0:
        return (False, f"the sender ({peer.describe()}) is in a PID namespace this daemon cannot see, so "
                       "whether it uses the GPU cannot be told (run the daemon in the host's PID namespace: "
                       "hostPID: true in its DaemonSet)", index, [])
    try:
        processes = ctx.hw.nvml.compute_processes(index)
    except Exception as exc:  # a hung or failing NVML call leaves the verdict unattested, not refused
        return (False, f"NVML did not list GPU {index}'s compute processes: {type(exc).__name__}: {exc}",
                index, [])
    pids = sorted({p.pid for p in processes})
    if peer.pid in pids:
        if peer.alive() is False:
            return (False, f"the sender ({peer.describe()}) exited before its verdict was judged: pid "
                           f"{peer.pid} on GPU {index} may be another process's by now", index, processes)
        return (True, f"the sender ({peer.describe()}) holds a compute context on GPU {index} ({s.gpu_uuid})",
                index, processes)
    listed = ", ".join(map(str, pids[:16])) + (" ..." if len(pids) > 16 else "") if pids else "none"
    return (False, f"the sender ({peer.describe()}) holds no compute context on GPU {index} ({s.gpu_uuid}); "
                   f"NVML lists pid(s) {listed}", index, processes)
