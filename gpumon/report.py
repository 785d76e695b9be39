"""Reports of a run: the JSON document of the contract, and a table for people."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Sequence
from importlib import resources
from typing import IO, Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


# The JSON Schema of the report (what json_report returns), shipped as package data
SCHEMA_PACKAGE = "gpumon.schemas"
SCHEMA_FILE = "report-v1.schema.json"


def schema() -> dict[str, Any]:
    """The report's JSON Schema (draft 2020-12): every key of :func:`json_report`'s document, of
    ``gpumon run-bootstrap --json`` and of the daemon's report.json, described."""
    loaded: dict[str, Any] = json.loads(resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_FILE)
                                        .read_text(encoding="utf-8"))
    return loaded


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
# line, no word folded at 80 columns, whatever COLUMNS says.
PIPE_WIDTH = 1_000_000


def console_for(file: IO[str] | None = None, *, stderr: bool = False) -> Console:
    """A console for people: the terminal's width on a terminal; piped, one record per line."""
    console = Console(file=file, stderr=stderr, highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


# A table of records whose last column is text (a finding's message, a component's reasons), in one
# of three layouts:
# - piped: aligned columns without a box, the text last and not padded: one record per line, no
#   trailing blanks (a boxed table pads every line to its widest record: 1,677 characters);
# - on a terminal wide enough that the longest word of the text fits: a boxed table, the text
#   column wrapped at spaces;
# - on a narrower one: each record's other columns on one line, its text below it, indented and
#   wrapped at spaces. The columns that name a fault (check, component, action, an Xid's name in
#   the message) are never cut: a boxed table squeezed into 100 columns cut
#   ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS to "ROBUST_CHANNEL_GPU_HAS_F…".
Cell = str | Text
_GAP = "  "
_INDENT = 4


def _text(cell: Cell) -> Text:
    return cell if isinstance(cell, Text) else Text(cell)


def _longest_word(texts: Iterable[str]) -> int:
    return max((cell_len(w) for t in texts for w in t.split()), default=0)


Record = tuple[Sequence[Cell], Sequence[str]]


def print_records(console: Console, columns: Sequence[str], rows: Sequence[Record], *,
                  wrap: Collection[int] = ()) -> None:
    """``rows``: (the cells of ``columns[:-1]``, the paragraphs of the last column). ``wrap``: the
    indexes of the cells that may wrap at their spaces in a boxed table (a date), the others
    never wrap."""
    heads = [Text(c, style="bold") for c in columns]
    records = [([_text(c) for c in row], list(p)) for row, p in rows]
    cells = [r for r, _ in records]
    paragraphs = [p for _, p in records]
    n = len(columns) - 1
    widths = [max([cell_len(heads[i].plain), *(cell_len(r[i].plain) for r in cells)]) for i in range(n)]
    if not console.is_terminal:
        table_lines = [[*heads[:n], heads[n]]] + [[*r, Text("; ".join(p))] for r, p in records]
        for cols in table_lines:
            out = Text()
            for i, cell in enumerate(cols[:n]):
                out.append_text(cell)
                out.append(" " * (widths[i] - cell_len(cell.plain)) + _GAP)
            out.append_text(cols[n])
            out.rstrip()
            console.print(out, no_wrap=True, crop=False, soft_wrap=True)
        return
    # a boxed table: a border and one blank each side per column, one border more
    overhead = 3 * len(columns) + 1
    text_min = max(_longest_word(t for p in paragraphs for t in p), cell_len(columns[-1]))
    text_max = max([cell_len(columns[-1]), *(cell_len(t) for p in paragraphs for t in p)])
    fixed = [widths[i] if i not in wrap else
             max(cell_len(heads[i].plain), _longest_word(r[i].plain for r in cells)) for i in range(n)]
    room = console.width - overhead
    if room - sum(fixed) >= text_min:
        # the wrappable cells whole where there is room, then the text gets the rest
        spare = room - sum(fixed) - text_min
        col_widths = list(fixed)
        for i in sorted(wrap):
            grow = min(spare, widths[i] - fixed[i])
            col_widths[i] += grow
            spare -= grow
        text_width = min(text_max, room - sum(col_widths))
        table = Table()
        for i in range(n):
            table.add_column(heads[i], width=col_widths[i], no_wrap=i not in wrap, overflow="fold")
        table.add_column(heads[n], width=max(text_width, text_min), overflow="fold")
        for r, p in records:
            table.add_row(*r, Text("\n".join(p)))  # on a terminal: one reason a line
        console.print(table)
        return
    for r, p in records:
        line = Text()
        for i, cell in enumerate(r):
            line.append_text(cell)
            if i < n - 1:
                line.append(" " * (widths[i] - cell_len(cell.plain)) + _GAP)
        line.rstrip()
        console.print(line)
        for para in p:
            for wrapped in Text(para).wrap(console, max(1, console.width - _INDENT)):
                wrapped.rstrip()
                console.print(Text(" " * _INDENT) + wrapped, no_wrap=True, crop=False)


_COLUMNS = ("check", "component", "severity", "action", "message")


def print_table(runs: Sequence[CheckRun], *, node: str, profile: str, verbose: bool,
                file: IO[str] | None = None) -> Status:
    console = console_for(file)
    status = overall_status(all_findings(runs))
    # the headline on a line of its own: a table title is padded with blanks to the table's width
    console.print(f"gpumon on {node} (profile {profile}): {status.value.upper()}")
    rows = [((f.check, f.component, Text(f.severity.value, style=_STYLE[f.severity]),
              f.action.value if f.action.value != "none" else ""), [f.message])
            for f in shown(runs, verbose)]
    print_records(console, _COLUMNS, rows)
    return status
