"""HTTP(S) server for /metrics, with the exporter-toolkit web-config file.

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
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import CollectorRegistry

from gpumon.errors import ConfigError
from gpumon.schema import build, load_yaml_file

CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert",
                     "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


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
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError("basic_auth_users values must be bcrypt hashes ($2y$...)", file=str(path),
                              line=src.line(("basic_auth_users", user)), key=f"basic_auth_users.{user}")
    if config.basic_auth_users:
        _bcrypt()  # fail at startup, not at the first scrape
    return config


def _bcrypt() -> Any:
    try:
        import bcrypt
    except ImportError:
        raise ConfigError("basic_auth_users needs the bcrypt package (pip install bcrypt)") from None
    return bcrypt


class BasicAuth:
    """WSGI middleware checking HTTP basic auth against bcrypt hashes.

    bcrypt is slow on purpose (~100 ms at cost 10); a scrape every 15 s must not
    pay that each time, so a verified (user, password) pair is remembered by a
    keyed digest of the password, never the password itself.
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], users: dict[str, str]) -> None:
        self.app = app
        self.users = users
        self._bcrypt = _bcrypt()
        self._key = hashlib.sha256(repr(sorted(users.items())).encode()).digest()
        self._verified: set[bytes] = set()
        self._lock = threading.Lock()

    def _ok(self, header: str) -> bool:
        if not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        token = hmac.new(self._key, f"{user}\0{password}".encode(), "sha256").digest()
        with self._lock:
            if token in self._verified:
                return True
        if not self._bcrypt.checkpw(password.encode(), hashed.encode()):
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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood the journal


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
                  web: WebConfig | None = None) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Start serving /metrics on a daemon thread; returns the server (``shutdown()`` stops it).

    ``registry`` is a registry (rendered per scrape) or a WSGI app such as
    ``CachedExposition``.
    """
    app: Callable[..., Iterable[bytes]] = (make_wsgi_app(registry) if isinstance(registry, CollectorRegistry)
                                           else registry)
    if web is not None and web.basic_auth_users:
        app = BasicAuth(app, web.basic_auth_users)
    httpd = make_server(address, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    if web is not None and web.tls_server_config is not None:
        httpd.socket = _tls_context(web.tls_server_config).wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, name="gpumon-metrics", daemon=True)
    thread.start()
    return httpd, thread
