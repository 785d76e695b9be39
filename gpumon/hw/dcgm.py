"""DCGM diagnostics (``dcgmi diag``): parsers for its JSON and its tables, and a bounded run through
DCGM's own Python bindings.

Result shapes, all normalised to :class:`DiagReport` (one :class:`DiagTest` per test, each with
per-GPU :class:`DiagResult` entries and its warning/info texts):

- JSON, DCGM 2.x/3.x (``dcgmi diag -j``): ``{"DCGM GPU Diagnostic": {"test_categories": [{"category",
  "tests": [{"name", "results": [{"gpu_ids" | "gpu_id": "0", "status": "Pass", "warnings": [...],
  "info": [...]}]}]}]}}``; a deployment test's ``gpu_ids`` is a CSV of every GPU.
- JSON, DCGM 4.x (NVIDIA/DCGM testing/python3/dcgm_diag_schema.json): ``{"DCGM Diagnostic":
  {"test_categories": [{"category", "tests": [{"name", "results": [{"entity_group": "GPU",
  "entity_id": 0, "status", "warnings": [{"warning", "error_id", ...}]}], "test_summary":
  {"status"}}]}], "runtime_error"}, "metadata": {"version"}}``.
- Tables, three generations (captures in tests/data/dcgmi-diag): 2.x and 3.x print ``| Test | Pass |``,
  ``Fail - All``, or one ``Pass - GPU: 1`` / ``Fail - GPU: 0`` line per group, followed by ``Warning``
  and ``Info`` rows; 4.x prints lower-case test names with a summary and one ``GPU0: Pass`` line per
  GPU. Long texts are cut into fixed-width slices, mid-word (``Run a fie`` / ``ld diagnostic``):
  the slices are joined back exactly, without adding or dropping a character.

Text that is neither (a JSON fragment, a table cut off mid-row, no table at all) raises
:class:`DcgmParseError` with what was wrong, or yields a report whose ``truncated`` says so; the
check turns either into ``unknown``, never into a pass.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.hw.tools import ToolResult, ToolRunner

PASS, FAIL, WARN, SKIP, NOT_RUN = "pass", "fail", "warn", "skip", "not_run"
_STATUS_WORDS = {
    "pass": PASS, "passed": PASS,
    "fail": FAIL, "failed": FAIL,
    "warn": WARN, "warning": WARN,
    "skip": SKIP, "skipped": SKIP,
    "not run": NOT_RUN, "notrun": NOT_RUN, "not_run": NOT_RUN,
}
STATUS_RANK = {PASS: 0, SKIP: 1, NOT_RUN: 2, WARN: 3, FAIL: 4}

# Where DCGM installs its Python bindings (they ship with DCGM, not on PyPI): DCGM 4 packages
# (datacenter-gpu-manager-4-core), and DCGM 3 and older.
BINDINGS_DIRS = (
    "/usr/share/datacenter-gpu-manager-4/bindings/python3",
    "/usr/local/dcgm/bindings/python3",
    "/usr/local/dcgm/bindings",
)


class DcgmParseError(ValueError):
    """Output from which no diagnostic result can be read."""


@dataclass(frozen=True)
class DiagResult:
    gpu: int | None  # None: the result covers every GPU ("Fail - All", a deployment test)
    status: str  # pass | fail | warn | skip | not_run


@dataclass(frozen=True)
class DiagMessage:
    gpu: int | None  # the GPU the text names, when it names one
    text: str
    error_id: int | None = None


@dataclass
class DiagTest:
    category: str
    name: str
    summary: str | None = None  # the test's overall status, when DCGM prints one
    results: list[DiagResult] = field(default_factory=list)
    warnings: list[DiagMessage] = field(default_factory=list)
    info: list[DiagMessage] = field(default_factory=list)

    def status_for(self, gpu: int) -> str | None:
        """This test's verdict for one GPU: its own result, else an all-GPU one, else the summary."""
        own = [r.status for r in self.results if r.gpu == gpu]
        if own:
            return max(own, key=STATUS_RANK.__getitem__)
        shared = [r.status for r in self.results if r.gpu is None]
        if shared:
            return max(shared, key=STATUS_RANK.__getitem__)
        if not self.results and self.summary is not None:
            return self.summary
        return None

    def messages_for(self, gpu: int | None) -> list[DiagMessage]:
        return [m for m in self.warnings if m.gpu is None or m.gpu == gpu]


