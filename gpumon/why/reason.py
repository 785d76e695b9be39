"""The reasoning: from the nodes' health history and the job's log to ranked suspects, or none.

What a collective failure looks like from the outside: every rank blocks in one collective, and
PyTorch's watchdog gives up ``watchdog_timeout`` later (10 min by default for ProcessGroupNCCL,
pytorch/pytorch PR #110947). The cause, if it is the infrastructure, happened about one watchdog
timeout *before* the job's end, not at it: that is the ``expected`` moment suspects are ranked by.

What counts (each from what the node's checks recorded, judged there by gpumon's own rules; the
Xid catalog's verdict is the one the node stored, not re-judged here):

- tier 1, explains a collective failure: a GPU lost (NVML GPU_IS_LOST), an Xid whose catalog
  action is reset_gpu / reboot_node / check_cables / inspect_hardware, an InfiniBand outage longer
  than NCCL's IB retry window, an NVLink link down, a reboot of the node during the job;
- tier 2, may explain it or a slow job: hung NVML/tool calls, HW or thermal slowdown, a failed
  fabric probe, an SDC (canary/guard) failure, any other failure that needs an action;
- context, listed in the timeline only: warnings, application-class Xids (catalog action
  restart_app, e.g. Xid 13), IB outages NCCL retried through.

NCCL's IB retry window (NCCL User Guide, Environment Variables, NCCL_IB_TIMEOUT and
NCCL_IB_RETRY_CNT, docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html): each try waits
4.096 us x 2^NCCL_IB_TIMEOUT and "the total time spent waiting for a response is the product of
NCCL_IB_TIMEOUT and NCCL_IB_RETRY_CNT": 4.096 us x 2^T x RETRY_CNT. Defaults: NCCL_IB_RETRY_CNT 7;
NCCL_IB_TIMEOUT 18 up to NCCL 2.22 (7.5 s), 20 from 2.23 (30 s). Unknown NCCL version: the shorter
window (7.5 s), said as an assumption, so an outage between 7.5 and 30 s is a suspect only "if NCCL
< 2.23".

Times. Each node's events are on its own clock, the job's on the controller's (this host's): a node
whose clock runs ahead would put a fault that came seconds before the failure after it. Every node's
skew is measured when it answers (``NodeEvidence.clock_skew_s``); past SKEW_CORRECT_S its times are
moved onto this host's clock before anything is compared, and the verdict says so (``node_time``:
as the node recorded it).

A span, not a moment: a finding stands from its event to the end of the fault it raised. A fault
still open in the node's health state at the answer (the query API's ``open``, or one of
/api/v1/findings' faults) stands to now, so a fault raised before the job that was never cleared
was there for the whole run, however long ago its check last repeated it.

The onset window: a suspect explains *this* failure only if it came when the failure began. A
collective that hangs is given up one watchdog timeout after it was issued (``expected``); the fault
behind it came up to a step and a teardown before that (the collective is issued at the next step
after the fault; the job's end is stamped after its ranks are torn down), or at any moment up to the
failure itself (a rank that dies with its GPU ends the job at once). So the window is
[expected - ONSET_MARGIN_S, the job's end]. A fault before it is one the job ran on past: still a
suspect (a fault open during the job), still a culprit an epilog may drain (the node needs it), but
never said to have killed the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon.why.collect import NodeEvidence
from gpumon.why.flight import Flight
from gpumon.why.job import Job
from gpumon.why.joblog import JobLog

IB_TIMEOUT_DEFAULT_OLD = 18  # NCCL 2.14 .. 2.22
IB_TIMEOUT_DEFAULT_NEW = 20  # NCCL >= 2.23
IB_RETRY_CNT_DEFAULT = 7
NCCL_DEFAULTS_CHANGED = (2, 23, 0)
PYTORCH_WATCHDOG_DEFAULT_S = 600.0  # ProcessGroupNCCL's default timeout (PyTorch PR #110947)
# an event this long before the job's start is still read (the state the job started on)
LEAD_S = 3600.0
_HW_ACTIONS = frozenset({"reset_gpu", "reboot_node", "check_cables", "inspect_hardware"})
# A skew smaller than this is left as recorded: NTP keeps nodes within milliseconds of each other,
# and the measurement (the node's "now" against the middle of one request) is only good to half a
# round trip, so correcting less (or less than that error) would move times by the measurement's noise
SKEW_CORRECT_S = 1.0
# How long before the expected moment the fault behind a failure may have come (module docstring):
# the step between the fault and the next collective (seconds for a training step, more for an
# evaluation or a checkpoint) plus the teardown between the watchdog and the job's recorded end
# (Slurm's KillWait is 30 s by default)
ONSET_MARGIN_S = 120.0
# Tier-1 suspects that are the node's hardware (what an epilog may drain the node for). A reboot is
# tier 1 but not one of them: an operator's reboot, or a kernel panic of software, look the same.
HARDWARE_WHATS = frozenset({"gpu_lost", "xid", "ib_outage", "nvlink_down"})
# The node check that names the hung-collective signature (checks/collective_hang): a GPU at ~100 %
# utilization with little power, no memory activity and no PCIe traffic for a minute, the picture of
# a rank spinning in a collective that waits for another rank
HANG_CHECK = "collective_hang"
# A timeline item that is a hole in the evidence, not an event (the xid check could not read the
# kernel log): Xids in its span would not have been seen
MISSING = "missing_evidence"


def _version(text: str | None) -> tuple[int, int, int] | None:
    if not text:
        return None
    try:
        parts = [int(p) for p in text.split("+")[0].split(".")[:3]]
    except ValueError:
        return None
    padded = [*parts, 0, 0, 0]
    return padded[0], padded[1], padded[2]


@dataclass(frozen=True)
class NcclSettings:
    ib_timeout: int
    retry_cnt: int
    source: str  # where the numbers come from, in words

    @property
    def retry_window_s(self) -> float:
        return float(4.096e-6 * (2 ** self.ib_timeout) * self.retry_cnt)

    def to_json(self) -> dict[str, Any]:
        return {"NCCL_IB_TIMEOUT": self.ib_timeout, "NCCL_IB_RETRY_CNT": self.retry_cnt,
                "retry_window_s": round(self.retry_window_s, 3), "source": self.source}


def nccl_settings(env: Mapping[str, str], version: str | None) -> NcclSettings:
    """From the job's NCCL environment (``--nccl-env``, or what its log says NCCL read), else the
    defaults of its NCCL version, else the shorter of the documented defaults."""
    notes = []
    parsed = _version(version)
    if parsed is None:
        default_t = IB_TIMEOUT_DEFAULT_OLD
        default_note = ("NCCL version unknown: NCCL_IB_TIMEOUT assumed 18 (the default before NCCL 2.23, "
                        "the shorter window; 20 since 2.23)")
    elif parsed >= NCCL_DEFAULTS_CHANGED:
        default_t, default_note = IB_TIMEOUT_DEFAULT_NEW, f"NCCL {version}: default NCCL_IB_TIMEOUT 20"
    else:
        default_t, default_note = IB_TIMEOUT_DEFAULT_OLD, f"NCCL {version}: default NCCL_IB_TIMEOUT 18"

    def number(name: str) -> int | None:
        raw = env.get(name)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            notes.append(f"{name}={raw!r} not a number: ignored")
            return None

    t, r = number("NCCL_IB_TIMEOUT"), number("NCCL_IB_RETRY_CNT")
    notes.append(f"NCCL_IB_TIMEOUT={t} from the job's environment" if t is not None else default_note)
    notes.append(f"NCCL_IB_RETRY_CNT={r} from the job's environment" if r is not None
                 else "NCCL_IB_RETRY_CNT default 7")
    return NcclSettings(t if t is not None else default_t, r if r is not None else IB_RETRY_CNT_DEFAULT,
                        "; ".join(notes))


@dataclass
class Item:
    """One thing that happened on a node, placed on the job's timeline."""

    node: str
    time: float
    component: str
    check: str
    what: str  # a category: gpu_lost, xid, ib_outage, nvlink_down, reboot, hung_call, slowdown, ...
    tier: int  # 1, 2: a suspect; 3: context
    summary: str
    why: str = ""  # how it explains the failure (suspects)
    until: float | None = None  # the span's end (still open at the last reading: last_seen)
    evidence: dict[str, Any] = field(default_factory=dict)
    score: float = 0.0
    action: str | None = None  # the remedy the node's check named for it (gpumon's Action words)
    open: bool = False  # the fault it raised was still open at the node's answer
    node_time: float | None = None  # ``time`` as the node's clock said it, where that was corrected
    # whether it came in the onset window (Reasoner.onset); None: not judged (outside the job)
    in_onset: bool | None = None

    def to_json(self, end: float | None) -> dict[str, Any]:
        return {"node": self.node, "time": self.time,
                "relative_s": None if end is None else round(self.time - end, 1),
                "until": self.until, "open": self.open, "node_time": self.node_time,
                "in_onset_window": self.in_onset, "component": self.component, "check": self.check,
                "what": self.what, "tier": self.tier, "summary": self.summary, "why": self.why,
                "evidence": self.evidence, "action": self.action}


