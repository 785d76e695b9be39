#!/usr/bin/env python3
"""Generate the reference pages of docs/reference/ from the code.

    python tools/gen_reference.py               # regenerate docs/reference/
    python tools/gen_reference.py --check       # exit 1 if a page is out of date
    python tools/gen_reference.py --output DIR  # write the pages somewhere else

Each page is read off the code it documents, never written by hand:

- ``checks.md``: every built-in check, found in checks/ as setup.py finds its entry points (a
  top-level class whose name ends in ``Check`` and that sets ``name``): its class attributes, its
  module docstring's first paragraph, its ``Config`` dataclass (options, defaults, bounds, source
  notes, the comments above each field), the SKU profiles' values for them, and its ``readings``;
- ``metrics.md``: the exporter's own families (``gpumon.export.prometheus.FAMILIES``, with their
  type and labels as the collector emits them for a sample snapshot) and every reading the checks
  declare (``ReadingSpec``), named as ``/metrics`` names them;
- ``configuration.md``: the ``gpumon.config.Config`` dataclass and the settings dataclasses under
  it, the settings every check has, and the SKU profile file (``gpumon.profiles.Profile``);
- ``cli.md``: the ``gpumon`` command's parsers (``gpumon.cli.build_parser``), formatted here, so
  that nothing depends on the terminal's width or on the Python version's argparse layout;
- ``schemas.md`` and the JSON Schemas it describes, copied beside it: the JSON report
  (``gpumon/schemas/report-v1.schema.json``) and the guard's verdict file
  (``gpumon/guard/schema/verdict-v1.schema.json``).

The output is the same on every machine: sorted, no time stamps, no paths but the repository's.
tests/test_reference_docs.py regenerates the pages and fails on any difference; after changing a
check, an option, a metric, a flag or a schema, run this and commit the pages with the change.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import importlib.util
import inspect
import io
import json
import logging
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "docs" / "reference"
CHECKS_DIR = ROOT / "checks"
CHECKS_PACKAGE = "gpumon_checks"  # checks/ as it is installed (pyproject's package-dir)
REGENERATE = "python tools/gen_reference.py"
SCHEMAS = {  # the file in docs/reference/ -> the package file it is a copy of
    "report-v1.schema.json": ROOT / "gpumon" / "schemas" / "report-v1.schema.json",
    "verdict-v1.schema.json": ROOT / "gpumon" / "guard" / "schema" / "verdict-v1.schema.json",
}
OPENAPI = ("openapi-v1.json", ROOT / "gpumon" / "export" / "openapi-v1.json")
_USAGE_WIDTH = 100


def _note(what: str) -> str:
    return (f"*Generated from {what} by `tools/gen_reference.py`: do not edit by hand; run "
            f"`{REGENERATE}` after changing the code.*")


# --------------------------------------------------------------------------- Markdown text

_CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.S)  # never across a paragraph
# what a docstring means as emphasis: **strong**, *emphasis* (a star inside a word, or alone, is text)
_EMPHASIS = re.compile(r"\*\*[^*\n]+?\*\*|(?<![\w*])\*[^\s*][^*\n]*?(?<=[^\s*])\*(?![\w*])")


def _escape(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*")
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    # an underscore that could open or close emphasis (Markdown never reads one inside a word so)
    return re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", text)


def _protected(text: str, keep: Sequence[re.Pattern[str]]) -> str:
    """``text`` escaped, but for the spans that one of ``keep`` matches (first match wins)."""
    for i, pattern in enumerate(keep):
        out: list[str] = []
        pos = 0
        for m in pattern.finditer(text):
            out += [_protected(text[pos:m.start()], keep[i + 1:]), m.group(0)]
            pos = m.end()
        if out:
            return "".join([*out, _protected(text[pos:], keep[i + 1:])])
    return _escape(text)


def md(text: str) -> str:
    """``text`` as one line of Markdown prose: what Markdown would read as HTML, emphasis or a
    table's column break escaped, code spans (``x`` and ```x```) left as they are."""
    return _protected(" ".join(text.split()), (_CODE_SPAN,))


def md_block(doc: str) -> list[str]:
    """A docstring as Markdown lines: its paragraphs and lists kept, its code spans and its
    emphasis kept, the rest escaped as :func:`md` does."""
    return _protected(inspect.cleandoc(doc), (_CODE_SPAN, _EMPHASIS)).splitlines()


def code(value: str) -> str:
    """``value`` as a code span (one line), whatever backticks it holds."""
    value = " ".join(value.split())
    if not value:
        return ""
    ticks = "`" * (max((len(t) for t in re.findall(r"`+", value)), default=0) + 1)
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{ticks}{pad}{value}{pad}{ticks}"


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return out


