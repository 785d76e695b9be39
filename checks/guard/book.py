"""The guard check's saved state (``ctx.state``, JSON) as ``Book``: the verdicts reported and not yet
moved, the uids' counts, the faults held per component, bounded; and the classes a verdict's fault
falls in and how a reported verdict is held."""

from __future__ import annotations

import uuid as uuidlib
from collections import Counter
from collections.abc import MutableMapping
from typing import Any

from gpumon.guard import verdict as vf

from .options import GuardConfig

# One token per daemon process: a file reported by an earlier run of THIS process is in health.db.
PROCESS = uuidlib.uuid4().hex
# Names, ids and files a summary finding lists: enough to open the files, and evidence of a bounded size.
FEW = 5
# Characters of a verdict's id or job kept in the saved state: the schema bounds neither.
_ID_CHARS = 200
# The classes a verdict's fault falls in: faults of their own are bounded per component and class.
FAIL, _WARN, _APP = "persistent", "transient-unknown", "application"
# How a reported verdict is held: a fault of its own, counted in its component's summary, or no fault.
ONE, MORE, _NONE = "one", "more", "none"


class Book:
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
            fail = [e for e in was.get(FAIL, []) if now - e[0] < self.hold]
            if warn:
                kept[_WARN] = warn
            if fail:
                kept[FAIL] = fail
            for cls in (_WARN, FAIL):
                summary = was.get(f"more:{cls}")
                if summary is not None and now - summary["last"] < self.hold:
                    kept[f"more:{cls}"] = summary
            if kept:
                self.held[component] = kept
        self.ones: Counter[tuple[str, str]] = Counter()
        for component, kept in self.held.items():
            for cls in (_WARN, FAIL):
                self.ones[(component, cls)] += len(kept.get(cls, []))
        for rec in self.reported.values():
            if rec["slot"] == ONE:
                self.ones[(rec["c"], class_of(rec["f"]))] += 1

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
        cls = class_of(v.fault)
        if cls == _APP:
            slot = _NONE
        elif self.ones[(component, cls)] < self.max_faults:
            slot = ONE
            self.ones[(component, cls)] += 1
        else:
            slot = MORE
        self.reported[name] = {"by": PROCESS, "st": lstat, "c": component, "f": v.fault,
                               "id": v.id[:_ID_CHARS], "t": min(v.time, self.now), "j": self.now,
                               "slot": slot, "chk": v.check, "job": (v.job or "")[:_ID_CHARS]}
        return slot

    def settled(self, name: str, fault: str) -> None:
        """A verdict that awaited its confirmation is judged by it now, as ``fault``."""
        rec = self.reported[name]
        rec["pend"] = False
        if rec["slot"] == ONE and class_of(fault) != class_of(rec["f"]):
            self.ones[(rec["c"], class_of(rec["f"]))] -= 1
            self.ones[(rec["c"], class_of(fault))] += 1
        rec["f"] = fault

    def drop(self, name: str) -> None:
        rec = self.reported.pop(name)
        if rec["slot"] == ONE:
            self.ones[(rec["c"], class_of(rec["f"]))] -= 1

    def fold(self, name: str) -> None:
        """A reported verdict is in judged/ now: held by its slot."""
        rec = self.reported.pop(name)
        cls = class_of(rec["f"])
        if rec["slot"] == ONE:
            entry = [rec["t"], rec["j"], name, rec["id"]] if cls == _WARN else [rec["j"], rec["id"]]
            self.held.setdefault(rec["c"], {}).setdefault(cls, []).append(entry)
        elif rec["slot"] == MORE:
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
            for cls in (_WARN, FAIL):
                summary = kept.get(f"more:{cls}")
                if summary is not None:
                    newest = [[*n, False] for n in summary["newest"]]
                    out[(component, cls)] = (summary["count"], summary["since"], newest)
        for name, rec in self.reported.items():
            if rec["slot"] == MORE:
                key = (rec["c"], class_of(rec["f"]))
                count, since, newest = out.get(key, (0, rec["j"], []))
                out[key] = (count + 1, min(since, rec["j"]), _newest([*newest, [*_brief(name, rec), True]]))
        return out


def _brief(name: str, rec: dict[str, Any]) -> list[Any]:
    return [rec["t"], rec["id"], name, rec["f"], rec["chk"], rec["job"]]


def _newest(briefs: list[list[Any]]) -> list[list[Any]]:
    return sorted(briefs, key=lambda b: (b[0], b[1]), reverse=True)[:FEW]


def class_of(fault: str) -> str:
    return FAIL if fault == "persistent" else _APP if fault == "application" else _WARN
