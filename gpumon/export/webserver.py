"""HTTP(S) server for /metrics, with the exporter-toolkit web-config file.

Paths, as Prometheus exporters have them: ``/metrics`` the exposition, ``/`` a
small landing page linking to it, anything else 404; GET and HEAD only.
Each connection is served on its own thread, TLS handshake included, under a
socket timeout: an idle or slow client holds one thread for at most that long
per read and never the accept loop.

The web-config format is the one Prometheus exporters share
(prometheus/exporter-toolkit docs/web-configuration.md)::

    tls_server_config:
      cert_file: /etc/gpumon/tls.crt
      key_file: /etc/gpumon/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: /etc/gpumon/ca.crt             # optional
    basic_auth_users:
      prometheus: $2y$10$...                          # bcrypt hash

Unknown keys are errors with file, line and key, like gpumon's own config.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from gpumon.distribution import ExtraMissing, require
from gpumon.errors import ConfigError
from gpumon.schema import build, load_yaml_file

CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert",
                     "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
# Per socket operation: the TLS handshake, each read of the request, each write of
# the answer. Prometheus gives up on a scrape after 10 s by default, so a client
# that has sent nothing for that long is not a scrape that could still succeed.
CONNECTION_TIMEOUT_S = 10.0
# $2a$/$2b$/$2y$, a two-digit cost, 22 characters of salt and 31 of hash
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
# bcrypt reads only the first 72 bytes of a password; bcrypt >= 5 refuses longer ones
_BCRYPT_MAX_PASSWORD = 72


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = field(default="NoClientCert", metadata={"choices": CLIENT_AUTH_TYPES})
    client_ca_file: str | None = None
    min_version: str | None = field(default=None, metadata={"choices": ("TLS12", "TLS13", None)})


@dataclass(frozen=True)
class HttpServerConfig:
    http2: bool = True
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WebConfig:
    tls_server_config: TlsServerConfig | None = None
    http_server_config: HttpServerConfig | None = None
    basic_auth_users: dict[str, str] = field(default_factory=dict)


def load_web_config(path: Path) -> WebConfig:
    data, src = load_yaml_file(path)
    config = build(WebConfig, data, src)
    for user, hashed in config.basic_auth_users.items():
        if not _BCRYPT_HASH.fullmatch(hashed):
            raise ConfigError("basic_auth_users values must be bcrypt hashes ($2y$10$ and 53 characters, "
                              "as htpasswd -nB writes them)", file=str(path),
                              line=src.line(("basic_auth_users", user)), key=f"basic_auth_users.{user}")
    if config.basic_auth_users:
        try:
            _bcrypt()  # fail at startup, not at the first scrape
        except ExtraMissing as exc:
            raise ConfigError(str(exc), file=str(path), line=src.line(("basic_auth_users",)),
                              key="basic_auth_users") from None
    return config


def _bcrypt() -> Any:
    return require("bcrypt", extra="basic-auth", library="bcrypt", needed_by="basic auth")


class BasicAuth:
    """WSGI middleware checking HTTP basic auth against bcrypt hashes.

    bcrypt is slow on purpose (~100 ms at cost 10); a scrape every 15 s must not
    pay that each time, so a verified (user, password) pair is remembered by a
    keyed digest of the password, never the password itself.

    A wrong user name costs the same bcrypt verification as a wrong password:
    answering it at once (~5 ms against ~90 ms) told the user names apart.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], users: dict[str, str]) -> None:
        self.app = app
        self.users = users
        self._bcrypt = _bcrypt()
        self._key = hashlib.sha256(repr(sorted(users.items())).encode()).digest()
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()
        # Verified against for an unknown user, its answer thrown away: a configured
        # hash, the costliest, so that the time spent is that of a real user's check.
        self._decoy = max(users.values(), key=lambda h: int(h[4:6]), default="").encode()

    def _ok(self, header: str) -> bool:
        if not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        secret = password.encode()
        if hashed is None or len(secret) > _BCRYPT_MAX_PASSWORD:
            if self._decoy:
                self._bcrypt.checkpw(b"", self._decoy)
            return False
        token = hmac.new(self._key, f"{user}\0{password}".encode(), "sha256").digest()
        with self._lock:
            if token in self._verified:
                return True
        if not self._bcrypt.checkpw(secret, hashed.encode()):
            return False
        with self._lock:
            self._verified.add(token)
        return True

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self._ok(environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="gpumon"'),
                                            ("Content-Type", "text/plain")])
        return [b"Unauthorized\n"]


