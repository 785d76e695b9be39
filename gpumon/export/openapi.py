"""The query API (gpumon.export.api) as an OpenAPI 3.1 document, built from the code that answers.

The daemon serves the document at ``/api/v1/openapi.json`` as the package ships it
(``gpumon/export/openapi-v1.json``, read by ``api.openapi_document``); this module builds that file.
What can drift is taken from the code rather than copied: the paths (``api.PATHS``), the limits
(``MAX_LIMIT``, ``DEFAULT_LIMIT``, ``MAX_WINDOW_S``, ``DEFAULT_WINDOW_S``), the enumerations
(``Severity``, ``Action``, ``EventKind``, ``Level``), a component's pattern, the words of a fault's
``status`` (asked of ``Fault.status`` itself), and each event kind's payload (asked of the event
constructors). tests/export/test_openapi.py rebuilds the document and compares it with the shipped
file, and validates a real daemon's answers against it.

OpenAPI 3.1 rather than 3.0: its schemas are JSON Schema 2020-12, so ``null`` is a type like any
other (the answers have many nullable fields), ``const``, ``prefixItems`` and ``if``/``then`` (an
event's payload by its kind) mean what they mean in JSON Schema, and any JSON Schema validator
checks an answer against the document's schemas as they are. It also has the ``mutualTLS``
security scheme that the exporter's ``client_auth_type`` is.

Regenerate after a change to the API: ``python -m gpumon.export.openapi --write``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from gpumon.config import ExporterSettings, split_listen
from gpumon.export.api import (
    API_VERSION,
    DEFAULT_LIMIT,
    DEFAULT_WINDOW_S,
    EVENTS_PATH,
    FINDINGS_PATH,
    MAX_LIMIT,
    MAX_WINDOW_S,
    OPENAPI_FILE,
    OPENAPI_PATH,
    PATHS,
)
from gpumon.health.state import (
    Event,
    EventKind,
    Fault,
    Level,
    boot_event,
    finding_event,
    quarantine_event,
    release_event,
    remediation_event,
    resolved_event,
    retest_passed_event,
    set_healthy_event,
)
from gpumon.model import COMPONENT_PATTERN, NODE, Action, Finding, Severity

OPENAPI_VERSION = "3.1.0"
# the severities a current finding (/api/v1/findings drops ok and skipped) and an open fault have
PROBLEM_SEVERITIES = tuple(s for s in Severity if s not in (Severity.OK, Severity.SKIPPED))

Schema = dict[str, Any]


def _ref(name: str, section: str = "schemas") -> Schema:
    return {"$ref": f"#/components/{section}/{name}"}


def _nullable(schema: Schema) -> Schema:
    """``schema`` (a $ref) or null: OpenAPI 3.1 has JSON Schema's ``null`` type."""
    return {"oneOf": [schema, {"type": "null"}]}


def _object(properties: dict[str, Schema], *, description: str = "") -> Schema:
    """A closed object with these properties, all required: the answers have no optional keys, and a
    key added to one must be added here (the test that validates real answers says so)."""
    out: Schema = {"type": "object"}
    if description:
        out["description"] = description
    out["required"] = list(properties)
    out["properties"] = properties
    out["additionalProperties"] = False
    return out


def _enum(values: Sequence[str], description: str) -> Schema:
    return {"type": "string", "enum": list(values), "description": description}


# -- what is asked of the code -------------------------------------------------------------------


def fault_statuses() -> list[str]:
    """Every ``status`` a fault can have, from ``Fault.status`` itself over every combination of what
    it reads (the action, escalated, remediated, still reported)."""
    words: list[str] = []
    for action, escalated, remediated, reported in itertools.product(
            Action, (False, True), (None, 0.0), (True, False)):
        fault = Fault(check="c", component=NODE, key="", severity=Severity.FAIL, action=action,
                      reported_action=action, message="", evidence={}, raised=0.0, last_seen=0.0,
                      signature=("fail", action.value, ""), reported=reported, remediated=remediated,
                      escalated=escalated)
        if fault.status not in words:
            words.append(fault.status)
    return words


