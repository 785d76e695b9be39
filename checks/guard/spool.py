"""The guard spool read with bounds: ``list_spool`` lists its top level (at most ``max_scan`` entries,
each owner's oldest ``max_files`` new files queued); ``read_verdict`` reads one file (never through a
symbolic link, never blocked by a FIFO, at most ``vf.MAX_BYTES`` + 1 bytes) as judged, its owner's
attestation included; the files read and left in place, remembered by this process (``LEFT``), and why
a file is not a verdict."""

from __future__ import annotations

import errno
import functools
import heapq
import json
import os
import pwd
import stat
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from gpumon.guard import verdict as vf

from .book import FEW, Book
from .options import GuardConfig

# Characters of a bad file's error kept in memory per file (the schema's own messages are <= 300).
_ERROR_CHARS = 400
BAD, WAIT = "bad", "wait"


class Left(NamedTuple):
    """A file this process read and left in the spool, as it was then (``lstat``)."""

    ino: int
    size: int
    mtime_ns: int
    uid: int
    kind: str  # BAD: not a verdict; WAIT: a verdict of a uid past its cap
    reason: str  # BAD: the kind of problem, for the count per reason
    error: str  # BAD: what is wrong, as the single-file warning says it
    where: str | None  # a schema violation's JSON path
    rule: str | None  # and the schema keyword that refused it


# (files that are not verdicts, their count per reason, the first few by name, uid -> its waiting verdicts)
_Summary = tuple[int, Counter[str], list[tuple[str, Left]], Counter[int]]
# spool -> file name -> what this process learnt of it: a cache, not state (a restart reads the
# files once more), so it lives in the process, bounded by max_scan entries per spool.
LEFT: dict[str, dict[str, Left]] = {}
# spool -> runs so far: which slice of the remembered files a run checks again with lstat
_TURN: dict[str, int] = {}
# spool -> the remembered files (the very dict in LEFT) and what they add up to (summarize),
# kept while a run finds the same files: a run over 20,000 of them need not count them again
SUMMARY: dict[str, tuple[dict[str, Left], _Summary]] = {}


@dataclass
class Listing:
    """One run's look at the spool's top level."""

    listed: int = 0
    cut: bool = False  # stopped at max_scan entries
    # uid -> its oldest max_files new files, a heap of (-mtime_ns, name, ino, size)
    queues: dict[int, list[tuple[int, str, int, int]]] = field(default_factory=dict)
    fresh: int = 0  # new files (neither remembered nor reported): the ones to read
    read: int = 0
    known: int = 0  # files remembered before this run
    carried: int = 0  # of those, taken as they were
    learnt: int = 0  # files this run read and left in the spool
    # what this process knows of the files left in the spool, as of this run
    left: dict[str, Left] = field(default_factory=dict)


