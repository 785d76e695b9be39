"""The node's query API: its health history and current findings as JSON, on the exporter's listener.

``GET /api/v1/events?since=T&until=T&limit=N`` and ``GET /api/v1/findings`` (docs/postmortem/query-api.md)
are what ``gpumon why`` asks every node of a failed job; ``GET /api/v1/openapi.json`` is the API's
own OpenAPI 3.1 document, the package's ``openapi-v1.json`` as shipped (built by
gpumon.export.openapi from this module and the types it answers with). They are served by the same
server as ``/metrics``, behind the same TLS and basic auth (``exporter.web_config_file``): who may
scrape may read the history, nobody else.

Read-only and bounded:

- events come from ``health.db`` through a read-only connection opened per request (WAL: a reader
  never blocks the daemon's writes), never from the daemon's writer connection;
- a window is at most ``MAX_WINDOW_S`` (31 days: the store keeps 30 by default) and an answer at
  most ``MAX_LIMIT`` events; more than ``limit`` in the window sets ``truncated`` (the oldest
  ``limit`` are returned, so a client asks again from the last one's time);
- a bad parameter is a 400 with ``{"error", "parameter"}``, never a guess at what was meant.

An event is in the window when the span it stands for, ``time`` to ``last_seen``, meets
``[since, until]``. ``last_seen`` is that span's end as of the answer: ``now`` for a finding whose
fault is still open in the health state (``open``: true), else the last time its check said the
same (its ``time`` if never repeated). An open fault's stored ``last_seen`` says only when the
daemon last folded a repeat of it (at most once a minute for a check that says the same, never
for one the check no longer reports while it awaits its remedy): a job that started after that
and before the fault closed ran on a node with that fault, and a post-mortem must see it so.
Events older than the store's retention are folded into its snapshot (gpumon.health.store):
``history_from`` says from when on the store still has single events, so a client can tell
"nothing happened" from "no longer known".
"""

from __future__ import annotations

import functools
import json
import math
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from gpumon import __version__
from gpumon.health import HealthView, StoreError
from gpumon.health.store import DB_NAME, EventStore
from gpumon.model import Severity

API_VERSION = 1
MAX_WINDOW_S = 31 * 86400.0
DEFAULT_WINDOW_S = 86400.0
MAX_LIMIT = 10_000
DEFAULT_LIMIT = 1_000
_EVENT_PARAMS = frozenset({"since", "until", "limit"})
EVENTS_PATH = "/api/v1/events"
FINDINGS_PATH = "/api/v1/findings"
OPENAPI_PATH = "/api/v1/openapi.json"
# every path the API answers (anything else under /api/ is a 404): the OpenAPI document describes
# these, and tests/export/test_openapi.py holds the two to each other
PATHS = (EVENTS_PATH, FINDINGS_PATH, OPENAPI_PATH)
# the OpenAPI document, package data beside this module (pyproject's package-data)
OPENAPI_FILE = "openapi-v1.json"


class BadRequest(ValueError):
    def __init__(self, parameter: str | None, message: str) -> None:
        self.parameter = parameter
        super().__init__(message)


def parse_time(value: str, parameter: str) -> float:
    """Unix seconds (``1718000000``, ``1718000000.5``) or RFC 3339 with a zone (``2024-06-10T06:13:20Z``,
    ``...+02:00``). A time without a zone is refused: the node and the asker may not share one."""
    text = value.strip()
    try:
        t = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(t) or t < 0:
            raise BadRequest(parameter, f"{parameter}={value!r}: not a time (Unix seconds >= 0)")
        return t
    iso = text[:-1] + "+00:00" if text[-1:] in ("Z", "z") else text
    try:
        parsed = datetime.fromisoformat(iso)
    except ValueError:
        raise BadRequest(parameter, f"{parameter}={value!r}: not Unix seconds nor an RFC 3339 time "
                                    "(e.g. 2024-06-10T06:13:20Z)") from None
    if parsed.tzinfo is None:
        raise BadRequest(parameter, f"{parameter}={value!r}: an RFC 3339 time needs its zone (Z or "
                                    "+HH:MM): the node's local time is not the asker's")
    return parsed.timestamp()


@dataclass(frozen=True)
class Window:
    since: float
    until: float
    limit: int