def _example_events() -> dict[EventKind, Event]:
    """One event of each kind as its constructor makes it (their payloads are the schema's)."""
    finding = Finding("xid", "gpu/3", Severity.FAIL, "Xid 79", Action.REBOOT_NODE, {"code": 79})
    made = [finding_event(finding, time=0.0, boot_id="b"),
            resolved_event(("xid", "gpu/3", "79"), time=0.0, boot_id="b"),
            boot_event("b", time=0.0, previous="a"),
            retest_passed_event(time=0.0, boot_id="b", by="bootstrap", detail="suite passed"),
            remediation_event(Action.RESET_GPU, "gpu/3", time=0.0, boot_id="b", by="gpumon"),
            set_healthy_event(time=0.0, boot_id="b", who="root", reason="replaced"),
            quarantine_event(time=0.0, boot_id="b", by="gpumon", reason="Xid 79", action=Action.REBOOT_NODE),
            release_event(time=0.0, boot_id="b", by="gpumon", reason="no open faults")]
    events = {e.kind: e for e in made}
    missing = set(EventKind) - set(events)
    if missing:
        raise AssertionError(f"no example event of kind {sorted(k.value for k in missing)}: add one here")
    return events


def _payload_value(key: str, value: Any) -> Schema:
    if key == "severity":
        return _ref("Severity")
    if key == "action":
        return _ref("Action")
    if isinstance(value, str):
        return {"type": "string"}
    raise AssertionError(f"payload key {key!r}: no schema for {type(value).__name__} (add one here)")


_PAYLOAD_WORDS = {
    "key": "the fault's key within (check, component): the finding's evidence fault_key, code or kind",
    "previous": "the boot id before this one (empty: none known)",
    "by": "who did it (gpumon, the bootstrap suite, an operator's tool)",
    "detail": "what was done or found, in words",
    "who": "the operator's user name",
    "reason": "why, in words",
}


def _event_kind_rule(kind: EventKind, event: Event) -> Schema:
    """What an event of ``kind`` holds: its payload's keys, and the top-level fields that come from
    them (``api.event_json``)."""
    payload = {k: v for k, v in event.payload.items() if k not in ("evidence", "message")}
    properties: dict[str, Schema] = {}
    for key, value in payload.items():
        schema = _payload_value(key, value)
        if key in _PAYLOAD_WORDS and "$ref" not in schema:
            schema = {**schema, "description": _PAYLOAD_WORDS[key]}
        properties[key] = schema
    rules: dict[str, Schema] = {
        "payload": {"type": "object", "required": list(payload), "properties": properties},
        "severity": _ref("Severity") if "severity" in payload else {"type": "null"},
        "action": _ref("Action") if "action" in payload else {"type": "null"},
        "key": {"type": "string"} if "key" in payload else {"type": "null"},
    }
    if kind is not EventKind.FINDING:
        # only a finding raises a fault (open), carries evidence, and is refreshed (latest)
        rules.update({"open": {"const": False}, "evidence": {"type": "object", "maxProperties": 0},
                      "latest": {"type": "null"}})
    return {"if": {"properties": {"kind": {"const": kind.value}}, "required": ["kind"]},
            "then": {"properties": rules}}


# -- the document ----------------------------------------------------------------------------------