@dataclass
class Verdict:
    verdict: str  # infrastructure | no_infrastructure_evidence | inconclusive | cannot_answer
    job: Job
    end: float  # the failure (the job's end), or now for a running job
    expected: float  # end - watchdog timeout: where the cause is looked for first
    watchdog_s: float
    watchdog_source: str
    nccl: NcclSettings
    suspects: list[Item]
    timeline: list[Item]
    nodes: list[NodeEvidence]
    log: JobLog | None
    notes: list[str]
    flight: Flight | None = None  # the job's Flight Recorder dumps, when given
    onset: tuple[float, float] = (0.0, 0.0)  # the onset window (Reasoner.onset)
    # per node, seconds added to its times to put them on this host's clock (minus its skew)
    corrections: dict[str, float] = field(default_factory=dict)
    # spans of the job in which a node could not see what a suspect would be made of (its kernel
    # log unreadable): evidence of nothing, and so no "no infrastructure evidence" either
    gaps: list[Item] = field(default_factory=list)

    @property
    def unreachable(self) -> list[NodeEvidence]:
        return [n for n in self.nodes if not n.reachable]

    @property
    def culprits(self) -> list[Item]:
        """Per node, its best-ranked tier-1 *hardware* suspect: the nodes the evidence says are
        broken, best first. Empty unless the verdict is ``infrastructure`` (never on an inconclusive
        verdict, nor for a tier-2 "may explain it")."""
        if self.verdict != "infrastructure":
            return []
        out: dict[str, Item] = {}
        for s in self.suspects:
            if s.tier == 1 and s.what in HARDWARE_WHATS and s.action in _HW_ACTIONS:
                out.setdefault(s.node, s)
        return list(out.values())

    @property
    def at_onset(self) -> list[Item]:
        return [s for s in self.suspects if s.in_onset]

    @property
    def exit_code(self) -> int:
        return {"no_infrastructure_evidence": 0, "inconclusive": 1, "infrastructure": 2,
                "cannot_answer": 3}[self.verdict]


