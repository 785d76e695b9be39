"""Slurm backend: drain this node with a reason gpumon owns, resume only that.

Slurm keeps one reason per node, so the reason is the ownership mark: gpumon's
always starts with ``gpumon:`` (``gpumon: <action>: <summary>``). gpumon never
overwrites a reason someone else set and never resumes a node whose reason is
not its own (NVSentinel #1424, #363: an agent lifting the operator's cordon).

Everything goes through ``ToolRunner`` (argv lists, no shell, bounded). The node
is read with ``sinfo`` rather than ``scontrol show node -o``: sinfo lets us put
the free-text reason last in a ``|``-separated line, so a reason holding
``|``, ``=``, quotes or unicode splits unambiguously, whereas scontrol's
one-liner puts ``Comment=``/``Extra=`` after ``Reason=`` with no quoting.

Known limit: Slurm has no compare-and-set on a node's state, so between
reading an operator-free node and draining it (or reading gpumon's reason and
resuming) an operator's change can slip in. The window is one RPC long.
"""

from __future__ import annotations

import calendar
import os
import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpumon.errors import ConfigError, GpumonError, HwCondition
from gpumon.hw.tools import ToolResult, ToolRunner
from gpumon.model import Action
from gpumon.remediate.base import OWNER_PREFIX, FleetShare, NodeOut, Outcome

REASON_PREFIX = f"{OWNER_PREFIX}:"

# Slurm stores any length, but sinfo/squeue columns, slurmctld logs and
# notification hooks show the start of it; 200 bytes keeps the action and the
# first finding readable everywhere without flooding the controller's state.
MAX_REASON_BYTES = 200

# Above Slurm's own client retry (about 9 s before "Unable to contact slurm
# controller" with the default MessageTimeout=10), so a down controller is
# reported in Slurm's words rather than as our timeout.
DEFAULT_TIMEOUT_S = 20.0

# sinfo line: node|state|reason time|reason. The reason goes last because it
# is the only free-text field; it may itself contain '|'.
_SINFO_FORMAT = "%N|%T|%H|%E"

# Slurm node names are hostnames. Refusing anything else matters: NodeName=
# takes hostlists ("gpu[01-64]") and comma lists, so a bad name could drain
# the fleet.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")

# sinfo's state suffixes: * not responding, ~ powered off, # powering up,
# ! pending power down, % powering down, $ maintenance reservation,
# @ pending reboot, ^ reboot issued, - planned by the backfill scheduler.
_STATE_SUFFIXES = "*~#!%$@^-"

# A node with one of these takes no new jobs. sinfo spells DRAIN as drain,
# drained, draining or drng (and shows DOWN+DRAIN as drained); scontrol writes
# IDLE+DRAIN, ALLOCATED+DRAIN, DOWN+DRAIN+NOT_RESPONDING.
_DRAIN_WORDS = frozenset({"drain", "drained", "draining", "drng", "fail", "failing", "failg"})
_DOWN_WORDS = frozenset({"down"})


class SlurmError(GpumonError):
    """Slurm could not be read or changed: tool missing, controller down, timeout, odd output."""


@dataclass(frozen=True)
class SlurmNode:
    """One node as sinfo reports it."""

    name: str
    state: str  # as printed, e.g. "drained*", "idle", "IDLE+DRAIN"
    reason: str  # "" when the node has none
    reason_time: float | None  # when the reason was set (epoch seconds), None if unknown

    @property
    def flags(self) -> frozenset[str]:
        return state_flags(self.state)

    @property
    def drained(self) -> bool:
        """DRAIN set (draining, drained, DOWN+DRAIN) or FAIL: Slurm schedules nothing new here."""
        return bool(self.flags & _DRAIN_WORDS)

    @property
    def out(self) -> bool:
        """Takes no new jobs for a stated reason: drained, failed, or down."""
        return self.drained or bool(self.flags & _DOWN_WORDS)

    @property
    def by_gpumon(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)


def state_flags(state: str) -> frozenset[str]:
    """Normalise a node state from sinfo (``drained*``) or scontrol (``DOWN+DRAIN``) to lowercase words."""
    words: set[str] = set()
    for part in state.strip().lower().split("+"):
        word = part.rstrip(_STATE_SUFFIXES)
        if word:
            words.add(word)
    return frozenset(words)


