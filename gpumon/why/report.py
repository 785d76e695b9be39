"""The verdict for people (a table) and for programs (``--json``, schema ``gpumon.why/v1``).

JSON (a contract documented in docs/postmortem/why.md): ``schema``, ``verdict``
(``infrastructure`` | ``no_infrastructure_evidence`` | ``inconclusive`` | ``cannot_answer``),
``exit_code``, ``job``, ``failure_time``, ``expected_cause_time``, ``watchdog_timeout_s`` and its
``watchdog_source``, ``nccl`` (the IB retry window used), ``suspects`` (ranked, best first),
``timeline`` (everything read, suspects and context, oldest first), ``nodes`` (each node's
reachability and what it answered), ``unreachable`` (names), ``log`` (what the job log said),
``notes`` (what limits the verdict), ``flight_recorder`` (what the job's Flight Recorder dumps
say, or null: ``gpumon.why.flight.Flight.to_json``), ``culprits`` (the nodes whose tier-1 hardware suspect an
epilog may drain, with gpumon's drain reason) and ``admin_comment`` (one bounded line for Slurm),
``onset_window`` (where a cause of this failure may lie), ``clock_corrections`` (the nodes whose
times were moved onto this host's clock) and ``missing_evidence`` (spans a node could not see).

A suspect before the onset window is a fault the job ran on past: its drain reason and the
AdminComment say so, and never that it failed the job.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from rich.console import Console

from gpumon.model import Action
from gpumon.remediate.slurm import drain_reason
from gpumon.report import print_records
from gpumon.why.reason import Item, Verdict, relative

SCHEMA = "gpumon.why/v1"
# A Slurm job's AdminComment: sacct and scontrol show it whole, but it is one line in a database
# row: the verdict and the first suspects, not the report
ADMIN_COMMENT_BYTES = 400

_HEADLINE = {
    "infrastructure": "infrastructure suspect(s) found",
    "infrastructure_before_onset": "infrastructure suspect(s) found, none in the onset window: faults "
                                   "the job ran on past, not what set off its failure",
    "inconclusive_gaps": "no infrastructure evidence recorded, but not every node could see it: evidence "
                         "is missing during the job (see missing_evidence)",
    "no_infrastructure_evidence": "no infrastructure evidence: every node answered and none recorded a "
                                  "fault that explains the failure (look at the application)",
    "inconclusive": "no infrastructure evidence on the nodes that answered, but not every node answered",
    "cannot_answer": "cannot answer: no node's history could be read",
}


def _headline(v: Verdict) -> str:
    if v.verdict == "infrastructure" and not v.at_onset:
        return _HEADLINE["infrastructure_before_onset"]
    if v.verdict == "inconclusive" and not v.unreachable and v.gaps:
        return _HEADLINE["inconclusive_gaps"]
    return _HEADLINE[v.verdict]


def to_json(v: Verdict) -> dict[str, Any]:
    return {"schema": SCHEMA, "verdict": v.verdict, "exit_code": v.exit_code, "summary": _headline(v),
            "job": v.job.to_json(), "failure_time": v.end, "expected_cause_time": v.expected,
            "watchdog_timeout_s": v.watchdog_s, "watchdog_source": v.watchdog_source,
            "nccl": v.nccl.to_json(),
            "suspects": [dict(s.to_json(v.end), rank=i + 1, score=round(s.score, 3))
                         for i, s in enumerate(v.suspects)],
            "timeline": [i.to_json(v.end) for i in v.timeline],
            "nodes": [n.to_json() for n in v.nodes],
            "unreachable": [n.node for n in v.unreachable],
            "log": None if v.log is None else v.log.to_json(),
            "flight_recorder": None if v.flight is None else v.flight.to_json(),
            "notes": list(v.notes),
            "onset_window": {"from": v.onset[0], "to": v.onset[1],
                             "from_relative_s": round(v.onset[0] - v.end, 1),
                             "to_relative_s": round(v.onset[1] - v.end, 1)},
            "clock_corrections": [{"node": node, "clock_skew_s": round(-d, 3), "corrected_by_s": round(d, 3)}
                                  for node, d in v.corrections.items()],
            "missing_evidence": [g.to_json(v.end) for g in v.gaps],
            "culprits": [{"node": c.node, "component": c.component, "what": c.what, "action": c.action,
                          "relative_s": round(c.time - v.end, 1), "in_onset_window": bool(c.in_onset),
                          "drain_reason": drain_reason(Action(c.action), _drain_words(v, c))}
                         for c in v.culprits if c.action is not None],
            "admin_comment": admin_comment(v)}


def _drain_words(v: Verdict, c: Item) -> str:
    """What the epilog's drain reason says after ``gpumon: <action>:``. A culprit in the onset
    window is why the job failed ("why job N"); one before it is a fault the node had during the
    job, which the job ran on past: the node is drained for it, not for the job."""
    what = c.summary if c.summary.startswith(c.component) else f"{c.component}: {c.summary}"
    job = f"job {v.job.id}" if v.job.id else "the job"
    if not c.in_onset:
        return f"during {job}, not at its failure ({relative(c.time, v.end)}): {what}"
    return f"why {job}: {what}" if v.job.id else f"why: {what}"


def _outside(s: Item) -> str:
    return "" if s.in_onset else ", before the onset window"


def _bounded(text: str, limit: int) -> str:
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    raw = flat.encode()
    if len(raw) <= limit:
        return flat
    return raw[: limit - 3].decode("utf-8", errors="ignore").rstrip() + "..."


def admin_comment(v: Verdict) -> str:
    """One line, at most ADMIN_COMMENT_BYTES of UTF-8: the verdict, the ranked suspects (node,
    component, when relative to the failure, what) and the unreachable nodes."""
    head = {"infrastructure": "infrastructure", "no_infrastructure_evidence":
            "no infrastructure evidence (look at the application)",
            "inconclusive": "inconclusive (no suspect on the nodes that answered)",
            "cannot_answer": "cannot answer (no node's history could be read)"}[v.verdict]
    if v.verdict == "infrastructure" and not v.at_onset:
        head = "infrastructure, none at the failure's onset (faults the job ran on past)"
    parts = [f"gpumon why: {head}"]
    for i, s in enumerate(v.suspects[:3]):
        parts.append(f"#{i + 1} {s.node} {s.component} {relative(s.time, v.end)}{_outside(s)}: {s.summary}")
    if len(v.suspects) > 3:
        parts.append(f"+{len(v.suspects) - 3} more suspects")
    if v.unreachable:
        parts.append("unreachable: " + ",".join(n.node for n in v.unreachable))
    gaps = sorted({g.node for g in v.gaps})
    if gaps:
        parts.append("missing evidence (Xids not seen): " + ",".join(gaps))
    return _bounded("; ".join(parts), ADMIN_COMMENT_BYTES)


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def print_verdict(v: Verdict, console: Console) -> None:
    job = v.job
    name = f"job {job.id}" if job.id else "job"
    state = f", {job.state} (exit {job.exit_code})" if job.state else ""
    console.print(f"{name}: {len(job.nodes)} node(s), {_utc(job.start)} .. "
                  f"{_utc(job.end) if job.end is not None else 'still running'}{state} [{job.source}]",
                  markup=False)
    console.print(f"failure at {_utc(v.end)}; cause expected about {relative(v.expected, v.end)} "
                  f"(watchdog timeout {v.watchdog_s:g} s: {v.watchdog_source}); onset window "
                  f"{relative(v.onset[0], v.end)} to {relative(v.onset[1], v.end)}", markup=False)
    for node, d in v.corrections.items():
        console.print(f"clock: {node}'s times corrected by {d:+.1f} s (its clock is {-d:+.1f} s off this "
                      "host's)", markup=False)
    console.print(f"NCCL IB retry window {v.nccl.retry_window_s:.2f} s ({v.nccl.source})", markup=False)
    if v.log is not None and v.log.stuck is not None:
        s = v.log.stuck
        ranks = ",".join(str(r) for r in sorted({t.rank for t in v.log.timeouts if t.rank is not None}))
        console.print(f"job log: watchdog timed out {s.op} SeqNum={s.seq} after {s.ran_ms} ms "
                      f"(Timeout(ms)={s.timeout_ms}) on rank(s) {ranks or '?'}", markup=False)
    if v.flight is not None:
        _print_flight(v, console)
    console.print(f"verdict: {_headline(v)}", markup=False)
    if v.suspects:
        rows = [((str(i + 1), s.node, s.component, s.what, relative(s.time, v.end) + _outside(s)),
                 [s.summary, s.why]) for i, s in enumerate(v.suspects)]
        print_records(console, ("#", "node", "component", "event", "at", "why it explains the failure"), rows)
    for n in v.unreachable:
        console.print(f"UNREACHABLE {n.node} ({n.url}): {n.error}", markup=False)
    context = [i for i in v.timeline if i.tier > 2]
    if context:
        console.print(f"context ({len(context)}, not suspects):", markup=False)
        for i in context[-20:]:
            console.print(f"  {relative(i.time, v.end):>10} {i.node} {i.component} {i.summary}", markup=False)
    for note in v.notes:
        console.print(f"note: {note}", markup=False)


def _print_flight(v: Verdict, console: Console) -> None:
    f = v.flight
    assert f is not None
    bad = f"; {len(f.errors)} file(s) not read" if f.errors else ""
    console.print(f"flight recorder: {len(f.dumps)} rank dump(s) read from {f.path}{bad}", markup=False)
    for name, why in f.errors.items():
        console.print(f"  not read {name}: {why}", markup=False)
    for g in f.groups:
        when = f", enqueued {relative(g.created, v.end)}" if g.created is not None else ""
        console.print(f"  process group {g.label}: stuck at {g.op} #{g.seq}{when}; entered by rank(s) "
                      f"{','.join(map(str, g.entered)) or 'none'}", markup=False)
    for finding in f.findings():
        console.print(f"  {finding.words}", markup=False)
    if f.pytorch.get("used"):
        said = "; ".join(f"#{x['seq']} {x['op']} missing {x['missing_ranks']} "
                         f"mismatched {x['mismatched_ranks']}"
                         for x in f.pytorch.get("findings", [])) or "nothing amiss"
        console.print(f"  PyTorch's analyzer ({f.pytorch.get('torch')}): {said}", markup=False)
    elif f.pytorch:
        console.print(f"  PyTorch's analyzer not used: {f.pytorch.get('why')}", markup=False)
    for note in f.notes:
        console.print(f"  note: {note}", markup=False)
