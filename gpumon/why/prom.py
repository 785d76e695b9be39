"""The evidence from Prometheus (``gpumon why --prometheus URL``): for nodes that are gone.

A node that died, was reimaged or is unreachable still has its exporter's series in Prometheus for
the server's retention. This asks the server's HTTP API (``/api/v1/query_range``) for the series
gpumon exports, for the job's nodes and window, and turns them into the events the node's query API
would have served (:class:`gpumon.why.collect.NodeEvidence`), so the same Reasoner judges them:

- ``gpumon_finding_severity{check,component}`` at warn (3) or fail (4): one finding event per run
  of one level, from the first step that saw it to the last, with the component's
  ``gpumon_recommended_action`` of that time as its action (the component's, i.e. its worst open
  fault's: the finding's own is not exported), the Xid code whose ``gpumon_xid_events_total`` rose
  nearest that time for an xid finding, and ``hung_in`` for a node finding of a check whose
  ``gpumon_check_outcome`` was hung or still-hung;
- ``gpumon_ib_downtime_seconds{component="ib/<dev>/<port>"}`` rising: an outage, its length the
  rise of the downtime (the ib check's own timing, exact to its 1 s sampling whatever the scrape
  interval), its start the step it was first seen at minus what it had already lasted (down at the
  node's first sample: timed from its start if ``gpumon_ib_outages`` says it is the only one in the
  check's window, else from that sample, a lower bound); still rising at the node's last sample:
  still down at the last reading; two rises less than a step apart are one outage;
- ``gpumon_build_info``: that the node was scraped at all (first and last sample, its ``node`` label
  as the identity), ``gpumon_health_state{component="node"}``: its state at the last sample;
- ``gpumon_gpu_collective_hang``: its series present, the node was watched for the hung-collective
  signature (``NodeEvidence.judging``; a collective_hang warn finding says when it showed).

What it cannot know: Prometheus holds samples every scrape interval, so every time is known to one
step (``--prometheus-step``, the scrape interval by default 30 s, gpumon's shipped scrape config's):
a fault raised and cleared between two scrapes is not seen (an IB outage is: the ib check's
downtime keeps it for 24 h), and only what gpumon exports is there: no finding's words or evidence,
no reboot (gpumon exports no boot time), no GPU-lost flag (a lost GPU shows as failing checks on
it), nothing older than the server's retention. A node with no series in the window is kept, as
"no data in Prometheus", never dropped.

Nodes are told apart by a target label (``--prometheus-node-label``, default ``instance``: gpumon's
scrape config for systemd hosts and its ServiceMonitor both set it to the node's name, without the
port); a label value matches a node if it is the node's name, optionally followed by ``.domain``
and ``:port``.
"""

from __future__ import annotations

import argparse
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpumon.errors import ConfigError
from gpumon.why.collect import Access, NodeEvidence, Unanswered, read_json

DEFAULT_STEP_S = 30.0  # the scrape interval of config/prometheus/gpumon-scrape.yaml and the ServiceMonitor
DEFAULT_NODE_LABEL = "instance"
MAX_POINTS = 10_000  # per series and query (Prometheus refuses more than 11,000)
SEVERITY = {3: "warn", 4: "fail"}
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class PromAccess:
    url: str
    node_label: str = DEFAULT_NODE_LABEL
    step_s: float = DEFAULT_STEP_S
    timeout_s: float = 30.0
    user: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def _access(self) -> Access:
        return Access(self.url, {}, self.user, self.password, self.cafile, self.certfile, self.keyfile)


class PromError(Exception):
    """Prometheus did not answer, or not as its HTTP API does."""


Series = tuple[dict[str, str], list[tuple[float, float]]]


