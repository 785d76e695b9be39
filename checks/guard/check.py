"""guard: the verdicts that training jobs on this node wrote (``gpumon.guard``), as findings.

A job's ranks write one JSON file per verdict into the spool (``/var/lib/gpumon/guard`` by default;
the job's ``$GPUMON_GUARD_DIR``). Each valid verdict becomes a finding on ``gpu/<index>``, the GPU of
this node's inventory with the verdict's NVML UUID; a verdict from a CPU rank, or with a UUID this
node does not have, goes on ``node`` and says why. ``fault``: persistent -> fail/inspect_hardware
(closed only by an operator's set-healthy, like any RMA-path fault); transient and unknown -> warn;
application (the rerun on another node's GPU reproduced the result: the data or the program, not the
hardware) -> an ok finding on ``node`` that says so: held against no GPU, and never on a GPU's
component (an ok there would close that GPU's other guard faults).

Judged once, lost never, across daemon restarts too:

- a new verdict (a file in the spool's top level) is reported by every run until a LATER run of this
  same daemon process moves it to ``judged/``. Within one process the daemon folds a run's findings
  into the health store before the check runs again, so a moved verdict is in health.db; a daemon
  that dies in between reports the file again after its restart (a repeat is one fault, not two:
  the fault key is the verdict's id), and one that dies after moving it, before its state was
  saved, finds the file in ``judged/`` and books it as moved;
- once judged, a persistent verdict is no longer reported: its fault stays until set-healthy (a
  reboot does not bring back a fault the operator closed). A transient or unknown one is reported
  for ``warn_hold_s`` after it was written, then resolves like any warning whose condition is gone;
- a file that is not a verdict this gpumon reads (bad JSON, a newer ``version``, or anything the
  verdict's JSON Schema refuses: ``gpumon/guard/schema/verdict-v1.schema.json``, the one the package
  ships, compiled once per process) is left where it is and reported on every run until someone
  removes or fixes it, or a newer gpumon reads it: all such files together are ONE warning on
  ``node`` with their count, the count per reason and the first few (by name) with what is wrong
  and, for the schema, the JSON path of the value refused. Temp files of ``write_atomic``
  (``.<name>.tmp``) are not verdicts yet and are skipped.

Bounded, whatever the spool holds (it is mode 1777: any user of the node can fill it):

- a run lists at most ``max_scan`` directory entries (``os.scandir``, stopped there) and reads at
  most ``max_files`` files, each at most ``vf.MAX_BYTES`` + 1 bytes, never through a symbolic link
  and never blocking on a FIFO. The files to read are taken in turn per owner (uid), oldest first
  within an owner, so that one user's flood does not hold back another user's verdict; what is left
  is read on later runs and counted in a warning (``spool-backlog``).
- a file read and left in place (not a verdict, or a verdict waiting for its owner's next window) is
  remembered by this process with its inode, size and mtime, and not read again until it changes:
  a run over 20,000 such files lists them and checks a rotating ``max_files`` of them with
  ``lstat``; it reads none. The memory is the process's only (a restart reads them once more).
- at most ``uid_max_verdicts`` verdicts of one uid are judged per ``uid_window_s``; that uid's other
  transient, unknown and application verdicts stay in the spool, counted in one warning naming the
  uid, and are judged in a later window, oldest first. A persistent verdict of root's (attested by
  the intake, or an operator's) is judged at once whatever the count: it is what the spool exists
  for; another user's "persistent" is not attested, judged as unknown, and waits like the rest.
- attestation: only a file owned by root (or this daemon's user) is hardware evidence. The intake
  (``checks/guard/intake.py``) puts a verdict handed over on the daemon's socket into the spool owned
  by root once its sender is seen computing on the GPU it names, else owned by the sender; any other
  user's file is judged with its ``persistent`` as ``unknown`` and says so (``attestation`` in the
  verdict's evidence: who wrote it, what it claimed, why it is not attested).
- at most ``max_faults_per_gpu`` verdicts per component (``gpu/<i>``, ``node``) and class (persistent;
  transient or unknown) judged within ``warn_hold_s`` become faults of their own (keyed by the
  verdict id); the others become ONE finding per component and class (keyed ``verdicts-more:...``:
  the same severity and action, their count since the first of them, the newest few ids and files),
  reported while one of them was judged within ``warn_hold_s``. A flood of fresh ids thus adds a
  bounded number of faults to health.db per hold window, and no persistent verdict goes unsaid.
- the check's saved state (``ctx.state``: the verdicts reported and not yet moved, the uids' counts,
  the faults held per component) is bounded by the above; pace files are listed like the spool.
"""

from __future__ import annotations

import errno
import functools
import heapq
import json
import os
import pwd
import stat
import sys
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from gpumon.check import Check, CheckContext
from gpumon.guard import verdict as vf
from gpumon.hw.nvml import CLOCK_EVENT_REASONS
from gpumon.hw.placement import normalize_uuid
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, gpu, reading

from .confirming import Confirmations, pending
from .intake import intake as take_verdict
from .options import GuardConfig, spool_of