@dataclass
class DiagReport:
    source: str  # "json" | "table" | "bindings"
    tests: list[DiagTest] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    runtime_error: str | None = None
    # the output ended before DCGM finished printing it (why, in words), or None
    truncated: str | None = None
    # messages that belong to no test (a fragment starting after its test's row)
    orphans: list[str] = field(default_factory=list)

    @property
    def version(self) -> str | None:
        return self.metadata.get("version") or self.metadata.get("DCGM Version")

    @property
    def gpus(self) -> list[int]:
        """GPUs named by any result, in order."""
        return sorted({r.gpu for t in self.tests for r in t.results if r.gpu is not None})


def status_word(text: str) -> str | None:
    return _STATUS_WORDS.get(" ".join(text.strip().lower().split()))


# "GPU 0" in DCGM's texts; DCGM 2.4 glues names together ("GPU 0GPU 0's NvLink link 0 ..."),
# so a word boundary cannot be required before "GPU"
_GPU_IN_TEXT = re.compile(r"(?<![A-Za-z])GPU\s?(\d+)(?!\d)")


def _gpu_named(text: str) -> int | None:
    found = {int(g) for g in _GPU_IN_TEXT.findall(text)}
    return found.pop() if len(found) == 1 else None


# --------------------------------------------------------------------------- JSON


def parse_diag_json(text: str) -> DiagReport:
    """``dcgmi diag -j`` output (DCGM 2.x..4.x); DcgmParseError if it is not a whole JSON document."""
    start = text.find("{")
    if start < 0:
        raise DcgmParseError("no JSON object in the output")
    try:
        # dcgmi may print a line before the document (DCGM's own JSON tests show a WARNING line)
        data, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError as exc:
        line = text[: start].count("\n") + exc.lineno
        raise DcgmParseError(f"not valid JSON (line {line}, column {exc.colno}: {exc.msg}): "
                             "the output is cut off or mangled") from None
    return diag_from_json(data)


def diag_from_json(data: Any) -> DiagReport:
    if not isinstance(data, Mapping):
        raise DcgmParseError(f"expected a JSON object, got {type(data).__name__}")
    root = data.get("DCGM GPU Diagnostic", data.get("DCGM Diagnostic"))
    if not isinstance(root, Mapping):
        raise DcgmParseError("no 'DCGM GPU Diagnostic' or 'DCGM Diagnostic' object in the JSON")
    report = DiagReport("json")
    for src in (data, root, data.get("metadata") or {}):
        if isinstance(src, Mapping):
            for key in ("version", "Driver Version Detected", "DCGM Version"):
                if isinstance(src.get(key), str):
                    report.metadata.setdefault(key, src[key])
    err = root.get("runtime_error") or data.get("runtime_error")
    if err:
        report.runtime_error = str(err)
    categories = root.get("test_categories") or []
    if not isinstance(categories, list):
        raise DcgmParseError("'test_categories' is not a list")
    pairs: list[tuple[str, Any]] = []
    for cat in categories:
        if not isinstance(cat, Mapping):
            raise DcgmParseError(f"a test category is {type(cat).__name__}, not an object")
        tests = cat.get("tests") or []
        if not isinstance(tests, list):
            raise DcgmParseError(f"category {cat.get('category')!r}: 'tests' is not a list")
        pairs.extend((str(cat.get("category", "")), t) for t in tests)
    # DCGM 4 builds that hoist "tests" to the top of the diagnostic object
    hoisted = root.get("tests") or []
    pairs.extend(("", t) for t in (hoisted if isinstance(hoisted, list) else []))
    for category, test in pairs:
        if test is None:
            continue  # DCGM 3.2 prints null between tests (its own JSON tests keep one)
        report.tests.append(_json_test(category, test))
    if not report.tests and report.runtime_error is None:
        raise DcgmParseError("the JSON holds no test results and no runtime_error")
    return report


def _json_test(category: str, test: Any) -> DiagTest:
    if not isinstance(test, Mapping) or not isinstance(test.get("name"), str):
        raise DcgmParseError(f"a test entry without a name: {json.dumps(test)[:80]}")
    out = DiagTest(category, test["name"])
    summary = test.get("test_summary")
    if isinstance(summary, Mapping) and isinstance(summary.get("status"), str):
        out.summary = status_word(summary["status"])
    results = test.get("results") or []
    if not isinstance(results, list):
        raise DcgmParseError(f"test {out.name!r}: 'results' is not a list")
    for res in results:
        if not isinstance(res, Mapping):
            raise DcgmParseError(f"test {out.name!r}: a result is {type(res).__name__}, not an object")
        gpus = _json_gpus(res)
        if gpus is None:
            continue  # a CPU or another entity group: not a GPU verdict
        status = status_word(str(res.get("status", "")))
        if status is None:
            raise DcgmParseError(f"test {out.name!r}: unknown status {res.get('status')!r}")
        for g in gpus:
            out.results.append(DiagResult(g, status))
        one = gpus[0] if len(gpus) == 1 else None
        for w in _as_list(res.get("warnings")):
            out.warnings.append(_json_message(w, one))
        for i in _as_list(res.get("info")):
            out.info.append(_json_message(i, one))
    return out