def parse_window(query: str, now: float) -> Window:
    """``since``/``until``/``limit`` of a query string, bounded; raises ``BadRequest``."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query),
                          max_num_fields=len(_EVENT_PARAMS) + 1)
    except ValueError as exc:
        raise BadRequest(None, f"query string not understood: {exc}") from None
    for name, values in params.items():
        if name not in _EVENT_PARAMS:
            raise BadRequest(name, f"unknown parameter {name!r} (known: {', '.join(sorted(_EVENT_PARAMS))})")
        if len(values) != 1:
            raise BadRequest(name, f"{name} given {len(values)} times")
    until = parse_time(params["until"][0], "until") if "until" in params else now
    since = parse_time(params["since"][0], "since") if "since" in params else until - DEFAULT_WINDOW_S
    if since > until:
        raise BadRequest("since", "since is after until")
    if until - since > MAX_WINDOW_S:
        raise BadRequest("since", f"the window is {(until - since) / 86400:.1f} days; at most "
                                  f"{MAX_WINDOW_S / 86400:g} days per request (ask again for the rest)")
    limit = DEFAULT_LIMIT
    if "limit" in params:
        raw = params["limit"][0]
        try:
            limit = int(raw)
        except ValueError:
            raise BadRequest("limit", f"limit={raw!r}: not a whole number") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise BadRequest("limit", f"limit={limit}: must be 1 to {MAX_LIMIT}")
    return Window(since, until, limit)


@dataclass(frozen=True)
class NodeIdentity:
    """Who answers: what a post-mortem needs to align this node's times with a job's."""

    node: str  # the node name gpumon reports (node_name, else the machine's, else the host name)
    host: str
    boot_id: str | None
    boot_time: float | None  # the current boot (/proc/stat btime)
    daemon_started: float

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "boot_id": self.boot_id, "boot_time": self.boot_time,
                "daemon_started": self.daemon_started, "version": __version__}


def event_json(row: Mapping[str, Any], *, now: float | None = None) -> dict[str, Any]:
    """One stored event, flattened for readers: what the check said at the transition (``severity``,
    ``action``, ``message``, ``evidence``), the newest words of a repeated finding (``latest``), and
    the end of its span (``last_seen``): ``now`` when given (its fault is still open), else the
    stored refresh, else its own time."""
    payload = row["payload"]
    stored = row["last_seen"] if row["last_seen"] is not None else row["time"]
    last_seen = stored if now is None else max(stored, now)
    return {"id": row["id"], "time": row["time"], "last_seen": last_seen, "open": now is not None,
            "kind": row["kind"], "check": row["check"], "component": row["component"],
            "boot_id": row["boot_id"],
            "severity": payload.get("severity"), "action": payload.get("action"),
            "message": payload.get("message") or payload.get("reason") or payload.get("detail") or "",
            "key": payload.get("key"), "evidence": payload.get("evidence", {}),
            "payload": {k: v for k, v in payload.items() if k not in ("evidence", "message")},
            "latest": row["latest"]}


class HistoryApi:
    """WSGI app for ``/api/v1/...`` (``Routes`` hands it every path under ``/api/``)."""

    def __init__(self, state_dir: Path | str, identity: Callable[[], NodeIdentity],
                 view: Callable[[], HealthView | None],
                 findings: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (),
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(state_dir) / DB_NAME
        self.identity = identity
        self.view = view
        self.findings = findings
        self.clock = clock

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        try:
            if path == EVENTS_PATH:
                doc = self._events(environ.get("QUERY_STRING", ""))
            elif path in PATHS:
                if environ.get("QUERY_STRING"):
                    raise BadRequest(None, f"{path} takes no parameters")
                if path == OPENAPI_PATH:
                    return _answer(start_response, "200 OK", openapi_document())
                doc = self._current()
            else:
                return _json(start_response, "404 Not Found",
                             {"error": f"no such API path {path!r} (known: {', '.join(PATHS)})"})
        except BadRequest as exc:
            return _json(start_response, "400 Bad Request", {"error": str(exc), "parameter": exc.parameter})
        except StoreError as exc:
            return _json(start_response, "503 Service Unavailable",
                         {"error": f"health history unreadable: {exc.reason}",
                          "node": self.identity().to_json()})
        return _json(start_response, "200 OK", doc)

    def _events(self, query: str) -> dict[str, Any]:
        now = self.clock()
        window = parse_window(query, now)
        view = self.view()
        # the events behind the faults open now: their span runs to now (module docstring)
        open_ids = set() if view is None else {f.event_id for f in view.node.why if f.event_id is not None}
        store = EventStore(self.path, readonly=True)
        try:
            rows, truncated, history_from = store.window(
                window.since, window.until, window.limit, open_ids=open_ids if now >= window.since else ())
        finally:
            store.close()
        events = [event_json(r, now=now if r["id"] in open_ids else None) for r in rows]
        return {"api": API_VERSION, "node": self.identity().to_json(), "now": now,
                "since": window.since, "until": window.until, "limit": window.limit,
                "truncated": truncated, "history_from": history_from, "count": len(events),
                "events": events}

    def _current(self) -> dict[str, Any]:
        view = self.view()
        latest = [dict(f) for f in self.findings()]
        findings = [f for f in latest if f.get("severity") not in (Severity.OK.value, Severity.SKIPPED.value)]
        # the checks whose latest run judged something here: a post-mortem can then tell "did not
        # show it" (a check that looked) from "not known" (one that is skipped or cannot read)
        judging = sorted({str(f.get("check")) for f in latest
                          if f.get("severity") not in (Severity.SKIPPED.value, Severity.UNKNOWN.value)})
        doc: dict[str, Any] = {"api": API_VERSION, "node": self.identity().to_json(), "now": self.clock(),
                               "findings": findings, "checks_judging": judging}
        if view is None:
            doc["health"] = None
        else:
            doc["health"] = {"state": view.node.level.value, "action": view.node.action.value,
                             "since": view.node.since,
                             "faults": [f.to_json() for f in view.node.why],
                             "quarantine": None if view.node.quarantine is None
                             else view.node.quarantine.to_json()}
        return doc


def _json(start_response: Callable[..., Any], status: str, doc: Mapping[str, Any]) -> list[bytes]:
    return _answer(start_response, status,
                   (json.dumps(doc, separators=(",", ":"), default=str, allow_nan=False) + "\n").encode())


def _answer(start_response: Callable[..., Any], status: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store")])
    return [body]


@functools.cache
def openapi_document() -> bytes:
    """The API's OpenAPI document as the package ships it (``OPENAPI_FILE``), read once."""
    return (files("gpumon.export") / OPENAPI_FILE).read_bytes()


def identity_of(node: str, boot_id: str | None, boot_time: float | None,
                started: float) -> Callable[[], NodeIdentity]:
    ident = NodeIdentity(node, socket.gethostname(), boot_id, boot_time, started)
    return lambda: ident


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