def drain_reason(action: Action, summary: str) -> str:
    """``gpumon: <action>: <summary>`` on one line, capped at MAX_REASON_BYTES of UTF-8."""
    # sinfo and scontrol print one line per node: a newline in the reason
    # would break every reader of the output, ours included.
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in summary).split())
    text = f"{REASON_PREFIX} {action.value}: {flat}" if flat else f"{REASON_PREFIX} {action.value}"
    raw = text.encode()
    if len(raw) <= MAX_REASON_BYTES:
        return text
    # cut on a character boundary so that the controller never stores half a code point
    cut = raw[: MAX_REASON_BYTES - 3].decode("utf-8", errors="ignore")
    return cut.rstrip() + "..."


def reason_action(reason: str) -> str | None:
    """The action word of a gpumon reason (``gpumon: reset_gpu: ...`` -> ``reset_gpu``), else None."""
    if not reason.startswith(REASON_PREFIX):
        return None
    return reason[len(REASON_PREFIX):].split(":", 1)[0].strip() or None


def parse_sinfo(text: str) -> list[SlurmNode]:
    """Parse ``sinfo --Node --format=%N|%T|%H|%E`` lines; SlurmError on a line that does not fit.

    A node in several partitions is listed once per partition; the first line wins.
    """
    nodes: dict[str, SlurmNode] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("|", 3)
        if len(parts) != 4 or not parts[0].strip() or not parts[1].strip():
            raise SlurmError(f"unparsable sinfo output, line {lineno}: {line[:200]!r}")
        name, state, stamp, reason = (p.strip() for p in parts)
        if not _NODE_NAME.match(name):
            raise SlurmError(f"unparsable sinfo output, line {lineno}: node name {name[:80]!r}")
        when = _parse_time(stamp)
        if stamp not in ("Unknown", "None", "") and when is None:
            raise SlurmError(f"unparsable sinfo output, line {lineno}: reason time {stamp[:40]!r}")
        # sinfo prints "none" for a node without a reason, with time Unknown;
        # a reason that really says "none" has a time.
        if reason == "none" and when is None:
            reason = ""
        nodes.setdefault(name, SlurmNode(name, state, reason, when))
    return list(nodes.values())


def _parse_time(stamp: str) -> float | None:
    # We run sinfo with SLURM_TIME_FORMAT=standard and TZ=UTC0, so the stamp is
    # ISO 8601 in UTC whatever the site's locale and time settings are.
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


