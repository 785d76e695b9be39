"""The query API's OpenAPI document (gpumon/export/openapi-v1.json) against the code and real answers.

- The shipped file is what gpumon.export.openapi builds from the code now (regenerate, compare), a
  valid OpenAPI 3.1 document (openapi-spec-validator), with valid JSON Schemas.
- A real ``gpumon daemon --simulate`` on 127.0.0.1:0, behind TLS and basic auth (the exporter's web
  config) and with Slurm remediation (stand-in ``sinfo``/``scontrol`` that keep the drain in a file),
  on a node whose GPU 3 has an uncontained memory error (Xid 95: reset_gpu, a take-out) and whose IB
  port blinks: asked at every path, GET and HEAD, with typical, edge and bad parameters, without and
  with wrong credentials, on other paths and with other methods: once while gpumon has the node
  quarantined, once after an operator's ``gpumon set-healthy`` and gpumon's release.
- The same stack (``serve_metrics`` with a ``HistoryApi``) in this process over a store that holds
  an event of every kind (open, refreshed, resolved, remedied, ...), with no health state yet, and
  over an unreadable store (503).

Every answer is validated against the document's answer for its path, method and status (body by
its schema, headers, content type; a HEAD answer has no body), an events request's parameters
against their schemas (valid ones answer 200, a value its schema refuses answers 400 naming it),
and the paths asked are the document's and the server's (``api.PATHS``), every answer the
document declares met. The daemon's /api/v1/openapi.json is the package file, byte for byte.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from prometheus_client.registry import CollectorRegistry
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from conftest import clean_env, run_gpumon, tls_web_config
from gpumon.export import api
from gpumon.export.api import HistoryApi, identity_of
from gpumon.export.openapi import OPENAPI_VERSION, PROBLEM_SEVERITIES, main, render, shipped_path
from gpumon.export.webserver import serve_metrics
from gpumon.health import Health
from gpumon.health.state import EventKind, Level
from gpumon.model import Action, Finding, Severity

SHIPPED = shipped_path().read_bytes()
DOC: dict[str, Any] = json.loads(SHIPPED)
BASE = "urn:gpumon:openapi-v1"  # the document's URI for the $refs of the validators below
REGISTRY: Registry[Any] = Registry().with_resource(
    BASE, Resource.from_contents(DOC, default_specification=DRAFT202012))
USER, PASSWORD = "oa", "pw-oa"
METHODS = ("get", "head")


# -- the document itself -------------------------------------------------------------------------


def test_the_shipped_document_is_the_one_built_from_the_code() -> None:
    assert SHIPPED.decode() == render(), "run: python -m gpumon.export.openapi --write"
    said: list[str] = []
    assert main(["--check"], said.append) == 0 and "up to date" in said[0]


def test_the_document_is_valid_openapi_3_1_with_valid_schemas() -> None:
    from openapi_spec_validator import OpenAPIV31SpecValidator, validate

    assert DOC["openapi"] == OPENAPI_VERSION == "3.1.0"
    validate(DOC, cls=OpenAPIV31SpecValidator)
    for name, schema in DOC["components"]["schemas"].items():
        try:
            Draft202012Validator.check_schema(schema)
        except Exception as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"components.schemas.{name}: {exc}")


def test_the_enumerations_and_limits_are_the_codes() -> None:
    schemas = DOC["components"]["schemas"]
    assert schemas["Action"]["enum"] == [a.value for a in Action]
    assert "confirm_sdc" in schemas["Action"]["enum"]
    assert schemas["Severity"]["enum"] == [s.value for s in Severity]
    assert schemas["ProblemSeverity"]["enum"] == [s.value for s in PROBLEM_SEVERITIES] == ["unknown", "warn",
                                                                                          "fail"]
    assert schemas["EventKind"]["enum"] == [k.value for k in EventKind]
    assert schemas["Level"]["enum"] == [level.value for level in Level]
    limit = DOC["components"]["parameters"]["limit"]["schema"]
    assert (limit["minimum"], limit["maximum"], limit["default"]) == (1, api.MAX_LIMIT, api.DEFAULT_LIMIT)
    assert set(DOC["paths"]) == set(api.PATHS)


# -- asking ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    where: str
    method: str  # lower case, as the document's operations
    target: str  # path and query, as sent
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> str:
        return urlsplit(self.target).query

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Server:
    where: str
    port: int
    tls: ssl.SSLContext | None = None
    auth: str | None = None  # the Authorization header sent unless a request says otherwise
    said: list[Exchange] = field(default_factory=list)

    def ask(self, target: str, method: str = "get", *, auth: str | None = "default") -> Exchange:
        conn: http.client.HTTPConnection = (
            http.client.HTTPConnection("127.0.0.1", self.port, timeout=10) if self.tls is None
            else http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=self.tls))
        header = self.auth if auth == "default" else auth
        try:
            conn.request(method.upper(), target, headers={"Authorization": header} if header else {})
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        said = Exchange(self.where, method, target, resp.status, {k.lower(): v for k, v in resp.getheaders()},
                        body)
        self.said.append(said)
        return said

    def both(self, target: str, **kw: Any) -> Exchange:
        """GET and HEAD of ``target``: the GET's answer."""
        got = self.ask(target, "get", **kw)
        self.ask(target, "head", **kw)
        return got


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _rfc3339(t: float, zone: str = "Z") -> str:
    if zone == "Z":
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t + 7200)) + "+02:00"