def _schemas() -> dict[str, Schema]:
    time_s = {"type": "number", "description": "Unix seconds (UTC)"}
    component = _ref("Component")
    events = _example_events()
    window_days = f"{MAX_WINDOW_S / 86400:g}"
    return {
        "Severity": _enum([s.value for s in Severity],
                          "How bad a finding is, best to worst. skipped: the check does not apply here; "
                          "unknown: it should have run but could not say (never folded into ok)."),
        "ProblemSeverity": _enum([s.value for s in PROBLEM_SEVERITIES],
                                 "The severities of a finding that is a problem (neither ok nor skipped)."),
        "Action": _enum([a.value for a in Action],
                        "What an operator (or gpumon's remediation) should do, least to most taken away; "
                        "worst wins. confirm_sdc: gpumon itself confirms an in-job SDC verdict on the GPU "
                        "it names, nothing is asked of an operator."),
        "EventKind": _enum([k.value for k in EventKind],
                           "finding: a check's finding that changed something; resolved: a completed run "
                           "no longer reports the fault; boot: a new boot was seen; retest_passed; "
                           "remediation: a remedy was carried out; set_healthy: an operator's override; "
                           "quarantine: gpumon took the node out (cordon/drain); release: it put it back."),
        "Level": _enum([level.value for level in Level], "Health of the node, best to worst."),
        "Component": {"type": "string", "pattern": COMPONENT_PATTERN,
                      "description": "node, gpu/<index>, nvlink/<gpu>/<link>, ib/<device>/<port>, "
                                     "pci/<bus id>, nvswitch/<index>"},
        "Evidence": {"type": "object", "additionalProperties": True,
                     "description": "What the check measured, as it says it (check-specific keys)."},
        "NodeIdentity": _object({
            "node": {"type": "string", "description": "the node name gpumon reports (node_name, else "
                                                      "the machine's, else the host name)"},
            "host": {"type": "string", "description": "the host name"},
            "boot_id": {"type": ["string", "null"], "description": "the current boot's id"},
            "boot_time": {"type": ["number", "null"],
                          "description": "the current boot, Unix seconds (/proc/stat btime)"},
            "daemon_started": {**time_s, "description": "when the daemon started, Unix seconds"},
            "version": {"type": "string", "description": "gpumon's version"},
        }, description="Who answers: what a post-mortem needs to align this node's times with a job's."),
        "Latest": _object({
            "time": time_s,
            "message": {"type": "string"},
            "evidence": _ref("Evidence"),
        }, description="The newest words of a finding repeated since the event (the store writes them "
                       "within 10 s)."),
        "Event": {
            **_object({
                "id": {"type": "integer", "minimum": 1, "description": "the store's id, never reused"},
                "time": {**time_s, "description": "when it happened, Unix seconds"},
                "last_seen": {**time_s, "description":
                              "the end of the span the event stands for, as of the answer: now while "
                              "its fault is open (open: true), else the last time its check said the "
                              "same, else its own time; never null"},
                "open": {"type": "boolean", "description": "the fault this event raised is open now"},
                "kind": _ref("EventKind"),
                "check": {"type": "string", "description": "the check's name; empty for events of no "
                                                           "check (boot, quarantine, ...)"},
                "component": component,
                "boot_id": {"type": "string", "description": "the boot it happened in"},
                "severity": _nullable(_ref("Severity")),
                "action": _nullable(_ref("Action")),
                "message": {"type": "string", "description": "what the check said at the transition "
                                                             "(else the reason or detail; else empty)"},
                "key": {"type": ["string", "null"], "description": "the fault's key within (check, "
                                                                   "component)"},
                "evidence": _ref("Evidence"),
                "payload": {"type": "object", "additionalProperties": True,
                            "description": "the rest of the stored event (by its kind)"},
                "latest": _nullable(_ref("Latest")),
            }, description="One stored health event. Only changes are stored: a repeat refreshes "
                           "last_seen and latest."),
            "allOf": [_event_kind_rule(kind, events[kind]) for kind in EventKind],
        },
        "EventsAnswer": _object({
            "api": {"const": API_VERSION},
            "node": _ref("NodeIdentity"),
            "now": {**time_s, "description": "the node's clock at the answer, to align times"},
            "since": {"type": "number", "description": "the window asked, Unix seconds"},
            "until": {"type": "number", "description": "the window asked, Unix seconds"},
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
            "truncated": {"type": "boolean", "description":
                          "more events in the window than limit: the oldest limit are returned, ask "
                          "again from the last one's time"},
            "history_from": {"type": ["number", "null"], "description":
                             "the oldest event still stored (null: none): older events are folded into "
                             "the store's snapshot, so before this time 'nothing' means 'no longer known'"},
            "count": {"type": "integer", "minimum": 0, "maximum": MAX_LIMIT},
            "events": {"type": "array", "maxItems": MAX_LIMIT, "items": _ref("Event"),
                       "description": "oldest first"},
        }, description=f"The events whose span (time to last_seen) meets [since, until] (at most "
                       f"{window_days} days), oldest first."),
        "Finding": _object({
            "check": {"type": "string"},
            "component": component,
            "severity": _ref("ProblemSeverity"),
            "action": _ref("Action"),
            "message": {"type": "string"},
            "evidence": _ref("Evidence"),
        }, description="A finding of a check's latest run."),
        "Fault": _object({
            "check": {"type": "string"},
            "component": component,
            "key": {"type": "string", "description": "the fault's key within (check, component)"},
            "severity": {**_ref("ProblemSeverity"), "description": "the worst while open"},
            "action": {**_ref("Action"), "description": "what is recommended now (escalation applied)"},
            "reported_action": {**_ref("Action"), "description": "the worst the check itself asked"},
            "message": {"type": "string"},
            "evidence": _ref("Evidence"),
            "raised": time_s,
            "last_seen": time_s,
            "signature": {"type": "array", "minItems": 3, "maxItems": 3,
                          "prefixItems": [_ref("ProblemSeverity"), _ref("Action"), {"type": "string"}],
                          "description": "severity, action and message as the check last said them"},
            "boot_id": {"type": "string"},
            "reported": {"type": "boolean", "description": "false: the check no longer reports it (it "
                                                            "awaits a remedy or a retest)"},
            "remediated": {"type": ["number", "null"], "description": "when a remedy was carried out"},
            "escalated": {"type": "boolean"},
            "event_id": {"type": ["integer", "null"], "description": "the stored event behind it"},
            "status": _enum(fault_statuses(), "where the fault stands, in words"),
        }, description="An open fault: raised by a finding, closed by an ok finding, a retest after a "
                       "remedy, or an operator's set_healthy."),
        "Quarantine": _object({
            "since": time_s,
            "by": {"type": "string"},
            "reason": {"type": "string"},
            "action": _ref("Action"),
        }, description="gpumon has the node out (cordon/drain)."),
        "Health": _object({
            "state": _ref("Level"),
            "action": _ref("Action"),
            "since": {**time_s, "description": "when state or action last changed"},
            "faults": {"type": "array", "items": _ref("Fault"), "description": "every open fault, "
                                                                               "worst first"},
            "quarantine": _nullable(_ref("Quarantine")),
        }, description="The node's health state now."),
        "FindingsAnswer": _object({
            "api": {"const": API_VERSION},
            "node": _ref("NodeIdentity"),
            "now": time_s,
            "findings": {"type": "array", "items": _ref("Finding"),
                         "description": "the latest run's findings of every check that are neither ok "
                                        "nor skipped"},
            "checks_judging": {"type": "array", "uniqueItems": True, "items": {"type": "string"},
                               "description": "the checks whose latest run judged something here (had "
                                              "a finding neither skipped nor unknown), sorted: what "
                                              "tells 'did not show it' from 'not known'"},
            "health": _nullable(_ref("Health")),
        }, description="The current findings and health state (null health: not open yet)."),
        "BadRequest": _object({
            "error": {"type": "string", "description": "what was wrong, in words"},
            "parameter": {"type": ["string", "null"], "description": "the parameter at fault (null: "
                                                                     "the query string as a whole)"},
        }),
        "NotFound": _object({"error": {"type": "string", "description": "names the known paths"}}),
        "StoreUnreadable": _object({
            "error": {"type": "string", "description": "why health.db cannot be read"},
            "node": _ref("NodeIdentity"),
        }),
        "OpenApiDocument": {"type": "object", "required": ["openapi", "info", "paths"],
                            "properties": {"openapi": {"const": OPENAPI_VERSION}},
                            "description": "This document."},
    }


