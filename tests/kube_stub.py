"""A loopback stand-in for the Kubernetes API server, for tests that run the real official client.

No apiserver can run here. ``ApiStub`` is a small ``http.server`` on 127.0.0.1:0 that records every
request (method, path, query, content type, JSON body, Authorization) and answers with what its
subclass's ``_answer`` returns: the endpoints a test needs, as JSON shaped on real objects. These
stubs check **the wire format** (which requests the real client sends, and how gpumon reads real
answers), not apiserver semantics. ``fail``: HTTP statuses for the next requests, one each, with a
Kubernetes ``Status`` body; ``delay_s``: a slow apiserver.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str | None
    body: Any
    authorization: str | None = None


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` as the apiserver writes it for a refused request."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class ApiStub:
    """See the module docstring. Subclasses answer in ``_answer`` (called under ``self.lock``)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.fail: list[int] = []
        self.delay_s = 0.0  # a slow apiserver: each answer this late ...
        self.delay_match = ""  # ... of the requests whose path holds this
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stub._handle(self, "GET")

            def do_PATCH(self) -> None:
                stub._handle(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll so that shutdown() returns at once, not after the default 0.5 s
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def reset(self) -> None:
        self.requests.clear()

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        if self.delay_s and self.delay_match in parts.path:
            time.sleep(self.delay_s)
        with self.lock:
            self.requests.append(Request(method, parts.path, query, h.headers.get("Content-Type"), body,
                                         h.headers.get("Authorization")))
            if self.fail:
                code = self.fail.pop(0)
                answer = status_body(code, "InternalError", "etcdserver: request timed out")
            else:
                code, answer = self._answer(method, parts.path, query, h.headers.get("Content-Type"), body)
        data = json.dumps(answer).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        try:
            h.end_headers()
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting (a test of its timeout)

    def _answer(self, method: str, path: str, query: dict[str, str], ctype: str | None,
                body: Any) -> tuple[int, dict[str, Any]]:
        return 404, status_body(404, "NotFound", f"no route {path}")


@contextlib.contextmanager
def api_client(url: str, *, retries: int | None = None) -> Iterator[client.ApiClient]:
    """The official client on ``url``, with a configuration of its own (never the global default);
    ``retries`` as urllib3 takes it (None: its default, 3), read when the client is made."""
    configuration = client.Configuration()
    configuration.host = url
    configuration.retries = retries
    api = client.ApiClient(configuration)
    try:
        yield api
    finally:
        api.close()  # type: ignore[no-untyped-call]
