"""What a job's PyTorch Flight Recorder dumps say: which ranks never entered the stuck collective.

Flight Recorder (PyTorch >= 2.5) keeps, per rank, a ring buffer of its last collectives
(``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``: how many entries; 0, the
default, records nothing). ProcessGroupNCCL's watchdog writes the buffer on a collective timeout
(``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) to ``<TORCH_FR_DUMP_TEMP_FILE><global rank>`` (formerly
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default ``~/.cache/torch/comm_lib_trace_rank_``): a pickle of a
dict ``version`` ("2.10" in PyTorch 2.13), ``pg_config`` (per process group: name, desc, ranks),
``pg_status`` (per group: last enqueued/started/completed collective), ``entries`` (each:
``record_id``, ``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``,
``profiling_name`` such as ``nccl:all_reduce``, ``input_sizes``, ``state`` scheduled | started |
completed, ``time_created_ns`` (Unix time), ``timeout_ms``, ``is_p2p``, ``frames``). The JSON form
(``_dump_fr_trace_json``) has the same keys and is read too.

ProcessGroupGloo (PyTorch 2.13, checked on this build) records its collectives in the same buffer,
but: nothing dumps it on a timeout (the job calls ``torch._C._distributed_c10d._dump_fr_trace()``
itself, e.g. in its exception handler); every entry stays ``state: scheduled`` (completion is not
recorded); and its ``pg_config`` names the group ``""`` where its entries name it ``"0"``, on which
PyTorch's own analyzer (``torchfrtrace``) stops with ``KeyError: ('0', <rank>)``.

So the finding here rests on what every backend records, the sequence numbers: per process group,
the last collective each rank *entered*. A rank whose last is below the others' never entered the
next one, which the others are blocked in (the stuck collective); ranks that entered the same
sequence number with a different operation or size are a desync. Completion, where recorded (NCCL),
tells a collective every rank entered but that never finished (then the cause is not a missing rank).
PyTorch's own analyzer (``torch.distributed.flight_recorder``'s ``build_db``) is run on the same dumps
where torch is installed, and what it says is reported beside (``pytorch_analysis``).

The dumps are untrusted input (the job's user wrote them; ``gpumon why`` may run as root in an epilog):
they are unpickled with no globals allowed (a Flight Recorder pickle holds only dicts, lists, tuples,
strings, numbers; PyTorch's ``read_dump`` uses a plain ``pickle.load``, which runs whatever a file
says, so it is not used), each bounded in size, each file's error said and the others still read.

Where each rank ran: a dump's folder, relative to the one given, when there is one (write each node's
dumps under its own name: ``TORCH_FR_DUMP_TEMP_FILE=/shared/fr/$JOB/$(hostname)/rank_``); the dumps
themselves carry no host name.
"""

from __future__ import annotations

import ast
import copy
import io
import json
import logging
import os
import pickle
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_DUMP_BYTES = 256 << 20
MAX_FILES = 1 << 17
_RANK = re.compile(r"(\d+)$")
# what a file that is being written, or a trigger pipe, is called next to the dumps
_SKIP_SUFFIXES = (".tmp", ".pipe", ".partial")


class DumpError(Exception):
    pass


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(f"refused: the pickle asks for {module}.{name} (a Flight Recorder dump needs "
                        "no code to load)")

    def persistent_load(self, pid: Any) -> Any:
        raise DumpError("refused: the pickle has persistent ids (not a Flight Recorder dump)")


@dataclass
class Dump:
    path: str
    rank: int
    host: str | None
    version: str
    entries: list[dict[str, Any]]
    pg_config: dict[str, Any]
    pg_status: dict[str, Any]
    comm_lib_version: str | None = None

    @property
    def newest_ns(self) -> int:
        return max((e.get("time_created_ns") or 0 for e in self.entries), default=0)


