"""The guard's side of the daemon's intake (``gpumon.intake``): hand a verdict to this node's daemon
over its Unix socket, so that the daemon can attest it (the kernel tells the daemon which process
sent it, and the daemon checks that process against the GPU the verdict names).

``$GPUMON_INTAKE_SOCKET`` names the socket; unset or empty, ``/run/gpumon/intake.sock`` (the
daemon's ``daemon.intake_socket`` default). A job in a container reaches it where the host's
``/run/gpumon`` is mounted at the same path (or names the mount point in the variable). When the
daemon cannot be reached (no socket, nothing listening, no answer in time), the guard writes the
verdict to the spool instead (``gpumon.guard.verdict.write``), as before there was an intake:
``hand_over`` does both, for the guard.

Imports no torch: the CLI and the daemon's tests use it too. Bounded: connecting takes at most
``CONNECT_TIMEOUT_S``, the whole exchange ``EXCHANGE_TIMEOUT_S``; a training process waits no
longer than that for its node's daemon.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from gpumon.guard.verdict import Verdict, write
from gpumon.intake_protocol import DEFAULT_SOCKET, MAX_REQUEST_BYTES, IntakeReply

log = logging.getLogger("gpumon.guard")

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


def hand_over(v: Verdict, spool_dir: str | Path | None, files: list[Path]) -> None:
    """Hand this rank's verdict to its node's daemon and say how, in the job's log, at once: a
    launcher stops the other ranks when the first one exits, so a line printed after the alarm is
    raised may never be written (torchrun's SIGTERM), while this one is out before the ranks leave.

    Over the daemon's intake socket first (``send``, ``$GPUMON_INTAKE_SOCKET``): from this process,
    which holds the GPU the verdict names, so that the daemon can attest it. A daemon that cannot be
    reached, or that does not take the verdict, leaves it to the spool file (``files`` lists those
    written), judged as before. Never raises: the ranks must still leave the alarm together."""
    try:
        reply = send("guard", v.to_json())
    except Unreachable as exc:
        why = f"could not reach this node's daemon: {exc}"
    except Exception as exc:
        why = f"could not reach this node's daemon: {type(exc).__name__}: {exc}"
    else:
        if reply.accepted:
            said = "attested" if reply.attested else f"not attested: {reply.message}"
            log.warning("gpumon.guard: rank %d: verdict handed to this node's daemon (%s)", v.subject.rank,
                        said)
            return
        why = f"this node's daemon did not take the verdict: {reply.message}"
    try:
        path = write(v, spool_dir)
    except OSError as exc:
        log.error("gpumon.guard: rank %d: %s; could not write the %s verdict to the spool either: %s (is the "
                  "spool directory there and writable by this job?)", v.subject.rank, why, v.check, exc)
        return
    except Exception as exc:  # never out of an alarm: the ranks must still leave it together
        log.error("gpumon.guard: rank %d: %s; could not write the %s verdict to the spool either: %s: %s",
                  v.subject.rank, why, v.check, type(exc).__name__, exc)
        return
    files.append(path)
    # the line's start is what docs/guard/contract.md promises
    # ("verdict written for this node's daemon: PATH")
    log.warning("gpumon.guard: rank %d: verdict written for this node's daemon: %s (to the spool: %s)",
                v.subject.rank, path, why)
