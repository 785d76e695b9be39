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

Its parts: ``spool`` (the spool listed and read within these bounds), ``book`` (the saved state),
``wording`` (what the findings say), ``pace_files`` and ``node_signals`` (for stragglers), and
``intake``, ``confirming``, ``options``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from gpumon.check import CheckContext
from gpumon.guard import verdict as vf
from gpumon.hw.placement import normalize_uuid
from gpumon.model import NODE, Finding, Phase, ReadingSpec, Severity, gpu, reading

from .book import FAIL, MORE, ONE, PROCESS, Book, class_of
from .confirming import Confirmations, pending
from .intake import intake as take_verdict
from .node_signals import signals
from .options import GuardConfig, spool_of
from .pace_files import pace_scores
from .spool import (
    BAD,
    LEFT,
    WAIT,
    Left,
    Listing,
    error_text,
    list_spool,
    read_verdict,
    reason_of,
    schema_place,
)
from .wording import GuardWording

JUDGED = "judged"
# judged file -> (its lstat, the verdict read from it): the warnings held one by one are reported
# every run, and a file judged does not change
_HELD: dict[str, tuple[tuple[int, int, int], vf.Verdict]] = {}


class GuardCheck(GuardWording):
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
        book = Book(ctx.state, now, options)
        self._confirm = Confirmations.of(options, ctx.state_dir, now)
        self._by_uuid = by_uuid
        judged_dir = spool / JUDGED
        try:
            listing = list_spool(spool, book, options)
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
        LEFT[str(spool)] = listing.left
        book.save()
        for f in out:
            if f.evidence.get("verdict_check") == "straggler" and f.component != NODE:
                assert isinstance(f.evidence, dict)
                f.evidence["node_signals"] = signals(ctx, int(f.component.split("/")[1]))
        if not out:
            out.append(self.ok(NODE, f"no guard verdicts to report (spool {spool})", spool=str(spool)))
        pace = pace_scores(spool / vf.PACE_DIR, by_uuid, now, options.pace_max_age_s, options.max_scan)
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

    def _carry(self, spool: Path, judged_dir: Path, book: Book,
               by_uuid: dict[str | None, int]) -> list[Finding]:
        """The verdicts reported by an earlier run: moved to judged/ when that run was this process's
        (its findings are in health.db), else reported again."""
        out: list[Finding] = []
        for name, rec in list(book.reported.items()):
            path = spool / name
            try:
                now_st = os.lstat(path)
            except OSError:
                if rec["by"] != PROCESS and (judged_dir / name).is_file():
                    book.fold(name)  # moved by a process that died before its state was saved
                else:
                    book.drop(name)
                continue
            if [now_st.st_ino, now_st.st_size, now_st.st_mtime_ns] != rec["st"]:
                book.drop(name)  # rewritten since it was read: the next run reads it as a new file
                continue
            # a verdict awaiting its confirmation stays in the spool, reported every run, until judged by it
            if rec["by"] == PROCESS and not rec.get("pend") and self._judge(path, judged_dir):
                book.fold(name)
                continue
            rec["by"] = PROCESS
            if rec["slot"] == MORE:
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

    def _read(self, spool: Path, listing: Listing, book: Book, by_uuid: dict[str | None, int],
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
                listing.left[name] = Left(ino, size, -neg_mtime, uid, BAD, reason_of(exc),
                                           error_text(exc), *schema_place(exc))
                listing.learnt += 1
                continue
            if class_of(verdict.fault) != FAIL and book.capped(uid):
                listing.left[name] = Left(ino, size, -neg_mtime, uid, WAIT, "", "", None, None)
                listing.learnt += 1
                continue
            book.counted(uid)
            slot = book.report(name, [ino, size, -neg_mtime], _component(verdict, by_uuid), verdict)
            if slot == ONE and pending(verdict):
                book.reported[name]["pend"] = True
            if slot != MORE:
                out.append(self._finding(verdict, path, by_uuid))
        return out

    def _held(self, judged_dir: Path, book: Book, by_uuid: dict[str | None, int]) -> list[Finding]:
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

    def _adopt(self, judged_dir: Path, book: Book, by_uuid: dict[str | None, int],
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
        return self._confirm.judge(read_verdict(path), self._by_uuid)

    def _judge(self, path: Path, judged_dir: Path) -> bool:
        try:
            judged_dir.mkdir(exist_ok=True)
            os.replace(path, judged_dir / path.name)
        except OSError:
            return False  # left in place: reported again, moved on a later run
        return True


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
