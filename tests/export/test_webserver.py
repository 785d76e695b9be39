"""The exporter's HTTP(S) server against hostile and odd clients, on real sockets (issue 14)."""

from __future__ import annotations

import base64
import gzip
import http.client
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import run_gpumon
from gpumon.errors import ConfigError
from gpumon.export.prometheus import CachedExposition, Snapshot, SnapshotHolder
from gpumon.export.webserver import WebConfig, load_web_config, serve_metrics
from gpumon.model import CheckRun, Finding, Severity, reading

Serve = Callable[..., int]  # serve(web, **serve_metrics options) -> port


def _holder() -> SnapshotHolder:
    f = Finding("thermal", "gpu/0", Severity.OK, "fine",
                evidence={"readings": [reading("gpu_temperature_celsius", 41.0)]})
    return SnapshotHolder(Snapshot("node-a", "h100-sxm", "0.1.0",
                                   {"thermal": CheckRun("thermal", [f], 1000.0, 0.01, "completed")},
                                   {"node": ("healthy", "none")}))


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "tls.key", d / "tls.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(crt), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, crt


def _web(tmp_path: Path, text: str) -> WebConfig:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return load_web_config(path)


def _tls(tmp_path: Path, cert: tuple[Path, Path], extra: str = "") -> WebConfig:
    key, crt = cert
    return _web(tmp_path, f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n{extra}")


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[Any] = []

    def start(web: WebConfig | None = None, **kw: float) -> int:
        server, _ = serve_metrics(CachedExposition(_holder()), "127.0.0.1", 0, web, **kw)
        servers.append(server)
        return int(server.server_port)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _https_get(port: int, crt: Path, path: str = "/metrics", timeout: float = 5,
               headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(crt))
    req = urllib.request.Request(f"https://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def _closed_by_server_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``sock`` (EOF or reset); fails after ``seconds``."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept an idle connection open for {seconds} s")
    return time.monotonic() - start


# ----------------------------------------------------------------------------- TLS handshakes

def test_idle_tcp_connections_do_not_stop_tls_scrapes(tmp_path: Path, cert: tuple[Path, Path], serve: Serve,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    port = serve(_tls(tmp_path, cert))
    start = time.monotonic()
    idle = _idle(port, 200)  # connected, never a ClientHello: one of them stopped every scrape
    assert time.monotonic() - start < 3  # a burst is accepted at once, not a few per second
    try:
        for _ in range(3):
            start = time.monotonic()
            status, body = _https_get(port, cert[1])
            assert status == 200 and b"gpumon_gpu_temperature_celsius" in body
            assert time.monotonic() - start < 3
    finally:
        for s in idle:
            s.close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_connection_that_never_handshakes_is_closed_after_the_timeout(
        tmp_path: Path, cert: tuple[Path, Path], serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    port = serve(_tls(tmp_path, cert), timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
        waited = _closed_by_server_within(silent, 10)
    assert 0.5 <= waited < 5
    # a half-sent handshake too: the first bytes of a TLS record, then nothing
    with socket.create_connection(("127.0.0.1", port), timeout=5) as stalled:
        stalled.sendall(b"\x16\x03\x01\x02\x00")
        assert _closed_by_server_within(stalled, 10) < 5
    assert _https_get(port, cert[1])[0] == 200  # and the server still serves
    assert "Traceback" not in capsys.readouterr().err  # a client's timeout is not our error


def test_slowloris_on_plain_http_blocks_nothing_and_is_dropped(serve: Serve) -> None:
    port = serve(WebConfig(), timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the end of the headers never comes
        start = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
        assert time.monotonic() - start < 3
        assert _closed_by_server_within(slow, 10) < 5


def test_shutdown_does_not_wait_for_a_silent_client() -> None:
    server, _ = serve_metrics(CachedExposition(_holder()), "127.0.0.1", 0, WebConfig(), timeout_s=30)
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5):
        time.sleep(0.2)  # accepted, its thread waiting for a request line
        start = time.monotonic()
        server.shutdown()
        server.server_close()
        assert time.monotonic() - start < 5  # the daemon's stop joined every connection thread


# ----------------------------------------------------------------------------- basic auth

def _cpu_cost(port: int, crt: Path, user: str, password: str) -> tuple[int, float]:
    """Status of one request and the CPU seconds this process (client and server threads)
    spent on it: the work the server did for the credentials, which a neighbour's load on the
    machine does not change the way it changes wall time."""
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    start = time.process_time()
    status, _ = _https_get(port, crt, headers={"Authorization": f"Basic {auth}"})
    return status, time.process_time() - start


def test_an_unknown_user_costs_as_much_as_a_wrong_password(tmp_path: Path, cert: tuple[Path, Path],
                                                           serve: Serve) -> None:
    import bcrypt

    # cost 11: ~0.1-0.2 s of CPU per check, far above the few ms of a request's TLS, so that
    # the difference an early "no such user" made (~5 ms against ~90 ms) cannot hide in noise
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=11)).decode()
    other = bcrypt.hashpw(b"other", bcrypt.gensalt(rounds=4)).decode()
    port = serve(_tls(tmp_path, cert, f"basic_auth_users:\n  prom: '{hashed}'\n  probe: '{other}'\n"))
    wrong, unknown, too_long = [], [], []
    for _ in range(3):  # interleaved, so that a change in the machine's pace hits all three alike
        wrong.append(_cpu_cost(port, cert[1], "prom", "nope"))
        unknown.append(_cpu_cost(port, cert[1], "nobody", "nope"))
        too_long.append(_cpu_cost(port, cert[1], "prom", "x" * 100))
    assert {s for s, _ in wrong + unknown + too_long} == {401}
    floor = min(t for _, t in wrong)
    # min of each: the least disturbed request; the unknown user pays the costliest hash
    assert min(t for _, t in unknown) > 0.5 * floor, (wrong, unknown)
    assert min(t for _, t in too_long) > 0.5 * floor, (wrong, too_long)
    assert _cpu_cost(port, cert[1], "prom", "s3cret")[0] == 200


def test_bcrypt_hashes_are_checked_when_the_web_config_is_read(tmp_path: Path) -> None:
    for bad in ("$2y$10$short", "$2y$99$" + "a" * 53, "plaintext"):
        with pytest.raises(ConfigError, match="bcrypt") as info:
            _web(tmp_path, f"basic_auth_users:\n  probe: '{bad}'\n")
        assert (info.value.line, info.value.key) == (2, "basic_auth_users.probe")


# ----------------------------------------------------------------------------- paths

def _request(port: int, method: str, path: str,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_metrics_only_at_metrics_a_landing_page_at_root_404_elsewhere(serve: Serve) -> None:
    port = serve(WebConfig())
    status, headers, body = _request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"gpumon_gpu_temperature_celsius" in body
    status, headers, body = _request(port, "GET", "/metrics?x=1")
    assert status == 200 and b"gpumon_build_info" in body

    status, headers, body = _request(port, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"<title>gpumon exporter</title>" in body and b'href="metrics"' in body
    assert b"gpumon_" not in body

    for path in ("/foo", "/metrics/", "/metric", "/favicon.ico", "/index.html"):
        status, _, body = _request(port, "GET", path)
        assert status == 404 and b"gpumon_" not in body, path

    # HEAD is GET without the body: same status, same length
    for path, want in (("/metrics", 200), ("/", 200), ("/foo", 404)):
        _, get_headers, get_body = _request(port, "GET", path)
        status, headers, body = _request(port, "HEAD", path)
        assert (status, body) == (want, b""), path
        assert headers["content-length"] == get_headers["content-length"] == str(len(get_body)), path

    status, headers, _ = _request(port, "POST", "/metrics")
    assert status == 405 and headers["allow"] == "GET, HEAD"


def test_metrics_keeps_gzip_and_openmetrics_negotiation(serve: Serve) -> None:
    port = serve(WebConfig())
    status, headers, body = _request(port, "GET", "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert b"gpumon_gpu_temperature_celsius" in gzip.decompress(body)
    status, headers, body = _request(port, "GET", "/metrics",
                                     {"Accept": "application/openmetrics-text;version=1.0.0"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_auth_guards_every_path(tmp_path: Path, serve: Serve) -> None:
    import bcrypt

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    port = serve(_web(tmp_path, f"basic_auth_users:\n  prom: '{hashed}'\n"))
    good = {"Authorization": "Basic " + base64.b64encode(b"prom:s3cret").decode()}
    for path in ("/", "/metrics", "/foo"):
        assert _request(port, "GET", path)[0] == 401, path
    assert [_request(port, "GET", p, good)[0] for p in ("/", "/metrics", "/foo")] == [200, 200, 404]
    status, _, body = _request(port, "HEAD", "/metrics")
    assert (status, body) == (401, b"")


# ----------------------------------------------------------------------------- the web-config file

def test_alias_bomb_web_config_exits_3_at_once_naming_the_file(tmp_path: Path) -> None:
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    web = tmp_path / "web.yml"
    web.write_text("\n".join(lines) + "\n")
    config = tmp_path / "gpumon.yaml"
    config.write_text(f"exporter:\n  web_config_file: {web}\n")
    start = time.monotonic()
    proc = run_gpumon("daemon", "--config", str(config), "--simulate", "healthy-8xh100", "--duration", "3",
                      "--listen", "127.0.0.1:0", timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert f"{web}:5:" in proc.stderr and "aliases expand to more than" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20