def _post(access: PromAccess, path: str, form: Mapping[str, str], deadline: float) -> Any:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PromError(f"no answer within {access.timeout_s:g} s")
    base = access.url.rstrip("/")
    via = access._access()
    headers = via.headers()
    headers["Content-Type"] = "application/x-www-form-urlencoded"
    req = urllib.request.Request(base + path, data=urllib.parse.urlencode(form).encode(), headers=headers,
                                 method="POST")
    ctx = via.ssl_context() if base.startswith("https:") else None
    try:
        doc = read_json(req, left, ctx, auth_hint="--prometheus-user/--prometheus-password-file",
                        timed_out=f"no answer within {access.timeout_s:g} s",
                        not_json="the answer is not JSON (is this a Prometheus server's URL?)")
    except Unanswered as exc:
        raise PromError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("status") != "success" or "data" not in doc:
        raise PromError("the answer is not a Prometheus API success: " + str(doc)[:200])
    return doc["data"]


def _string(text: str) -> str:
    """A PromQL double-quoted string literal (Go escapes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(nodes: Sequence[str], label: str) -> str:
    """``label`` matching each node's name, optionally with a domain and a port (RE2, anchored)."""
    pattern = "(" + "|".join(re.escape(n) for n in nodes) + r")(\..+)?(:[0-9]+)?"
    return f"{label}=~{_string(pattern)}"


def node_of(value: str, nodes: Sequence[str]) -> str | None:
    host = value.rsplit(":", 1)[0] if re.search(r":[0-9]+$", value) else value
    for n in nodes:
        if host == n or host.startswith(n + "."):
            return n
    return None


def query_range(access: PromAccess, expr: str, start: float, end: float, step: float,
                deadline: float) -> list[Series]:
    data = _post(access, "/api/v1/query_range",
                 {"query": expr, "start": repr(start), "end": repr(end), "step": f"{step:.3f}"}, deadline)
    if data.get("resultType") != "matrix":
        raise PromError(f"query_range answered a {data.get('resultType')}, not a matrix")
    out: list[Series] = []
    for s in data.get("result") or []:
        points = []
        for t, v in s.get("values") or []:
            value = float(v)
            if not math.isnan(value):
                points.append((float(t), value))
        out.append((dict(s.get("metric") or {}), points))
    return out


@dataclass
class _Node:
    node: str
    instance: str = ""
    first: float | None = None
    last: float | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    state: str | None = None
    severity: list[Series] = field(default_factory=list)
    actions: list[Series] = field(default_factory=list)
    hung: list[Series] = field(default_factory=list)
    xids: list[Series] = field(default_factory=list)
    downtime: list[Series] = field(default_factory=list)
    outages: dict[str, dict[float, float]] = field(default_factory=dict)  # component -> time -> count
    # checks whose per-GPU series Prometheus holds for the node (they ran and judged it)
    judging: set[str] = field(default_factory=set)


def _runs(points: list[tuple[float, float]], step: float) -> list[tuple[float, float, float]]:
    """(first, last, value) of each run of one value on consecutive steps."""
    out: list[tuple[float, float, float]] = []
    for t, v in points:
        if out and v == out[-1][2] and t - out[-1][1] <= step * 1.5:
            out[-1] = (out[-1][0], t, v)
        else:
            out.append((t, t, v))
    return out


def _overlaps(series: Series, lo: float, hi: float) -> bool:
    return any(lo <= t <= hi for t, _ in series[1])


def _xid_code(n: _Node, component: str, t: float, step: float) -> int | None:
    """The code whose counter rose nearest ``t`` on the component (a series that appears counts
    as a rise: it is exported from the first Xid since boot)."""
    best: tuple[float, int] | None = None
    for labels, points in n.xids:
        if labels.get("component") != component:
            continue
        try:
            code = int(labels.get("code", ""))
        except ValueError:
            continue
        prev: tuple[float, float] | None = None
        for pt, pv in points:
            rose = prev is None or pv > prev[1] or pt - prev[0] > step * 1.5
            if rose and (best is None or abs(pt - t) < best[0]):
                best = (abs(pt - t), code)
            prev = (pt, pv)
    return None if best is None else best[1]