def _moved(times: Mapping[str, Any], keys: tuple[str, ...], d: float) -> dict[str, Any]:
    out = dict(times)
    for key in keys:
        if isinstance(out.get(key), (int, float)):
            out[key] = float(out[key]) + d
    return out


def _moved_evidence(evidence: Any, d: float) -> Any:
    """The evidence times the reasoning reads (an IB port's outages, a hang's start), moved by ``d``."""
    if not isinstance(evidence, Mapping):
        return evidence
    out = _moved(evidence, ("since",), d)
    if isinstance(out.get("recent_outages"), list):
        out["recent_outages"] = [_moved(r, ("start", "end"), d) if isinstance(r, Mapping) else r
                                 for r in out["recent_outages"]]
    return out


def on_our_clock(record: Mapping[str, Any], d: float) -> dict[str, Any]:
    """An event of the query API (or one of /findings' faults) with its times moved by ``d`` s:
    from the node's clock onto this host's."""
    if d == 0.0:
        return dict(record)
    out = _moved(record, ("time", "last_seen", "raised"), d)
    if "evidence" in out:
        out["evidence"] = _moved_evidence(out["evidence"], d)
    if isinstance(out.get("latest"), Mapping):
        latest = _moved(out["latest"], ("time",), d)
        if "evidence" in latest:
            latest["evidence"] = _moved_evidence(latest["evidence"], d)
        out["latest"] = latest
    return out


def _fault_event(fault: Mapping[str, Any]) -> dict[str, Any]:
    """The finding event an open fault of /findings stands for, from the fault itself (an older
    daemon's event window leaves out a fault raised before it and not repeated since)."""
    return {"id": fault.get("event_id"), "time": fault.get("raised"), "last_seen": fault.get("last_seen"),
            "kind": "finding", "check": fault.get("check"), "component": fault.get("component"),
            "severity": fault.get("severity"), "action": fault.get("reported_action") or fault.get("action"),
            "message": fault.get("message"), "evidence": fault.get("evidence") or {}, "open": True}


def _span(event: Mapping[str, Any]) -> tuple[float, float]:
    t = float(event.get("time") or 0.0)
    seen = event.get("last_seen")
    latest = event.get("latest") or {}
    ends = [t, float(seen) if isinstance(seen, (int, float)) else t]
    if isinstance(latest.get("time"), (int, float)):
        ends.append(float(latest["time"]))
    return t, max(ends)


def _evidences(event: Mapping[str, Any]) -> list[tuple[float, Mapping[str, Any]]]:
    """(time said, evidence) of what the event said at its transition and, refreshed, last."""
    out: list[tuple[float, Mapping[str, Any]]] = []
    if isinstance(event.get("evidence"), Mapping):
        out.append((float(event.get("time") or 0.0), event["evidence"]))
    latest = event.get("latest")
    if isinstance(latest, Mapping) and isinstance(latest.get("evidence"), Mapping):
        out.append((float(latest.get("time") or event.get("time") or 0.0), latest["evidence"]))
    return out