JUDGED = "judged"
# One token per daemon process: a file reported by an earlier run of THIS process is in health.db.
_PROCESS = uuidlib.uuid4().hex
# Names, ids and files a summary finding lists: enough to open the files, and evidence of a bounded size.
_FEW = 5
# Characters of a verdict's id or job kept in the saved state: the schema bounds neither.
_ID_CHARS = 200
# Characters of a bad file's error kept in memory per file (the schema's own messages are <= 300).
_ERROR_CHARS = 400
# The classes a verdict's fault falls in: faults of their own are bounded per component and class.
_FAIL, _WARN, _APP = "persistent", "transient-unknown", "application"
# How a reported verdict is held: a fault of its own, counted in its component's summary, or no fault.
_ONE, _MORE, _NONE = "one", "more", "none"
_BAD, _WAIT = "bad", "wait"


class _Left(NamedTuple):
    """A file this process read and left in the spool, as it was then (``lstat``)."""

    ino: int
    size: int
    mtime_ns: int
    uid: int
    kind: str  # _BAD: not a verdict; _WAIT: a verdict of a uid past its cap
    reason: str  # _BAD: the kind of problem, for the count per reason
    error: str  # _BAD: what is wrong, as the single-file warning says it
    where: str | None  # a schema violation's JSON path
    rule: str | None  # and the schema keyword that refused it


# (files that are not verdicts, their count per reason, the first few by name, uid -> its waiting verdicts)
_Summary = tuple[int, Counter[str], list[tuple[str, _Left]], Counter[int]]
# spool -> file name -> what this process learnt of it: a cache, not state (a restart reads the
# files once more), so it lives in the process, bounded by max_scan entries per spool.
_LEFT: dict[str, dict[str, _Left]] = {}
# spool -> runs so far: which slice of the remembered files a run checks again with lstat
_TURN: dict[str, int] = {}
# spool -> the remembered files (the very dict in _LEFT) and what they add up to (_summarize),
# kept while a run finds the same files: a run over 20,000 of them need not count them again
_SUMMARY: dict[str, tuple[dict[str, _Left], _Summary]] = {}
# judged file -> (its lstat, the verdict read from it): the warnings held one by one are reported
# every run, and a file judged does not change
_HELD: dict[str, tuple[tuple[int, int, int], vf.Verdict]] = {}


