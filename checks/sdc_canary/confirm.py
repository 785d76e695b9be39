"""sdc_confirm: the node's own SDC canaries on a GPU that a training job said computes wrong numbers.

A ``persistent`` in-job verdict (gpumon.guard) is one job's word; before the ``guard`` check fails the
GPU (the RMA path) it asks this check to confirm it (``gpumon.sdc.confirm``: a request in the state
directory, the node kept out of service meanwhile by the guard's ``confirm_sdc`` finding). Each run
takes the open requests, oldest first; for each GPU named:

- busy (a compute process on it, or utilization over the limit: the job that wrote the verdict, or
  the drain still letting jobs finish) -> ``skipped``, and the request waits: a canary must not steal
  a job's GPU, and busy results would be compared under other heat;
- idle -> the ``sdc_canary`` check's own run (its workloads, golden file or majority of the node's
  idle GPUs; this check's options are the canary's) with that GPU among the idle ones. The GPU
  computing wrong bits -> result ``reproduced`` (and the canary's own fail/``inspect_hardware`` on
  it, as the canary would report it); agreeing -> ``not_reproduced``; the canary unable to judge it
  (one idle GPU and no golden, a split, a hung worker) -> tried again next run, and after
  ``max_attempts`` such runs ``cannot_confirm``, with why;
- torch missing, or no golden and majority off -> ``cannot_confirm`` at once, with why.

Any other idle GPU the canary found computing wrong bits is reported too: a second bad GPU is news.
The job's kept step (its replay bundle) is not replayed by the daemon: a replay imports the job's own
code, and the daemon does not run a job's code; the result names the command that replays it as its
owner (``gpumon canary replay --as-owner``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any

from gpumon import workers
from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition
from gpumon.idle import idle_gate
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu
from gpumon.sdc.confirm import (
    CANNOT_CONFIRM,
    NOT_REPRODUCED,
    REPRODUCED,
    ConfirmQueue,
    Request,
    Result,
    confirm_commands,
)

from .check import SdcCanaryCheck, SdcCanaryConfig


@dataclass(frozen=True)
class SdcConfirmConfig(SdcCanaryConfig):
    max_attempts: int = field(default=3, metadata={
        "min": 1,
        "source": "argued: runs in which the GPU was idle but the canary could not judge it (a split "
                  "without a golden, a hung worker) before the verdict is left to the operator as "
                  "cannot_confirm; three rules out a one-off"})
    keep_results_s: float = field(default=7 * 86400.0, metadata={
        "min": 0,
        "source": "argued: a week, past the guard's warn_hold_s (a day), so a verdict judged by its "
                  "result keeps it while it is reported; then the files are removed"})


class SdcConfirmCheck(Check):
    name = "sdc_confirm"
    phase = Phase.CANARY
    description = "confirms in-job SDC verdicts with the node's own canaries before the RMA path"
    # a verdict waits for its confirmation with the node out of service: looked at often, and a
    # run with nothing to confirm reads one directory
    interval = 30.0
    timeout = 3600.0
    Config = SdcConfirmConfig

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(SdcConfirmConfig)
        if ctx.state_dir is None:
            return [self.finding(NODE, Severity.SKIPPED, "no state directory: no verdict to confirm")]
        queue = ConfirmQueue(ctx.state_dir)
        queue.prune(options.keep_results_s, ctx.clock())
        requests, bad = queue.open_requests()
        out = [self.finding(NODE, Severity.WARN, f"cannot read a confirmation request: {why}; left in "
                            "place for an operator", fault_key=f"bad-request:{i}")
               for i, why in enumerate(bad[:5])]
        if not requests:
            return out or [self.ok(NODE, "no in-job SDC verdict awaits confirmation")]
        cannot = self._cannot_run(options)
        if cannot is not None:
            for req in requests:
                queue.answer(self._result(req, CANNOT_CONFIRM, cannot, {}))
            return [*out, self.finding(NODE, Severity.WARN, f"cannot confirm {len(requests)} in-job SDC "
                                       f"verdict(s) on this node: {cannot}", fault_key="cannot-confirm")]
        by_gpu: dict[int, list[Request]] = {}
        for req in requests:
            by_gpu.setdefault(req.gpu_index, []).append(req)
        ready: list[int] = []
        for index, reqs in sorted(by_gpu.items()):
            try:
                gate = idle_gate(ctx.hw, index, options.idle_max_utilization_pct)
            except HwCondition as cond:
                out.append(self.from_condition(cond, gpu(index)))
                for req in reqs:
                    queue.note(req.verdict_id, f"GPU {index} unreadable: {cond}")
                continue
            if gate.busy is not None:
                for req in reqs:
                    queue.note(req.verdict_id, f"{gate.busy}: confirmed once it is free")
                out.append(self.finding(gpu(index), Severity.SKIPPED,
                                        f"{gate.busy}: {len(reqs)} in-job SDC verdict(s) on it wait for it "
                                        "to be free to be confirmed", **gate.evidence))
                continue
            ready.append(index)
        if ready:
            out += self._confirm(ctx, options, queue, {i: by_gpu[i] for i in ready})
        return out

    def _cannot_run(self, options: SdcConfirmConfig) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return workers.TORCH_MISSING
        if not options.golden_file and not options.majority:
            return ("no golden_file configured and majority mode off (checks.sdc_confirm): nothing to "
                    "compare with")
        return None

    def _confirm(self, ctx: CheckContext, options: SdcConfirmConfig, queue: ConfirmQueue,
                 ready: dict[int, list[Request]]) -> list[Finding]:
        for reqs in ready.values():
            for req in reqs:
                queue.note(req.verdict_id, "canary running", self._attempts(queue, req))
        canary_options = SdcCanaryConfig(**{f.name: getattr(options, f.name)
                                            for f in dataclasses.fields(SdcCanaryConfig)})
        # the canary judges every idle GPU (a majority needs them); the GPUs named are among them
        if canary_options.gpus:
            canary_options = dataclasses.replace(
                canary_options, gpus=sorted({*canary_options.gpus, *ready}))
        canary = SdcCanaryCheck()
        found = canary.run(dataclasses.replace(ctx, options=canary_options))
        out: list[Finding] = []
        for f in found:
            out.append(dataclasses.replace(f, check=self.name))
        by_component = {f.component: f for f in found}
        for index, reqs in ready.items():
            for req in reqs:
                self._judge(queue, options, req, by_component.get(gpu(index)), found)
        return out

    def _attempts(self, queue: ConfirmQueue, req: Request) -> int:
        status = queue.status(req.verdict_id) or {}
        attempts = status.get("attempts")
        return attempts if isinstance(attempts, int) else 0

    def _judge(self, queue: ConfirmQueue, options: SdcConfirmConfig, req: Request, f: Finding | None,
               found: list[Finding]) -> None:
        index = req.gpu_index
        canary: dict[str, Any] = {"gpu": index}
        if f is not None:
            canary.update(severity=f.severity.value, message=f.message,
                          evidence={k: v for k, v in f.evidence.items() if k != "mismatches"})
        compared = sorted(int(x.component.split("/")[1]) for x in found
                          if x.component.startswith("gpu/") and x.severity in (Severity.OK, Severity.FAIL))
        canary["gpus_judged"] = compared
        if f is not None and f.severity is Severity.FAIL and f.action is Action.INSPECT_HARDWARE:
            queue.answer(self._result(req, REPRODUCED, f"the node's SDC canary reproduced it: {f.message}",
                                      canary))
            return
        if f is not None and f.severity is Severity.OK:
            queue.answer(self._result(
                req, NOT_REPRODUCED,
                f"the node's SDC canaries on GPU {index} computed the right bits ({f.message})", canary))
            return
        attempts = self._attempts(queue, req) + 1
        why = f.message if f is not None else f"the canary did not run on GPU {index}"
        if attempts >= options.max_attempts:
            queue.answer(self._result(req, CANNOT_CONFIRM, f"the canary could not judge GPU {index} in "
                                      f"{attempts} runs: {why}", canary))
        else:
            queue.note(req.verdict_id, f"the canary could not judge GPU {index}: {why}; again next run",
                       attempts)

    def _result(self, req: Request, outcome: str, said: str, canary: dict[str, Any]) -> Result:
        evidence: dict[str, Any] = {"canary": canary, "gpu_index": req.gpu_index, "gpu_uuid": req.gpu_uuid,
                                    "commands": confirm_commands(req.gpu_index, req.bundle)}
        if req.bundle:
            evidence["replay"] = {
                "run": False, "bundle": req.bundle,
                "why": "the daemon does not run a job's own code; replay the kept step as its owner",
                "command": f"gpumon canary replay --as-owner {req.bundle}"}
        return Result(verdict_id=req.verdict_id, outcome=outcome, said=said, time=time.time(),
                      evidence=evidence)