def _outages(events: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float | None, float]]]:
    """Per IB port, its outages (start, end or None if still down at the last reading, seconds down),
    merged from every event's evidence: the measured records and the one still open."""
    found: dict[str, dict[float, tuple[float, float | None, float]]] = {}
    for e in events:
        comp = str(e.get("component", ""))
        if e.get("check") != "ib" or not comp.startswith("ib/"):
            continue
        port = found.setdefault(comp, {})
        for said, ev in _evidences(e):
            for r in ev.get("recent_outages") or []:
                try:
                    start, end, down = float(r["start"]), r.get("end"), float(r.get("down_s") or 0.0)
                except (KeyError, TypeError, ValueError):
                    continue
                key = round(start)
                port[key] = (start, None if end is None else float(end), down)
            ongoing = ev.get("ongoing_outage_s")
            if isinstance(ongoing, (int, float)):
                start = said - float(ongoing)
                key = round(start)
                old = port.get(key)
                if old is None or (old[1] is None and old[2] < float(ongoing)):
                    port[key] = (start, None, float(ongoing))
    return {comp: _merge(sorted(v.values())) for comp, v in found.items() if v}


# An open outage's start is estimated from a reading (its time minus ``ongoing_outage_s``, rounded
# to 0.1 s) and the closed record's is measured: the same outage, seen twice, starts up to a
# sample interval or so apart
_SAME_OUTAGE_S = 2.0


def _merge(outages: list[tuple[float, float | None, float]]) -> list[tuple[float, float | None, float]]:
    """One entry per outage: of those starting within _SAME_OUTAGE_S, the closed record (its end
    and length are measured), else the longest still open."""
    out: list[tuple[float, float | None, float]] = []
    for o in outages:
        if out and o[0] - out[-1][0] <= _SAME_OUTAGE_S:
            prev = out[-1]
            if (o[1] is not None, o[2]) > (prev[1] is not None, prev[2]):
                out[-1] = o
            continue
        out.append(o)
    return out


def _fmt_s(s: float) -> str:
    sign = "-" if s < 0 else "+"
    s = abs(s)
    if s < 120:
        return f"{sign}{s:.0f} s"
    if s < 7200:
        return f"{sign}{s / 60:.1f} min"
    return f"{sign}{s / 3600:.1f} h"


