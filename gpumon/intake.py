"""The daemon's intake: documents that local processes hand to a check, over a Unix socket.

A training job's guard hands its verdict to the node's daemon here rather than as a file in a
world-writable spool, so that the daemon can say who sent it: the kernel tells it the sender's pid,
uid and gid (``SO_PEERCRED``, read on the accepted socket; nothing the sender writes can change
them), and the check the document is for judges the document and the sender together (the guard
check: does that pid hold a compute context on the GPU its verdict names?).

Protocol, one request per connection::

    -> {"check": "<name>", "document": {...}}      one JSON object, then EOF (shutdown of the
                                                   write side) or a newline; at most 1 MiB
    <- {"accepted": bool, "attested": bool, "message": "..."}\\n

Any local process may connect (the socket is 0666 in a 0755 root directory): what it sends is
judged, never trusted. So every connection is bounded: a few served at once (the next is told the
daemon is busy), a number per uid per minute (``daemon.intake_per_uid_per_min``), the request read
within 2 s, at most 1 MiB. Bad input of any kind (not JSON, unknown check, a check that takes no
documents, too large, nothing sent) gets a reply that says why and one line in the daemon's log;
nothing a client does ends the server or the daemon.

This module imports nothing heavy: the in-job client (``gpumon.guard.handover``) reads the reply
with :class:`IntakeReply`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumon.intake_protocol import DEFAULT_SOCKET, MAX_REQUEST_BYTES, IntakeReply, Peer, refused

if TYPE_CHECKING:
    from gpumon.check import Check, CheckContext

log = logging.getLogger("gpumon.intake")

# what a client and the daemon share, from gpumon.intake_protocol (the guard's side imports no daemon)
__all__ = ["DEFAULT_SOCKET", "MAX_REQUEST_BYTES", "IntakeReply", "Peer", "refused"]

# A client writes its request at once (it has it in memory); 2 s is far beyond that on a loaded
# node, and short enough that a silent client holds a slot only briefly.
READ_TIMEOUT_S = 2.0
# Connections served at once. A node's jobs hand over one verdict per named rank per alarm (8 GPUs:
# at most 8 at one moment, and an intake takes milliseconds); a slot holds at most READ_TIMEOUT_S
# plus one bounded NVML call, so 4 keeps an alarm's verdicts moving while a flood of idle
# connections costs the daemon at most 4 threads and 4 MiB.
MAX_CONNECTIONS = 4
# sun_path is 108 bytes with its terminating NUL on Linux
MAX_PATH_BYTES = 107
# the reply's message is a sentence, not a dump of what the client sent
MAX_MESSAGE = 2000
# SO_PEERCRED's struct ucred: pid_t, uid_t, gid_t
_UCRED = struct.Struct("iII")
# include/uapi/asm-generic/socket.h (Linux 6.5); Python names it from 3.13 on
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


class IntakeUnavailable(RuntimeError):
    """The intake socket cannot be served at this path; says why."""


def dispatch(checks: Sequence[Check], known: Sequence[str], name: str, document: dict[str, Any],
             peer: Peer, context: Callable[[Check], CheckContext]) -> IntakeReply:
    """Hand ``document`` to the check called ``name`` among ``checks`` (the daemon's running ones;
    ``known``: every check this gpumon has, to tell a disabled one from a misspelt one)."""
    check = next((c for c in checks if c.name == name), None)
    if check is None:
        if name in known:
            return refused(f"check {name!r} does not run in this daemon (disabled in its configuration)")
        return refused(f"no check named {name!r} in this daemon")
    if not check.accepts_documents():
        return refused(f"check {name!r} takes no documents")
    return check.intake(document, peer, context(check))


def peer_of(conn: socket.socket) -> Peer:
    """The peer of ``conn``, with its pidfd where the kernel gives one (the caller closes it)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    try:
        user: str | None = pwd.getpwuid(uid).pw_name
    except KeyError:  # a container's uid the daemon's passwd does not name
        user = None
    pidfd: int | None = None
    exited = False
    if pid > 0:
        try:
            pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError as exc:
            # ESRCH or EINVAL (by kernel version): the process that connected was reaped (newer
            # kernels give a pidfd of it, which polls as exited); ENOPROTOOPT before Linux 6.5
            exited = exc.errno in (errno.ESRCH, errno.EINVAL)
    return Peer(pid, uid, gid, user, pidfd, exited)


class _Refusal(Exception):
    """A request refused before it reached a check; the message is the reply's."""