def list_spool(spool: Path, book: Book, options: GuardConfig) -> Listing:
    """List the spool's top level, at most ``max_scan`` entries. A remembered file (not a verdict;
    a verdict of a uid still past its cap) whose inode is the same is taken as it was, without a
    system call; a rotating ``max_files`` of them are checked with lstat each run (a file rewritten
    in place keeps its inode), the rest of each cycle on later runs."""
    known = LEFT.get(str(spool), {})
    turn = _TURN[str(spool)] = _TURN.get(str(spool), -1) + 1
    cycles = max(1, -(-len(known) // options.max_files))
    turn %= cycles
    capped = book.capped_uids()
    reported = book.reported
    out = Listing(known=len(known))
    left = out.left
    seen_known = 0
    with os.scandir(spool) as entries:
        for entry in entries:
            if out.listed >= options.max_scan:
                out.cut = True
                break
            out.listed += 1
            name = entry.name
            if not name.endswith(".json") or name[0] == "." or name in reported:
                continue
            was = known.get(name)
            if was is not None and was.ino == entry.inode():
                seen_known += 1
                if seen_known % cycles != turn and (was.kind == BAD or was.uid in capped):
                    left[name] = was
                    out.carried += 1
                    continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since it was listed
            if (was is not None and (st.st_ino, st.st_size, st.st_mtime_ns) == was[:3]
                    and (was.kind == BAD or was.uid in capped)):
                left[name] = was
                out.carried += 1
                continue
            out.fresh += 1
            queue = out.queues.setdefault(st.st_uid, [])
            item = (-st.st_mtime_ns, name, st.st_ino, st.st_size)
            if len(queue) < options.max_files:
                heapq.heappush(queue, item)
            else:
                heapq.heappushpop(queue, item)  # drops the newest: a uid's oldest files go first
    return out


def summarize(left: dict[str, Left]) -> _Summary:
    """(files that are not verdicts, their count per reason, the first few by name, uid -> its
    verdicts waiting for a later window)."""
    bad: list[tuple[str, Left]] = []
    waiting: Counter[int] = Counter()
    for name, was in left.items():
        if was.kind == BAD:
            bad.append((name, was))
        else:
            waiting[was.uid] += 1
    reasons = Counter(was.reason for _, was in bad)
    return len(bad), reasons, heapq.nsmallest(FEW, bad, key=lambda kv: kv[0]), waiting


def read_verdict(path: Path) -> vf.Verdict:
    """``vf.read`` for a directory every user can write: never through a symbolic link, never
    blocked by a FIFO (open would wait for a writer), never more than ``vf.MAX_BYTES`` + 1 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise vf.VerdictError("a symbolic link: not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise vf.VerdictError("not a regular file")
        chunks: list[bytes] = []
        left = vf.MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > vf.MAX_BYTES:
        raise vf.VerdictError(f"larger than {vf.MAX_BYTES} bytes: not a verdict")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise vf.VerdictError(f"not JSON: {exc}") from None
    vf.validate(data)
    return _as_judged(vf.Verdict.from_json(data), data, st.st_uid)


FUTURE = "of a newer version"


def reason_of(exc: Exception) -> str:
    """The kind of problem of a file that is not a verdict, for the count per reason."""
    if isinstance(exc, vf.FutureVerdict):
        return FUTURE
    if isinstance(exc, vf.SchemaViolation):
        return "refused by the schema"
    if isinstance(exc, OSError):
        return "unreadable"
    text = str(exc)
    for prefix, reason in (("not JSON", "not JSON"), ("format is", "of another format"),
                           ("larger than", "too large"), ("a symbolic link", "not a regular file"),
                           ("not a regular file", "not a regular file")):
        if text.startswith(prefix):
            return reason
    return "not a verdict"


def error_text(exc: Exception) -> str:
    text = str(exc)
    # interned: a flood of one junk file's copies is one string in memory, not one per file
    return sys.intern(text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "...")


def schema_place(exc: Exception) -> tuple[str | None, str | None]:
    return (exc.where, exc.rule) if isinstance(exc, vf.SchemaViolation) else (None, None)


def _trusted(uid: int) -> bool:
    """A file of root's (an operator's tool, the daemon's intake after attesting its sender) or of
    this daemon's own user: no other user can make one in the spool."""
    return uid == 0 or uid == os.geteuid()


@functools.lru_cache(maxsize=256)
def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def _as_judged(v: vf.Verdict, data: dict[str, Any], owner: int) -> vf.Verdict:
    """The verdict as the check judges it. Only a root-owned file is hardware evidence: anyone on the
    node can write the spool, so the file of any other uid is not attested (its sender was not seen
    on the GPU it names). Its ``persistent`` is judged as ``unknown`` (a warning, never fail or a
    drain; within its uid's cap like any other); what it claimed and why it is not attested are in
    its evidence (``attestation``), which on a root-owned file is what the intake recorded."""
    if _trusted(owner):
        said = data.get("attestation")
        attestation = dict(said) if isinstance(said, dict) else {
            "attested": True, "why": f"the spool file is owned by uid {owner} ({_user(owner)})"}
        return replace(v, evidence={**v.evidence, "attestation": attestation})
    why = (f"the spool file is owned by uid {owner} ({_user(owner)}); a file any user of this node can "
           "write is not hardware evidence: only a verdict that the guard handed to the daemon's intake "
           "socket from a process computing on that GPU (or a file of root's) is")
    if isinstance(data.get("attestation"), dict):
        why += "; its own 'attestation' member is ignored (only the daemon's intake writes one, as root)"
    attestation = {"attested": False, "why": why, "writer_uid": owner, "writer_user": _user(owner),
                   "claimed_fault": v.fault}
    fault = "unknown" if v.fault == "persistent" else v.fault
    return replace(v, fault=fault, evidence={**v.evidence, "attestation": attestation})
