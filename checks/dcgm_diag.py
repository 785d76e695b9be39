"""dcgm_diag: NVIDIA DCGM's diagnostic (level 2 by default), one finding per GPU.

How it runs (bounded, both ways; a hung DCGM is a finding, never a wait):

1. DCGM's own Python bindings, when DCGM is installed: they ship with DCGM, not on PyPI, in
   ``/usr/share/datacenter-gpu-manager-4/bindings/python3`` (DCGM 4) or ``/usr/local/dcgm/bindings``
   (older); ``bindings_dirs`` lists where to look. They run in a child process
   (gpumon/hw/dcgm.py) so that a DCGM call that never returns can be killed: NVSentinel #1748 saw a
   stalled DCGM take its monitor down 49 times without the fault ever being reported.
2. Else (no bindings, or bindings older than DCGM 4's response layout) ``dcgmi diag -r <level> -j``.
3. Neither installed: ``skipped`` with the reason.

These paths are in gpumon's own filesystem (like tools on PATH), not under the host root: the
bindings load DCGM's libraries into a process of ours.

Verdicts (per GPU, from every test's result for that GPU, or the test's all-GPU result):

- a failed test -> ``fail``; the action follows what failed: a deployment/software test (denylist,
  libraries, permissions, persistence mode, environment) -> none (the node is misconfigured, not
  broken: degraded); graphics processes on the GPU -> restart_app; page retirement / row remap ->
  reset_gpu (a pending remap is applied by a reset); InfoROM -> inspect_hardware; a failure DCGM
  explains as "busy or unavailable" -> reset_gpu (DCGM's own advice in that text: "Reset GPU.
  Restart DCGM. Rerun diagnostics."); NVLink reported down -> reboot_node (as the nvlink check);
  any other hardware, integration or stress test -> inspect_hardware.
- a warning -> ``warn``; every test skipped -> ``skipped`` (DCGM does not test this part);
  nothing but "not run" -> ``unknown``.
- output DCGM did not finish (cut off), a runtime error, output that is not DCGM's -> ``unknown``
  for the node, with the reason; a failure read from a cut-off output still fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpumon.check import Check, CheckContext
from gpumon.errors import HwCondition, HwTimeout
from gpumon.hw import dcgm
from gpumon.hw.inventory import Inventory
from gpumon.hw.tools import ToolResult
from gpumon.model import NODE, Action, Finding, Phase, Severity, gpu

_SOFTWARE = frozenset({"denylist", "blacklist", "nvml library", "cuda main library", "cuda toolkit libraries",
                       "permissions and os blocks", "persistence mode", "environment variables", "software"})
_MAX_TEXTS = 5


@dataclass(frozen=True)
class DcgmDiagConfig:
    level: int = field(default=2, metadata={
        "min": 1, "max": 4,
        "source": "issue 5 (bootstrap suite): DCGM diagnostic level 2; NVIDIA DCGM User Guide, "
                  "'Run Levels': level 1 takes seconds, level 2 about 2 minutes, level 3 about 30 "
                  "minutes, so level 2 is the deepest that fits a 5-minute bootstrap"})
    diag_timeout_s: float = field(default=240.0, metadata={
        "min": 10, "max": 7200,
        "source": "design: level 2 takes about 2 minutes (DCGM User Guide, as above); twice that "
                  "bounds it and stays inside the check's 300 s budget. Raise both together for level 3"})
    use_bindings: bool = True
    bindings_dirs: list[str] = field(default_factory=lambda: list(dcgm.BINDINGS_DIRS))


def action_for(test: dcgm.DiagTest, texts: list[str]) -> Action:
    """The remedy for a failed test (see the module docstring)."""
    name = " ".join(test.name.lower().split())
    joined = " ".join(texts).lower()
    if "busy or unavailable" in joined:
        return Action.RESET_GPU
    if "nvlink" in joined and "down" in joined:
        return Action.REBOOT_NODE
    if name in _SOFTWARE:
        return Action.NONE
    if name == "graphics processes":
        return Action.RESTART_APP
    if name.startswith("page retirement") or "row remap" in name:
        return Action.RESET_GPU
    return Action.INSPECT_HARDWARE


class DcgmDiagCheck(Check):
    name = "dcgm_diag"
    phase = Phase.BOOTSTRAP
    description = "NVIDIA DCGM diagnostic (dcgmi diag -r 2 or DCGM's Python bindings), per test and GPU"
    timeout = 300.0
    # what a healthy run costs (seconds): the suite orders by it and shows it as the ETA. DCGM's
    # dcgmi-diag reference: level 2 is "medium validation, normally lasting approximately two minutes"
    cost = 120.0
    Config = DcgmDiagConfig

    def supported(self, inventory: Inventory) -> str | None:
        return inventory.no_nvml_gpus()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(DcgmDiagConfig)
        tools = ctx.hw.tools
        gpus = [g.index for g in ctx.inventory.gpus]
        notes: list[str] = []
        text: str | None = None
        result: ToolResult | None = None
        source = ""
        bindings = dcgm.find_bindings(options.bindings_dirs) if options.use_bindings else None
        try:
            if bindings is not None:
                result = dcgm.run_diag_bindings(tools, bindings, options.level, gpus=gpus,
                                                timeout=options.diag_timeout_s)
                if result.returncode == 0 and result.stdout.strip():
                    text, source = result.stdout, f"DCGM Python bindings ({bindings})"
                else:
                    notes.append(f"DCGM's bindings in {bindings} not usable here: "
                                 f"{_last_line(result) or f'exit {result.returncode}'}")
            if text is None:
                if tools.which("dcgmi") is None:
                    where = ", ".join(options.bindings_dirs) if options.use_bindings else "(bindings off)"
                    why = f"; {notes[0]}" if notes else f" and no Python bindings in {where}"
                    return [self.finding(NODE, Severity.UNKNOWN if notes else Severity.SKIPPED,
                                         f"DCGM is not installed: no dcgmi on PATH{why}", Action.NONE,
                                         notes=notes)]
                result = dcgm.run_dcgmi(tools, options.level, timeout=options.diag_timeout_s)
                text, source = result.stdout, f"dcgmi diag -r {options.level} -j"
        except HwTimeout as cond:
            return [self.finding(NODE, Severity.FAIL,
                                 f"DCGM diagnostic did not finish within {cond.seconds:g} s (killed): a hung "
                                 "diagnostic leaves the GPUs unjudged; check nv-hostengine", Action.NONE,
                                 call=cond.call, timeout_s=cond.seconds)]
        except HwCondition as cond:
            return [self.from_condition(cond, NODE)]
        base: dict[str, Any] = {"level": options.level, "source": source, "exit_code": result.returncode
                                if result else None, "seconds": round(result.seconds, 1) if result else None}
        if notes:
            base["notes"] = notes
        if not text or not text.strip():
            said = f": {_last_line(result)}" if _last_line(result) else ""
            return [self.finding(NODE, Severity.UNKNOWN,
                                 f"{source} printed nothing (exit {base['exit_code']}){said}", Action.NONE,
                                 **base)]
        try:
            report = dcgm.parse_diag(text)
        except dcgm.DcgmParseError as exc:
            why = _last_line(result)
            return [self.finding(NODE, Severity.UNKNOWN, f"could not read the output of {source}: {exc}"
                                 + (f" (stderr: {why})" if why else ""), Action.NONE,
                                 output_head=text[:300], **base)]
        return self.judge(report, gpus, base)

    def judge(self, report: dcgm.DiagReport, gpus: list[int], base: dict[str, Any]) -> list[Finding]:
        """Findings for one parsed report (public so that a capture can be judged on its own)."""
        base = {**base, "dcgm_version": report.version}
        out: list[Finding] = []
        if report.runtime_error:
            out.append(self.finding(NODE, Severity.UNKNOWN,
                                    f"DCGM could not run the diagnostic: {report.runtime_error}", Action.NONE,
                                    **base))
        for index in sorted(set(gpus) | set(report.gpus)):
            out.append(self._gpu(report, index, base))
        if report.truncated:
            out.append(self.finding(NODE, Severity.UNKNOWN,
                                    f"DCGM's output is incomplete ({report.truncated}): tests after the cut "
                                    "were not judged", Action.NONE, orphans=report.orphans[:_MAX_TEXTS],
                                    **base))
        if not out:
            out.append(self.finding(NODE, Severity.UNKNOWN, "DCGM reported no test for any GPU", Action.NONE,
                                    **base))
        return out

    def _gpu(self, report: dcgm.DiagReport, index: int, base: dict[str, Any]) -> Finding:
        statuses: dict[str, str] = {}
        failed: list[tuple[dcgm.DiagTest, list[str]]] = []
        warned: list[tuple[dcgm.DiagTest, list[str]]] = []
        for test in report.tests:
            status = test.status_for(index)
            if status is None:
                continue
            statuses[test.name] = status
            texts = [m.text for m in test.messages_for(index)]
            if status == dcgm.FAIL:
                failed.append((test, texts))
            elif status == dcgm.WARN:
                warned.append((test, texts))
        comp = gpu(index)
        ev: dict[str, Any] = {**base, "tests": statuses}
        if failed or warned:
            ev["warnings"] = [f"{t.name}: {x}" for t, xs in (*failed, *warned) for x in xs][:_MAX_TEXTS]
        if failed:
            action = max(action_for(t, xs) for t, xs in failed)
            parts = [t.name + (f" ({xs[0][:160]})" if xs else "") for t, xs in failed]
            return self.finding(comp, Severity.FAIL,
                                f"GPU {index}: DCGM diagnostic failed: {'; '.join(parts)}", action, **ev)
        if warned:
            parts = [t.name + (f" ({xs[0][:160]})" if xs else "") for t, xs in warned]
            return self.finding(comp, Severity.WARN,
                                f"GPU {index}: DCGM diagnostic warned: {'; '.join(parts)}", Action.NONE, **ev)
        if not statuses:
            return self.finding(comp, Severity.UNKNOWN, f"GPU {index}: DCGM reported no result for this GPU",
                                Action.NONE, **ev)
        values = set(statuses.values())
        if values == {dcgm.SKIP}:
            return self.finding(comp, Severity.SKIPPED, f"GPU {index}: DCGM skipped every test "
                                f"({len(statuses)}): not supported on this GPU", Action.NONE, **ev)
        if dcgm.PASS not in values:
            return self.finding(comp, Severity.UNKNOWN, f"GPU {index}: no DCGM test ran to a verdict "
                                f"({', '.join(sorted(values))})", Action.NONE, **ev)
        passed = sum(1 for s in statuses.values() if s == dcgm.PASS)
        rest = f", {len(statuses) - passed} skipped or not run" if passed < len(statuses) else ""
        return self.ok(comp, f"GPU {index}: DCGM diagnostic passed ({passed} test(s) passed{rest})", **ev)


def _last_line(result: ToolResult | None) -> str:
    if result is None:
        return ""
    lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""