def first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return inspect.cleandoc(doc).split("\n\n", 1)[0]


def own_doc(cls: type) -> str:
    """The class's own docstring ('' for the signature a dataclass writes when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def yaml_value(value: Any) -> str:
    """A default as a site file writes it (YAML flow style)."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1 << 16, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    return value


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:g} s"


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


# --------------------------------------------------------------------------- dataclass options


@dataclasses.dataclass(frozen=True)
class Option:
    """One key of a settings dataclass, flattened (``remediation.breaker.share``)."""

    key: str
    type: str
    default: str
    allowed: str
    about: str
    source: str


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments written with it in the class's source: the block right above
    it and those on its own lines."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    src = textwrap.dedent("".join(lines))
    text = src.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            note = tok.string.lstrip("#").strip()
            if not re.match(r"(noqa|type:|pragma)\b", note):
                comments[tok.start[0]] = note
    klass = ast.parse(src).body[0]
    assert isinstance(klass, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in klass.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line >= 1 and text[line - 1].lstrip().startswith("#"):
            if line in comments:
                above.insert(0, comments[line])
            line -= 1
        span = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
        within = [comments[n] for n in span if n in comments]
        notes = " ".join([*above, *within])
        if notes:
            out[stmt.target.id] = notes
    return out


def number(value: float) -> str:
    """A bound as a reader writes it: 8589934592, 0.05, 1e-06."""
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e16):
        return str(int(value))
    return repr(value)


def _allowed(meta: Mapping[str, Any]) -> str:
    parts = []
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        parts.append(f"{number(lo)} .. {number(hi)}")
    elif lo is not None:
        parts.append(f"≥ {number(lo)}")
    elif hi is not None:
        parts.append(f"≤ {number(hi)}")
    if meta.get("allow_inf"):
        parts.append("`.inf` allowed")
    if "choices" in meta:
        parts.append("one of " + ", ".join(code(yaml_value(c)) for c in meta["choices"]))
    if meta.get("sourced"):
        parts.append("written `{value: X, source: \"...\"}`")
    return "; ".join(parts)


def _sentences(*parts: str) -> str:
    """``parts`` one after the other, each ended with a full stop where it has none."""
    texts = [" ".join(p.split()) for p in parts if p.strip()]
    return " ".join(t if t[-1] in ".!?)" or i == len(texts) - 1 else t + "." for i, t in enumerate(texts))


def _is_settings(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def options_of(cls: type, prefix: str = "", skip: Iterable[str] = ()) -> list[Option]:
    """Every key of dataclass ``cls``, nested settings dataclasses flattened, in declaration order."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if _is_settings(tp):
            out += options_of(tp, f"{key}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = yaml_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = yaml_value(f.default_factory())
        else:
            default = "required"
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            meta: Mapping[str, Any] = {**f.metadata, "choices": [m.value for m in tp]}
        else:
            meta = f.metadata
        about = _sentences(str(meta.get("help", "")), comments.get(f.name, ""))
        out.append(Option(key, type_name(tp), default, _allowed(meta), about, str(meta.get("source", ""))))
    return out


def options_table(options: Sequence[Option], key_label: str = "option") -> list[str]:
    rows = [(code(o.key), code(o.type), "required" if o.default == "required" else code(o.default),
             md(o.allowed) if o.allowed else "", md(o.about)) for o in options]
    lines = table((key_label, "type", "default", "allowed", "about"), rows)
    sourced = [o for o in options if o.source]
    if sourced:
        lines += ["", "Where the defaults come from:", ""]
        lines += [f"- {code(o.key)}: {md(o.source)}" for o in sourced]
    return lines


# --------------------------------------------------------------------------- the checks


@functools.cache
def _setup_py() -> Any:
    """setup.py as a module (it runs ``setup()`` only as a script)."""
    spec = importlib.util.spec_from_file_location("_gpumon_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checks_in(path: Path) -> list[tuple[str, str]]:
    """(check name, class name) of every check class defined at the top of ``path``: setup.py's own
    rule for the ``gpumon.checks`` entry points."""
    found: list[tuple[str, str]] = _setup_py()._checks_in(path)
    return found


def builtin_checks() -> dict[str, Any]:
    """Check name -> class, for every check under checks/ (found as setup.py finds them, so a check
    added since the last install is documented too)."""
    from gpumon.check import Check

    found: dict[str, Any] = {}
    for path in sorted(CHECKS_DIR.rglob("*.py")):
        rel = path.relative_to(CHECKS_DIR).with_suffix("")
        if "__pycache__" in rel.parts or rel.name == "__init__" or rel.name.startswith("test"):
            continue
        for name, cls_name in _checks_in(path):
            cls = getattr(importlib.import_module(".".join((CHECKS_PACKAGE, *rel.parts))), cls_name)
            if not (isinstance(cls, type) and issubclass(cls, Check)) or cls.name != name:
                raise SystemExit(f"{path.relative_to(ROOT)}: {cls_name} is not the gpumon Check {name!r}")
            if name in found:
                raise SystemExit(f"two checks named {name!r}")
            found[name] = cls
    return dict(sorted(found.items()))


def _source_path(cls: type) -> str:
    """The check's file in the checkout (checks/ is installed as gpumon_checks), however installed."""
    top, *parts = cls.__module__.split(".")
    if top != CHECKS_PACKAGE:
        return cls.__module__
    path = CHECKS_DIR.joinpath(*parts)
    path = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
    return path.relative_to(ROOT).as_posix()


_PHASE = {
    "continuous": "continuous: runs in `gpumon check` and, every `interval_s`, in the daemon",
    "bootstrap": "bootstrap: runs once per bootstrap suite (`gpumon run-bootstrap`), within `timeout_s`",
    "canary": "canary: the daemon runs it every `interval_s`",
}


def how_it_works(cls: Any) -> str:
    """The check's module docstring (and its class's own, if it has one), without the ``name:``
    its first line starts with."""
    doc = inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "")
    prefix = f"{cls.name}:"
    if doc.startswith(prefix):
        doc = doc[len(prefix):].strip()
        doc = doc[:1].upper() + doc[1:]
    own = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    return "\n\n".join(d for d in (doc, own) if d)