def _parameters() -> dict[str, Schema]:
    time_param = {"type": "string", "anyOf": [{"pattern": r"^[0-9]+(\.[0-9]+)?$"}, {"format": "date-time"}]}
    hours = f"{DEFAULT_WINDOW_S / 3600:g}"
    days = f"{MAX_WINDOW_S / 86400:g}"
    zone = ("Unix seconds (1718000000.5) or RFC 3339 with a zone (2024-06-10T06:13:20Z, "
            "...+02:00); a time without a zone is refused (the node's local time is not the asker's).")
    return {
        "since": {"name": "since", "in": "query", "required": False, "schema": time_param,
                  "description": f"The window's start, {hours} h before until by default. {zone} At most "
                                 f"{days} days before until, and not after it.",
                  "examples": {"unix": {"value": "1718000000.5"},
                               "rfc3339": {"value": "2024-06-10T06:13:20Z"}}},
        "until": {"name": "until", "in": "query", "required": False, "schema": time_param,
                  "description": f"The window's end, now by default. {zone}",
                  "examples": {"unix": {"value": "1718086400"},
                               "rfc3339": {"value": "2024-06-11T06:13:20+02:00"}}},
        "limit": {"name": "limit", "in": "query", "required": False,
                  "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
                  "description": "At most this many events (the oldest); more in the window sets truncated."},
    }


