"""The guard's side of the daemon's intake (``gpumon.intake``): hand a verdict to this node's daemon
over its Unix socket, so that the daemon can attest it (the kernel tells the daemon which process
sent it, and the daemon checks that process against the GPU the verdict names).

``$GPUMON_INTAKE_SOCKET`` names the socket; unset or empty, ``/run/gpumon/intake.sock`` (the
daemon's ``daemon.intake_socket`` default). A job in a container reaches it where the host's
``/run/gpumon`` is mounted at the same path (or names the mount point in the variable). When the
daemon cannot be reached (no socket, nothing listening, no answer in time), the guard writes the
verdict to the spool instead (``gpumon.guard.verdict.write``), as before there was an intake.

Imports no torch: the CLI and the daemon's tests use it too. Bounded: connecting takes at most
``CONNECT_TIMEOUT_S``, the whole exchange ``EXCHANGE_TIMEOUT_S``; a training process waits no
longer than that for its node's daemon.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from gpumon.intake_protocol import DEFAULT_SOCKET, MAX_REQUEST_BYTES, IntakeReply

SOCKET_ENV = "GPUMON_INTAKE_SOCKET"
# A daemon on the same node accepts within microseconds; a second means it is wedged or gone, and
# the alarm that hands the verdict over must not wait on it.
CONNECT_TIMEOUT_S = 1.0
# The daemon reads the request within 2 s and answers after one bounded NVML call (its list of the
# GPU's compute processes); 5 s covers both on a loaded node and still keeps the alarm short.
EXCHANGE_TIMEOUT_S = 5.0
# a reply is one short JSON line
MAX_REPLY_BYTES = 64 << 10


class Unreachable(Exception):
    """No answer from the daemon (no socket, nothing listening, no reply in time); says why."""


def socket_path(explicit: str | None = None) -> str:
    """``explicit``, else ``$GPUMON_INTAKE_SOCKET``, else the daemon's default."""
    return explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def send(check: str, document: dict[str, Any], path: str | None = None, *,
         connect_timeout_s: float = CONNECT_TIMEOUT_S, timeout_s: float = EXCHANGE_TIMEOUT_S) -> IntakeReply:
    """Hand ``document`` to the daemon's check ``check``; the daemon's reply. Raises ``Unreachable``."""
    where = socket_path(path)
    payload = json.dumps({"check": check, "document": document}, sort_keys=True).encode() + b"\n"
    if len(payload) > MAX_REQUEST_BYTES:
        raise Unreachable(f"the document is larger than the intake takes ({MAX_REQUEST_BYTES} bytes)")
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(min(connect_timeout_s, timeout_s))
        try:
            sock.connect(where)
        except FileNotFoundError:
            raise Unreachable(f"no socket at {where} (no gpumon daemon with an intake on this node, or "
                              f"${SOCKET_ENV} does not name where it is mounted)") from None
        except ConnectionRefusedError:
            raise Unreachable(f"nothing listens on {where} (the daemon is not running)") from None
        except TimeoutError:
            raise Unreachable(f"{where} did not accept within {connect_timeout_s:g} s") from None
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered without reading (busy, or this uid's limit): the answer says so
        reply = bytearray()
        while b"\n" not in reply and len(reply) <= MAX_REPLY_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        raise Unreachable(f"no answer from {where} within {timeout_s:g} s") from None
    except OSError as exc:
        raise Unreachable(f"{where}: {exc.strerror or exc}") from None
    finally:
        sock.close()
    try:
        return IntakeReply.from_json(json.loads(bytes(reply).split(b"\n", 1)[0].decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as exc:
        raise Unreachable(f"{where} answered what is not an intake reply ({exc})") from None