def _kernel_log(cls: Any) -> str:
    needs = cls.kernel_log
    if needs is None:
        return ""
    parts = []
    if needs.events is None:
        parts.append("every kernel-log record and NVRM event")
    elif needs.events:
        parts.append("the NVRM events " + ", ".join(code(t.__name__) for t in needs.events))
    if needs.fold is not None:
        parts.append("its own summary (fold) of the raw records, kept up to date by the daemon's "
                     "kernel-log pump between runs")
    return "; ".join(parts) + " (`gpumon check --kmsg-file FILE` judges a saved log)"


def _extras(cls: Any) -> list[str]:
    out = []
    if cls.State is not None:
        out.append(f"keeps state between runs ({code(cls.State.__name__)}, reset at a reboot)")
    if cls.has_after_suite():
        out.append("has an after-suite step (a second look once the whole bootstrap suite has run)")
    if cls.judges_canaries():
        out.append("judges canary runs (`gpumon canary`)")
    if cls.accepts_documents():
        out.append("takes documents from local processes over the intake socket (`daemon.intake_socket`)")
    return out


def profile_values() -> dict[str, list[tuple[str, str, str]]]:
    """Check name -> (option, profile, value) of every value a shipped SKU profile sets."""
    from gpumon.profiles import builtin_profiles

    out: dict[str, list[tuple[str, str, str]]] = {}
    for pname, profile in sorted(builtin_profiles().items()):
        for check, options in profile.checks.items():
            for option, entry in options.items():
                value = entry["value"] if isinstance(entry, Mapping) else entry
                out.setdefault(check, []).append((option, pname, yaml_value(value)))
    return {name: sorted(rows) for name, rows in out.items()}