class GuardCheck(Check):
    name = "guard"
    phase = Phase.CONTINUOUS
    description = "verdicts of the in-job SDC checks (gpumon.guard) of jobs on this node"
    readings = (
        ReadingSpec(
            "guard_pace_score", "gauge",
            "In-job pace of this node's GPU (label gpu: its index) in the latest window of a guarded "
            "training job (gpumon.guard): the job's median compute per step over all ranks divided by this "
            "GPU's rank's own (forward to its last gradient bucket, plus optimizer.step(); waiting for "
            "other ranks excluded). 1 is the group's pace, 0.5 half speed; below 0.75 (NVIDIA Resiliency "
            "Extension's straggler threshold) in 3 of 5 windows the job names it a straggler.",
            unit="ratio",
            source="the job's pace file in the guard spool, exported while under pace_max_age_s (15 min) old",
            labels=("gpu",)),
        ReadingSpec(
            "guard_pace_slowest_score", "gauge",
            "The lowest guard_pace_score of this node's GPUs: how far the slowest GPU of this node holds "
            "back its guarded training job (1: at the group's pace).",
            unit="ratio",
            source="as guard_pace_score"),
    )
    interval = 10.0
    timeout = 30.0
    Config = GuardConfig
    # verdicts handed over on the daemon's socket (gpumon.intake): attested, put into the spool
    intake = staticmethod(take_verdict)

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(GuardConfig)
        spool = spool_of(options, ctx)
        if not spool.is_dir():
            return [self.ok(NODE, f"no guard verdicts (spool {spool} does not exist)", spool=str(spool))]
        try:
            vf.validator()
        except Exception as exc:  # a broken install: judging no file beats calling every file bad
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot load the guard verdict schema "
                                 f"({vf.SCHEMA_PACKAGE}/{vf.SCHEMA_FILE}): {type(exc).__name__}: {exc}; "
                                 "the spool is not read (reinstall gpumon)", spool=str(spool))]
        now = ctx.clock()
        by_uuid = {normalize_uuid(g.uuid): g.index for g in ctx.inventory.gpus}
        book = _Book(ctx.state, now, options)
        self._confirm = Confirmations.of(options, ctx.state_dir, now)
        self._by_uuid = by_uuid
        judged_dir = spool / JUDGED
        try:
            listing = _list(spool, book, options)
        except OSError as exc:
            return [self.finding(NODE, Severity.UNKNOWN, f"cannot list the guard spool {spool}: {exc}",
                                 spool=str(spool))]
        if book.fresh:
            self._adopt(judged_dir, book, by_uuid, options)
        out = self._carry(spool, judged_dir, book, by_uuid)
        out += self._read(spool, listing, book, by_uuid, options)
        out += self._held(judged_dir, book, by_uuid)
        out += self._summaries(spool, judged_dir, book, options)
        out += self._spool_warnings(spool, listing, book, options)
        _LEFT[str(spool)] = listing.left
        book.save()
        for f in out:
            if f.evidence.get("verdict_check") == "straggler" and f.component != NODE:
                assert isinstance(f.evidence, dict)
                f.evidence["node_signals"] = _signals(ctx, int(f.component.split("/")[1]))
        if not out:
            out.append(self.ok(NODE, f"no guard verdicts to report (spool {spool})", spool=str(spool)))
        pace = _pace(spool / vf.PACE_DIR, by_uuid, now, options.pace_max_age_s, options.max_scan)
        if pace:
            slowest = min(pace, key=lambda kv: kv[1])
            readings = [reading("guard_pace_score", score, gpu=index) for index, score in sorted(pace)]
            readings.append(reading("guard_pace_slowest_score", slowest[1]))
            said = f"in-job pace of {len(pace)} GPU(s): slowest GPU {slowest[0]} at {slowest[1]:.2f}"
            node_finding = next((f for f in out if f.component == NODE), None)
            if node_finding is None:
                out.append(self.ok(NODE, said, readings=readings, spool=str(spool)))
            else:
                assert isinstance(node_finding.evidence, dict)
                node_finding.evidence["readings"] = [*node_finding.evidence.get("readings", []), *readings]
        return out

    def _carry(self, spool: Path, judged_dir: Path, book: _Book,
               by_uuid: dict[str | None, int]) -> list[Finding]:
        """The verdicts reported by an earlier run: moved to judged/ when that run was this process's
        (its findings are in health.db), else reported again."""
        out: list[Finding] = []
        for name, rec in list(book.reported.items()):
            path = spool / name
            try:
                now_st = os.lstat(path)
            except OSError:
                if rec["by"] != _PROCESS and (judged_dir / name).is_file():
                    book.fold(name)  # moved by a process that died before its state was saved
                else:
                    book.drop(name)
                continue
            if [now_st.st_ino, now_st.st_size, now_st.st_mtime_ns] != rec["st"]:
                book.drop(name)  # rewritten since it was read: the next run reads it as a new file
                continue
            # a verdict awaiting its confirmation stays in the spool, reported every run, until judged by it
            if rec["by"] == _PROCESS and not rec.get("pend") and self._judge(path, judged_dir):
                book.fold(name)
                continue
            rec["by"] = _PROCESS
            if rec["slot"] == _MORE:
                continue  # said again in its component's summary
            try:
                verdict = self._load(path)
            except (vf.VerdictError, OSError):
                book.drop(name)
                continue
            if rec.get("pend") and not pending(verdict):
                book.settled(name, verdict.fault)  # judged by its confirmation: this run says so
            out.append(self._finding(verdict, path, by_uuid))
        return out

    def _read(self, spool: Path, listing: _Listing, book: _Book, by_uuid: dict[str | None, int],
              options: GuardConfig) -> list[Finding]:
        """Read up to ``max_files`` new files: in turn per owner, oldest first within an owner."""
        out: list[Finding] = []
        turns: deque[tuple[int, Iterator[tuple[int, str, int, int]]]] = deque(
            (uid, iter(sorted(queue, key=lambda item: (-item[0], item[1]))))
            for uid, queue in sorted(listing.queues.items(), key=lambda kv: (-max(kv[1])[0], kv[0])))
        while turns and listing.read < options.max_files:
            uid, files = turns.popleft()
            item = next(files, None)
            if item is None:
                continue
            turns.append((uid, files))
            listing.read += 1
            neg_mtime, name, ino, size = item
            path = spool / name
            try:
                verdict = self._load(path)
            except (vf.VerdictError, OSError) as exc:
                listing.left[name] = _Left(ino, size, -neg_mtime, uid, _BAD, _reason(exc),
                                           _error(exc), *_schema_place(exc))
                listing.learnt += 1
                continue
            if _class(verdict.fault) != _FAIL and book.capped(uid):
                listing.left[name] = _Left(ino, size, -neg_mtime, uid, _WAIT, "", "", None, None)
                listing.learnt += 1
                continue
            book.counted(uid)
            slot = book.report(name, [ino, size, -neg_mtime], _component(verdict, by_uuid), verdict)
            if slot == _ONE and pending(verdict):
                book.reported[name]["pend"] = True
            if slot != _MORE:
                out.append(self._finding(verdict, path, by_uuid))
        return out

    def _held(self, judged_dir: Path, book: _Book, by_uuid: dict[str | None, int]) -> list[Finding]:
        """The judged transient and unknown verdicts with a fault of their own, within their hold:
        read again from judged/ (at most max_faults_per_gpu per component)."""
        out: list[Finding] = []
        cached = {str(judged_dir / name): _HELD.get(str(judged_dir / name)) for name in book.held_warnings()}
        for key, was in cached.items():
            path = Path(key)
            try:
                st = os.lstat(path)
                as_is = (st.st_ino, st.st_size, st.st_mtime_ns)
                verdict = was[1] if was is not None and was[0] == as_is else self._load(path)
            except (vf.VerdictError, OSError):
                book.forget(path.name)  # gone, or changed since it was judged: no longer held
                _HELD.pop(key, None)
                continue
            _HELD[key] = (as_is, verdict)
            out.append(self._finding(verdict, path, by_uuid))
        for key in [k for k in _HELD if Path(k).parent == judged_dir and k not in cached]:
            del _HELD[key]
        return out

    def _summaries(self, spool: Path, judged_dir: Path, book: _Book, options: GuardConfig) -> list[Finding]:
        out: list[Finding] = []
        for (component, cls), (count, since, newest) in sorted(book.summaries().items()):
            where = (f"GPU {component.split('/')[1]}" if component != NODE
                     else "this node (CPU ranks, or GPUs that are not this node's)")
            files = [{"id": vid, "time": t, "fault": fault, "verdict_check": check, "job": job or None,
                      "verdict_file": str((spool if waiting else judged_dir) / name)}
                     for t, vid, name, fault, check, job, waiting in newest]
            kinds = "persistent" if cls == _FAIL else "transient or unknown"
            message = (f"{count} more in-job SDC verdicts ({kinds}) on {where} since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))} than the "
                       f"{options.max_faults_per_gpu} held as faults of their own "
                       f"(checks.guard.max_faults_per_gpu): counted in this one; newest: "
                       f"{', '.join(str(f['id']) for f in files)}")
            if cls == _FAIL:
                # not one of them is confirmed on its own: the GPU fails (or not) by the confirmation
                # of the ones held as faults of their own
                message += ("; the GPU is judged by the node's confirmation of those (checks.guard.confirm), "
                            "not by how many there are")
            out.append(self.finding(component, Severity.WARN, message, Action.NONE,
                                    fault_key=f"verdicts-more:{cls}",
                                    verdicts=count, since=since, newest=files,
                                    max_faults_per_gpu=options.max_faults_per_gpu))
        return out

    def _spool_warnings(self, spool: Path, listing: _Listing, book: _Book,
                        options: GuardConfig) -> list[Finding]:
        out: list[Finding] = []
        cached = _SUMMARY.get(str(spool))
        if (cached is not None and cached[0] is _LEFT.get(str(spool)) and not listing.learnt
                and listing.carried == listing.known):
            summary = cached[1]
        else:
            summary = _summarize(listing.left)
        _SUMMARY[str(spool)] = (listing.left, summary)
        bad, reasons, first, waiting = summary
        if bad:
            out.append(self._not_verdicts(spool, bad, reasons, first))
        for uid, n in sorted(waiting.items()):
            judged = book.judged_by(uid)
            out.append(self.finding(
                NODE, Severity.WARN,
                f"uid {uid} filed more guard verdicts than the {options.uid_max_verdicts} judged per uid "
                f"within {options.uid_window_s:g} s (checks.guard.uid_max_verdicts): {n} more of its "
                f"verdict files wait in {spool}, judged in a later window, oldest first (not deleted; "
                "a persistent verdict only waits if it is not attested)",
                fault_key=f"uid-cap:{uid}", uid=uid, waiting=n, judged=judged,
                uid_max_verdicts=options.uid_max_verdicts, uid_window_s=options.uid_window_s))
        unread = listing.fresh - listing.read
        if unread or listing.cut:
            said = (f"{unread} files in the guard spool {spool} wait beyond the {options.max_files} read per "
                    "run (checks.guard.max_files): read on later runs, in turn per owner, oldest first")
            if listing.cut:
                said += (f"; the spool holds more than the {options.max_scan} entries listed per run "
                         "(checks.guard.max_scan): those past them are not seen until it holds fewer")
            out.append(self.finding(NODE, Severity.WARN, said, spool=str(spool), waiting=unread,
                                    listed=listing.listed, listing_cut=listing.cut,
                                    fault_key="spool-backlog"))
        return out

    def _not_verdicts(self, spool: Path, bad: int, reasons: Counter[str],
                      first: list[tuple[str, _Left]]) -> Finding:
        files: list[dict[str, Any]] = []
        for name, left in first:
            said: dict[str, Any] = {"file": str(spool / name), "error": left.error}
            if left.where is not None:
                said.update(schema=vf.SCHEMA_ID, schema_error_path=left.where, schema_rule=left.rule)
            files.append(said)
        if bad == 1:
            (name, left), = first
            what = ("a newer guard's verdict" if left.reason == _FUTURE
                    else "not a guard verdict this gpumon reads")
            message = (f"guard spool file {spool / name}: {what}: {left.error}; left in place (remove or fix "
                       "it; it is read again every run)")
        else:
            counts = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
            errors = "; ".join(f"{name}: {left.error}" for name, left in first)
            message = (f"{bad} files in the guard spool {spool} are not guard verdicts this gpumon "
                       f"reads ({counts}); the first {len(first)} by name: {errors}; left in place (remove "
                       "or fix them; each is looked at again every run)")
        # the first file's own fields at the top, as a single bad file's warning always had them
        return self.finding(NODE, Severity.WARN, message, fault_key="spool-not-verdicts",
                            files_not_verdicts=bad, reasons=dict(reasons), files=files, **files[0])

    def _adopt(self, judged_dir: Path, book: _Book, by_uuid: dict[str | None, int],
               options: GuardConfig) -> None:
        """A state that holds no faults (a first run of this version, a state set aside): the
        warnings judged earlier and still within their hold are taken from judged/, bounded like a
        run over the spool, so that they go on being reported."""
        listed = reads = 0
        try:
            with os.scandir(judged_dir) as entries:
                for entry in entries:
                    listed += 1
                    if listed > options.max_scan or reads >= options.max_files:
                        break
                    if not _named_like_a_verdict(entry.name):
                        continue
                    try:
                        mtime = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    if book.now - mtime > book.hold + 3600 and mtime < book.now:
                        continue  # cheap first: a file moved long ago cannot hold a warning any more
                    reads += 1
                    try:
                        verdict = self._load(Path(entry.path))
                    except (vf.VerdictError, OSError):
                        continue
                    if _holds(verdict, book.now, book.hold):
                        book.adopt(entry.name, _component(verdict, by_uuid), verdict)
        except OSError:
            return  # no judged/ yet, or unreadable: nothing to adopt

    def _load(self, path: Path) -> vf.Verdict:
        """The verdict in ``path`` as judged: its attestation, then (persistent) its confirmation."""
        return self._confirm.judge(_load(path), self._by_uuid)

    def _judge(self, path: Path, judged_dir: Path) -> bool:
        try:
            judged_dir.mkdir(exist_ok=True)
            os.replace(path, judged_dir / path.name)
        except OSError:
            return False  # left in place: reported again, moved on a later run
        return True

    def _finding(self, v: vf.Verdict, path: Path, by_uuid: dict[str | None, int]) -> Finding:
        s = v.subject
        if v.fault == "application":
            job = f"job {v.job}, " if v.job else ""
            return self.ok(NODE, f"in-job SDC check {v.check} ({job}application: not a hardware fault, no "
                                 f"GPU held responsible) from rank {s.rank} on {s.host}: {v.message}",
                           verdict_file=str(path), verdict_check=v.check, fault=v.fault, step=v.step,
                           job=v.job, rank=s.rank, gpu_uuid=s.gpu_uuid, verdict_evidence=v.evidence)
        key = normalize_uuid(s.gpu_uuid)
        index = by_uuid.get(key) if key else None
        if index is not None:
            component, where = gpu(index), f"GPU {index} ({s.gpu_uuid})"
        elif key:
            component = NODE
            where = (f"GPU {s.gpu_uuid}, which is not one of this node's GPUs (written on host "
                     f"{s.host}: a spool shared between nodes, or a GPU gone from NVML)")
        else:
            component, where = NODE, f"this node, not a GPU ({s.gpu_note or f'device {s.device}'})"
        if v.fault == "persistent":
            severity, action = Severity.FAIL, Action.INSPECT_HARDWARE
        else:
            severity, action = Severity.WARN, Action.NONE
        job = f"job {v.job}, " if v.job else ""
        message = f"in-job SDC check {v.check} ({job}{v.fault}) on {where}: {v.message}"
        attestation = v.evidence.get("attestation")
        if isinstance(attestation, dict) and attestation.get("attested") is False:
            claimed = attestation.get("claimed_fault", v.fault)
            message = (f"NOT ATTESTED in-job SDC verdict {v.check} ({job}claims {claimed}; judged as a "
                       f"warning) on {where}: {attestation.get('why')}. The verdict says: {v.message}")
        fault_key = v.id
        confirmation = v.evidence.get("confirmation")
        if isinstance(confirmation, dict) and not (isinstance(attestation, dict)
                                                   and attestation.get("attested") is False):
            severity, action, message = _confirmation_words(v, confirmation, where, job, severity, action)
            if pending(v):
                fault_key = f"confirm:{v.id}"  # its own fault: cleared when the confirmation judges it
                trouble = self._confirm.ask(v)
                if trouble:
                    message += f" ({trouble})"
        if v.check == "straggler":
            message = (f"in-job straggler ({job.rstrip(', ') or 'a job'}) on {where}: {v.message}; "
                       "compare this GPU's throttle, thermal, pcie and nvlink findings (node_signals in "
                       "the evidence: read when the verdict was judged)")
        evidence: dict[str, Any] = {
            "fault_key": fault_key, "verdict_id": v.id, "verdict_file": str(path), "verdict_check": v.check,
            "fault": v.fault, "step": v.step, "job": v.job, "time": v.time, "rank": s.rank,
            "world_size": s.world_size, "host": s.host, "node_name": s.node_name, "local_rank": s.local_rank,
            "device": s.device,
            "gpu_uuid": s.gpu_uuid, "gpu_pci_bus_id": s.gpu_pci_bus_id, "verdict_evidence": v.evidence}
        return self.finding(component, severity, message, action, **evidence)