class SlurmBackend:
    """Drain and resume one Slurm node, owning only gpumon's drains.

    ``current()`` and ``fleet_share()`` raise ``SlurmError`` when Slurm cannot
    be read; ``take_out()`` and ``bring_back()`` never raise for that, they
    return an Outcome that is not done and says why.

    ``NodeOut.out`` is true for any node that takes no new jobs for a stated
    reason (drain, fail, or down): a down node's reason belongs to whoever set
    it, so gpumon must not drain over it either.
    """

    name = "slurm"

    def __init__(self, node_name: str, tools: ToolRunner, *, scontrol: str = "scontrol",
                 sinfo: str = "sinfo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 slurm_conf: str | None = None, clock: Callable[[], float] = time.time) -> None:
        if not _NODE_NAME.match(node_name):
            raise ConfigError(f"not a Slurm node name: {node_name!r} (one hostname, no lists or "
                              "hostlist ranges)", key="node_name")
        self.node_name = node_name
        self.tools = tools
        self.scontrol = scontrol
        self.sinfo = sinfo
        self.timeout_s = timeout_s
        self.slurm_conf = slurm_conf
        self.clock = clock

    # -- reading -----------------------------------------------------------

    def node(self) -> SlurmNode:
        out = self._run([self.sinfo, "--noheader", "--Node", "--all", f"--nodes={self.node_name}",
                         f"--format={_SINFO_FORMAT}"])
        nodes = [n for n in parse_sinfo(out) if n.name == self.node_name]
        if not nodes:
            # sinfo exits 0 with no lines for a name it does not know
            raise SlurmError(f"node {self.node_name} is not known to Slurm (sinfo lists no such node)")
        return nodes[0]

    def current(self) -> NodeOut:
        node = self.node()
        if not node.out:
            return NodeOut(out=False, by_gpumon=False)
        return NodeOut(out=True, by_gpumon=node.by_gpumon, reason=node.reason, since=node.reason_time)

    def fleet_share(self, window_s: float) -> FleetShare:
        out = self._run([self.sinfo, "--noheader", "--Node", "--all", f"--format={_SINFO_FORMAT}"])
        nodes = parse_sinfo(out)
        if not nodes:
            raise SlurmError("sinfo lists no nodes at all")
        since = self.clock() - window_s
        recent = sum(1 for n in nodes if n.out and n.by_gpumon and n.reason_time is not None
                     and n.reason_time >= since)
        return FleetShare(taken_out_recently=recent, total=len(nodes))

    # -- changing ----------------------------------------------------------

    def take_out(self, action: Action, summary: str, *, dry_run: bool) -> Outcome:
        reason = drain_reason(action, summary)
        argv = [self.scontrol, "update", f"NodeName={self.node_name}", "State=DRAIN", f"Reason={reason}"]
        try:
            node = self.node()
        except SlurmError as exc:
            return Outcome(False, f"cannot read node {self.node_name} from Slurm: {exc}")
        if node.out and not node.by_gpumon:
            # Draining would replace their reason with ours, and a later
            # bring_back would then resume a node an operator took out.
            return Outcome(False, f"node {self.node_name} is already out ({node.state}) with someone "
                                  f"else's reason {node.reason!r}; gpumon leaves it alone")
        if node.out and reason_action(node.reason) == action.value:
            # Re-draining would only reset the reason time, and the circuit
            # breaker would count this node as newly taken out.
            return Outcome(True, f"node {self.node_name} already drained by gpumon for {action.value}")
        change = shlex.join(argv)
        if dry_run:
            return Outcome(True, f"observe mode: would drain {self.node_name}: {reason}", [change])
        try:
            self._run(argv)
        except SlurmError as exc:
            return Outcome(False, f"drain of {self.node_name} failed: {exc}")
        return Outcome(True, f"drained {self.node_name}: {reason}", [change])

    def bring_back(self, summary: str, *, dry_run: bool) -> Outcome:
        argv = [self.scontrol, "update", f"NodeName={self.node_name}", "State=RESUME"]
        try:
            node = self.node()
        except SlurmError as exc:
            return Outcome(False, f"cannot read node {self.node_name} from Slurm: {exc}")
        if not node.out:
            return Outcome(True, f"node {self.node_name} is not drained ({node.state}); nothing to lift")
        if not node.by_gpumon:
            return Outcome(False, f"node {self.node_name} is out ({node.state}) with someone else's "
                                  f"reason {node.reason!r}; gpumon never resumes it")
        change = shlex.join(argv)
        # RESUME carries no reason, so the retest summary lives in our outcome only.
        if dry_run:
            return Outcome(True, f"observe mode: would resume {self.node_name} ({summary})", [change])
        try:
            self._run(argv)
        except SlurmError as exc:
            return Outcome(False, f"resume of {self.node_name} failed: {exc}")
        return Outcome(True, f"resumed {self.node_name} (was {node.reason!r}): {summary}", [change])

    # -- plumbing ----------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Fixed time output whatever the site sets: SLURM_TIME_FORMAT may be
        # "relative" or a strftime of its own, and local time is ambiguous
        # around DST changes.
        env["SLURM_TIME_FORMAT"] = "standard"
        env["TZ"] = "UTC0"
        if self.slurm_conf is not None:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def _run(self, argv: Sequence[str]) -> str:
        try:
            result: ToolResult = self.tools.run(argv, timeout=self.timeout_s, env=self._env())
        except HwCondition as exc:  # ToolMissing, HwTimeout, HwFailure (cannot start)
            raise SlurmError(str(exc)) from None
        if result.returncode != 0:
            said = (result.stderr.strip() or result.stdout.strip() or "no output")[-500:]
            label = " ".join(a for a in argv[:2] if not a.startswith("-"))
            raise SlurmError(f"{label} exited {result.returncode}: {said}")
        return result.stdout