def _json_gpus(res: Mapping[str, Any]) -> list[int | None] | None:
    """The GPUs a result is about ([None]: every GPU); None for another entity group (a CPU)."""
    if "entity_group" in res or "entity_id" in res:
        group = str(res.get("entity_group", "GPU"))
        if group.upper() != "GPU":
            return None
        entity = res.get("entity_id")
        if isinstance(entity, bool) or not isinstance(entity, (int, str)) or not str(entity).isdigit():
            raise DcgmParseError(f"entity_id {entity!r} is not a GPU number")
        return [int(entity)]
    ids = res.get("gpu_ids", res.get("gpu_id"))
    if ids is None:
        return [None]
    parts = [p.strip() for p in str(ids).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise DcgmParseError(f"gpu id {ids!r} is not a number or a list of numbers")
    if len(parts) > 1:
        return [None]  # a deployment test covering every GPU of the group
    return [int(parts[0])]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _json_message(value: Any, gpu: int | None) -> DiagMessage:
    if isinstance(value, Mapping):
        text = str(value.get("warning", value.get("info", value.get("message", ""))))
        code = value.get("error_id")
        return DiagMessage(gpu if gpu is not None else _gpu_named(text), text,
                           int(code) if isinstance(code, int) else None)
    text = str(value)
    return DiagMessage(gpu if gpu is not None else _gpu_named(text), text)


# --------------------------------------------------------------------------- tables

_BORDER_RE = re.compile(r"^\+[-=+]+\+$")
_SECTION_RE = re.compile(r"^[|+]-+\s+(?P<name>[A-Za-z][A-Za-z0-9 /_-]*?)\s+-+\+-+[|+]$")
_LEGACY_STATUS_RE = re.compile(r"^(?P<status>Pass|Fail|Warn|Skip|Not Run)"
                               r"(?:\s*-\s*(?P<who>All|GPUs?:\s*(?P<ids>[\d,\s]+)))?$", re.IGNORECASE)
_ENTITY_STATUS_RE = re.compile(r"^GPU\s?(?P<id>\d+)\s*:\s*(?P<status>Pass|Fail|Warn|Skip|Not Run)$",
                               re.IGNORECASE)
_METADATA = "Metadata"


@dataclass
class _Cell:
    name: str
    text: str  # the value cell's content slice, exactly as printed


def _row(line: str) -> _Cell | None:
    """A two-cell table row ``| name | value |``; None for anything else."""
    if not (line.startswith("|") and line.endswith("|")) or line.count("|") != 3:
        return None
    _, name, value, _ = line.split("|")
    # a value cell is " " + a fixed-width slice + "  ": long texts are cut into such slices
    # (mid-word), so the slice is kept exactly, trailing blanks included, and joined as is
    return _Cell(name.strip(), value[1:len(value) - 2] if len(value) >= 3 else value.strip())


@dataclass
class _Open:
    """The row that continuation lines (an empty name cell) belong to."""

    kind: str  # "status": more results of ``test``; "message": more text of a warning/info row
    test: DiagTest | None
    message_kind: str = ""  # "warning" | "info"
    gpu: int | None = None  # the GPU the row's name cell names ("Warning: GPU0")
    parts: list[str] = field(default_factory=list)

    def close(self, report: DiagReport) -> None:
        if self.kind != "message":
            return
        text = "".join(self.parts).strip()
        if self.test is None:
            report.orphans.append(text)  # a fragment that starts below its test's row
            return
        gpu = self.gpu if self.gpu is not None else _gpu_named(text)
        where = self.test.warnings if self.message_kind == "warning" else self.test.info
        where.append(DiagMessage(gpu, text))


def parse_diag_table(text: str) -> DiagReport:
    """A ``dcgmi diag`` table (DCGM 2.x, 3.x or 4.x layout), whole or in part."""
    report = DiagReport("table")
    lines = [ln.rstrip() for ln in text.splitlines()]
    # the diagnostic table starts at its header; anything before it (a shell prompt, kubectl's
    # "Defaulted container" line, another dcgmi command's output) is not part of it
    start = 0
    for i, line in enumerate(lines):
        if re.match(r"^\|\s*Diagnostic\s*\|\s*Result\s*\|$", line.strip()):
            start = i + 1
    body = lines[start:]
    if not any(ln.startswith(("|", "+")) for ln in body):
        raise DcgmParseError("no dcgmi diag table in the output (no '| name | value |' rows)")
    category = ""
    test: DiagTest | None = None
    open_row: _Open | None = None
    closed = False
    seen_table = False
    for line in body:
        if not line.startswith(("|", "+")):
            if seen_table and line.strip():
                # text after the table started: the paste or the output stops here
                break
            continue
        seen_table = True
        closed = False
        section = _SECTION_RE.match(line)
        if section or _BORDER_RE.match(line):
            if open_row:
                open_row.close(report)
            open_row, test = None, None
            if section:
                category = section.group("name").strip()
            else:
                closed = True
            continue
        cell = _row(line)
        if cell is None:
            report.truncated = f"table row cut off: {line.strip()[:80]!r}"
            break
        if category == _METADATA and cell.name:
            report.metadata[cell.name] = cell.text.strip()
            continue
        if not cell.name:
            if open_row is None:
                report.orphans.append(cell.text.strip())
            elif open_row.kind == "status" and open_row.test is not None:
                _status_line(open_row.test, cell.text.strip(), report)
            else:
                open_row.parts.append(cell.text)
            continue
        if open_row:
            open_row.close(report)
        kind = cell.name.split(":")[0].strip().lower()
        if kind in ("warning", "info"):
            open_row = _Open("message", test, kind, _gpu_named(cell.name), [cell.text])
            continue
        test = DiagTest(category, cell.name)
        report.tests.append(test)
        _status_line(test, cell.text.strip(), report, first=True)
        open_row = _Open("status", test)
    if open_row:
        open_row.close(report)
    if report.truncated is None and not closed:
        report.truncated = "no closing border after the last row: the output was cut off"
    if not report.tests and not report.metadata and not report.orphans:
        raise DcgmParseError("no test rows in the dcgmi diag table")
    for t in report.tests:
        # DCGM 4: once per-GPU lines are known, the summary on the test's own row is not a result
        if t.summary is not None and any(r.gpu is not None for r in t.results):
            t.results = [r for r in t.results if r.gpu is not None]
    return report


def _status_line(test: DiagTest, text: str, report: DiagReport, first: bool = False) -> None:
    if m := _ENTITY_STATUS_RE.match(text):
        test.results.append(DiagResult(int(m.group("id")), _STATUS_WORDS[m.group("status").lower()]))
        return
    m = _LEGACY_STATUS_RE.match(text)
    if m is None:
        # not a status: text under a test row that no layout we know prints there
        report.orphans.append(f"{test.name}: {text}")
        return
    status = _STATUS_WORDS[" ".join(m.group("status").lower().split())]
    ids = m.group("ids")
    if ids:
        for g in re.findall(r"\d+", ids):
            test.results.append(DiagResult(int(g), status))
        return
    if first and not m.group("who"):
        # a bare status on the test's own row: DCGM 4's summary (per-GPU lines follow), or a
        # 2.x/3.x deployment test that covers every GPU
        test.summary = status
    test.results.append(DiagResult(None, status))  # "- All", or the bare status


def parse_diag(text: str) -> DiagReport:
    """JSON when the output is JSON, else a table."""
    stripped = text.lstrip()
    if stripped.startswith("{") or ('"DCGM' in text and "{" in text and "|" not in text):
        return parse_diag_json(text)
    return parse_diag_table(text)


# --------------------------------------------------------------------------- running it


def find_bindings(dirs: Iterable[str] = BINDINGS_DIRS) -> Path | None:
    """The first directory holding DCGM's Python bindings (``pydcgm.py`` and ``dcgm_structs.py``)."""
    for d in dirs:
        p = Path(d)
        if (p / "pydcgm.py").is_file() and (p / "dcgm_structs.py").is_file():
            return p
    return None


# Runs by path in a child process (bounded and killable: a DCGM call that hangs in this process could
# never be interrupted); see that module.
BINDINGS_PROGRAM = Path(__file__).with_name("dcgm_bindings.py")


def run_diag_bindings(tools: ToolRunner, bindings: Path, level: int, *, gpus: Sequence[int] = (),
                      timeout: float, python: str = sys.executable) -> ToolResult:
    """Run a diagnostic through DCGM's Python bindings in a child process; its stdout is JSON
    for :func:`parse_diag_json`. Exit 3/4: the bindings are unusable here (fall back to dcgmi)."""
    return tools.run([python, str(BINDINGS_PROGRAM), str(bindings), str(level), ",".join(map(str, gpus))],
                     timeout=timeout)


def run_dcgmi(tools: ToolRunner, level: int, *, timeout: float, binary: str = "dcgmi") -> ToolResult:
    return tools.run([binary, "diag", "-r", str(level), "-j"], timeout=timeout)