_LANDING = b"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>gpumon exporter</title></head>
<body>
<h1>gpumon exporter</h1>
<p>GPU node health checks. <a href="metrics">Metrics</a></p>
%API%
</body>
</html>
"""


def _answer(start_response: Callable[..., Any], status: str, content_type: str, body: bytes,
            *extra: tuple[str, str]) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *extra])
    return [body]


class Routes:
    """WSGI app: ``/metrics`` is ``metrics``, ``/`` a landing page, ``/api/...`` the query API
    (``api``, gpumon.export.api) when the daemon serves one, anything else 404.

    Serving the exposition on every path hid typos in scrape configs (a job
    scraping ``/metric`` got data) and left nothing to show a browser. The
    landing page links relatively ("metrics") so that it also works behind a
    reverse proxy that serves the exporter under a path prefix.
    """

    def __init__(self, metrics: Callable[..., Iterable[bytes]],
                 api: Callable[..., Iterable[bytes]] | None = None) -> None:
        self.metrics = metrics
        self.api = api
        self.landing = _LANDING.replace(b"%API%\n", b"" if api is None else (
            b'<p>Query API (JSON): <a href="api/v1/findings">api/v1/findings</a>, '
            b'<a href="api/v1/events">api/v1/events</a>; its OpenAPI document: '
            b'<a href="api/v1/openapi.json">api/v1/openapi.json</a></p>\n'))

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self.metrics(environ, start_response)
        if self.api is not None and path.startswith("/api/"):
            return self.api(environ, start_response)
        if path == "/":
            return _answer(start_response, "200 OK", "text/html; charset=utf-8", self.landing)
        return _answer(start_response, "404 Not Found", "text/plain; charset=utf-8", b"404 page not found\n")


class GetOrHead:
    """WSGI middleware, outermost: GET and HEAD only; HEAD is a GET without the body.

    Outermost so that every answer, a 401 or a 404 too, follows the rule.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", "text/plain; charset=utf-8",
                           b"method not allowed\n", ("Allow", "GET, HEAD"))
        body = self.app(environ, start_response)
        if method == "GET":
            return body
        # the GET's status and headers, Content-Length included, and no body (RFC 9110 9.3.2)
        close = getattr(body, "close", None)
        if close is not None:
            close()
        return []


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the journal


class MetricsServer(ThreadingWSGIServer):
    """Thread per connection; TLS is handshaken on that thread, never in accept().

    Wrapping the listening socket made accept() do the handshake on the one
    thread that accepts, with no timeout: a client that connected and sent
    nothing stopped every scrape.
    """

    # Connection threads are daemons; shutting down must not wait for a slow client.
    block_on_close = False
    # socketserver's 5 let a burst of connections fill the queue faster than the
    # accept loop drains it; a scrape's SYN then was dropped and retried 1 s later.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler],
                 tls: ssl.SSLContext | None = None, timeout_s: float = CONNECTION_TIMEOUT_S) -> None:
        self.tls = tls
        self.timeout_s = timeout_s
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = self.socket.accept()
        conn.settimeout(self.timeout_s)
        return conn, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        # The plain socket is detached into the TLS one; closing that one is ours.
        conn = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        try:
            conn.do_handshake()  # under the socket timeout set in get_request
            super().finish_request(conn, client_address)
        finally:
            self.shutdown_request(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out, reset, or failed the TLS handshake is no
        # fault of ours; a traceback per such connection would flood the journal.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


def _tls_context(tls: TlsServerConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if tls.min_version == "TLS13":
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_auth_type != "NoClientCert":
        if tls.client_ca_file:
            ctx.load_verify_locations(tls.client_ca_file)
        required = tls.client_auth_type in ("RequireAnyClientCert", "RequireAndVerifyClientCert")
        ctx.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL
    return ctx


def serve_metrics(registry: CollectorRegistry | Callable[..., Iterable[bytes]], address: str, port: int,
                  web: WebConfig | None = None, *, timeout_s: float = CONNECTION_TIMEOUT_S,
                  api: Callable[..., Iterable[bytes]] | None = None
                  ) -> tuple[MetricsServer, threading.Thread]:
    """Start serving /metrics on a daemon thread; returns the server (``shutdown()`` stops it).

    ``registry`` is a registry (rendered per scrape) or a WSGI app such as
    ``CachedExposition``. ``timeout_s`` bounds each socket operation of a
    connection, the TLS handshake included. ``api``: the query API's WSGI app
    (``/api/...``), behind the same TLS and basic auth as /metrics.
    """
    app: Callable[..., Iterable[bytes]] = Routes(
        make_wsgi_app(registry) if isinstance(registry, CollectorRegistry) else registry, api)
    web = web or WebConfig()
    if web.basic_auth_users:
        app = BasicAuth(app, web.basic_auth_users)
    app = GetOrHead(app)
    tls = _tls_context(web.tls_server_config) if web.tls_server_config is not None else None
    httpd = MetricsServer((address, port), _QuietHandler, tls, timeout_s)
    httpd.set_app(app)
    thread = threading.Thread(target=httpd.serve_forever, name="gpumon-metrics", daemon=True)
    thread.start()
    return httpd, thread