@dataclass
class GroupFinding:
    """One process group: the collective it is stuck in, who entered it and who did not."""

    pg: str
    desc: str
    members: list[int] | None  # from pg_config; None where the dumps do not say
    seq: int  # the stuck collective's collective_seq_id
    op: str  # its profiling_name, as most ranks that entered it issued it
    entered: list[int]
    missing: list[int]  # ranks with a dump whose last collective in this group is before seq
    no_dump: list[int]  # member ranks that left no dump (unknown)
    mismatched: dict[int, str]  # rank -> what it issued at seq instead ("gloo:broadcast [[64]]")
    not_completed: list[int] | None  # ranks on which seq did not complete; None: not recorded
    last: dict[int, tuple[int, str]]  # rank -> its last (seq, op) in this group
    created: float | None  # when the first rank enqueued it (Unix seconds)
    timeout_ms: int | None

    @property
    def label(self) -> str:
        return f"{self.pg} ({self.desc})" if self.desc and self.desc != "undefined" else self.pg


@dataclass
class RankFinding:
    """What one rank did wrong, in words an operator can act on."""

    rank: int
    host: str | None
    kind: str  # never_entered | mismatch | no_dump
    group: GroupFinding
    words: str


@dataclass
class Flight:
    path: str
    dumps: dict[int, Dump] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # file -> why it was not read
    ignored: int = 0  # files without a rank number at the end of their name
    notes: list[str] = field(default_factory=list)
    groups: list[GroupFinding] = field(default_factory=list)
    pytorch: dict[str, Any] = field(default_factory=dict)

    @property
    def hosts(self) -> dict[int, str]:
        return {r: d.host for r, d in self.dumps.items() if d.host is not None}

    @property
    def timeout_s(self) -> float | None:
        values = [g.timeout_ms for g in self.groups if g.timeout_ms]
        return max(values) / 1000.0 if values else None

    def findings(self) -> list[RankFinding]:
        out: list[RankFinding] = []
        hosts = self.hosts
        for g in self.groups:
            coll = f"{g.op} #{g.seq} of process group {g.label}"
            for r in g.missing:
                last_seq, last_op = g.last.get(r, (0, ""))
                before = (f"its last was {last_op} #{last_seq}" if last_seq
                          else "its dump has no collective of this group")
                out.append(RankFinding(r, hosts.get(r), "never_entered", g,
                                       f"rank {r}{_on(hosts.get(r))} never entered {coll}, which rank(s) "
                                       f"{_ranks(g.entered)} entered ({before})"))
            for r, what in sorted(g.mismatched.items()):
                others = [x for x in g.entered if x not in g.mismatched]
                out.append(RankFinding(r, hosts.get(r), "mismatch", g,
                                       f"rank {r}{_on(hosts.get(r))} issued {what} as #{g.seq} of process "
                                       f"group {g.label} where rank(s) {_ranks(others)} issued {g.op}: the "
                                       "ranks disagree on the collective (a desync, the job's code path)"))
            for r in g.no_dump:
                out.append(RankFinding(r, None, "no_dump", g,
                                       f"rank {r} left no Flight Recorder dump: whether it entered {coll} is "
                                       "unknown (its process may have died or hung before it could dump)"))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ranks_read": sorted(self.dumps), "hosts": {str(r): h for r, h in
                                                                              sorted(self.hosts.items())},
                "errors": dict(sorted(self.errors.items())), "ignored_files": self.ignored,
                "version": sorted({d.version for d in self.dumps.values()}),
                "groups": [{"pg": g.pg, "desc": g.desc, "members": g.members, "stuck_seq": g.seq, "op": g.op,
                            "entered": g.entered, "missing": g.missing, "no_dump": g.no_dump,
                            "mismatched": {str(r): w for r, w in sorted(g.mismatched.items())},
                            "not_completed": g.not_completed, "created": g.created,
                            "timeout_ms": g.timeout_ms,
                            "last": {str(r): {"seq": s, "op": o} for r, (s, o) in sorted(g.last.items())}}
                           for g in self.groups],
                "findings": [{"rank": f.rank, "host": f.host, "kind": f.kind, "pg": f.group.pg,
                              "seq": f.group.seq, "op": f.group.op, "words": f.words}
                             for f in self.findings()],
                "pytorch_analysis": self.pytorch, "notes": list(self.notes)}


