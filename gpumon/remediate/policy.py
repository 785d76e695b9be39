"""When to take this node out of service and when to bring it back: the decision, for any scheduler.

The daemon calls ``RemediationPolicy.step()`` after the health state changed and
on a timer. One step reads the health state, reads the scheduler's view of
the node (``backend.current()``), and makes the scheduler agree with the
health state, under these rules (DESIGN.md "Own your cordon"):

- **Take out** when the node's recommended action is one of ``take_out_actions``
  (default: every action but ``none`` and ``restart_app``; see
  ``DEFAULT_TAKE_OUT_ACTIONS``). Done once: a node gpumon already took out
  for the same action is left alone; a changed action (``reset_gpu``
  escalated to ``inspect_hardware``) updates gpumon's marks. The health state
  records ``quarantine`` only after the backend says it is done.
- **Bring back** when no open fault asks for such an action any more, and
  only if the scheduler's mark is gpumon's own (``NodeOut.by_gpumon``); the
  health state records ``release``. That is the same for ``healthy`` and
  ``degraded``: the health state clears a fault that needed a reset or reboot
  only after gpumon's own retest passed, so "no action needed" already means
  "the retest passed"; and ``degraded`` (warnings, a hung probe, a failure with
  no remedy) must not keep a node out (NVSentinel #911).
- **Someone else's mark** (an operator's cordon or drain): never lifted, and
  never added to: a node someone else took out first is theirs, so the
  backends change nothing on it (no taint, condition or drain reason of
  gpumon's) and the result is ``left_alone``; the fault stays visible in
  gpumon's state and metrics. A backend
  must leave it as it is; see ``SchedulerBackend.take_out``.
- **Circuit breaker**: before a new take-out, ``backend.fleet_share(window)``
  says how much of the fleet gpumon took out within the window; above
  ``breaker_share`` nothing is done and the result says ``breaker_open``. A
  fleet-wide false positive (a driver update that makes every node report
  an Xid) must not empty the cluster; NVSentinel stops at 50 % in 5 min,
  gpumon's default is 20 % in 10 min.
- **Observe mode** computes the same decision and asks the backend for the
  changes it would make (``dry_run``), and changes nothing. It records
  nothing in the health state either: the store is the record of what
  happened, and a ``quarantine`` event there would make ``gpumon status`` and
  the ``quarantined`` metric say the node is out while jobs still land on it.
  What would be done is in the result (the daemon logs it and exports it).
- **Errors never stop the daemon**: a backend that raises (apiserver down,
  ``scontrol`` failing) makes a result with ``error``; the next step starts
  from a fresh read and tries again.

Nothing is decided before the first check has reported: an empty health
state is "not known", not "healthy", so a restarted agent with a lost state
directory does not lift a cordon before it has looked at the GPUs.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpumon.health import Fault, Health, HealthView, StoreError
from gpumon.model import Action
from gpumon.remediate.base import OWNER_PREFIX, FleetShare, Mode, NodeOut, Outcome, SchedulerBackend

log = logging.getLogger("gpumon.remediate")

# ``restart_app`` is left out: it is what NVIDIA's catalog says for
# application-level Xids (13, 31, 43 ...), which a user's buggy kernel causes as
# often as a GPU does. Taking the node out does not cure it (restarting the
# job does), and a buggy job spread over a hundred nodes would otherwise take
# all of them out. The same Xids repeating escalate to ``inspect_hardware``,
# which does take the node out.
DEFAULT_TAKE_OUT_ACTIONS = frozenset({Action.CHECK_CABLES, Action.CONFIRM_SDC, Action.RESET_GPU,
                                      Action.REBOOT_NODE, Action.INSPECT_HARDWARE})
# Slurm keeps a drain reason on one line and Kubernetes shows the condition
# message in ``kubectl describe``: the worst fault's words, cut to this length.
MAX_SUMMARY = 200


class Decision(enum.Enum):
    WAIT = "wait"  # no check has reported yet: nothing is decided on an empty state
    NONE = "none"  # nothing of gpumon's is wanted or present
    TAKE_OUT = "take_out"  # take the node out, or update gpumon's marks (the action changed)
    KEEP_OUT = "keep_out"  # out by gpumon for this action already: nothing to send
    BLOCKED = "blocked"  # the circuit breaker stopped a take-out
    BRING_BACK = "bring_back"  # lift gpumon's marks
    LEFT_ALONE = "left_alone"  # out by someone else, and the backend adds nothing beside their mark


@dataclass(frozen=True)
class PolicyResult:
    """What one step decided and did (or, in observe mode, would do)."""

    time: float
    mode: Mode
    decision: Decision
    action: Action  # what the health state asks the scheduler for (NONE: nothing)
    summary: str  # the reason text given to the backend
    node: NodeOut | None = None  # the scheduler's view before this step (None: could not read it)
    outcome: Outcome | None = None  # what the backend did (enforce) or would do (observe)
    share: FleetShare | None = None  # asked only before a new take-out
    breaker_open: bool = False
    recorded: str | None = None  # "quarantine" / "release": the event written to the health state
    error: str | None = None  # the backend or the store failed; the next step tries again

    @property
    def changed(self) -> bool:
        """The scheduler was changed by this step."""
        return (self.mode is Mode.ENFORCE and self.outcome is not None and self.outcome.done
                and bool(self.outcome.changes))

    @property
    def would_change(self) -> list[str]:
        """Observe mode: the changes that enforce mode would have made."""
        if self.mode is not Mode.OBSERVE or self.outcome is None:
            return []
        return list(self.outcome.changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time, "mode": self.mode.value, "decision": self.decision.value,
            "action": self.action.value, "summary": self.summary,
            "node": None if self.node is None else {
                "out": self.node.out, "by_gpumon": self.node.by_gpumon, "reason": self.node.reason,
                "since": self.node.since},
            "outcome": None if self.outcome is None else {
                "done": self.outcome.done, "detail": self.outcome.detail,
                "changes": list(self.outcome.changes)},
            "share": None if self.share is None else {
                "taken_out_recently": self.share.taken_out_recently, "total": self.share.total,
                "share": self.share.share},
            "breaker_open": self.breaker_open, "recorded": self.recorded, "error": self.error,
        }


def summarize(faults: Iterable[Fault], actions: frozenset[Action]) -> str:
    """The worst fault that asks for one of ``actions``, in its own words, plus how many more."""
    relevant = [f for f in faults if f.action in actions]  # ``why`` is sorted worst first
    if not relevant:
        return ""
    worst = relevant[0]
    text = f"{worst.message} ({worst.check}, {worst.component})"
    if len(relevant) > 1:
        text += f" and {len(relevant) - 1} more"
    return text if len(text) <= MAX_SUMMARY else text[:MAX_SUMMARY - 3] + "..."


class RemediationPolicy:
    """Keeps the scheduler's view of this node in line with its health state.

    Not thread-safe: one caller (the daemon's loop) calls ``step``.
    """

    def __init__(self, backend: SchedulerBackend, health: Health, *, mode: Mode,
                 breaker_share: float = 0.2, breaker_window_s: float = 600.0,
                 clock: Callable[[], float] = time.time,
                 take_out_actions: Iterable[Action] = DEFAULT_TAKE_OUT_ACTIONS,
                 by: str = OWNER_PREFIX) -> None:
        if not 0.0 <= breaker_share <= 1.0:
            raise ValueError(f"breaker_share must be within 0..1, got {breaker_share}")
        if breaker_window_s <= 0:
            raise ValueError(f"breaker_window_s must be positive, got {breaker_window_s}")
        actions = frozenset(take_out_actions)
        if Action.NONE in actions:
            # a finding with no action must never leave a node out (NVSentinel #911)
            raise ValueError("take_out_actions cannot contain 'none'")
        self.backend = backend
        self.health = health
        self.mode = mode
        self.breaker_share = breaker_share
        self.breaker_window_s = breaker_window_s
        self.clock = clock
        self.take_out_actions = actions
        self.by = by
        # The action whose take-out completed in this process. Until then (start,
        # or after a failure) a node already out by gpumon is reconciled once more:
        # a take-out cut short between its two writes (cordon done, condition not)
        # is finished, and the backend's idempotent take-out sends nothing if all is there.
        self._in_sync: Action | None = None
        self._logged: tuple[Decision, Action, str | None] | None = None
        self.last: PolicyResult | None = None

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> PolicyResult:
        result = self._step()
        self.last = result
        self._log(result)
        return result

    def _step(self) -> PolicyResult:
        now = self.clock()
        view = self.health.view()
        action, summary = self._wanted(view)
        if not view.components:
            return PolicyResult(now, self.mode, Decision.WAIT, action, summary)
        try:
            node = self.backend.current()
        except Exception as exc:  # any backend failure is retried next step; the daemon must go on
            self._in_sync = None
            return PolicyResult(now, self.mode, Decision.NONE, action, summary,
                                error=_describe("reading the node", exc))
        if action is not Action.NONE:
            return self._take_out(now, view, node, action, summary)
        return self._bring_back(now, view, node)

    def _wanted(self, view: HealthView) -> tuple[Action, str]:
        """The action that takes the node out (NONE: none does), and why."""
        # From the open faults, not the node's level, which reads ``quarantined`` while
        # gpumon has the node out and hides what is underneath; and the worst action
        # among those that take a node out, so that a site's narrower list still acts
        # on its faults when a worse fault of another action is open beside them.
        action = max((f.action for f in view.node.why if f.action in self.take_out_actions),
                     default=Action.NONE)
        if action is Action.NONE:
            return Action.NONE, ""
        return action, summarize(view.node.why, self.take_out_actions) or action.value

    def _take_out(self, now: float, view: HealthView, node: NodeOut, action: Action,
                  summary: str) -> PolicyResult:
        recorded = view.node.quarantine
        if (node.out and node.by_gpumon and self._in_sync is action and recorded is not None
                and recorded.action is action):
            return PolicyResult(now, self.mode, Decision.KEEP_OUT, action, summary, node)
        share: FleetShare | None = None
        if not node.by_gpumon:
            # a new take-out: the breaker decides. Updating gpumon's own marks on a
            # node it already took out does not add to the share, so it is not asked.
            try:
                share = self.backend.fleet_share(self.breaker_window_s)
            except Exception as exc:  # as in _step: retried next step
                self._in_sync = None
                return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node,
                                    error=_describe("asking the fleet share", exc))
            if share.total > 0 and share.share > self.breaker_share:
                self._in_sync = None
                return PolicyResult(now, self.mode, Decision.BLOCKED, action, summary, node,
                                    share=share, breaker_open=True)
        dry_run = self.mode is Mode.OBSERVE
        try:
            outcome = self.backend.take_out(action, summary, dry_run=dry_run)
        except Exception as exc:  # as in _step: retried next step
            self._in_sync = None
            return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node, share=share,
                                error=_describe("taking the node out", exc))
        if not outcome.done and node.out and not node.by_gpumon and not outcome.changes:
            # A backend whose mark is the one the operator already set (a Slurm drain
            # reason) declines: not an error, and nothing of gpumon's to record.
            self._in_sync = None
            return PolicyResult(now, self.mode, Decision.LEFT_ALONE, action, summary, node, outcome, share)
        if dry_run:
            return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node, outcome, share)
        if not outcome.done:
            self._in_sync = None
            return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node, outcome, share,
                                error=outcome.detail or "the backend did not finish the take-out")
        self._in_sync = action
        if recorded is not None and recorded.action is action:
            return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node, outcome, share)
        error = self._record(lambda: self.health.quarantine(by=self.by, reason=summary, action=action))
        return PolicyResult(now, self.mode, Decision.TAKE_OUT, action, summary, node, outcome, share,
                            recorded="quarantine", error=error)

    def _bring_back(self, now: float, view: HealthView, node: NodeOut) -> PolicyResult:
        self._in_sync = None
        recorded = view.node.quarantine
        summary = _healthy_summary(view)
        if not node.by_gpumon:
            # Nothing of gpumon's on the node: whatever else is there (an operator's
            # cordon or drain) is not gpumon's to lift. A quarantine the health state
            # still records is over all the same (someone removed gpumon's marks by
            # hand, or they never landed): the record follows the scheduler.
            if recorded is None or self.mode is Mode.OBSERVE:
                return PolicyResult(now, self.mode, Decision.NONE, Action.NONE, summary, node)
            error = self._record(lambda: self.health.release(
                by=self.by, reason=f"gpumon's marks are no longer on the node; {summary}"))
            return PolicyResult(now, self.mode, Decision.NONE, Action.NONE, summary, node,
                                recorded="release", error=error)
        dry_run = self.mode is Mode.OBSERVE
        try:
            outcome = self.backend.bring_back(summary, dry_run=dry_run)
        except Exception as exc:  # as in _step: retried next step
            return PolicyResult(now, self.mode, Decision.BRING_BACK, Action.NONE, summary, node,
                                error=_describe("bringing the node back", exc))
        if dry_run:
            return PolicyResult(now, self.mode, Decision.BRING_BACK, Action.NONE, summary, node, outcome)
        if not outcome.done:
            return PolicyResult(now, self.mode, Decision.BRING_BACK, Action.NONE, summary, node, outcome,
                                error=outcome.detail or "the backend did not finish bringing the node back")
        if recorded is None:
            return PolicyResult(now, self.mode, Decision.BRING_BACK, Action.NONE, summary, node, outcome)
        error = self._record(lambda: self.health.release(by=self.by, reason=summary))
        return PolicyResult(now, self.mode, Decision.BRING_BACK, Action.NONE, summary, node, outcome,
                            recorded="release", error=error)

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _record(write: Callable[[], object]) -> str | None:
        """Write a health event. A store that cannot be written keeps the event in memory
        (the state has it) and writes it later: the step is done, the result says so."""
        try:
            write()
        except StoreError as exc:
            return f"recorded in memory only: {exc}"
        return None

    def _log(self, result: PolicyResult) -> None:
        # once per change of what is going on, not once per step
        key = (result.decision, result.action, result.error)
        if key == self._logged:
            return
        self._logged = key
        if result.error is not None:
            log.error("remediation (%s, %s): %s; retrying next step", result.mode.value,
                      result.decision.value, result.error)
        elif result.decision is Decision.BLOCKED and result.share is not None:
            log.error("circuit breaker open: gpumon took out %d of %d nodes within %g s (limit %g %%); "
                      "not taking this node out for %s: %s", result.share.taken_out_recently,
                      result.share.total, self.breaker_window_s, self.breaker_share * 100,
                      result.action.value, result.summary)
        elif result.mode is Mode.OBSERVE and result.would_change:
            log.warning("observe mode: would %s (%s): %s", result.decision.value.replace("_", " "),
                        "; ".join(result.would_change), result.summary)
        elif result.changed and result.outcome is not None:
            log.warning("%s (%s): %s", result.decision.value.replace("_", " "),
                        "; ".join(result.outcome.changes), result.summary)


def _healthy_summary(view: HealthView) -> str:
    faults = view.node.why
    if not faults:
        return "no open faults"
    return f"no fault needs the node out ({len(faults)} open with no such action)"


def _describe(what: str, exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{what}: {text}"