def exercise(server: Server, now: float, events_status: int = 200) -> None:
    """Every path with typical, edge and bad parameters, GET and HEAD; other paths and methods.
    ``events_status``: what a good events request gets (503 from a store that cannot be read)."""
    day = 86400.0
    good = ("", "limit=10000", "limit=1", f"since={now - 3600:.3f}&until={now + 60:.3f}",
            f"since={quote(_rfc3339(now - 7200))}&until={quote(_rfc3339(now + 60, '+02:00'))}",
            "since=0&until=0", "until=100", f"since={int(now - 31 * day + 60)}",
            f"limit=5&since={int(now - 60)}.5")
    # each a 400 naming the parameter, or none: the query string as a whole
    bad = ("since=yesterday", "until=2024-06-10T06:13:20", "since=100&until=50", "since=0&until=2700000",
           "limit=0", "limit=10001", "limit=ten", "limit=2.5", "since=-5", "until=nan", "check=xid",
           "limit=5&limit=6", "limit", "a=1&b=2&c=3&d=4&e=5")
    for queries, status in ((good, events_status), (bad, 400)):
        for query in queries:
            got = server.both(api.EVENTS_PATH + (f"?{query}" if query else ""))
            assert got.status == status, (query, got.status, got.body[:300])
    for path in (api.FINDINGS_PATH, api.OPENAPI_PATH):
        assert server.both(path).status == 200
        assert server.both(f"{path}?x=1").status == 400
    for other in ("/api/v1/nothing", "/api/v2/events", "/api/", "/api/v1/events/"):
        assert server.both(other).status == 404
    for path, method in ((api.EVENTS_PATH, "post"), (api.OPENAPI_PATH, "delete")):
        assert server.ask(path, method).status == 405


# -- a real daemon ---------------------------------------------------------------------------------

_SINFO = """#!/bin/sh
# sinfo --Node --format=%N|%T|%H|%E for one node, drained while drain.reason holds gpumon's reason
d=$(dirname "$0")
if [ -s "$d/drain.reason" ]; then
  printf '%s|drained|%s|%s\\n' "{node}" "$(cat "$d/drain.time")" "$(cat "$d/drain.reason")"
else
  echo '{node}|idle|Unknown|none'
fi
"""
_SCONTROL = """#!/bin/sh
# scontrol update NodeName=.. State=DRAIN Reason=.. | State=RESUME, kept in drain.reason/drain.time
d=$(dirname "$0"); drain=""; reason=""
for a in "$@"; do
  case "$a" in
    State=DRAIN) drain=1;;
    State=RESUME) rm -f "$d/drain.reason" "$d/drain.time";;
    Reason=*) reason="${a#Reason=}";;
  esac
done
if [ -n "$drain" ]; then
  printf '%s' "$reason" > "$d/drain.reason"; date -u +%Y-%m-%dT%H:%M:%S > "$d/drain.time"
fi
"""
NODE = "oa-node"
# Xid 95, not 79: a GPU off the bus fails every NVML check too, each on its own schedule, and one that
# first says so between the operator's set-healthy and gpumon's release would keep the node out
SCENARIO = (f"name: {NODE}\nsku: h100-sxm\nfaults:\n  - {{at_s: 1, kind: xid, gpu: 3, code: 95}}\n"
            "  - {at_s: 2, kind: ib_down, device: mlx5_2, port: 1, duration_s: 2}\n")