def _confirmation_words(v: vf.Verdict, said: dict[str, Any], where: str, job: str, severity: Severity,
                        action: Action) -> tuple[Severity, Action, str]:
    """Severity, action and message of a persistent verdict judged by the node's confirmation."""
    commands = "; ".join(f"`{c}`" for c in said.get("commands", []))
    state = said.get("state")
    if state == "pending":
        waiting = f"; now: {said['waiting']}" if said.get("waiting") else ""
        # said first: a drain reason keeps the first 200 characters
        return Severity.WARN, Action.CONFIRM_SDC, (
            f"confirming an in-job SDC verdict on this node before the RMA path, no new work until then: "
            f"in-job SDC check {v.check} ({job}persistent) on {where}: {v.message}; the node's SDC canaries "
            f"run on GPU {said.get('gpu_index')} once it is free{waiting}")
    if state == "reproduced":
        return Severity.FAIL, Action.INSPECT_HARDWARE, (
            f"in-job SDC check {v.check} ({job}persistent) on {where}, CONFIRMED on this node: "
            f"{said.get('said')}. The verdict says: {v.message}")
    if state == "not_reproduced":
        return severity, action, (
            f"in-job SDC verdict {v.check} ({job}claims persistent) on {where} NOT reproduced on this node: "
            f"{said.get('said')}; judged as a warning, and the node serves again. The verdict says: "
            f"{v.message}" + (f". To look further: {commands}" if commands else ""))
    why = said.get("said") or said.get("why")
    return severity, action, (
        f"in-job SDC verdict {v.check} ({job}claims persistent; judged as a warning) on {where}: it could "
        f"not be confirmed on this node: {why}. The verdict says: {v.message}"
        + (f". To confirm it: {commands}" if commands else ""))


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


