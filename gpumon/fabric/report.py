"""The group report as a person reads it (rank 0, without ``--json``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gpumon.fabric.isolate import bw_text
from gpumon.fabric.judge import Verdict
from gpumon.report import console_for

_STYLE = {"ok": "green", "skipped": "dim", "unknown": "yellow", "warn": "yellow", "fail": "bold red"}


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_report(doc: dict[str, Any], verdict: Verdict | None, where: str,
                 console: Console | None = None) -> None:
    # piped: one event per line, nothing folded (gpumon.report.console_for, as check and status);
    # lines outside the tables are never broken by rich either (soft_wrap), a terminal wraps them
    console = console or console_for()
    nodes = doc.get("nodes", [])
    console.print(f"fabric probe: [bold]{doc.get('status')}[/] ({doc.get('outcome')}) — {len(nodes)} nodes, "
                  f"{doc.get('ranks')} ranks, {doc.get('seconds')} s, launched by "
                  f"{doc.get('launch', {}).get('launcher')}", soft_wrap=True)
    if doc.get("reason"):
        console.print(f"  {doc['reason']}", soft_wrap=True)
    rows = doc.get("collectives") or []
    if rows:
        # titles on lines of their own: a table title is padded with blanks to the table's width
        console.print("collectives (group: slowest rank's median, worst rank's p95/p99; latencies in us)",
                      soft_wrap=True)
        table = Table()
        # 72 columns wide: nothing is cut on an 80-column terminal
        for col in ("op", "size", "n", "p50", "p95", "p99", "busbw GB/s", "wrong"):
            table.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
        for r in rows:
            table.add_row(r["op"], _size(r["nbytes"]), str(r["iterations"]),
                          _num(r["p50_us"], ".0f"), _num(r["p95_us"], ".0f"), _num(r["p99_us"], ".0f"),
                          _num(r["busbw_gbps"], ".3f"), str(r["wrong"]) if r["wrong"] else "")
        console.print(table)
    iso = doc.get("isolation")
    if iso:
        ref = iso["reference_busbw_gbps"]
        bw, lat = bw_text(ref) if ref is not None else "-", _num(iso["reference_p95_us"], ".0f")
        console.print(f"pair rounds: {iso['rounds']}, {iso['pairs_measured']} pairs; reference {bw}, "
                      f"p95 {lat} us", soft_wrap=True)
    if doc.get("seed") is not None:
        console.print(f"seed {doc['seed']} (--seed {doc['seed']} repeats its data patterns and follow-up "
                      "rounds)", soft_wrap=True)
    pairs = doc.get("pairs") or []
    if pairs:
        by_round: dict[int, list[str]] = {}
        for pr in pairs:
            bw = pr.get("busbw_gbps")
            fig = f" {bw_text(bw)}" if isinstance(bw, (int, float)) else ""
            by_round.setdefault(int(pr["round"]), []).append(f"{pr['a']}-{pr['b']}{fig}")
        for k, measured in sorted(by_round.items()):
            console.print(f"  round {k}: {', '.join(measured)}", soft_wrap=True)
    cov = doc.get("coverage")
    if cov:
        since = cov["runs_since_full_coverage"]
        played = cov["rounds_played"]
        span = (f"tournament rounds {played[0]}-{played[-1]} of 0-{cov['cycle_rounds'] - 1}" if played
                else "no tournament round")
        last = ("every pair measured, this run" if since == 0
                else f"{since} run(s) since every pair was measured")
        console.print(f"pair coverage ({cov['mode']}): {cov['pairs_measured']}/{cov['pairs_total']} pairs "
                      f"this cycle, {span}; every pair within {cov['runs_per_cycle']} run(s); {last}",
                      soft_wrap=True)
        for note in cov.get("notes") or []:
            console.print(f"  {note}", soft_wrap=True)
        for err in cov.get("errors") or []:
            console.print(f"[yellow]rotation copy not used[/] {err}", soft_wrap=True)
        if cov.get("errors"):
            origin = cov.get("continued_from")
            console.print(f"  continued from {origin}'s copy" if origin else "  started a fresh rotation",
                          soft_wrap=True)
    for st in doc.get("stalls") or []:
        console.print(f"[yellow]stall[/] {st['where']}: {st['seconds']} s, nodes {', '.join(st['nodes'])}",
                      soft_wrap=True)
    for rank, lost in (doc.get("lost") or {}).items():
        console.print(f"[bold red]lost[/] rank {rank} on {lost['node']} (last heard: {lost['last_heard']})",
                      soft_wrap=True)
    if doc.get("stopped"):
        console.print(f"stopped: {doc['stopped']}", soft_wrap=True)
    findings = doc.get("findings") or {}
    if findings:
        console.print("nodes", soft_wrap=True)
        table = Table()
        # on a narrow terminal only the message folds: a node's name and its verdict stay whole
        for col in ("node", "severity", "action"):
            table.add_column(col, no_wrap=True)
        table.add_column("why", overflow="fold")
        for node, f in sorted(findings.items()):
            sev = f["severity"]
            table.add_row(node, f"[{_STYLE.get(sev, '')}]{sev}[/]", f["action"], f["message"])
        console.print(table)
    console.print(f"report: {where}", soft_wrap=True)