@dataclass
class Daemon:
    server: Server
    quarantined: dict[str, Any]  # /api/v1/findings while gpumon had the node out
    released: dict[str, Any]  # /api/v1/events after the operator's set-healthy and gpumon's release


def _until(what: str, ok: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path,
           within: float) -> None:
    deadline = time.monotonic() + within
    while not ok():
        assert proc.poll() is None, f"the daemon exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not within {within:g} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("openapi")
    web, crt = tls_web_config(tmp, USER, PASSWORD)
    slurm = tmp / "slurm"
    slurm.mkdir()
    for name, text in (("sinfo", _SINFO.replace("{node}", NODE)), ("scontrol", _SCONTROL)):
        (slurm / name).write_text(text)
        (slurm / name).chmod(0o755)
    scenario = tmp / "s.yaml"
    scenario.write_text(SCENARIO)
    cfg = tmp / "gpumon.yaml"
    cfg.write_text(f"node_name: {NODE}\nexporter:\n  web_config_file: {web}\n"
                   f"remediation:\n  backend: slurm\n  mode: enforce\n"
                   f"  slurm: {{sinfo: {slurm / 'sinfo'}, scontrol: {slurm / 'scontrol'}}}\n")
    sim = ["--simulate", str(scenario), "--sim-dir", str(tmp / "sim")]
    log = tmp / "daemon.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", *sim,
                                 "--listen", "127.0.0.1:0", "--duration", "300"],
                                stdout=subprocess.DEVNULL, stderr=err, env=clean_env())
    try:
        port: list[int] = []

        def serving() -> bool:
            found = re.search(r"metrics on https://127\.0\.0\.1:(\d+)/metrics", log.read_text())
            port.extend([int(found.group(1))] if found else [])
            return bool(port)

        _until("serving", serving, proc, log, 60)
        tls = ssl.create_default_context(cafile=str(crt))
        server = Server("daemon", port[0], tls, _basic(USER, PASSWORD))

        def kinds() -> set[str]:
            got = server.ask(api.EVENTS_PATH + "?limit=10000")
            return {e["kind"] for e in got.json()["events"]} if got.status == 200 else set()

        def quarantined() -> bool:
            got = server.ask(api.FINDINGS_PATH)
            return got.status == 200 and (got.json()["health"] or {}).get("quarantine") is not None

        _until("gpumon's quarantine", lambda: quarantined() and "quarantine" in kinds(), proc, log, 60)
        exercise(server, time.time())
        findings = server.ask(api.FINDINGS_PATH).json()
        proc_set = run_gpumon("--config", str(cfg), "set-healthy", *sim, "--reason", "GPU 3 reseated")
        assert proc_set.returncode == 0, proc_set.stdout + proc_set.stderr
        _until("gpumon's release", lambda: {"set_healthy", "release"} <= kinds(), proc, log, 60)
        exercise(server, time.time())
        events = server.ask(api.EVENTS_PATH + "?limit=10000").json()
        # without credentials, and with a wrong password: every path, GET and HEAD
        for path in api.PATHS:
            server.both(path, auth=None)
            server.both(path, auth=_basic(USER, "wrong"))
        yield Daemon(server, findings, events)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the same stack in this process ----------------------------------------------------------------


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def step(self, s: float = 1.0) -> float:
        self.t += s
        return self.t