def _signals(ctx: CheckContext, index: int) -> dict[str, Any]:
    """What this node's hardware says of a GPU a job called slow: throttle reasons, temperature,
    PCIe link against its maximum, NVLink links up. Each reading bounded; one that fails says why."""
    nvml = ctx.hw.nvml

    def reasons() -> list[str]:
        mask = nvml.clocks_event_reasons(index)
        return [n for n, bit in CLOCK_EVENT_REASONS.items() if mask & bit and n != "gpu_idle"]

    def pcie() -> dict[str, Any]:
        link = nvml.pcie_link(index)
        return {"generation": link.generation, "max_generation": link.max_generation, "width": link.width,
                "max_width": link.max_width,
                "degraded": link.width < link.max_width or link.generation < link.max_generation}

    def nvlink() -> str:
        n = nvml.nvlink_count(index)
        return f"{sum(nvml.nvlink_state(index, i) for i in range(n))}/{n}"

    out: dict[str, Any] = {}
    for key, fn in (("clock_event_reasons", reasons), ("temperature_c", lambda: nvml.temperature_c(index)),
                    ("pcie_link", pcie), ("nvlink_up", nvlink)):
        try:
            out[key] = fn()
        except Exception as exc:  # a signal that cannot be read is said, never a crash of the check
            out[key] = f"unreadable: {type(exc).__name__}: {exc}"
    return out


