"""Reports of a run: the JSON document of the contract, and a table for people."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from gpumon import __version__
from gpumon.model import CheckRun, Finding, Severity, Status, overall_status

_STYLE = {
    Severity.OK: "green",
    Severity.SKIPPED: "dim",
    Severity.UNKNOWN: "yellow",
    Severity.WARN: "yellow",
    Severity.FAIL: "bold red",
}


def all_findings(runs: Sequence[CheckRun]) -> list[Finding]:
    return [f for r in runs for f in r.findings]


def shown(runs: Sequence[CheckRun], verbose: bool) -> list[Finding]:
    """Non-ok findings, plus one line for each check whose findings were all ok."""
    out: list[Finding] = []
    for run in runs:
        if verbose:
            out.extend(run.findings)
            continue
        bad = [f for f in run.findings if f.severity is not Severity.OK]
        if bad:
            out.extend(bad)
        else:
            first = run.findings[0]
            n = len(run.findings)
            message = first.message if n == 1 else f"{n} components ok"
            out.append(Finding(run.check, first.component if n == 1 else "node", Severity.OK, message))
    return out


def json_report(runs: Sequence[CheckRun], *, node: str, profile: str, verbose: bool = False,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    status = overall_status(all_findings(runs))
    doc: dict[str, Any] = {
        "status": status.value,
        "node": node,
        "profile": profile,
        "gpumon_version": __version__,
        "time": time.time(),
        "findings": [f.to_json() for f in shown(runs, verbose)],
        "checks": [{"check": r.check, "outcome": r.outcome, "seconds": round(r.seconds, 3)}
                   for r in runs],
    }
    if extra:
        doc.update(extra)
    return doc


# Piped output (a file, a pager, grep, a health-check wrapper) is never wrapped: one record per
# line, no word folded at 80 columns. Rich lays a table out no wider than its content.
PIPE_WIDTH = 1_000_000


def console_for(file: IO[str] | None = None, *, stderr: bool = False) -> Console:
    """A console for people: the terminal's width on a terminal; piped, one record per line."""
    console = Console(file=file, stderr=stderr, highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def print_table(runs: Sequence[CheckRun], *, node: str, profile: str, verbose: bool,
                file: IO[str] | None = None) -> Status:
    console = console_for(file)
    status = overall_status(all_findings(runs))
    # the headline on a line of its own: a table title is padded with blanks to the table's width
    console.print(f"gpumon on {node} (profile {profile}): {status.value.upper()}")
    table = Table(show_lines=False)
    for col in ("check", "component", "severity", "action", "message"):
        table.add_column(col, overflow="fold")
    for f in shown(runs, verbose):
        style = _STYLE[f.severity]
        table.add_row(f.check, f.component, f"[{style}]{f.severity.value}[/]",
                      f.action.value if f.action.value != "none" else "", f.message)
    console.print(table)
    return status