def _json_response(description: str, schema: str) -> Schema:
    return {"description": description, "headers": {"Cache-Control": _ref("CacheControl", "headers")},
            "content": {"application/json": {"schema": _ref(schema)}}}


def _responses() -> dict[str, Schema]:
    days = f"{MAX_WINDOW_S / 86400:g}"
    return {
        "Events": _json_response("The events in the window.", "EventsAnswer"),
        "Findings": _json_response("The current findings and health state.", "FindingsAnswer"),
        "OpenApiDocument": _json_response("This document, as the package ships it.", "OpenApiDocument"),
        "BadRequest": _json_response(
            f"A bad parameter: not a time or a number, an unknown or a repeated one, since after until, a "
            f"window over {days} days, a limit out of bounds; on a path that takes none, any query string. "
            "Never a guess at what was meant.", "BadRequest"),
        "Unauthorized": {
            "description": "No or wrong basic-auth credentials, where the exporter's web config has "
                           "basic_auth_users.",
            "headers": {"WWW-Authenticate": {"schema": {"type": "string", "const": 'Basic realm="gpumon"'}}},
            "content": {"text/plain": {"schema": {"type": "string"}}}},
        "StoreUnreadable": _json_response("health.db cannot be read.", "StoreUnreadable"),
        "NotFound": _json_response("Any other path under /api/ (no operation of this document: listed "
                                   "for its body).", "NotFound"),
        "MethodNotAllowed": {
            "description": "A method other than GET or HEAD, on any path (no operation of this document: "
                           "listed for its answer).",
            "headers": {"Allow": {"schema": {"type": "string", "const": "GET, HEAD"}}},
            "content": {"text/plain": {"schema": {"type": "string"}}}},
    }


# path -> (operation name, summary, description, parameters, {status: response component})
_OPERATIONS: dict[str, tuple[str, str, str, tuple[str, ...], dict[str, str]]] = {
    EVENTS_PATH: (
        "Events", "The node's health events in a time window",
        "Events from health.db (read-only, per request) whose span, time to last_seen, meets [since, "
        "until], oldest first. The event behind a fault still open is in every window up to now, however "
        "long ago it was raised. What is where: IB outages in ib events on ib/<dev>/<port> "
        "(evidence.recent_outages), Xids in xid events (evidence.code), a lost GPU in any NVML check's "
        "event with evidence.gpu_lost, NVLink lanes in nvlink events on nvlink/<gpu>/<link>, a hung probe "
        "in the event of the check that hung (evidence.hung_in), reboots as boot events.",
        ("since", "until", "limit"),
        {"200": "Events", "400": "BadRequest", "401": "Unauthorized", "503": "StoreUnreadable"}),
    FINDINGS_PATH: (
        "Findings", "The node's current findings and health state",
        "From what the exporter already holds: no check runs for the question, no hardware is touched. "
        "Takes no parameters.",
        (), {"200": "Findings", "400": "BadRequest", "401": "Unauthorized"}),
    OPENAPI_PATH: (
        "OpenApiDocument", "This document",
        "The query API's OpenAPI document, as the package ships it. Takes no parameters.",
        (), {"200": "OpenApiDocument", "400": "BadRequest", "401": "Unauthorized"}),
}