def _on(host: str | None) -> str:
    return f" on {host}" if host else " (node unknown)"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks) if ranks else "none"


# -- reading ---------------------------------------------------------------------------------------


def _load_bytes(raw: bytes) -> Any:
    if raw[:1] in (b"{", b"["):
        return json.loads(raw)
    try:
        return _NoGlobals(io.BytesIO(raw)).load()
    except DumpError:
        raise
    except Exception as exc:  # a truncated or foreign pickle raises any of a dozen types
        raise DumpError(f"not a readable pickle ({type(exc).__name__}: {exc})") from None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _entry(e: Any) -> dict[str, Any] | None:
    """An entry as the analysis needs it, or None where it lacks what identifies a collective."""
    if not isinstance(e, Mapping):
        return None
    pg = e.get("process_group")
    if not (isinstance(pg, (list, tuple)) and len(pg) == 2 and all(isinstance(x, str) for x in pg)):
        return None
    if _int(e.get("collective_seq_id")) is None or not isinstance(e.get("profiling_name"), str):
        return None
    out = dict(e)
    out["process_group"] = (pg[0], pg[1])
    return out


def read_dump(path: Path, rank: int, host: str | None) -> Dump:
    """Raises OSError or DumpError."""
    with path.open("rb") as fh:
        raw = fh.read(MAX_DUMP_BYTES + 1)
    if len(raw) > MAX_DUMP_BYTES:
        raise DumpError(f"larger than {MAX_DUMP_BYTES >> 20} MiB: not read")
    if not raw:
        raise DumpError("empty (a dump cut short, or never written)")
    try:
        data = _load_bytes(raw)
    except json.JSONDecodeError as exc:
        raise DumpError(f"not valid JSON ({exc})") from None
    if not isinstance(data, Mapping) or "entries" not in data or "version" not in data:
        raise DumpError("not a Flight Recorder dump (no 'entries' and 'version')")
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list):
        raise DumpError("not a Flight Recorder dump ('entries' is not a list)")
    entries = [x for x in (_entry(e) for e in raw_entries) if x is not None]
    if len(entries) < len(raw_entries):
        raise DumpError(f"{len(raw_entries) - len(entries)} of {len(raw_entries)} entries lack "
                        "process_group / collective_seq_id / profiling_name (a foreign or damaged dump)")
    entries.sort(key=lambda e: _int(e.get("record_id")) or 0)
    pg_config = data.get("pg_config")
    pg_status = data.get("pg_status")
    lib = data.get("comm_lib_version")
    return Dump(str(path), rank, host, str(data["version"]), entries,
                dict(pg_config) if isinstance(pg_config, Mapping) else {},
                dict(pg_status) if isinstance(pg_status, Mapping) else {},
                lib if isinstance(lib, str) else None)


def read_dir(path: Path) -> Flight:
    """Every dump under ``path`` (recursively, as PyTorch's reader walks it): the rank is the number
    that ends the file's name, the host the first folder below ``path`` (if any). Raises OSError if
    ``path`` cannot be listed."""
    flight = Flight(str(path))
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: not a folder")
    seen = 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(_SKIP_SUFFIXES):
                continue
            m = _RANK.search(name)
            if m is None:
                flight.ignored += 1
                continue
            seen += 1
            if seen > MAX_FILES:
                flight.notes.append(f"more than {MAX_FILES} dump files: the rest not read")
                break
            file = Path(root) / name
            rel = file.relative_to(path)
            host = rel.parts[0] if len(rel.parts) > 1 else None
            try:
                dump = read_dump(file, int(m.group(1)), host)
            except OSError as exc:
                flight.errors[str(rel)] = f"cannot read: {exc.strerror or exc}"
                continue
            except DumpError as exc:
                flight.errors[str(rel)] = str(exc)
                continue
            old = flight.dumps.get(dump.rank)
            if old is not None:
                keep, drop = (dump, old) if dump.newest_ns >= old.newest_ns else (old, dump)
                flight.notes.append(f"rank {dump.rank} has two dumps ({old.path}, {dump.path}): the newer "
                                    f"{keep.path} read, {drop.path} not")
                dump = keep
            flight.dumps[dump.rank] = dump
        else:
            continue
        break
    analyse(flight)
    return flight