def checks_page(checks: Mapping[str, Any]) -> str:
    tuned = profile_values()
    out = [
        "# Checks",
        "",
        _note("the check classes under `checks/`"),
        "",
        "Every check gpumon ships, with what it reads, the options a site sets under "
        "`checks.<name>` (see [Configuration](configuration.md#checks)) and the readings it exports "
        "(see [Metrics](metrics.md)). Besides its own options every check has `enabled`, "
        "`interval_s` and `timeout_s`; the defaults are listed with each check.",
        "",
        "Every check reports `skipped` with the reason when it does not apply to the node, and "
        "`unknown` when it should have judged but could not; a hardware call that does not return "
        "within its bound is a `fail` (`reboot_node` for an NVML call on a GPU, `reset_gpu` for "
        "another hung probe of a GPU), and a GPU that NVML reports lost is a `fail` with "
        "`reboot_node`.",
        "",
    ]
    rows = [(f"[{name}](#{name})", cls.phase.value, md(cls.description)) for name, cls in checks.items()]
    out += table(("check", "phase", "what it checks"), rows)
    for name, cls in checks.items():
        out += ["", f"## {name}", ""]
        if cls.description:
            out += [md(cls.description[:1].upper() + cls.description[1:]) + ".", ""]
        facts = [
            f"- **Phase:** {_PHASE.get(cls.phase.value, cls.phase.value)}",
            f"- **Defined in:** `{_source_path(cls)}`, class `{cls.__name__}`",
            f"- **Defaults:** `interval_s` {seconds(cls.interval)}, `timeout_s` {seconds(cls.timeout)}"
            + (f", expected cost {seconds(cls.cost)}" if cls.cost is not None else ""),
        ]
        if (kl := _kernel_log(cls)):
            facts.append(f"- **Kernel log:** {kl}")
        facts += [f"- {md(extra[0].upper() + extra[1:])}" for extra in _extras(cls)]
        out += facts
        doc = how_it_works(cls)
        if doc:
            out += ["", "### How it works", "", *md_block(doc)]
        out += ["", "### Options", ""]
        if cls.Config is None:
            out.append(f"No options of its own (only `enabled`, `interval_s`, `timeout_s`), under "
                       f"`checks.{name}`.")
        else:
            out += [f"Under `checks.{name}` in the site file (`{cls.Config.__name__}`):", ""]
            doc = own_doc(cls.Config)
            if doc:
                out += [md(first_paragraph(doc)), ""]
            out += options_table(options_of(cls.Config))
        if name in tuned:
            out += ["", "SKU profiles that set its options (beneath the site file):", ""]
            out += table(("option", "profile", "value"),
                         [(code(o), code(p), code(v)) for o, p, v in tuned[name]])
        out += ["", "### Readings", ""]
        if not cls.readings:
            out.append("None: its findings are on `/metrics` as `gpumon_finding_severity`.")
        else:
            for spec in sorted(cls.readings, key=lambda s: s.name):
                metric = f"gpumon_{spec.name}"
                unit = f", {md(spec.unit)}" if spec.unit else ""
                out.append(f"- [`{metric}`](metrics.md#{metric}) ({spec.kind}{unit}): {md(spec.meaning)}")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- metrics


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as the exposition names its samples (a counter's with _total)
    kind: str
    labels: tuple[str, ...]
    help: str


def fixed_families() -> list[Family]:
    """The exporter's own families, with the type and labels the collector gives them for a sample
    snapshot that has every part (a check run, health, remediation, the kernel-log pump, sinks)."""
    from gpumon.export.prometheus import FAMILIES, GpumonCollector, Snapshot
    from gpumon.export.readings import ReadingCatalog
    from gpumon.model import Action, CheckRun, Finding, Severity

    run = CheckRun("x", [Finding("x", "gpu/0", Severity.WARN, "m", Action.RESET_GPU)], 0.0, 0.1, "completed")
    snap = Snapshot(
        node="n", profile="p", version="v", runs={"x": run},
        health={"node": ("degraded", "reset_gpu"), "gpu/0": ("degraded", "reset_gpu")},
        remediation={"backend": "slurm", "mode": "observe", "breaker_open": False, "decision": "none",
                     "error": None, "errors_total": 0},
        accepted=frozenset({("x", "gpu/0")}),
        kernel_log={"read": 1, "dropped": {("x", "queue_full"): 1}, "merged": {"x": 1}},
        sinks={"health": 0})
    found: dict[str, Family] = {}
    for family in GpumonCollector(lambda: snap, readings=ReadingCatalog()).collect():
        labels: list[str] = []
        for sample in family.samples:
            labels += [k for k in sample.labels if k not in labels]
        name = f"{family.name}_total" if family.type == "counter" else family.name
        found[family.name] = Family(name, family.type, tuple(labels), family.documentation)
    missing = sorted(set(FAMILIES) - set(found))
    if missing:
        raise SystemExit(f"tools/gen_reference.py: the sample snapshot yields no {', '.join(missing)}: "
                         "give fixed_families() what the collector needs to emit them")
    return [found[name] for name in sorted(FAMILIES)]


def metrics_page(checks: Mapping[str, Any]) -> str:
    from gpumon.export.readings import ReadingCatalog

    catalog = ReadingCatalog.of(checks.values())
    out = [
        "# Metrics",
        "",
        _note("`gpumon/export/prometheus.py` and the readings the checks declare"),
        "",
        "The daemon serves these on `/metrics` at `exporter.listen` (default `0.0.0.0:9426`), in the "
        "Prometheus text format or OpenMetrics, as the scraper asks. A scrape never touches the "
        "hardware: it reads the daemon's latest snapshot. Every name starts with `gpumon_`; a "
        "counter's samples end in `_total`.",
        "",
        "## gpumon's own metrics",
        "",
    ]
    out += table(("metric", "type", "labels", "meaning"),
                 [(code(f.name), f.kind, ", ".join(code(lb) for lb in f.labels), md(f.help))
                  for f in fixed_families()])
    out += [
        "",
        "## Readings of the checks",
        "",
        "A check publishes readings in a finding's evidence (`evidence.readings`, see the "
        "[JSON report](schemas.md#json-report)); each becomes `gpumon_<name>` with the labels "
        "`check` and `component` and its own. The check declares its meaning, unit and source, "
        "which are the family's HELP text. A site's own check that declares nothing is still "
        "exported, with a HELP that names the check.",
        "",
    ]
    names = sorted(catalog)
    out += table(("metric", "type", "unit", "declared by"),
                 [(f"[`gpumon_{n}`](#gpumon_{n})", catalog[n].kind, md(catalog[n].unit or "—"),
                   ", ".join(f"[{c}](checks.md#{c})" for c in catalog.declared_by(n))) for n in names])
    for n in names:
        spec = catalog[n]
        labels = ["check", "component", *sorted(spec.labels)]
        out += ["", f"### gpumon_{n}", ""]
        out.append(f"- **Type:** {spec.kind}")
        out.append(f"- **Unit:** {md(spec.unit) if spec.unit else 'none (a flag or an enumeration)'}")
        out.append(f"- **Labels:** {', '.join(code(lb) for lb in labels)}")
        out.append(f"- **Declared by:** {', '.join(f'[{c}](checks.md#{c})' for c in catalog.declared_by(n))}")
        out.append(f"- **Meaning:** {md(spec.meaning)}")
        out.append(f"- **Source:** {md(spec.source)}")
        if spec.note:
            out.append(f"- **Note:** {md(spec.note)}")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- configuration


def configuration_page(checks: Mapping[str, Any]) -> str:
    from gpumon import config as config_module
    from gpumon.config import COMMON_SETTINGS, MAX_CHECK_TIMEOUT_S, SITE_CONFIG, Config
    from gpumon.config_show import _INTERNAL
    from gpumon.profiles import Profile

    out = [
        "# Configuration",
        "",
        _note("the dataclasses of `gpumon/config.py`, the checks' `Config` classes and "
              "`gpumon/profiles.py`"),
        "",
        md(inspect.cleandoc(config_module.__doc__ or "").split("\n\n", 1)[-1]),
        "",
        f"The site file is `{SITE_CONFIG}` (or `--config FILE`). An unknown key, a value of the wrong "
        "type or out of bounds stops gpumon with the file, the line and the key. "
        "`gpumon config --defaults` prints every option with its default; `gpumon config` prints "
        "the configuration a command would run with and where each value came from.",
        "",
        "## Top level",
        "",
    ]
    hints = typing.get_type_hints(Config)
    fields = [f for f in dataclasses.fields(Config) if f.init and f.name not in _INTERNAL]
    top = [f.name for f in fields if not _is_settings(hints[f.name])]
    every = options_of(Config, skip=_INTERNAL)
    out += options_table([o for o in every if o.key in top], "key")
    for f in fields:
        if f.name in top:
            continue
        cls = hints[f.name]
        out += ["", f"## {f.name}", ""]
        doc = own_doc(cls)
        if doc:
            out += [md(inspect.cleandoc(doc)), ""]
        out += options_table([o for o in every if o.key.startswith(f"{f.name}.")], "key")
    out += [
        "",
        "## checks",
        "",
        "`checks.<name>` holds one check's settings: the three every check has, and its own "
        "options, listed with each check in the [checks reference](checks.md). A section that names "
        "no installed check is refused (one that names a check whose plugin did not load is kept "
        "as written). A SKU profile may set a check's options beneath the site file.",
        "",
    ]
    common = {
        "enabled": ("bool", "true", "", "false: the check never runs (a check the bootstrap suite "
                    "requires then leaves the suite incomplete)"),
        "interval_s": ("float", "the check's (below)", "> 0",
                       "seconds between runs in the daemon (continuous and canary checks), +- "
                       "`daemon.jitter`"),
        "timeout_s": ("float", "the check's (below)", f"> 0, ≤ {MAX_CHECK_TIMEOUT_S:g}",
                      "seconds a run may take before it is reported hung (a bootstrap check's "
                      "budget in the suite)"),
    }
    assert tuple(common) == COMMON_SETTINGS, "gen_reference: describe every common check setting"
    out += table(("key", "type", "default", "allowed", "about"),
                 [(code(f"checks.<name>.{k}"), code(t), d if d.startswith("the") else code(d), md(a),
                   md(about)) for k, (t, d, a, about) in common.items()])
    out += ["", "Each check's defaults:", ""]
    out += table(("check", "phase", "enabled", "interval_s", "timeout_s", "own options"),
                 [(f"[{name}](checks.md#{name})", cls.phase.value, "`true`", code(f"{cls.interval:g}"),
                   code(f"{cls.timeout:g}"),
                   str(len(options_of(cls.Config))) if cls.Config is not None else "none")
                  for name, cls in checks.items()])
    out += [
        "",
        "## SKU profile files",
        "",
        "A profile says what healthy means for one GPU model on its reference node. gpumon ships "
        "one per supported SKU and picks the one whose `match` fits the GPUs' name (`profile: auto`); "
        "a site adds its own as `<name>.yaml` in `profile_dirs`. Every number is written "
        "`{value: X, source: \"...\"}`: the loader refuses a number without a source note.",
        "",
    ]
    out += options_table(options_of(Profile, skip=("notes", "origin")), "key")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- CLI


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        mv = action.metavar
        return " ".join(mv) if isinstance(mv, tuple) else str(mv)
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _arg_text(action: argparse.Action) -> str:
    """What follows the option (or what the positional looks like), argparse's way."""
    mv = _metavar(action)
    nargs = action.nargs
    if nargs == 0:
        return ""
    if nargs is None:
        return mv
    if nargs == "?":
        return f"[{mv}]"
    if nargs == "*":
        return f"[{mv} ...]"
    if nargs == "+":
        return f"{mv} [{mv} ...]"
    if isinstance(nargs, int):
        return " ".join([mv] * nargs)
    return mv


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion of %(default)s and the like
        params: dict[str, Any] = dict(vars(action), prog=prog)
        params = {k: v for k, v in params.items() if v is not argparse.SUPPRESS}
        params = {k: getattr(v, "__name__", v) for k, v in params.items()}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        text = text % params
    return text


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS or action.nargs == 0 or value == []:
        return ""
    return code(str(value))


def _shown(parser: argparse.ArgumentParser, hide: set[str]) -> list[argparse.Action]:
    return [a for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
            and not (a.option_strings and set(a.option_strings) <= hide)]


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return out


def _usage(prog: str, parser: argparse.ArgumentParser, hide: set[str], has_globals: bool) -> list[str]:
    items: list[str] = []
    grouped: dict[int, argparse._MutuallyExclusiveGroup] = {}
    for exclusive in parser._mutually_exclusive_groups:
        for a in exclusive._group_actions:
            grouped[id(a)] = exclusive
    done: set[int] = set()
    shown = _shown(parser, hide)
    if has_globals:
        items.append("[global options]")
    for action in [a for a in shown if a.option_strings] + [a for a in shown if not a.option_strings]:
        if id(action) in done:
            continue
        group = grouped.get(id(action))
        members = [a for a in group._group_actions if a in shown] if group is not None else [action]
        done.update(id(a) for a in members)
        parts = []
        for a in members:
            arg = _arg_text(a)
            parts.append(" ".join(p for p in (a.option_strings[0] if a.option_strings else "", arg) if p))
        text = " | ".join(parts)
        required = (group.required if group is not None else
                    (action.required or (not action.option_strings and action.nargs not in ("?", "*"))))
        if len(members) > 1:
            items.append(f"({text})" if required else f"[{text}]")
        else:
            items.append(text if required or not action.option_strings else f"[{text}]")
    if _subcommands(parser):
        items.append("COMMAND ...")
    lines = [f"{prog}"]
    indent = " " * (len(prog) + 1)
    for item in items:
        if len(lines[-1]) + 1 + len(item) > _USAGE_WIDTH and lines[-1].strip():
            lines.append(indent + item)
        else:
            lines[-1] += " " + item
    return lines


def _arguments_table(parser: argparse.ArgumentParser, prog: str, hide: set[str]) -> list[str]:
    rows = []
    for a in _shown(parser, hide):
        name = ", ".join(code(s) for s in a.option_strings) if a.option_strings else code(_metavar(a))
        arg = _arg_text(a)
        if not a.option_strings and arg == _metavar(a):
            arg = ""  # one value: the name says it
        about = md(_help(a, prog))
        if a.required and a.option_strings:
            about = "required. " + about
        rows.append((name, code(arg), _default(a), about))
    return table(("argument", "value", "default", "help"), rows) if rows else []


def _command_sections(prog: str, parser: argparse.ArgumentParser, hide: set[str]) -> Iterator[str]:
    yield from ["", f"## {prog}", ""]
    yield from ["```text", *_usage(prog, parser, hide, has_globals=True), "```", ""]
    if parser.description:
        yield from [md(parser.description), ""]
    subs = _subcommands(parser)
    if subs:
        yield from table(("command", "what it does"),
                         [(f"[{name}](#{_slug(f'{prog} {name}')})", md(about)) for name, about, _ in subs])
        yield ""
    args = _arguments_table(parser, prog, hide)
    if args:
        yield from args
    elif not subs:
        yield "No arguments but the global options."
    if parser.epilog:
        yield from ["", md(parser.epilog)]
    for name, _, sub in subs:
        yield from _command_sections(f"{prog} {name}", sub, hide)


def _slug(heading: str) -> str:
    """The id MkDocs (Python-Markdown's toc) gives a heading of plain words."""
    value = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def cli_page() -> str:
    import gpumon.cli as cli

    parser = cli.build_parser()
    prog = parser.prog
    globals_ = [a for a in _shown(parser, set()) if a.option_strings]
    hide = {s for a in globals_ for s in a.option_strings}
    body = inspect.cleandoc(cli.__doc__ or "").split("\n\n", 1)
    out = [
        "# Command line",
        "",
        _note("the argument parsers of `gpumon/cli.py` (`build_parser`)"),
        "",
        "```text",
        *_usage(prog, parser, set(), has_globals=False),
        "```",
        "",
        md(parser.description or ""),
        "",
    ]
    if len(body) > 1:
        out += [md(body[1]), ""]
    out += ["## Global options", "",
            "Accepted before the command and after it (`gpumon --simulate X check` and "
            "`gpumon check --simulate X` are the same).", ""]
    out += table(("argument", "value", "default", "help"),
                 [(", ".join(code(s) for s in a.option_strings), code(_arg_text(a)), _default(a),
                   md(_help(a, prog))) for a in globals_])
    out += ["", "`--version` prints the version; `-h`/`--help` after any command prints its help.", "",
            "## Commands", ""]
    out += table(("command", "what it does"),
                 [(f"[{name}](#{_slug(f'{prog} {name}')})", md(about))
                  for name, about, _ in _subcommands(parser)])
    for name, _, sub in _subcommands(parser):
        out += list(_command_sections(f"{prog} {name}", sub, hide))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- schemas


def _schema_type(node: Mapping[str, Any]) -> str:
    tp = node.get("type")
    if isinstance(tp, list):
        return " or ".join(map(str, tp))
    if tp is None and "const" in node:
        return type(node["const"]).__name__
    return str(tp or "any")


# "string: ...", "string or null: ...": the type column says it
_TYPE_PREFIX = re.compile(r"^(?:string|number|integer|boolean|object|array|null)"
                          r"(?: or (?:string|number|integer|boolean|object|array|null))*: ")


def _schema_rows(node: Mapping[str, Any], root: Mapping[str, Any], path: str, required: bool,
                 depth: int = 0) -> Iterator[tuple[str, str, str, str]]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    if path:
        about = _TYPE_PREFIX.sub("", str(node.get("description", "")))
        if "const" in node:
            about += f" Always {code(json.dumps(node['const']))}."
        elif "enum" in node and not all(str(v) in about for v in node["enum"]):
            about += " One of " + ", ".join(code(json.dumps(v)) for v in node["enum"]) + "."
        yield (code(path), _schema_type(node), "yes" if required else "", md(about))
    if depth > 6:
        return
    props = node.get("properties")
    if isinstance(props, Mapping):
        needed = set(node.get("required", ()))
        for key, sub in props.items():
            yield from _schema_rows(sub, root, f"{path}.{key}" if path else key, key in needed, depth + 1)
    extra = node.get("additionalProperties")
    if isinstance(extra, Mapping) and extra:
        key = "<component>" if node.get("propertyNames") else "<key>"
        yield from _schema_rows(extra, root, f"{path}.{key}", False, depth + 1)
    for i, sub in enumerate(node.get("prefixItems", ())):
        yield from _schema_rows(sub, root, f"{path}[{i}]", True, depth + 1)
    items = node.get("items")
    if isinstance(items, Mapping):
        yield from _schema_rows(items, root, f"{path}[]", False, depth + 1)


_SCHEMA_PAGES = (
    ("JSON report", "report-v1.schema.json", "gpumon/schemas/report-v1.schema.json",
     "`gpumon.report.schema()`"),
    ("Guard verdict file", "verdict-v1.schema.json", "gpumon/guard/schema/verdict-v1.schema.json",
     "`gpumon.guard.verdict.schema()`"),
)


def schemas_page(schemas: Mapping[str, Mapping[str, Any]]) -> str:
    out = [
        "# JSON Schemas",
        "",
        _note("the JSON Schemas gpumon ships"),
        "",
        "The JSON documents gpumon writes for other programs, as JSON Schemas (draft 2020-12). The "
        "package ships each one, and the tests validate gpumon's real output against it.",
    ]
    for title, file, shipped, loader in _SCHEMA_PAGES:
        schema = schemas[file]
        out += ["", f"## {title}", "", md(str(schema.get("description", ""))), ""]
        out += [f"- **Schema:** [{file}]({file}), `$id` {code(str(schema.get('$id', '')))}",
                f"- **In the package:** `{shipped}`, loaded with {loader}", ""]
        out += table(("field", "type", "required", "meaning"), _schema_rows(schema, schema, "", True))
    return "\n".join(out) + "\n"


def _resolved(doc: Mapping[str, Any], node: Any) -> Any:
    """``node`` with a top-level ``$ref`` (``#/components/...``) followed."""
    while isinstance(node, Mapping) and "$ref" in node:
        target: Any = doc
        for part in str(node["$ref"]).lstrip("#/").split("/"):
            target = target[part]
        node = target
    return node


def openapi_page(doc: Mapping[str, Any]) -> str:
    """The Query API's operations, from the OpenAPI document the daemon serves."""
    info = doc.get("info", {})
    out = [
        "# Query API (OpenAPI)",
        "",
        _note("the OpenAPI document gpumon ships (gpumon/export/openapi-v1.json)"),
        "",
        f"{md(str(info.get('title', '')))}, version {code(str(info.get('version', '')))}: the daemon serves "
        "this document at `/api/v1/openapi.json`, behind the same TLS and basic auth as the rest of the "
        f"API. The whole document: [{OPENAPI[0]}]({OPENAPI[0]}) "
        f"(OpenAPI {code(str(doc.get('openapi', '')))}). "
        "How the API is used: [Query API](../postmortem/query-api.md).",
    ]
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if method not in ("get", "head", "post", "put", "delete") or not isinstance(op, Mapping):
                continue
            out += ["", f"## {method.upper()} `{path}`", "", md(str(op.get("summary", ""))), ""]
            params = [_resolved(doc, p) for p in op.get("parameters", [])]
            if params:
                rows = []
                for prm in params:
                    schema = _resolved(doc, prm.get("schema", {}))
                    kind = schema.get("type", "") if isinstance(schema, Mapping) else ""
                    meaning = md(first_paragraph(str(prm.get("description", ""))))
                    rows.append((code(str(prm.get("name", ""))), md(str(prm.get("in", ""))),
                                 code(str(kind)) if kind else "", meaning))
                out += [*table(("parameter", "in", "type", "meaning"), rows), ""]
            answers = [(code(str(status)), md(first_paragraph(str(_resolved(doc, r).get("description", "")))))
                       for status, r in op.get("responses", {}).items()]
            out += table(("status", "answer"), answers)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- all of it


def generate() -> dict[str, str]:
    """File name in docs/reference/ -> its text."""
    # a check that logs while imported or gathered (a reading declared twice) is not the page's
    # business; the tests of the checks see it
    logging.getLogger("gpumon").setLevel(logging.ERROR)
    checks = builtin_checks()
    texts = {file: path.read_text(encoding="utf-8") for file, path in SCHEMAS.items()}
    schemas = {file: json.loads(text) for file, text in texts.items()}
    texts[OPENAPI[0]] = OPENAPI[1].read_text(encoding="utf-8")
    openapi = json.loads(texts[OPENAPI[0]])
    pages: dict[str, Callable[[], str]] = {
        "checks.md": lambda: checks_page(checks),
        "metrics.md": lambda: metrics_page(checks),
        "configuration.md": lambda: configuration_page(checks),
        "cli.md": cli_page,
        "schemas.md": lambda: schemas_page(schemas),
        "openapi.md": lambda: openapi_page(openapi),
    }
    out = {name: re.sub(r"\n{3,}", "\n\n", render()) for name, render in pages.items()}
    out.update(texts)
    return dict(sorted(out.items()))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the folder to write (docs/reference)")
    p.add_argument("--check", action="store_true", help="only say whether the pages are up to date")
    args = p.parse_args(argv)
    files = generate()
    if args.check:
        stale = [name for name, text in files.items()
                 if not (args.output / name).is_file()
                 or (args.output / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{args.output / name} is out of date: run {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    args.output.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = args.output / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