def _path_item(path: str) -> Schema:
    name, summary, description, params, answers = _OPERATIONS[path]
    parameters = [_ref(p, "parameters") for p in params]
    get: Schema = {"operationId": f"get{name}", "summary": summary, "description": description}
    head: Schema = {"operationId": f"head{name}", "summary": f"{summary}: the GET's status and headers, "
                                                             "without the body"}
    if parameters:
        get["parameters"] = head["parameters"] = parameters
    get["responses"] = {status: _ref(response, "responses") for status, response in answers.items()}
    described = _responses()
    head["responses"] = {status: {"description": f"As GET's {status}, without the body.",
                                  **({"headers": described[response]["headers"]}
                                     if "headers" in described[response] else {})}
                         for status, response in answers.items()}
    return {"get": get, "head": head}


def document() -> dict[str, Any]:
    """The OpenAPI document of the query API, as built from the code now."""
    missing = set(PATHS) ^ set(_OPERATIONS)
    if missing:
        raise AssertionError(f"api.PATHS and the operations described here differ: {sorted(missing)}")
    port = split_listen(ExporterSettings().listen)[1]
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "gpumon node query API",
            "version": str(API_VERSION),
            "summary": "A GPU node's health history and current findings, as JSON.",
            "description":
                "Served by the gpumon daemon on the exporter's listener (exporter.listen), beside /metrics "
                "and behind the same TLS and basic auth (exporter.web_config_file: who may scrape may "
                "read the history). Read-only: no request touches the hardware. GET and HEAD only: any "
                "other method is a 405 (components.responses.MethodNotAllowed); another path under /api/ "
                "is a 404 with a JSON body (components.responses.NotFound). gpumon why is its client.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [{
            "url": "{scheme}://{node}:{port}",
            "description": "A node's exporter listener.",
            "variables": {
                "scheme": {"enum": ["http", "https"], "default": "http",
                           "description": "https where the web config has tls_server_config"},
                "node": {"default": "localhost", "description": "the node's host name or address"},
                "port": {"default": str(port), "description": "exporter.listen's port"},
            },
        }],
        "security": [{}, {"basicAuth": []}, {"mutualTLS": []}, {"basicAuth": [], "mutualTLS": []}],
        "paths": {path: _path_item(path) for path in PATHS},
        "components": {
            "schemas": _schemas(),
            "parameters": _parameters(),
            "responses": _responses(),
            "headers": {"CacheControl": {"description": "Answers are never cached.",
                                         "schema": {"type": "string", "const": "no-store"}}},
            "securitySchemes": {
                "basicAuth": {"type": "http", "scheme": "basic", "description":
                              "Required where the web config lists basic_auth_users (bcrypt hashes)."},
                "mutualTLS": {"type": "mutualTLS", "description":
                              "Where the web config's tls_server_config sets a client_auth_type that asks "
                              "for a client certificate."},
            },
        },
    }


def render(doc: dict[str, Any] | None = None) -> str:
    """The document as the shipped file holds it."""
    return json.dumps(document() if doc is None else doc, indent=2, ensure_ascii=False) + "\n"


def shipped_path() -> Path:
    """The package file (in a checkout: gpumon/export/openapi-v1.json)."""
    return Path(str(files("gpumon.export") / OPENAPI_FILE))


def main(argv: Sequence[str] | None = None, out: Callable[[str], object] = sys.stdout.write) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumon.export.openapi",
                                     description="The query API's OpenAPI document, built from the code.")
    parser.add_argument("--write", action="store_true", help=f"write it to the package's {OPENAPI_FILE}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the package file differs")
    args = parser.parse_args(argv)
    text = render()
    target = shipped_path()
    if args.check:
        same = target.is_file() and target.read_text(encoding="utf-8") == text
        out(f"{target}: " + ("up to date\n" if same else
                             "out of date: run python -m gpumon.export.openapi --write\n"))
        return 0 if same else 1
    if args.write:
        target.write_text(text, encoding="utf-8")
        out(f"wrote {target}\n")
        return 0
    out(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