class PerUidLimit:
    """At most ``limit`` requests per uid in any ``window_s`` (a sliding window)."""

    def __init__(self, limit: int, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._seen: dict[int, deque[float]] = {}
        self._lock = threading.Lock()

    def allow(self, uid: int) -> bool:
        now = self._clock()
        with self._lock:
            if len(self._seen) > 4096:  # uids of a node are few; forget the idle ones all the same
                self._seen = {u: q for u, q in self._seen.items() if q and now - q[-1] < self.window_s}
            times = self._seen.setdefault(uid, deque())
            while times and now - times[0] >= self.window_s:
                times.popleft()
            if len(times) >= self.limit:
                return False
            times.append(now)
            return True


def check_directory(directory: Path) -> None:
    """Create ``directory`` (0755) when missing; refuse one that another uid owns or that others
    may write: whoever can write the socket's directory can replace the socket and be the
    "daemon" every job hands its verdicts to."""
    if not directory.exists():
        try:
            directory.mkdir(mode=0o755, parents=True)
            os.chmod(directory, 0o755)  # the daemon's umask (systemd's UMask=0077) must not narrow it
        except OSError as exc:
            raise IntakeUnavailable(f"cannot create its directory {directory}: {exc.strerror or exc}") \
                from None
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise IntakeUnavailable(f"{directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise IntakeUnavailable(f"its directory {directory} is owned by uid {st.st_uid}, not by this "
                                f"daemon's uid {os.geteuid()}: its owner could replace the socket (use a "
                                "directory of the daemon's own, e.g. /run/gpumon)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise IntakeUnavailable(f"its directory {directory} is writable by others (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}): any of them could replace the socket "
                                "(use a directory of the daemon's own, mode 0755, e.g. /run/gpumon)")