class Reasoner:
    def __init__(self, job: Job, nodes: list[NodeEvidence], log: JobLog | None, nccl: NcclSettings,
                 *, now: float, watchdog_s: float | None = None, flight: Flight | None = None,
                 onset_margin_s: float = ONSET_MARGIN_S) -> None:
        self.job = job
        self.nodes = nodes
        self.log = log
        self.flight = flight
        self.nccl = nccl
        self.end = job.end if job.end is not None else now
        if watchdog_s is not None:
            self.watchdog_s, self.watchdog_source = watchdog_s, "--watchdog-timeout"
        elif log is not None and log.watchdog_timeout_s is not None:
            self.watchdog_s = log.watchdog_timeout_s
            self.watchdog_source = f"the job log ({log.path}: Timeout(ms)=)"
        elif flight is not None and flight.timeout_s is not None:
            self.watchdog_s = flight.timeout_s
            self.watchdog_source = f"the Flight Recorder dumps ({flight.path}: timeout_ms)"
        else:
            self.watchdog_s = PYTORCH_WATCHDOG_DEFAULT_S
            self.watchdog_source = "PyTorch ProcessGroupNCCL's default (10 min): no watchdog line in a log"
        self.expected = max(job.start, self.end - self.watchdog_s)
        self.onset_margin_s = onset_margin_s
        # the onset window (module docstring): from ONSET_MARGIN_S before the expected moment to
        # the failure (as the job's end is counted: to its resolution)
        self.onset = (self.expected - onset_margin_s, self.end + job.resolution_s)
        self.notes: list[str] = list(job.notes)
        # onto this host's clock: minus each node's measured skew, where it is past SKEW_CORRECT_S
        # and past what the measurement cannot tell from none
        self.corrections = {
            n.node: -n.clock_skew_s for n in nodes if n.reachable and n.clock_skew_s is not None
            and abs(n.clock_skew_s) > max(SKEW_CORRECT_S, n.clock_skew_error_s or 0.0)}

    # -- one node's history to items ------------------------------------------------------------

    def items(self, ev: NodeEvidence) -> list[Item]:
        """The node's history as timeline items, on this host's clock."""
        d = self.corrections.get(ev.node, 0.0)
        out = self._items(ev, d)
        if d:
            for item in out:
                item.node_time = item.time - d
        return out

    def _items(self, ev: NodeEvidence, d: float) -> list[Item]:
        out: list[Item] = []
        events = [on_our_clock(e, d) for e in ev.events]
        faults = [on_our_clock(f, d) for f in ev.faults]
        # what was open at the node's answer stands to now, whatever its last_seen says (an older
        # daemon does not say "open": its /findings faults do)
        open_ids = {f.get("event_id") for f in faults if f.get("event_id") is not None}
        by_id = {e.get("id"): e for e in events}
        for fault in faults:
            e = by_id.get(fault.get("event_id"))
            if e is None:
                events.append(_fault_event(fault))
                continue
            # an open fault's current words (from /findings) are fresher than the stored refresh
            e = dict(e)
            e["last_seen"] = max(float(e.get("last_seen") or 0.0), float(fault.get("last_seen") or 0.0))
            e["latest"] = {"time": fault.get("last_seen"), "message": fault.get("message"),
                           "evidence": fault.get("evidence") or {}}
            by_id[e.get("id")] = e
        events = [by_id.get(e.get("id"), e) if e.get("id") is not None else e for e in events]
        lost: set[str] = set()
        lost_first: dict[str, Item] = {}  # a loss an NVML check reported before any Xid said it
        for e in events:
            kind = e.get("kind")
            t, until = _span(e)
            still = bool(e.get("open")) or (e.get("id") is not None and e.get("id") in open_ids)
            if still:
                until = max(until, self.end)
            if kind == "boot":
                if not self.job.start <= t <= self.end + self.job.resolution_s:
                    continue
                ident = ev.identity or {}
                booted = ident.get("boot_time")
                if (e.get("boot_id") and e.get("boot_id") == ident.get("boot_id")
                        and isinstance(booted, (int, float)) and booted + d < self.job.start):
                    # the daemon (re)started during the job and first saw a boot older than the
                    # job: no reboot, only a gap in what the node recorded before
                    out.append(Item(ev.node, t, "node", "", "daemon_start", 3,
                                    "gpumon's daemon started on the node (no reboot: the node booted "
                                    "before the job)"))
                    continue
                out.append(Item(ev.node, t, "node", "", "reboot", 1,
                                "the daemon saw a new boot of the node",
                                "a node that reboots takes every rank on it down"))
                continue
            if kind != "finding":
                continue
            sev, action = e.get("severity"), e.get("action")
            if sev in ("ok", "skipped", None) and e.get("check") != "ib":
                continue
            comp, check = str(e.get("component", "")), str(e.get("check", ""))
            evidence: Mapping[str, Any] = e.get("evidence") or {}
            message = str((e.get("latest") or {}).get("message") or e.get("message") or "")
            base: dict[str, Any] = {"node": ev.node, "time": t, "component": comp, "check": check,
                                    "until": until, "open": still}
            if check == "ib" and comp.startswith("ib/"):
                continue  # outages are read from every ib event together, below
            if check == "xid":
                code = evidence.get("code")
                if code is None and comp == "node" and sev != "fail":
                    # the check's own state, not an Xid (an Xid it could not pin on a GPU is on the
                    # node too, but with its code): it could not read the kernel log, or lost records
                    # of it, so an Xid in this span would not have been seen
                    out.append(Item(**base, what=MISSING, tier=3, summary=f"Xids not seen: {message}",
                                    why="the xid check could not read the node's kernel log: missing "
                                        "evidence on this node, not an application fault"))
                elif action in _HW_ACTIONS and sev == "fail":
                    if evidence.get("gpu_lost"):
                        # the loss (Xid 79) the NVML checks report too, each at its next run: they
                        # are this fault seen later, not a loss of their own that began then
                        lost.add(comp)
                        seen = lost_first.pop(comp, None)
                        if seen is not None:
                            # an NVML check saw the loss before the xid check read its Xid (a kernel
                            # log read late, a busy node): one fault, named by its Xid, from when it
                            # was first seen
                            out[:] = [i for i in out if i is not seen]
                            base["time"] = min(t, seen.time)
                    out.append(Item(**base, what="xid", tier=1, summary=message,
                                    why=f"Xid {code}: gpumon's Xid catalog says {action}: the GPU's work "
                                        "(the rank's kernels) is lost or stalled",
                                    evidence={"code": code, "action": action}, action=action))
                else:
                    out.append(Item(**base, what="xid", tier=3, summary=message,
                                    why=f"Xid {code}: catalog action {action}: usually the application's "
                                        "own fault (points at the job, not the node)",
                                    evidence={"code": code, "action": action}))
            elif evidence.get("gpu_lost"):
                if comp in lost:
                    continue  # every NVML check reports the same loss: the first one says it
                lost.add(comp)
                lost_first[comp] = Item(
                    **base, what="gpu_lost", tier=1, summary=f"{comp} lost: {message}",
                    why="a GPU that fell off the bus stops its rank inside the collective; the others wait "
                        "for it until the watchdog fires",
                    action=action if action in _HW_ACTIONS else "reboot_node")
                out.append(lost_first[comp])
            elif "hung_in" in evidence:
                out.append(Item(**base, what="hung_call", tier=2 if sev == "fail" else 3, summary=message,
                                why="a driver or tool call that does not return on the node: the GPU or "
                                    "driver may have stopped answering the job too"))
            elif check == "nvlink" and comp.startswith("nvlink/") and sev == "fail":
                out.append(Item(**base, what="nvlink_down", tier=1, summary=message,
                                why="a collective's NVLink traffic over a lane that is down stalls or fails",
                                action=action if action in _HW_ACTIONS else "reboot_node"))
            elif check == HANG_CHECK and sev == "warn":
                out.append(Item(**base, what="hang_signature", tier=3, summary=message,
                                why="this GPU spun in a collective that did not complete: its rank waited "
                                    "for another",
                                evidence={"since": evidence.get("since"), "held_s": evidence.get("held_s")}))
            elif check in ("throttle", "thermal") and sev in ("fail", "warn"):
                out.append(Item(**base, what="slowdown", tier=2 if sev == "fail" else 3, summary=message,
                                why="a GPU held at low clocks makes its rank the slowest: every collective "
                                    "waits for it (a slow job; a hang only if extreme)"))
            elif check == "fabric" and sev == "fail":
                out.append(Item(**base, what="fabric_probe", tier=2, summary=message,
                                why="gpumon's fabric probe found this node's links below par"))
            elif check in ("guard", "sdc_canary") and sev == "fail":
                out.append(Item(**base, what="sdc", tier=2, summary=message,
                                why="silent data corruption on this GPU: wrong numbers (a loss spike or NaN "
                                    "that stops the job), not a hang"))
            elif sev == "fail" and action in _HW_ACTIONS:
                out.append(Item(**base, what="hardware", tier=2, summary=message,
                                why=f"a failure the node's check says needs {action}"))
            elif sev in ("warn", "fail"):
                out.append(Item(**base, what="warning", tier=3, summary=message))
        for port, outages in _outages(events).items():
            for start, end, down in outages:
                stop = end if end is not None else start + down
                long = down > self.nccl.retry_window_s
                ongoing = " (still down at the last reading)" if end is None else ""
                summary = f"{port} down {down:.1f} s{ongoing}"
                window = f"{self.nccl.retry_window_s:.2f} s"
                if long:
                    why = (f"down {down:.1f} s, longer than NCCL's IB retry window of {window} "
                           f"(NCCL_IB_TIMEOUT={self.nccl.ib_timeout}, "
                           f"NCCL_IB_RETRY_CNT={self.nccl.retry_cnt}): "
                           "the queue pair errors out (retry exceeded) and the collective on this rail "
                           "never completes")
                else:
                    why = (f"down {down:.1f} s, within NCCL's IB retry window of {window}: NCCL "
                           "retried through it")
                # the ib check's remedy for a port that goes down (its outage findings say so)
                out.append(Item(ev.node, start, port, "ib", "ib_outage", 1 if long else 3, summary, why,
                                until=stop, evidence={"start": start, "end": end, "down_s": down,
                                                      "retry_window_s": round(self.nccl.retry_window_s, 3)},
                                action="check_cables"))
        if ev.identity is not None:
            boot = ev.identity.get("boot_time")
            boot_at = None if not isinstance(boot, (int, float)) else float(boot) + d
            if boot_at is not None and self.job.start < boot_at <= self.end + self.job.resolution_s \
                    and not any(i.what == "reboot" for i in out):
                out.append(Item(ev.node, boot_at, "node", "", "reboot", 1,
                                "the node booted during the job (its current boot time)",
                                "a node that reboots takes every rank on it down"))
        return out

    # -- the judgement --------------------------------------------------------------------------

    def _in_job(self, item: Item) -> bool:
        until = item.until if item.until is not None else item.time
        return item.time <= self.end + self.job.resolution_s and until >= self.job.start

    def _mattered(self, item: Item) -> float:
        """When it began to matter to the job: an outage when it outlasted the retry window,
        anything else when raised; a fault raised before the job (and open) from the job's start."""
        t = item.time
        if item.what == "ib_outage":
            t = item.time + self.nccl.retry_window_s
        return max(t, self.job.start)

    def _score(self, item: Item) -> float:
        d = abs(self._mattered(item) - self.expected)
        return 1.0 / (1.0 + d / max(self.watchdog_s, 1.0))

    def _in_onset(self, item: Item) -> bool:
        return self.onset[0] <= self._mattered(item) <= self.onset[1]

    def judge(self) -> Verdict:
        timeline: list[Item] = []
        for ev in self.nodes:
            if ev.reachable:
                timeline += self.items(ev)
        timeline.sort(key=lambda i: (i.time, i.node, i.component))
        for i in timeline:
            if self._in_job(i):
                i.in_onset = self._in_onset(i)
        suspects = [i for i in timeline if i.tier <= 2 and i.in_onset is not None]
        for s in suspects:
            s.score = self._score(s)
        # within a tier, what came in the onset window first: a fault the job ran on past did not
        # set off its failure
        suspects.sort(key=lambda i: (i.tier, not i.in_onset, -i.score, i.time))
        self._corroborate(suspects)
        waited = self._hang_signature(timeline, suspects)
        if self._flight_recorder(suspects) or waited:
            # a suspect on the node of a rank that never entered the stuck collective, or that the
            # others' GPUs were seen waiting for, explains more
            suspects.sort(key=lambda i: (i.tier, "flight_recorder" not in i.evidence
                                         and "hang_signature" not in i.evidence, not i.in_onset, -i.score,
                                         i.time))
        gaps = [i for i in timeline if i.what == MISSING and i.in_onset is not None]
        reachable = [n for n in self.nodes if n.reachable]
        unreachable = [n for n in self.nodes if not n.reachable]
        for n in self.nodes:
            self.notes += [f"{n.node}: {note}" for note in n.notes]
        for n in reachable:
            if n.truncated:
                self.notes.append(f"{n.node}: more events in the window than read (truncated)")
            d = self.corrections.get(n.node, 0.0)
            if n.history_from is not None and n.history_from + d > self.job.start:
                self.notes.append(f"{n.node}: its health history starts at "
                                  f"{_fmt_s(n.history_from + d - self.end)} from the failure, after the "
                                  "job's start (older events were folded away, or the daemon was not "
                                  "running)")
            if d:
                self.notes.append(f"{n.node}: its clock is {-d:+.1f} s off this host's (measured when it "
                                  f"answered): its times are corrected by {d:+.1f} s before they are "
                                  "compared with the job's (node_time: as the node recorded them)")
            ident = (n.identity or {}).get("node")
            if ident and ident != n.node and ident.split(".")[0] != n.node.split(".")[0]:
                self.notes.append(f"{n.node}: the API at {n.url} answers as node {ident!r} (wrong URL?)")
        for g in gaps:
            until = ("still so at its answer" if g.open
                     else f"to {_fmt_s((g.until or g.time) - self.end)}")
            self.notes.append(f"{g.node}: missing evidence from {_fmt_s(g.time - self.end)} from the "
                              f"failure, {until}: {g.summary}; an Xid on {g.node} then would not have "
                              "been seen")
        if unreachable:
            self.notes.append(f"{len(unreachable)} of {len(self.nodes)} nodes did not answer: their history "
                              "is unknown, so the verdict is of the others only (lower confidence)")
        if not reachable:
            verdict = "cannot_answer"
        elif suspects:
            verdict = "infrastructure"
        elif unreachable or gaps:
            # a node's history with a hole in it is partly unknown, as a node that did not answer is
            verdict = "inconclusive"
        else:
            verdict = "no_infrastructure_evidence"
        if self.job.failed is False and verdict == "infrastructure":
            self.notes.append("the job did not fail: the suspects may explain a slow run, not a failure")
        if suspects and not any(s.in_onset for s in suspects):
            self.notes.append(f"no suspect came in the onset window ({_fmt_s(self.onset[0] - self.end)} "
                              f"to {_fmt_s(self.onset[1] - self.end)} from the failure): the suspects are "
                              "faults the job ran on past; what set off its failure was not recorded")
        return Verdict(verdict, self.job, self.end, self.expected, self.watchdog_s, self.watchdog_source,
                       self.nccl, suspects, timeline, self.nodes, self.log, self.notes, self.flight,
                       self.onset, dict(self.corrections), gaps)

    def _corroborate(self, suspects: list[Item]) -> None:
        """The job log's "connection closed by remote peer X": a rank on X went away. Said with a
        suspect on that node; on its own it is a note (a crashed process looks the same)."""
        if self.log is None:
            return
        for peer, n in self.log.peers_closed.items():
            short = peer.split(".")[0]
            names = [ev.node for ev in self.nodes if ev.node == peer or ev.node.split(".")[0] == short]
            hits = [s for s in suspects if s.node in names]
            for s in hits:
                s.why += f"; the job log has {n} line(s) 'Connection closed by remote peer {peer}'"
            if not hits:
                self.notes.append(f"the job log says the remote peer {peer} closed its connections "
                                  f"({n} line(s)): a rank there went away; no infrastructure event on it "
                                  "explains that")


    def _hang_signature(self, timeline: list[Item], suspects: list[Item]) -> bool:
        """The hung-collective signature across the job's nodes (issue 20): the GPUs of ranks that
        wait in a collective spin at ~100 % utilization drawing little power; the rank they wait for
        does not. A node whose check watched for it (``NodeEvidence.judging``) and did not show it
        while others did is where the collective waited: evidence *on* a suspect of that node, and
        never a suspect of its own, for the reason the Flight Recorder's missing ranks are not (the
        rank that is late is as often the job's own code: a checkpoint write, a data loader, a
        rank-dependent path). Returns whether a suspect was corroborated."""
        shown: dict[str, list[Item]] = {}
        for item in timeline:
            if item.what == "hang_signature" and self._in_job(item):
                shown.setdefault(item.node, []).append(item)
        if not shown:
            return False
        reachable = [n for n in self.nodes if n.reachable]
        quiet = [n for n in reachable
                 if n.node not in shown and n.judging is not None and HANG_CHECK in n.judging]
        unknown = [n.node for n in reachable if n.node not in shown and n not in quiet]

        def began(items: list[Item]) -> float:
            return min(float(i.evidence.get("since") or i.time) for i in items)

        first = min(began(items) for items in shown.values())
        gpus = sum(len({i.component for i in items}) for items in shown.values())
        seen = (f"the hung-collective signature (GPUs at ~100 % utilization drawing little power, no memory "
                f"or PCIe traffic) showed on {', '.join(sorted(shown))} ({gpus} GPU(s), from "
                f"{_fmt_s(first - self.end)})")
        if unknown:
            self.notes.append(f"{', '.join(sorted(unknown))}: not known whether the hung-collective "
                              f"signature showed there (its {HANG_CHECK} check did not judge the node at the "
                              "last reading)")
        if not quiet:
            gone = [n.node for n in self.nodes if not n.reachable]
            if gone:
                self.notes.append(f"{seen}, on every node that answered: the job may have waited for "
                                  f"{', '.join(gone)}, which did not")
            elif not unknown:
                self.notes.append(f"{seen}, on every node: a collective no rank could complete; nothing "
                                  "here says which rank it waited for")
            return False
        corroborated = False
        for n in quiet:
            words = f"{seen}, not on {n.node}: the job's collectives waited for {n.node}"
            hits = [s for s in suspects if s.node == n.node]
            for s in hits:
                s.why += f"; {words}"
                s.evidence["hang_signature"] = {"shown_on": sorted(shown), "gpus": gpus, "since": first}
                corroborated = True
            if not hits:
                self.notes.append(f"{words}; no infrastructure event recorded on {n.node} explains it: look "
                                  "at what its rank(s) were doing then (their log, their stacks)")
        return corroborated

    def _node_of(self, host: str) -> NodeEvidence | None:
        short = host.split(".")[0]
        return next((ev for ev in self.nodes if ev.node == host or ev.node.split(".")[0] == short), None)

    def _flight_recorder(self, suspects: list[Item]) -> bool:
        """The Flight Recorder's ranks that never entered the stuck collective: evidence *on* a
        suspect of their node (it says which rank stopped, not why), never a suspect of its own: a
        rank that does not enter a collective is as often the job's own code (a rank-dependent path,
        a data loader, a deadlock) as its node. Without a suspect there, a note that says where to
        look. Returns whether a suspect was corroborated."""
        if self.flight is None:
            return False
        corroborated = False
        for g in self.flight.groups:
            if g.created is not None and not self.job.start - 60.0 <= g.created <= self.end + 60.0:
                self.notes.append(f"Flight Recorder: process group {g.label}'s {g.op} #{g.seq} was enqueued "
                                  f"{_fmt_s(g.created - self.end)} from the failure, outside the job's run: "
                                  "dumps of another job or run?")
        for f in self.flight.findings():
            if f.kind == "no_dump":
                self.notes.append(f"Flight Recorder: {f.words}")
                continue
            if f.kind == "mismatch":
                self.notes.append(f"Flight Recorder: {f.words}")
                continue
            if f.host is None:
                self.notes.append(f"Flight Recorder: {f.words}; the dumps do not say which node it ran on "
                                  "(keep each node's dumps in a folder named after it)")
                continue
            ev = self._node_of(f.host)
            if ev is None:
                self.notes.append(f"Flight Recorder: {f.words}; {f.host} is not one of the job's nodes")
                continue
            if not ev.reachable:
                self.notes.append(f"Flight Recorder: {f.words}; {ev.node} did not answer: its health "
                                  "history is unknown")
                continue
            hits = [s for s in suspects if s.node == ev.node]
            for s in hits:
                s.why += f"; the Flight Recorder says {f.words}"
                s.evidence.setdefault("flight_recorder", []).append(f.words)
                corroborated = True
            if not hits:
                self.notes.append(f"Flight Recorder: {f.words}; no infrastructure event recorded on "
                                  f"{ev.node} explains it: look at what that rank was doing (its own log, "
                                  "its stack)")
        return corroborated


def relative(t: float, end: float) -> str:
    return _fmt_s(t - end)