def _pace(directory: Path, by_uuid: dict[str | None, int], now: float,
          max_age_s: float, max_scan: int) -> list[tuple[int, float]]:
    """(GPU index, pace score) of this node's GPUs from fresh pace files (the newest file per GPU);
    at most 200 files, the first by name among at most ``max_scan`` entries (any job can write there)."""
    if not directory.is_dir():
        return []
    newest: dict[int, tuple[float, float]] = {}

    def names() -> Iterator[str]:
        with os.scandir(directory) as entries:
            for i, entry in enumerate(entries):
                if i >= max_scan:
                    return
                # a regular file only: opening a FIFO would wait for a writer
                if entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
                    yield entry.name

    try:
        files = [directory / name for name in heapq.nsmallest(200, names())]
    except OSError:
        return []
    for path in files:
        try:
            when, _, rows = vf.read_pace(path)
        except (vf.VerdictError, OSError):
            continue
        if now - when > max_age_s:
            continue
        for row in rows:
            index = by_uuid.get(normalize_uuid(row.gpu_uuid)) if row.gpu_uuid else None
            if index is not None and (index not in newest or newest[index][0] < when):
                newest[index] = (when, row.pace)
    return [(i, score) for i, (_, score) in newest.items()]


class _Book:
    """The check's saved state (``ctx.state``, JSON), bounded:

    - ``reported``: name -> the verdict a run reported and no run has moved yet (at most
      ``max_files`` a run): who reported it (the process token), its lstat, component, fault, id,
      time (``t``, never later than when it was read), when it was read (``j``) and how it is held
      (``slot``);
    - ``uids``: uid -> [start of its window, verdicts judged in it];
    - ``held``: component -> the judged verdicts that keep a fault of their own for ``warn_hold_s``
      after they were judged (``transient-unknown``: [t, j, name, id], reported while within their
      hold; ``persistent``: [j, id], counted only: their faults stay without them), and per class
      the summary of the others (``more:<class>``: since, last, count, the newest few).
    """

    def __init__(self, state: MutableMapping[str, Any], now: float, options: GuardConfig) -> None:
        self.state = state
        self.now = now
        self.hold = options.warn_hold_s
        self.max_faults = options.max_faults_per_gpu
        self.uid_cap = options.uid_max_verdicts
        self.fresh = "held" not in state
        # an earlier release saved name -> process token, with nothing to book a file by: those files
        # are read again as new ones (the same fault: keyed by the verdict id)
        self.reported: dict[str, dict[str, Any]] = {
            name: dict(rec) for name, rec in state.get("reported", {}).items() if isinstance(rec, dict)}
        self.uids: dict[str, list[float]] = {
            uid: [float(start), float(n)] for uid, (start, n) in state.get("uids", {}).items()
            if now - float(start) < options.uid_window_s}
        self.held: dict[str, dict[str, Any]] = {}
        for component, was in state.get("held", {}).items():
            kept: dict[str, Any] = {}
            warn = [e for e in was.get(_WARN, []) if now - e[1] < self.hold]
            fail = [e for e in was.get(_FAIL, []) if now - e[0] < self.hold]
            if warn:
                kept[_WARN] = warn
            if fail:
                kept[_FAIL] = fail
            for cls in (_WARN, _FAIL):
                summary = was.get(f"more:{cls}")
                if summary is not None and now - summary["last"] < self.hold:
                    kept[f"more:{cls}"] = summary
            if kept:
                self.held[component] = kept
        self.ones: Counter[tuple[str, str]] = Counter()
        for component, kept in self.held.items():
            for cls in (_WARN, _FAIL):
                self.ones[(component, cls)] += len(kept.get(cls, []))
        for rec in self.reported.values():
            if rec["slot"] == _ONE:
                self.ones[(rec["c"], _class(rec["f"]))] += 1

    def save(self) -> None:
        self.state["reported"] = self.reported
        self.state["uids"] = self.uids
        self.state["held"] = self.held

    # -- per uid ---------------------------------------------------------------------------------

    def capped_uids(self) -> set[int]:
        return {int(uid) for uid, window in self.uids.items() if window[1] >= self.uid_cap}

    def capped(self, uid: int) -> bool:
        window = self.uids.get(str(uid))
        return window is not None and window[1] >= self.uid_cap

    def counted(self, uid: int) -> None:
        self.uids.setdefault(str(uid), [self.now, 0.0])[1] += 1

    def judged_by(self, uid: int) -> int:
        window = self.uids.get(str(uid))
        return 0 if window is None else int(window[1])

    # -- verdicts ----------------------------------------------------------------------------------

    def report(self, name: str, lstat: list[int], component: str, v: vf.Verdict) -> str:
        """Book a verdict a run reports for the first time; how it is held."""
        cls = _class(v.fault)
        if cls == _APP:
            slot = _NONE
        elif self.ones[(component, cls)] < self.max_faults:
            slot = _ONE
            self.ones[(component, cls)] += 1
        else:
            slot = _MORE
        self.reported[name] = {"by": _PROCESS, "st": lstat, "c": component, "f": v.fault,
                               "id": v.id[:_ID_CHARS], "t": min(v.time, self.now), "j": self.now,
                               "slot": slot, "chk": v.check, "job": (v.job or "")[:_ID_CHARS]}
        return slot

    def settled(self, name: str, fault: str) -> None:
        """A verdict that awaited its confirmation is judged by it now, as ``fault``."""
        rec = self.reported[name]
        rec["pend"] = False
        if rec["slot"] == _ONE and _class(fault) != _class(rec["f"]):
            self.ones[(rec["c"], _class(rec["f"]))] -= 1
            self.ones[(rec["c"], _class(fault))] += 1
        rec["f"] = fault

    def drop(self, name: str) -> None:
        rec = self.reported.pop(name)
        if rec["slot"] == _ONE:
            self.ones[(rec["c"], _class(rec["f"]))] -= 1

    def fold(self, name: str) -> None:
        """A reported verdict is in judged/ now: held by its slot."""
        rec = self.reported.pop(name)
        cls = _class(rec["f"])
        if rec["slot"] == _ONE:
            entry = [rec["t"], rec["j"], name, rec["id"]] if cls == _WARN else [rec["j"], rec["id"]]
            self.held.setdefault(rec["c"], {}).setdefault(cls, []).append(entry)
        elif rec["slot"] == _MORE:
            kept = self.held.setdefault(rec["c"], {})
            summary = kept.setdefault(f"more:{cls}", {"since": rec["j"], "last": rec["j"], "count": 0,
                                                      "newest": []})
            summary["since"] = min(summary["since"], rec["j"])
            summary["last"] = max(summary["last"], rec["j"])
            summary["count"] += 1
            summary["newest"] = _newest([*summary["newest"], _brief(name, rec)])

    def adopt(self, name: str, component: str, v: vf.Verdict) -> None:
        """A judged warning found in judged/ by a run that had no state of them."""
        self.report(name, [], component, v)
        self.fold(name)

    def held_warnings(self) -> list[str]:
        return [e[2] for kept in self.held.values() for e in kept.get(_WARN, [])
                if self.now - e[0] < self.hold]

    def forget(self, name: str) -> None:
        for component, kept in self.held.items():
            warn = kept.get(_WARN, [])
            for e in warn:
                if e[2] == name:
                    warn.remove(e)
                    self.ones[(component, _WARN)] -= 1
                    return

    def summaries(self) -> dict[tuple[str, str], tuple[int, float, list[list[Any]]]]:
        """(component, class) -> (count, since, newest few) of the verdicts counted together, judged
        (in held) or reported and not yet moved."""
        out: dict[tuple[str, str], tuple[int, float, list[list[Any]]]] = {}
        for component, kept in self.held.items():
            for cls in (_WARN, _FAIL):
                summary = kept.get(f"more:{cls}")
                if summary is not None:
                    newest = [[*n, False] for n in summary["newest"]]
                    out[(component, cls)] = (summary["count"], summary["since"], newest)
        for name, rec in self.reported.items():
            if rec["slot"] == _MORE:
                key = (rec["c"], _class(rec["f"]))
                count, since, newest = out.get(key, (0, rec["j"], []))
                out[key] = (count + 1, min(since, rec["j"]), _newest([*newest, [*_brief(name, rec), True]]))
        return out