# -- the analysis ----------------------------------------------------------------------------------


def _ranks_of(value: Any) -> list[int] | None:
    """pg_config's ``ranks``: a list of ints, or its ``str()`` (as PyTorch writes it)."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)  # a literal only, never code
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    if isinstance(value, (list, tuple)) and all(_int(r) is not None for r in value):
        return sorted(set(value))
    return None


def _members(flight: Flight, pg: str, desc: str) -> list[int] | None:
    found: set[tuple[int, ...]] = set()
    for d in flight.dumps.values():
        cfg = d.pg_config.get(pg)
        if not isinstance(cfg, Mapping):
            # ProcessGroupGloo's pg_config: one group named "" for the entries' "0" (see above)
            groups = {k for e in d.entries for k in [e["process_group"][0]]}
            if len(d.pg_config) == 1 and groups == {pg}:
                cfg = next(iter(d.pg_config.values()))
        if isinstance(cfg, Mapping):
            ranks = _ranks_of(cfg.get("ranks"))
            if ranks:
                found.add(tuple(ranks))
    if len(found) == 1:
        return list(next(iter(found)))
    if len(found) > 1:
        flight.notes.append(f"process group {pg}: the dumps disagree on its members ({sorted(found)}): "
                            "members taken from the dumps' entries")
    return None


def _what(e: Mapping[str, Any]) -> str:
    return f"{e['profiling_name']} {e.get('input_sizes')}"


def analyse(flight: Flight) -> None:
    by_group: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for rank, d in flight.dumps.items():
        for e in d.entries:
            if e.get("is_p2p") or _int(e.get("collective_seq_id")) in (None, 0):
                continue  # point-to-point ops have their own numbers: not judged here
            by_group.setdefault(e["process_group"], {}).setdefault(rank, []).append(e)
    if not flight.dumps:
        flight.notes.append("no dump could be read")
    for (pg, desc), per_rank in sorted(by_group.items()):
        members = _members(flight, pg, desc)
        dumped = sorted(r for r in flight.dumps if members is None or r in members)
        # a member whose dump has no entry of this group: it never used it in its buffer's span
        last: dict[int, tuple[int, str]] = {r: (0, "") for r in dumped}
        for r, es in per_rank.items():
            top = max(es, key=lambda e: e["collective_seq_id"])
            last[r] = (top["collective_seq_id"], top["profiling_name"])
        if not last:
            continue
        low, high = min(s for s, _ in last.values()), max(s for s, _ in last.values())
        states = {e.get("state") for es in per_rank.values() for e in es}
        completion_known = bool(states & {"started", "completed"})
        if low < high:
            seq = low + 1
        elif completion_known:
            open_ = [e["collective_seq_id"] for es in per_rank.values() for e in es
                     if e.get("state") != "completed"]
            if not open_:
                continue  # every collective of this group completed on every rank: not stuck here
            seq = min(open_)
        else:
            seq = high
        at = {r: next((e for e in es if e["collective_seq_id"] == seq), None) for r, es in per_rank.items()}
        entered = sorted(r for r, (s, _) in last.items() if s >= seq)
        missing = sorted(r for r, (s, _) in last.items() if s < seq)
        present = {r: e for r, e in at.items() if e is not None}
        variants = Counter(_what(e) for e in present.values())
        mismatched: dict[int, str] = {}
        op = next((e["profiling_name"] for e in present.values()), "?")
        if variants:
            common, n = variants.most_common(1)[0]
            if list(variants.values()).count(n) > 1:
                # no majority: the lowest rank's is taken as the reference, and said so
                common = _what(present[min(present)])
                flight.notes.append(f"process group {pg} #{seq}: the ranks disagree with no majority; "
                                    f"rank {min(present)}'s {common} taken as the reference")
            if len(variants) > 1:
                mismatched = {r: _what(e) for r, e in present.items() if _what(e) != common}
            op = next(e["profiling_name"] for e in present.values() if _what(e) == common)
        not_completed = (sorted(r for r, e in present.items() if e.get("state") != "completed")
                         if completion_known else None)
        if low == high and not mismatched and not_completed == [] and not (members and
                                                                            set(members) - set(flight.dumps)):
            continue
        created = [e.get("time_created_ns") for e in present.values()]
        created_ns = min((c for c in created if isinstance(c, int) and c > 0), default=None)
        timeouts = [_int(e.get("timeout_ms")) for es in per_rank.values() for e in es]
        flight.groups.append(GroupFinding(
            pg, desc, members, seq, op, entered, missing,
            sorted(set(members) - set(flight.dumps)) if members else [], mismatched, not_completed,
            dict(sorted(last.items())), None if created_ns is None else created_ns / 1e9,
            max((t for t in timeouts if t), default=None)))
        if not completion_known and low == high and not mismatched:
            flight.notes.append(f"process group {pg}: every rank with a dump entered {op} #{seq}, and this "
                                "backend does not record completion (gloo): the dumps cannot tell more")
    flight.groups.sort(key=lambda g: (g.created if g.created is not None else float("inf"), g.pg))
    flight.pytorch = pytorch_analysis(flight)


# -- PyTorch's own analyzer, beside ----------------------------------------------------------------


def _details(flight: Flight) -> dict[str, dict[str, Any]]:
    """The dumps in the shape PyTorch's ``read_dump`` returns, from what was read safely here;
    ``ranks`` re-written as the literal list (PyTorch's builder may ``eval`` a string it finds
    there), and gloo's group named ``""`` re-keyed to its entries' name (one group each)."""
    out: dict[str, dict[str, Any]] = {}
    for rank, d in sorted(flight.dumps.items()):
        cfg: dict[str, Any] = {}
        names = {e["process_group"][0] for e in d.entries}
        for key, value in d.pg_config.items():
            if not isinstance(value, Mapping):
                continue
            ranks = _ranks_of(value.get("ranks"))
            if ranks is None:
                continue
            k = str(key)
            if k not in names and len(d.pg_config) == 1 and len(names) == 1:
                k = next(iter(names))
            cfg[k] = {"name": k, "desc": str(value.get("desc", "")), "ranks": str(ranks)}
        out[f"rank{rank}"] = {"host_name": d.host or f"host_rank{rank}", "rank": rank,
                              "entries": copy.deepcopy(d.entries), "version": d.version, "pg_config": cfg}
    return out


def pytorch_analysis(flight: Flight) -> dict[str, Any]:
    if not flight.dumps:
        return {"used": False, "why": "no dump read"}
    fr_log = logging.getLogger("Flight Recorder")
    was = fr_log.disabled
    fr_log.disabled = True  # its findings are read from its records, not its log lines
    try:
        try:
            import torch
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
        except ImportError as exc:
            return {"used": False, "why": f"torch's Flight Recorder analyzer is not installed ({exc})"}
        details = _details(flight)
        args = JobConfig().parse_args([])
        args.allow_incomplete_ranks = True
        try:
            db = build_db(details, args, next(iter(details.values()))["version"])
        except Exception as exc:  # its asserts and lookups on dumps it did not expect
            return {"used": False, "torch": torch.__version__,
                    "why": f"PyTorch's analyzer stopped: {type(exc).__name__}: {exc}"}
    finally:
        fr_log.disabled = was
    said: list[dict[str, Any]] = []
    for c in db.collectives:
        if c.missing_ranks or c.mismatch_collectives:
            said.append({"pg": c.group_id, "seq": c.collective_seq_id, "op": c.collective_name,
                         "missing_ranks": sorted(c.missing_ranks or ()),
                         "mismatched_ranks": sorted((c.mismatch_collectives or {}).keys()),
                         "state": c.collective_state})
    return {"used": True, "torch": torch.__version__, "collectives": len(db.collectives), "findings": said}
