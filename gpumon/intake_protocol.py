"""The intake's wire protocol (gpumon.intake): what a local process and the daemon share.

A base module with no gpumon imports, so that the guard inside a training job (gpumon.guard.handover),
the check framework and the checks can name the socket, the reply and the sender without importing the
daemon's server.
"""

from __future__ import annotations

import select
from dataclasses import dataclass, field
from typing import Any

# the guard's default too (gpumon.guard.handover): the daemon and the jobs meet there unconfigured
DEFAULT_SOCKET = "/run/gpumon/intake.sock"
# The largest request read: a guard verdict is a few KiB and gpumon.guard.verdict.MAX_BYTES (1 MiB)
# is the most the daemon reads of one; more is not a document, and must not cost the daemon memory.
MAX_REQUEST_BYTES = 1 << 20

@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection, as the kernel says (``SO_PEERCRED``): its pid in
    the daemon's PID namespace (0: the sender's namespace cannot be seen from the daemon's, e.g. a
    container's when the daemon runs without the host's PID namespace), its uid and gid in the
    daemon's user namespace, and the uid's name where the daemon's passwd has one."""

    pid: int
    uid: int
    gid: int
    user: str | None = None
    # the sender's pidfd (SO_PEERPIDFD, Linux 6.5), open while its request is judged; None before
    pidfd: int | None = field(default=None, compare=False, repr=False)
    # the kernel had no process left for it when asked for the pidfd: the sender is gone
    exited: bool = field(default=False, compare=False, repr=False)

    def alive(self) -> bool | None:
        """Whether the sending process still runs, so that its pid is still its own: a pid judged
        by a list read before this says True named the sender, not a new process that took the pid
        over after the sender exited. None: the kernel cannot tell (no SO_PEERPIDFD before 6.5)."""
        if self.exited:
            return False
        if self.pidfd is None:
            return None
        poll = select.poll()
        poll.register(self.pidfd, select.POLLIN)  # a pidfd is readable once its process has exited
        return not poll.poll(0)

    def describe(self) -> str:
        who = f"uid {self.uid} ({self.user})" if self.user else f"uid {self.uid}"
        return f"pid {self.pid}, {who}, gid {self.gid}"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid, "user": self.user}


@dataclass(frozen=True)
class IntakeReply:
    """A check's answer to a document: ``accepted`` (the check has it: the sender need not keep it
    elsewhere), ``attested`` (the check could confirm the sender's claim from what the machine
    says), ``message`` (why, in words, for the sender's log)."""

    accepted: bool
    attested: bool = False
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "attested": self.attested, "message": self.message}

    @classmethod
    def from_json(cls, data: Any) -> IntakeReply:
        """Raises ValueError for anything but a reply of this shape."""
        if not isinstance(data, dict):
            raise ValueError("the reply is not a JSON object")
        accepted, attested, message = data.get("accepted"), data.get("attested"), data.get("message")
        if not isinstance(accepted, bool) or not isinstance(attested, bool) or not isinstance(message, str):
            raise ValueError("the reply lacks accepted, attested (booleans) or message (a string)")
        return cls(accepted, attested, message)


def refused(message: str) -> IntakeReply:
    return IntakeReply(False, False, message)