class IntakeServer:
    """Serves the intake on ``path`` until :meth:`stop`. ``handle(check name, document, peer)``
    gives the reply (run on the connection's own thread, at most ``max_connections`` at once);
    whatever it raises is refused with its type and message, and logged."""

    def __init__(self, path: str | Path, handle: Callable[[str, dict[str, Any], Peer], IntakeReply], *,
                 per_uid_per_min: int, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.path = Path(path)
        self._handle = handle
        self._limit = PerUidLimit(per_uid_per_min)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._read_timeout_s = read_timeout_s
        self._stopping = threading.Event()
        self._workers: set[threading.Thread] = set()
        self._workers_lock = threading.Lock()
        # refusals that a flood repeats are logged once per minute each, with the count since
        self._quiet: dict[str, tuple[float, int]] = {}
        if len(os.fsencode(str(self.path))) > MAX_PATH_BYTES:
            raise IntakeUnavailable(f"the path is longer than a Unix socket's {MAX_PATH_BYTES} bytes")
        check_directory(self.path.parent)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            # any local process may hand a document over: what it sends is judged, and who it is
            # comes from the kernel, not from the document
            os.chmod(self.path, 0o666)
            sock.listen(16)
        except OSError:
            sock.close()
            raise
        self._inode = os.stat(self.path).st_ino
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="gpumon-intake", daemon=True)
        self._thread.start()

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise IntakeUnavailable(f"{self.path} exists and is not a socket (not removed: remove it, or "
                                    "name another path)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise IntakeUnavailable(f"cannot tell whether {self.path} is served: {exc.strerror or exc}") \
                    from None
        else:
            raise IntakeUnavailable(f"another process serves {self.path} (a second gpumon daemon?)")
        finally:
            probe.close()
        # a socket nobody listens on: left by a daemon that died
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # -- serving ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # out of descriptors or memory, mostly: said once a minute, and tried again shortly
                # rather than at once (the error would repeat as fast as accept returns)
                self._say_once("accept", f"intake: cannot accept a connection: {exc.strerror or exc}")
                self._stopping.wait(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                self._say_once("busy", f"intake: {self._max_connections} connections being served: further "
                                       "ones refused (busy)")
                self._reply(conn, refused(f"the daemon is serving {self._max_connections} other connections: "
                                          "busy, try again"), timeout=0.2)
                continue
            worker = threading.Thread(target=self._serve, args=(conn,), name="gpumon-intake-conn",
                                      daemon=True)
            with self._workers_lock:
                self._workers.add(worker)
            try:
                worker.start()
            except RuntimeError:  # no thread to be had: the client is told, the daemon goes on
                with self._workers_lock:
                    self._workers.discard(worker)
                self._slots.release()
                self._reply(conn, refused("the daemon cannot start a thread for this connection"),
                            timeout=0.2)

    def _serve(self, conn: socket.socket) -> None:
        reply: IntakeReply | None = None
        try:
            reply = self._answer(conn)
        except Exception:  # the server's own bug: logged, and the next connection is served
            log.exception("intake: serving a connection")
        finally:
            # the slot is free before the client has its answer: a client that sends its next
            # request as soon as it reads this one's is never told the daemon is busy with it
            self._slots.release()
        try:
            if reply is not None:
                self._reply(conn, reply, timeout=self._read_timeout_s)
            else:
                with contextlib.suppress(OSError):
                    conn.close()
        finally:
            with self._workers_lock:
                self._workers.discard(threading.current_thread())

    def _answer(self, conn: socket.socket) -> IntakeReply:
        peer: Peer | None = None
        try:
            peer = peer_of(conn)
            if not self._limit.allow(peer.uid):
                self._say_once(f"uid:{peer.uid}", f"intake: uid {peer.uid} sent more than "
                               f"{self._limit.limit} requests within a minute: refused "
                               "(daemon.intake_per_uid_per_min)")
                return refused(f"more than {self._limit.limit} requests from uid {peer.uid} within a "
                               "minute: refused (daemon.intake_per_uid_per_min)")
            name, document = self._request(conn)
            return self._judge(name, document, peer)
        except _Refusal as why:
            log.info("intake: refused a request from %s: %s", peer.describe() if peer else "?", why)
            return refused(str(why))
        except OSError as exc:  # the client went away, or the socket failed
            reply = refused(f"cannot read the request: {exc.strerror or exc}")
            log.info("intake: %s: %s", peer.describe() if peer else "a client", reply.message)
            return reply
        finally:
            if peer is not None and peer.pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(peer.pidfd)

    def _judge(self, name: str, document: dict[str, Any], peer: Peer) -> IntakeReply:
        try:
            reply = self._handle(name, document, peer)
        except Exception as exc:  # a check's bug on one document refuses that document, nothing more
            log.error("intake: check %s failed on a document from %s: %s: %s", name, peer.describe(),
                      type(exc).__name__, exc)
            log.debug("intake: check %s failed", name, exc_info=True)
            return refused(f"check {name!r} failed on this document: {type(exc).__name__}: {exc}")
        if reply.accepted:
            said, level = "accepted (attested)" if reply.attested else "accepted (not attested)", logging.INFO
        else:
            said, level = "refused", logging.WARNING
        log.log(level, "intake: %s for check %s from %s: %s", said, name, peer.describe(), reply.message)
        return reply

    def _request(self, conn: socket.socket) -> tuple[str, dict[str, Any]]:
        deadline = time.monotonic() + self._read_timeout_s
        buf = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refusal(f"no complete request within {self._read_timeout_s:g} s (end it with a "
                               "newline or by shutting down the write side)")
            conn.settimeout(left)
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue  # the deadline says so, above
            if not chunk:
                break
            end = chunk.find(b"\n")
            buf += chunk if end < 0 else chunk[:end]
            if len(buf) > MAX_REQUEST_BYTES:
                raise _Refusal(f"the request is larger than {MAX_REQUEST_BYTES} bytes: not a document")
            if end >= 0:
                break
        if not buf.strip():
            raise _Refusal("empty request: send one JSON object {\"check\": NAME, \"document\": {...}}")
        try:
            data = json.loads(bytes(buf).decode("utf-8"))
        except ValueError as exc:  # not UTF-8, not JSON, or an integer of more digits than Python reads
            raise _Refusal(f"the request is not JSON this daemon reads: {exc}"[:MAX_MESSAGE]) from None
        except RecursionError:
            raise _Refusal("the request is not JSON this daemon reads: nested too deeply") from None
        if not isinstance(data, dict) or not isinstance(data.get("check"), str) \
                or not isinstance(data.get("document"), dict):
            raise _Refusal("the request must be one JSON object {\"check\": NAME, \"document\": {...}}")
        return data["check"], data["document"]

    def _reply(self, conn: socket.socket, reply: IntakeReply, *, timeout: float) -> None:
        message = reply.message
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE - 3] + "..."
        line = json.dumps({**reply.to_json(), "message": message}) + "\n"
        try:
            conn.settimeout(timeout)
            conn.sendall(line.encode())
        except OSError:
            pass  # the client left without its answer: what it sent was judged all the same
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _say_once(self, key: str, message: str) -> None:
        now = time.monotonic()
        last, count = self._quiet.get(key, (-1e9, 0))
        if now - last >= 60.0:
            log.warning("%s%s", message, f" ({count} more since the last such line)" if count else "")
            self._quiet[key] = (now, 0)
        else:
            self._quiet[key] = (last, count + 1)

    def stop(self, timeout: float = 3.0) -> None:
        """Stop accepting, wait up to ``timeout`` for the connections being served, and remove the
        socket (only the one this server made: another daemon's at the same path is left)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._sock.close()
        self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        with self._workers_lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode:
                self.path.unlink()
