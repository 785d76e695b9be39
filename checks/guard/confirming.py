"""A persistent verdict as the guard check judges it: by the node's own confirmation (gpumon.sdc.confirm).

An attested ``persistent`` verdict is one job's word that a GPU computes wrong numbers. The guard
check does not fail the GPU on it: it asks the ``sdc_confirm`` check to run the node's SDC canaries
on that GPU once it is free, and judges the verdict by what they find:

- no result yet (``pending``): the verdict is reported as ``warn``/``confirm_sdc``, a fault of its own
  (``confirm:<verdict id>``) that takes the node out of service (gpumon's own cordon or drain, its
  reason saying that an in-job verdict is being confirmed) until the result comes;
- ``reproduced``: ``persistent`` as it was, fail/``inspect_hardware``, the confirmation its evidence;
- ``not_reproduced``: judged as ``unknown`` (a warning for ``warn_hold_s``), and the node serves again;
- ``cannot_confirm`` (no torch, nothing to compare with, the canary never able to judge the GPU), or
  no confirmer at work (``checks.guard.confirm`` off, ``sdc_confirm`` disabled, no request noted by it
  within ``confirm_wait_s``), or a GPU that is not this node's: judged as ``unknown``, a warning that
  names the commands that would confirm it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumon.guard import verdict as vf
from gpumon.hw.placement import normalize_uuid
from gpumon.sdc.confirm import REPRODUCED, ConfirmQueue, Request, confirm_commands

from .options import GuardConfig

PENDING = "pending"
NOT_CONFIRMED = "not_confirmed"
# how long a confirmation run may take without noting anything (the sdc_confirm check's timeout):
# a status note older than confirm_wait_s plus this is a confirmer that stopped
RUN_S = 3600.0


class Confirmations:
    """One guard run's view of the confirmations; ``queue`` None: this node does not confirm (why)."""

    def __init__(self, queue: ConfirmQueue | None, options: GuardConfig, now: float,
                 why_not: str = "") -> None:
        self.queue = queue
        self.wait_s = options.confirm_wait_s
        self.now = now
        self.why_not = why_not

    @classmethod
    def of(cls, options: GuardConfig, state_dir: Path | None, now: float) -> Confirmations:
        if not options.confirm:
            return cls(None, options, now, "checks.guard.confirm is off: this node does not confirm "
                                           "in-job verdicts")
        if state_dir is None:
            return cls(None, options, now, "no state directory to ask the sdc_confirm check in")
        return cls(ConfirmQueue(state_dir), options, now)

    def judge(self, v: vf.Verdict, by_uuid: dict[str | None, int]) -> vf.Verdict:
        """The verdict with its ``confirmation`` (evidence) and the fault it is judged as."""
        if v.fault != "persistent":
            return v
        key = normalize_uuid(v.subject.gpu_uuid)
        index = by_uuid.get(key) if key else None
        bundle = _bundle(v)
        if index is None:
            return _unconfirmed(v, {"state": NOT_CONFIRMED, "why": "it names no GPU of this node: there is "
                                    "no GPU here to confirm it on", "commands": []})
        commands = confirm_commands(index, bundle)
        if self.queue is None:
            return _unconfirmed(v, {"state": NOT_CONFIRMED, "why": self.why_not, "commands": commands})
        result = self.queue.result(v.id)
        if result is not None:
            said = {"state": result.outcome, "said": result.said, "time": result.time,
                    "commands": commands, **result.evidence}
            if result.outcome == REPRODUCED:
                return replace(v, evidence={**v.evidence, "confirmation": said})
            return _unconfirmed(v, said)
        request = self.queue.request(v.id)
        requested = request.requested if request is not None else self.now
        status = self.queue.status(v.id)
        noted = status.get("time") if status is not None else None
        if not isinstance(noted, (int, float)):
            if self.now - requested > self.wait_s:
                return _unconfirmed(v, {
                    "state": NOT_CONFIRMED, "commands": commands,
                    "why": f"no confirmation under way {self.wait_s:g} s after it was asked for "
                           "(checks.guard.confirm_wait_s): is the sdc_confirm check enabled on this node?"})
            waiting = "the sdc_confirm check's next run"
        elif self.now - noted > self.wait_s + RUN_S:
            last = status.get("waiting") if status is not None else ""
            return _unconfirmed(v, {"state": NOT_CONFIRMED, "commands": commands,
                                    "why": f"the sdc_confirm check stopped confirming it (its last note is "
                                           f"{self.now - noted:.0f} s old: {last})"})
        else:
            waiting = str(status.get("waiting")) if status is not None else ""
        return replace(v, evidence={**v.evidence, "confirmation": {
            "state": PENDING, "requested": requested, "gpu_index": index, "waiting": waiting,
            "commands": commands}})

    def ask(self, v: vf.Verdict) -> str | None:
        """Write the request of a pending verdict (once); what went wrong, if anything."""
        if self.queue is None:
            return None
        said = v.evidence.get("confirmation")
        if not isinstance(said, dict) or said.get("state") != PENDING:
            return None
        try:
            self.queue.ask(Request(verdict_id=v.id, gpu_index=int(said["gpu_index"]),
                                   gpu_uuid=str(v.subject.gpu_uuid), verdict_check=v.check, job=v.job,
                                   requested=float(said["requested"]), bundle=_bundle(v)))
        except OSError as exc:
            return f"cannot ask for its confirmation: {exc.strerror or exc}"
        return None


def pending(v: vf.Verdict) -> bool:
    said = v.evidence.get("confirmation")
    return v.fault == "persistent" and isinstance(said, dict) and said.get("state") == PENDING


def _unconfirmed(v: vf.Verdict, said: dict[str, Any]) -> vf.Verdict:
    """Judged as ``unknown``: a warning, never fail, never a drain."""
    return replace(v, fault="unknown",
                   evidence={**v.evidence, "confirmation": {**said, "claimed_fault": v.fault}})


def _bundle(v: vf.Verdict) -> str | None:
    bundle = v.evidence.get("bundle")
    return bundle if isinstance(bundle, str) and bundle else None
