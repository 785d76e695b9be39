"""The evidence: every node's query API (gpumon.export.api), asked in parallel, each within its timeout.

A node that does not answer (refused, timed out, TLS or auth refused, an answer that is not the
API's) is kept with the reason: a post-mortem that silently drops the one node that died would
blame the healthy ones or nobody. Each node's deadline is its own (``timeout_s`` for the whole
node: the events, their next pages and the findings), so one dead node costs ``timeout_s`` of
wall time, not ``timeout_s`` per node.
"""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PORT = 9426  # the exporter's default listen port (exporter.listen)
DEFAULT_TEMPLATE = "http://{node}:" + str(DEFAULT_PORT)
PAGE_LIMIT = 10_000  # the API's most per answer
MAX_PAGES = 5  # 50,000 events per node per window: more is a node that flapped all along
MAX_ANSWER_BYTES = 64 << 20


@dataclass
class NodeEvidence:
    node: str
    url: str
    error: str | None = None
    identity: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False
    history_from: float | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    state: str | None = None
    seconds: float = 0.0
    # the node's clock minus ours (its "now" against the middle of our request): events are in
    # the node's time, the job's in the controller's
    clock_skew_s: float | None = None
    clock_skew_error_s: float | None = None  # at most half the request's round trip
    # the checks known to judge the node at the last reading (the API's checks_judging; from
    # Prometheus, the checks whose series it holds); None: not known
    judging: frozenset[str] | None = None
    source: str = "api"  # where the evidence comes from: the node's API, or "prometheus" (gpumon.why.prom)
    notes: list[str] = field(default_factory=list)  # what the verdict must say about this node's evidence

    @property
    def reachable(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "url": self.url, "reachable": self.reachable, "error": self.error,
                "identity": self.identity, "events": len(self.events), "truncated": self.truncated,
                "history_from": self.history_from, "state": self.state, "seconds": round(self.seconds, 3),
                "clock_skew_s": None if self.clock_skew_s is None else round(self.clock_skew_s, 3),
                "clock_skew_error_s": None if self.clock_skew_error_s is None
                else round(self.clock_skew_error_s, 3),
                "judging": None if self.judging is None else sorted(self.judging), "source": self.source}


@dataclass(frozen=True)
class Access:
    """How to reach the nodes' APIs: the exporter's TLS and basic auth, seen from the client."""

    template: str = DEFAULT_TEMPLATE
    overrides: Mapping[str, str] = field(default_factory=dict)  # node -> base URL
    user: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def url(self, node: str) -> str:
        base = self.overrides.get(node)
        if base is None:
            base = self.template.replace("{node}", node)
        return base.rstrip("/")

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.cafile)
        if self.certfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "gpumon-why"}
        if self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        return headers


class Unanswered(Exception):
    """Why a request got no usable answer, in words for the verdict."""


def read_json(req: urllib.request.Request, timeout: float, ctx: ssl.SSLContext | None, *, auth_hint: str,
              timed_out: str, not_json: str) -> Any:
    """The JSON answer to ``req`` within ``timeout`` s, bounded to MAX_ANSWER_BYTES; every way it can
    fail is an ``Unanswered`` saying which (``auth_hint`` for a 401: the flags that give credentials)."""
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            body = resp.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = ""
        with contextlib.suppress(ValueError, AttributeError, OSError):
            detail = str(json.loads(exc.read(65536)).get("error", ""))
        hint = f" (basic auth refused: {auth_hint})" if exc.code == 401 else ""
        raise Unanswered(f"HTTP {exc.code} {exc.reason}{hint}" + (f": {detail}" if detail else "")) from None
    except urllib.error.URLError as exc:
        raise Unanswered(f"cannot connect: {exc.reason}") from None
    except TimeoutError:
        raise Unanswered(timed_out) from None
    except OSError as exc:  # ssl.SSLError too
        raise Unanswered(f"connection failed: {exc}") from None
    if len(body) > MAX_ANSWER_BYTES:
        raise Unanswered(f"answer larger than {MAX_ANSWER_BYTES} bytes")
    try:
        return json.loads(body)
    except ValueError:
        raise Unanswered(not_json) from None


def _get(url: str, access: Access, ctx: ssl.SSLContext | None, deadline: float) -> dict[str, Any]:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Unanswered("no answer within the per-node timeout")
    doc = read_json(urllib.request.Request(url, headers=access.headers()), left, ctx,
                    auth_hint="--user/--password-file", timed_out="no answer within the per-node timeout",
                    not_json="the answer is not JSON (is this gpumon's exporter, with the query API?)")
    if not isinstance(doc, dict) or doc.get("api") != 1:
        raise Unanswered("the answer is not gpumon's query API v1")
    return doc


def fetch_node(node: str, access: Access, since: float, until: float, timeout_s: float) -> NodeEvidence:
    url = access.url(node)
    ev = NodeEvidence(node, url)
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        ctx = access.ssl_context() if url.startswith("https:") else None
        asked = time.time()
        current = _get(f"{url}/api/v1/findings", access, ctx, deadline)
        answered = time.time()
        if isinstance(current.get("now"), (int, float)):
            ev.clock_skew_s = float(current["now"]) - (asked + answered) / 2
            ev.clock_skew_error_s = (answered - asked) / 2
        ev.identity = current.get("node")
        ev.findings = list(current.get("findings") or [])
        judging = current.get("checks_judging")
        if isinstance(judging, list):  # absent from an older daemon's answer: not known
            ev.judging = frozenset(str(c) for c in judging)
        health = current.get("health") or {}
        ev.faults = list(health.get("faults") or [])
        ev.state = health.get("state")
        seen: set[Any] = set()
        # the window is asked in the node's time: a node a minute ahead recorded the job's last
        # minute after "until" on its clock (widened, not shifted: the skew is measured now, and
        # may not have been the same all along)
        skew = ev.clock_skew_s or 0.0
        lo, hi = since + min(0.0, skew), until + max(0.0, skew)
        for _ in range(MAX_PAGES):
            query = urllib.parse.urlencode({"since": repr(lo), "until": repr(hi), "limit": PAGE_LIMIT})
            page = _get(f"{url}/api/v1/events?{query}", access, ctx, deadline)
            ev.history_from = page.get("history_from")
            for e in page.get("events") or []:
                if e.get("id") not in seen:
                    seen.add(e.get("id"))
                    ev.events.append(e)
            ev.truncated = bool(page.get("truncated"))
            if not ev.truncated or not page.get("events"):
                break
            lo = float(page["events"][-1]["time"])  # the next page starts at the last one's time
    except Unanswered as exc:
        ev.error = str(exc)
    except (ssl.SSLError, OSError, ValueError, KeyError, TypeError) as exc:
        ev.error = f"{type(exc).__name__}: {exc}"
    ev.seconds = time.monotonic() - start
    return ev


def collect(nodes: Sequence[str], access: Access, since: float, until: float, *, timeout_s: float = 10.0,
            workers: int = 64) -> list[NodeEvidence]:
    """Every node's evidence, in the order given; never fewer entries than nodes."""
    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(nodes))),
                            thread_name_prefix="gpumon-why") as pool:
        futures = [pool.submit(fetch_node, n, access, since, until, timeout_s) for n in nodes]
        return [f.result() for f in futures]