def _findings(n: _Node, step: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for labels, points in n.severity:
        check, comp = labels.get("check", ""), labels.get("component", "")
        if check == "ib" and comp.startswith("ib/"):
            continue  # outages come from the downtime series
        for first, last, value in _runs(points, step):
            sev = SEVERITY.get(int(value))
            if sev is None:
                continue
            # the component's action nearest the finding's start (the worst open fault's)
            actions = [(min(t for t, _ in ap if t >= first - step), al.get("action"))
                       for al, ap in n.actions
                       if al.get("component") == comp and _overlaps((al, ap), first - step, last)]
            action = min(actions)[1] if actions else None
            evidence: dict[str, Any] = {"source": "prometheus", "seen_after": first - step,
                                        "seen_by": first, "last_seen_at": last, "step_s": step}
            if check == "xid":
                evidence["code"] = _xid_code(n, comp, first, step)
            if comp == "node" and any(h[0].get("check") == check and _overlaps(h, first - step, last)
                                      for h in n.hung):
                evidence["hung_in"] = "unknown (Prometheus has gpumon_check_outcome hung, not where)"
            code = f", Xid {evidence['code']}" if evidence.get("code") is not None else ""
            out.append({"id": f"prom:{check}:{comp}:{first}", "kind": "finding", "time": first,
                        "last_seen": last, "check": check, "component": comp, "severity": sev,
                        "action": action, "evidence": evidence,
                        "message": f"{check} {sev} on {comp}{code} (Prometheus: gpumon_finding_severity="
                                   f"{int(value)} from this step to {last - first:.0f} s later; the "
                                   f"finding's words are not exported)"})
    return out


def _outages(n: _Node, step: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for labels, points in n.downtime:
        comp = labels.get("component", "")
        if not comp.startswith("ib/") or not points:
            continue
        # every port is exported from the node's first sample on (at 0 without downtime): the value
        # then is the baseline (an outage already under way is timed from there); a port that
        # appears later had none before
        t_prev, v_prev = points[0]
        rest = points[1:]
        records: list[dict[str, Any]] = []
        open_: dict[str, Any] | None = None
        if n.first is not None and n.first < t_prev - step * 0.5:
            t_prev, v_prev, rest = t_prev - step, 0.0, points
        elif len(points) > 1 and points[1][1] > v_prev + 0.05 and v_prev > 0 \
                and n.outages.get(comp, {}).get(t_prev) == 1:
            # down at the first sample, and the only outage in the check's window (gpumon_ib_outages
            # 1, the ongoing one included): all of that downtime is this outage's
            open_ = {"start": t_prev - v_prev, "end": None, "down_s": v_prev, "seen_by": t_prev}
            records.append(open_)
        for t, v in rest:
            if open_ is not None and t - t_prev > step * 1.5:  # no sample between: closed, unknown when
                open_["end"], open_ = open_["start"] + open_["down_s"], None
            if v > v_prev + 0.05:
                rise = v - v_prev
                if open_ is not None:
                    open_["down_s"] += rise
                elif records and t - rise - records[-1]["end"] <= step:
                    # a scrape that repeated the check's previous reading splits one outage in two:
                    # joined (two outages less than a step apart cannot be told apart anyway)
                    open_ = records[-1]
                    open_["down_s"] += rise
                    open_["end"] = None
                else:
                    open_ = {"start": t - rise, "end": None, "down_s": rise, "seen_by": t}
                    records.append(open_)
            elif open_ is not None:
                open_["end"], open_ = open_["start"] + open_["down_s"], None
            # a fall: outages left the check's 24 h window; the next rise is from this value
            t_prev, v_prev = t, v
        if not records:
            continue
        if open_ is not None and n.last is not None and points[-1][0] < n.last - step * 0.5:
            open_["end"] = open_["start"] + open_["down_s"]  # the port left the exposition, the node did not
        for r in records:
            r["down_s"] = round(r["down_s"], 1)
        still = any(r["end"] is None for r in records)
        out.append({"id": f"prom:ib:{comp}", "kind": "finding", "time": records[0]["start"],
                    "last_seen": points[-1][0], "check": "ib", "component": comp,
                    "severity": "fail" if still else "ok", "action": "check_cables",
                    "message": f"{comp}: gpumon_ib_downtime_seconds rose {len(records)} time(s) (Prometheus)",
                    "evidence": {"source": "prometheus", "step_s": step, "recent_outages": records}})
    return out


def _rel(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def fetch(nodes: Sequence[str], access: PromAccess, since: float, until: float) -> list[NodeEvidence]:
    """Every node's evidence from Prometheus, in the order given; never fewer entries than nodes.
    Prometheus not answering is every node's error."""
    started = time.monotonic()
    deadline = started + access.timeout_s
    if not _LABEL.match(access.node_label):
        raise ConfigError(f"--prometheus-node-label {access.node_label!r}: not a label name",
                          key="prometheus_node_label")
    step = max(access.step_s, (until - since) / MAX_POINTS)
    rng = f"[{round(step * 1000)}ms]"
    sel = selector(nodes, access.node_label)
    by: dict[str, _Node] = {n: _Node(n) for n in nodes}
    label = access.node_label

    def ask(expr: str) -> list[tuple[_Node, Series]]:
        found = []
        for labels, points in query_range(access, expr, since, until, step, deadline):
            node = node_of(labels.get(label, ""), nodes)
            if node is not None and points:
                found.append((by[node], (labels, points)))
        return found

    base = url_of(access)
    try:
        for n, (labels, points) in ask(f"max_over_time(gpumon_build_info{{{sel}}}{rng})"):
            first, last = points[0][0], points[-1][0]
            n.first = first if n.first is None else min(n.first, first)
            if n.last is None or last >= n.last:
                n.last = last
                n.instance = labels.get(label, "")
                n.identity = {"node": labels.get("node"), "version": labels.get("version"),
                              "profile": labels.get("profile"), "source": "prometheus",
                              label: labels.get(label)}
        for n, s in ask(f"max_over_time(gpumon_finding_severity{{{sel}}}{rng}) >= 3"):
            n.severity.append(s)
        for n, s in ask(f'max_over_time(gpumon_recommended_action{{{sel},action!="none"}}{rng}) == 1'):
            n.actions.append(s)
        for n, s in ask(f'max_over_time(gpumon_check_outcome{{{sel},outcome=~"hung|still-hung"}}{rng}) == 1'):
            n.hung.append(s)
        for n, s in ask(f"max_over_time(gpumon_xid_events_total{{{sel}}}{rng})"):
            n.xids.append(s)
        for n, s in ask(f"last_over_time(gpumon_ib_downtime_seconds{{{sel}}}{rng})"):
            n.downtime.append(s)
        for n, (labels, points) in ask(f"last_over_time(gpumon_ib_outages{{{sel}}}{rng}) > 0"):
            n.outages[labels.get("component", "")] = dict(points)
        # the hung-collective check exports its flag for every GPU it judges, 0 or 1: a node with
        # the series was watched for the signature (its warn findings say when it showed)
        for n, _ in ask(f"max_over_time(gpumon_gpu_collective_hang{{{sel}}}{rng})"):
            n.judging.add("collective_hang")
        for n, (labels, points) in ask(
                f'last_over_time(gpumon_health_state{{{sel},component="node"}}{rng}) == 1'):
            if n.last is not None and points[-1][0] >= n.last - step * 0.5:
                n.state = labels.get("state")
    except PromError as exc:
        seconds = time.monotonic() - started
        return [NodeEvidence(n, base, error=f"Prometheus {base}: {exc}", source="prometheus",
                             seconds=seconds) for n in nodes]
    seconds = time.monotonic() - started
    out = []
    for name in nodes:
        n = by[name]
        if n.first is None:
            out.append(NodeEvidence(
                name, base, source="prometheus", seconds=seconds,
                error=f"no data in Prometheus: no gpumon_build_info{{{label}=\"{name}\"}} sample from "
                      f"{_rel(since)} to {_rel(until)} (never scraped then, outside the retention, or "
                      f"another label names nodes: --prometheus-node-label)"))
            continue
        events = sorted(_findings(n, step) + _outages(n, step), key=lambda e: float(e["time"]))
        ev = NodeEvidence(name, f"{base} ({label}=\"{n.instance}\")", identity=n.identity, events=events,
                          history_from=n.first, state=n.state, seconds=seconds, source="prometheus",
                          judging=frozenset(n.judging))
        ev.notes.append(f"evidence from Prometheus ({base}), not the node's API: samples every scrape, "
                        f"read at a {step:g} s step, so times are known to ± one step; its last sample is "
                        f"at {_rel(n.last)}; the findings' words, reboots and GPU-lost flags are not "
                        "exported")
        out.append(ev)
    return out


def url_of(access: PromAccess) -> str:
    return access.url.rstrip("/")


def fill_in(found: list[NodeEvidence], access: PromAccess, since: float, until: float) -> list[NodeEvidence]:
    """The nodes whose API did not answer, from Prometheus (the nodes' own history is richer: words,
    evidence, exact times, reboots; Prometheus is the fallback). A node neither answers keeps both
    reasons."""
    missing = [ev.node for ev in found if not ev.reachable]
    if not missing:
        return found
    from_prom = {ev.node: ev for ev in fetch(missing, access, since, until)}
    out = []
    for ev in found:
        p = from_prom.get(ev.node)
        if ev.reachable or p is None:
            out.append(ev)
        elif p.reachable:
            p.notes.insert(0, f"its API did not answer ({ev.url}: {ev.error}): judged from Prometheus")
            out.append(p)
        else:
            out.append(replace(ev, error=f"{ev.error}; and {p.error}"))
    return out


# -- the command line (gpumon.why.cli) ---------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Prometheus (nodes that are gone)")
    g.add_argument("--prometheus", metavar="URL",
                   help="a Prometheus server that scrapes the nodes' exporters: nodes whose API does not "
                        "answer are judged from its series (query_range), at --prometheus-step resolution")
    g.add_argument("--prometheus-only", action="store_true",
                   help="with --prometheus: do not ask the nodes' APIs at all (nodes known to be gone)")
    g.add_argument("--prometheus-node-label", default=DEFAULT_NODE_LABEL, metavar="LABEL",
                   help="the label whose value is the node's name, optionally .domain and :port "
                        f"(default {DEFAULT_NODE_LABEL}, as gpumon's scrape config and ServiceMonitor "
                        "set it)")
    g.add_argument("--prometheus-step", type=float, default=DEFAULT_STEP_S, metavar="SECONDS",
                   help=f"the query resolution: the scrape interval (default {DEFAULT_STEP_S:g}, gpumon's "
                        "scrape config's); coarser for long windows (at most 10,000 steps)")
    g.add_argument("--prometheus-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="for all the queries together (default 30)")
    g.add_argument("--prometheus-user", metavar="NAME", help="basic auth user of the Prometheus server "
                   "(TLS: --cacert, --cert, --key as for the nodes)")
    g.add_argument("--prometheus-password-file", type=Path, metavar="FILE", help="its password (first line)")


def from_args(args: argparse.Namespace) -> PromAccess | None:
    if args.prometheus is None:
        if args.prometheus_only:
            raise ConfigError("--prometheus-only needs --prometheus URL", key="why")
        return None
    if args.prometheus_step <= 0 or args.prometheus_timeout <= 0:
        raise ConfigError("--prometheus-step and --prometheus-timeout must be > 0", key="why")
    if not args.prometheus.startswith(("http://", "https://")):
        raise ConfigError(f"--prometheus {args.prometheus!r}: an http:// or https:// URL", key="why")
    password = None
    if args.prometheus_password_file is not None:
        try:
            lines = args.prometheus_password_file.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read the Prometheus password file: {exc.strerror or exc}",
                              file=str(args.prometheus_password_file)) from None
        password = lines[0] if lines else ""
    return PromAccess(args.prometheus, args.prometheus_node_label, args.prometheus_step,
                      args.prometheus_timeout, args.prometheus_user, password, args.cacert, args.cert,
                      args.key)