def _brief(name: str, rec: dict[str, Any]) -> list[Any]:
    return [rec["t"], rec["id"], name, rec["f"], rec["chk"], rec["job"]]


def _newest(briefs: list[list[Any]]) -> list[list[Any]]:
    return sorted(briefs, key=lambda b: (b[0], b[1]), reverse=True)[:_FEW]


@dataclass
class _Listing:
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
    left: dict[str, _Left] = field(default_factory=dict)


def _list(spool: Path, book: _Book, options: GuardConfig) -> _Listing:
    """List the spool's top level, at most ``max_scan`` entries. A remembered file (not a verdict;
    a verdict of a uid still past its cap) whose inode is the same is taken as it was, without a
    system call; a rotating ``max_files`` of them are checked with lstat each run (a file rewritten
    in place keeps its inode), the rest of each cycle on later runs."""
    known = _LEFT.get(str(spool), {})
    turn = _TURN[str(spool)] = _TURN.get(str(spool), -1) + 1
    cycles = max(1, -(-len(known) // options.max_files))
    turn %= cycles
    capped = book.capped_uids()
    reported = book.reported
    out = _Listing(known=len(known))
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
                if seen_known % cycles != turn and (was.kind == _BAD or was.uid in capped):
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
                    and (was.kind == _BAD or was.uid in capped)):
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


def _summarize(left: dict[str, _Left]) -> _Summary:
    """(files that are not verdicts, their count per reason, the first few by name, uid -> its
    verdicts waiting for a later window)."""
    bad: list[tuple[str, _Left]] = []
    waiting: Counter[int] = Counter()
    for name, was in left.items():
        if was.kind == _BAD:
            bad.append((name, was))
        else:
            waiting[was.uid] += 1
    reasons = Counter(was.reason for _, was in bad)
    return len(bad), reasons, heapq.nsmallest(_FEW, bad, key=lambda kv: kv[0]), waiting


def _load(path: Path) -> vf.Verdict:
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


_FUTURE = "of a newer version"


def _reason(exc: Exception) -> str:
    """The kind of problem of a file that is not a verdict, for the count per reason."""
    if isinstance(exc, vf.FutureVerdict):
        return _FUTURE
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


def _error(exc: Exception) -> str:
    text = str(exc)
    # interned: a flood of one junk file's copies is one string in memory, not one per file
    return sys.intern(text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "...")


def _schema_place(exc: Exception) -> tuple[str | None, str | None]:
    return (exc.where, exc.rule) if isinstance(exc, vf.SchemaViolation) else (None, None)


def _class(fault: str) -> str:
    return _FAIL if fault == "persistent" else _APP if fault == "application" else _WARN


def _component(v: vf.Verdict, by_uuid: dict[str | None, int]) -> str:
    """Where ``_finding`` puts the verdict."""
    if v.fault == "application":
        return NODE
    key = normalize_uuid(v.subject.gpu_uuid)
    index = by_uuid.get(key) if key else None
    return gpu(index) if index is not None else NODE


def _named_like_a_verdict(name: str) -> bool:
    return name.endswith(".json") and not name.startswith(".")


def _holds(v: vf.Verdict, now: float, hold_s: float) -> bool:
    """A judged verdict is still reported: a warning within its hold (a persistent one lives on in
    the health state by itself; an application one was never a fault)."""
    return v.fault in ("transient", "unknown") and now - v.time < hold_s