def _every_kind(state: Path, clock: Clock) -> tuple[Health, list[dict[str, Any]]]:
    """A store with an event of every kind, an open fault refreshed with new words, and the latest
    runs' findings (ok ones among them, which the API leaves out)."""
    health = Health.open(state, boot_id="boot-b", clock=clock)  # boot
    xid = Finding("xid", "gpu/3", Severity.FAIL, "Xid 79 on gpu/3", Action.RESET_GPU, {"code": 79})
    cable = Finding("ib", "ib/mlx5_0/1", Severity.WARN, "port flapped", Action.CHECK_CABLES, {"outages": 2})
    health.record_findings("xid", [xid], complete=True)  # finding
    clock.step()
    health.record_findings("ib", [cable], complete=True)
    clock.step()
    health.record_findings("ib", [], complete=True)  # resolved: the run no longer reports it
    health.quarantine(by="gpumon", reason="Xid 79 on gpu/3", action=Action.RESET_GPU)
    clock.step()
    health.remediation(Action.RESET_GPU, "gpu/3", by="gpumon", detail="nvidia-smi -r -i 3")
    clock.step()
    health.retest_passed("gpu/3", check="xid", by="gpumon", detail="xid retest after the reset")
    health.set_healthy("node", who="operator", reason="replaced the cable")
    health.release(by="gpumon", reason="no open faults")
    hot = Finding("thermal", "gpu/1", Severity.WARN, "GPU 1 at 91 C", Action.NONE, {"temperature_c": 91})
    health.record_findings("thermal", [hot], complete=True)  # open: its span runs to now
    clock.step(5)
    hotter = Finding("thermal", "gpu/1", Severity.WARN, "GPU 1 at 93 C", Action.NONE, {"temperature_c": 93})
    health.record_findings("thermal", [hotter], complete=True)  # the same fault in new words: latest
    health.flush()
    latest = [hot.to_json(), Finding("thermal", "gpu/0", Severity.OK, "ok").to_json(),
              Finding("pcie", "node", Severity.SKIPPED, "no switches").to_json(),
              Finding("nvlink", "gpu/2", Severity.UNKNOWN, "cannot read", Action.NONE).to_json()]
    return health, latest


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Three servers of the daemon's stack: a store with every kind of event and a health state; the
    same without a health state yet (health null); an unreadable store."""
    tmp = tmp_path_factory.mktemp("openapi-inproc")
    clock = Clock(1_750_000_000.0)
    health, latest = _every_kind(tmp / "full", clock)
    broken = tmp / "broken"
    broken.mkdir()
    (broken / "health.db").write_bytes(b"not a database, by far" * 100)
    ident = identity_of("oa-inproc", "boot-b", clock.t - 3600, clock.t - 60)
    apis = {"full": HistoryApi(tmp / "full", ident, health.view, lambda: latest, clock),
            "no-state": HistoryApi(tmp / "full", ident, lambda: None, lambda: [], clock),
            "unreadable": HistoryApi(broken, ident, lambda: None, lambda: [], clock)}
    started = []
    servers = []
    try:
        for where, app in apis.items():
            httpd, _ = serve_metrics(CollectorRegistry(), "127.0.0.1", 0, api=app)
            started.append(httpd)
            servers.append(Server(where, httpd.server_port))
        for server in servers:
            exercise(server, clock.t, 503 if server.where == "unreadable" else 200)
        yield servers
    finally:
        for httpd in started:
            httpd.shutdown()
            httpd.server_close()
        health.close()


# -- judging an answer ----------------------------------------------------------------------------


def _resolve(obj: dict[str, Any]) -> dict[str, Any]:
    """An object of the document with its (local) $ref followed."""
    while "$ref" in obj:
        ref = obj["$ref"]
        assert ref.startswith("#/"), ref
        node: Any = DOC
        for part in ref[2:].split("/"):
            node = node[part]
        obj = node
    return obj


def _validate(instance: Any, schema: dict[str, Any]) -> list[str]:
    """Problems of ``instance`` against ``schema``, a schema of the document (its $refs into it)."""
    validator = Draft202012Validator(_rebase(schema), registry=REGISTRY,
                                     format_checker=Draft202012Validator.FORMAT_CHECKER)
    out = []
    for error in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path)):
        # under a oneOf/anyOf (a nullable object), the deepest reason rather than "not valid under any"
        deepest: ValidationError = error
        while deepest.context:
            deepest = max(deepest.context, key=lambda e: len(e.absolute_path))
        out.append(f"{'/'.join(map(str, deepest.absolute_path)) or '.'}: {deepest.message[:300]}")
    return out


def _rebase(schema: Any) -> Any:
    """``schema`` with its local $refs (#/components/...) pointed at the document's URI."""
    if isinstance(schema, dict):
        return {k: (f"{BASE}{v}" if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase(v))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(v) for v in schema]
    return schema


def _response_of(x: Exchange) -> tuple[dict[str, Any] | None, str]:
    """The document's answer for this exchange (None: it declares none) and where it is."""
    item = DOC["paths"].get(x.path)
    if item is not None and x.method in item:
        responses = item[x.method]["responses"]
        where = f"paths.{x.path}.{x.method}.responses.{x.status}"
        return (_resolve(responses[str(x.status)]) if str(x.status) in responses else None), where
    # no operation: another path under /api/ (404) or another method (405)
    name = {404: "NotFound", 405: "MethodNotAllowed"}.get(x.status)
    where = f"components.responses.{name}"
    return (DOC["components"]["responses"][name] if name else None), where


def _get_response(x: Exchange) -> dict[str, Any]:
    """A HEAD answer's content is its GET's."""
    item = DOC["paths"][x.path]["get"]["responses"]
    return _resolve(item[str(x.status)])


def _parameter_problems(x: Exchange) -> list[str]:
    """An events request's parameters against their schemas: a request whose every parameter fits is
    answered 200 unless its window is out of bounds; one that does not fit is a 400 naming it."""
    if x.path != api.EVENTS_PATH or x.method != "get":
        return []
    params = {p["name"]: p for p in (_resolve(r) for r in DOC["paths"][x.path]["get"]["parameters"])}
    try:
        pairs = parse_qsl(x.query, keep_blank_values=True, strict_parsing=bool(x.query))
    except ValueError:
        return [] if x.status == 400 else [f"{x.target}: a query string that does not parse: {x.status}"]
    unfit = []
    for name, value in pairs:
        if name not in params:
            unfit.append(name)
            continue
        schema = params[name]["schema"]
        typed: Any = value
        if schema.get("type") == "integer":
            with contextlib.suppress(ValueError):
                typed = int(value)
        if _validate(typed, schema):
            unfit.append(name)
    names = [n for n, _ in pairs]
    if len(names) != len(set(names)):
        unfit.append(next(n for n in names if names.count(n) > 1))
    if unfit:
        # a 400 naming one of them, or none: the query string as a whole (too many fields)
        if x.status != 400 or x.json().get("parameter") not in (*unfit, None):
            return [f"{x.target}: the document refuses {unfit}, the server answered {x.status} "
                    f"{x.body[:200]!r}"]
    elif x.status == 400 and x.json()["parameter"] not in ("since", None):
        # every parameter fits its schema: only the window (since after until, too long) is refused
        return [f"{x.target}: every parameter fits the document, the server refused {x.body[:200]!r}"]
    return []


def problems(x: Exchange) -> list[str]:
    said = f"{x.where}: {x.method.upper()} {x.target} -> {x.status}"
    response, where = _response_of(x)
    if response is None:
        return [f"{said}: {where} is not in the document"]
    out = []
    for name, header in response.get("headers", {}).items():
        header = _resolve(header)
        value = x.headers.get(name.lower())
        if value is None:
            out.append(f"{said}: no {name} header ({where})")
        else:
            out += [f"{said}: header {name}: {p}" for p in _validate(value, header["schema"])]
    # a HEAD answer's content type is its GET's
    operation = not where.startswith("components")
    content = (_get_response(x) if x.method == "head" and operation else response).get("content", {})
    (media,) = content
    if x.headers.get("content-type", "").split(";")[0].strip() != media:
        out.append(f"{said}: content type {x.headers.get('content-type')!r}, the document says {media}")
    if x.method == "head":
        if x.body:
            out.append(f"{said}: a HEAD answer with a body")
        return out
    if media == "application/json":
        try:
            body = x.json()
        except ValueError as exc:
            return [*out, f"{said}: not JSON ({exc})"]
    else:
        body = x.body.decode()
    out += [f"{said}: {p} ({where})" for p in _validate(body, content[media]["schema"])]
    return out + [f"{x.where}: {p}" for p in _parameter_problems(x)]


def _all(daemon: Daemon, in_process: list[Server]) -> list[Exchange]:
    return [*daemon.server.said, *(x for s in in_process for x in s.said)]


# -- the tests ---------------------------------------------------------------------------------------


def test_every_answer_is_the_one_the_document_declares(daemon: Daemon, in_process: list[Server]) -> None:
    exchanges = _all(daemon, in_process)
    found = [p for x in exchanges for p in problems(x)]
    assert not found, f"{len(found)} problems in {len(exchanges)} answers:\n" + "\n".join(found[:40])


def test_the_paths_asked_are_the_documents_and_the_servers_and_every_answer_was_met(
        daemon: Daemon, in_process: list[Server]) -> None:
    exchanges = _all(daemon, in_process)
    answered = {x.path for x in exchanges if x.status not in (404, 405)}
    assert answered == set(DOC["paths"]) == set(api.PATHS)
    declared = {(path, method, status) for path, item in DOC["paths"].items() for method in METHODS
                for status in item[method]["responses"]}
    met = {(x.path, x.method, str(x.status)) for x in exchanges
           if x.path in DOC["paths"] and x.method in METHODS}
    assert declared == met, (f"declared, never met: {sorted(declared - met)}; "
                             f"met, undeclared: {sorted(met - declared)}")
    assert {404, 405} <= {x.status for x in exchanges}
    # the 401 and the 503 were each met where they arise: the daemon's basic auth, a store that cannot be read
    assert {x.status for x in daemon.server.said} >= {200, 400, 401, 404, 405}
    assert any(x.status == 503 for x in in_process[2].said)


def test_the_daemon_serves_the_package_file(daemon: Daemon) -> None:
    got = [x for x in daemon.server.said
           if x.target == api.OPENAPI_PATH and x.method == "get" and x.status == 200]
    assert got and all(x.body == SHIPPED for x in got)
    assert got[0].headers["content-type"] == "application/json"
    refused = [x for x in daemon.server.said if x.target == api.OPENAPI_PATH and x.status == 401]
    assert refused, "the document is behind the same basic auth as the rest"


def test_the_answers_had_something_to_say(daemon: Daemon, in_process: list[Server]) -> None:
    """What the validation above saw: a quarantined node with open faults and current findings, an
    event of every kind with open and refreshed ones, a truncated window, no health state yet."""
    health = daemon.quarantined["health"]
    assert health["quarantine"] is not None and health["faults"] and daemon.quarantined["findings"]
    assert any(f["check"] == "xid" and f["action"] == "reset_gpu" for f in health["faults"])
    seen = {e["kind"] for e in daemon.released["events"]}
    assert {"boot", "finding", "quarantine", "set_healthy", "release"} <= seen
    answers = [x.json() for x in _all(daemon, in_process)
               if x.method == "get" and x.status == 200 and x.path == api.EVENTS_PATH]
    events = [e for a in answers for e in a["events"]]
    assert {e["kind"] for e in events} == {k.value for k in EventKind}
    assert any(e["open"] for e in events) and any(e["latest"] for e in events)
    assert any(a["truncated"] for a in answers) and any(a["count"] == 0 for a in answers)
    full, no_state = in_process[0], in_process[1]
    findings = [x.json() for x in full.said if x.target == api.FINDINGS_PATH and x.method == "get"]
    assert findings and {f["severity"] for f in findings[0]["findings"]} == {"warn", "unknown"}
    assert [x.json()["health"] for x in no_state.said
            if x.target == api.FINDINGS_PATH and x.method == "get"] == [None]
