"""Guard verdicts: what a training process hands to its node's daemon (a versioned JSON file).

The training process never writes health.db. It writes one file per verdict into a spool directory on
its node (``$GPUMON_GUARD_DIR``, default ``/var/lib/gpumon/guard``), atomically (``write_atomic``:
temp file, fsync, rename), under a name no other verdict can take (time, host, pid, rank, a random
part). The node's ``guard`` check reads the spool and judges each file once. This module is shared by
both sides and imports nothing heavy (no torch).

Format ``gpumon-guard-verdict``, ``version`` 1::

    {"format": "gpumon-guard-verdict", "version": 1, "id": "...", "time": 1800000000.0,
     "check": "nonfinite_grad" | "nonfinite_reduce" | "weights" | "straggler" | "audit",
     "fault": "persistent" | "transient" | "unknown" | "application",
     "step": 57, "message": "...", "job": "slurm:1234" | null,
     "subject": {identity of the rank named, see Identity},
     "evidence": {...}}

The contract is the JSON Schema the package ships (``schema()``: ``gpumon/guard/schema/
verdict-v1.schema.json``, every field and the common evidence keys described); ``read`` validates
every file against it before building the ``Verdict``.

``fault`` is what the daemon acts on: ``persistent`` (the fault reproduced on this GPU, and GPUs of
other nodes computed otherwise) is fail / inspect_hardware; ``transient`` (a rerun on the same GPU
computed otherwise) and ``unknown`` (not disambiguated) are warn; ``application`` (the result
reproduced on a GPU of another node: the data or the program, not the hardware) is held against no
GPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

FORMAT = "gpumon-guard-verdict"
VERSION = 1
DEFAULT_DIR = "/var/lib/gpumon/guard"
DIR_ENV = "GPUMON_GUARD_DIR"
CHECKS = ("nonfinite_grad", "nonfinite_reduce", "weights", "straggler", "audit")
FAULTS = ("persistent", "transient", "unknown", "application")
# a verdict is a few KiB; anything far larger is not one (and must not cost the daemon memory)
MAX_BYTES = 1 << 20
SCHEMA_PACKAGE = "gpumon.guard.schema"
SCHEMA_FILE = f"verdict-v{VERSION}.schema.json"
SCHEMA_ID = f"urn:gpumon:{FORMAT}:{VERSION}"

# Exit codes for launchers (Megatron-LM's RerunStateMachine uses the same two numbers, so a launcher
# or Slurm epilog that knows Megatron's needs no second table):
EXIT_RESUME_ELSEWHERE = 16  # a GPU is suspect: requeue from a checkpoint, excluding the named node
EXIT_FAILED_VALIDATION = 17  # validation failed for good (a persistent fault): end the job


class VerdictError(ValueError):
    """A verdict file that is not one this reader can judge; says why."""


class SchemaViolation(VerdictError):
    """JSON of the right format and version that the schema refuses. ``where``: the JSON path of the
    value refused (``$.subject.rank``; a missing key is refused at its parent's path, and the
    message names it); ``rule``: the schema keyword that refused it
    (``/properties/subject/properties/rank/type``); ``problems``: how many the file has."""

    def __init__(self, where: str, rule: str, problem: str, problems: int) -> None:
        self.where = where
        self.rule = rule
        self.problem = problem
        self.problems = problems
        more = f"; {problems - 1} more problem(s)" if problems > 1 else ""
        super().__init__(f"{where}: {problem} (schema {SCHEMA_FILE}, {rule}{more})")


@dataclass(frozen=True)
class Identity:
    """Where a rank runs: rank -> host -> scheduler node -> local rank -> device -> GPU."""

    rank: int
    world_size: int
    host: str
    # the scheduler's name for the node (Slurm SLURMD_NODENAME, Kubernetes NODE_NAME), None if neither
    node_name: str | None
    node_name_source: str | None  # the env variable it came from
    local_rank: int | None
    device: str  # "cuda:3", "cpu"
    gpu_uuid: str | None = None  # NVML's form, GPU-...
    gpu_pci_bus_id: str | None = None  # 0000:18:00.0
    gpu_index: int | None = None  # NVML index on its node
    # why there is no GPU identity ("device cpu: no GPU"), or how it was resolved
    gpu_note: str = ""

    def describe(self) -> str:
        node = f" (node {self.node_name})" if self.node_name and self.node_name != self.host else ""
        gpu = f", GPU {self.gpu_uuid}" if self.gpu_uuid else ""
        bus = f" at {self.gpu_pci_bus_id}" if self.gpu_pci_bus_id else ""
        return f"rank {self.rank} on {self.host}{node}, {self.device}{gpu}{bus}"

    @classmethod
    def from_json(cls, data: Any) -> Identity:
        if not isinstance(data, Mapping):
            raise VerdictError("subject: not an object")

        def opt_str(key: str) -> str | None:
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise VerdictError(f"subject.{key}: not a string")
            return value

        def opt_int(key: str) -> int | None:
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise VerdictError(f"subject.{key}: not an integer")
            return value

        rank, world = opt_int("rank"), opt_int("world_size")
        host, device = opt_str("host"), opt_str("device")
        if rank is None or world is None or host is None or device is None:
            raise VerdictError("subject: rank, world_size, host and device are required")
        return cls(rank=rank, world_size=world, host=host, node_name=opt_str("node_name"),
                   node_name_source=opt_str("node_name_source"), local_rank=opt_int("local_rank"),
                   device=device, gpu_uuid=opt_str("gpu_uuid"), gpu_pci_bus_id=opt_str("gpu_pci_bus_id"),
                   gpu_index=opt_int("gpu_index"), gpu_note=opt_str("gpu_note") or "")


@dataclass(frozen=True)
class Verdict:
    """One verdict: the file's fields but ``format`` and ``version`` (``to_json`` adds them). Each
    field is described in the schema (``schema()``) and docs/guard/contract.md."""

    check: str
    fault: str
    step: int
    message: str
    subject: Identity
    evidence: dict[str, Any] = field(default_factory=dict)
    job: str | None = None
    time: float = 0.0
    id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "id": self.id, "time": self.time,
                "check": self.check, "fault": self.fault, "step": self.step, "message": self.message,
                "job": self.job, "subject": asdict(self.subject), "evidence": self.evidence}

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        """Parse a verdict; raises VerdictError saying what is wrong (``FutureVerdict`` for a newer
        version than this reader knows)."""
        _envelope(data)
        check, fault, step = data.get("check"), data.get("fault"), data.get("step")
        if check not in CHECKS:
            raise VerdictError(f"check {check!r} is not one of {', '.join(CHECKS)}")
        if fault not in FAULTS:
            raise VerdictError(f"fault {fault!r} is not one of {', '.join(FAULTS)}")
        if not isinstance(step, int) or isinstance(step, bool):
            raise VerdictError(f"step {step!r} is not an integer")
        message, vid, when = data.get("message"), data.get("id"), data.get("time")
        if not isinstance(message, str) or not isinstance(vid, str) or not vid:
            raise VerdictError("message and id must be strings")
        if not isinstance(when, (int, float)) or isinstance(when, bool):
            raise VerdictError(f"time {when!r} is not a number")
        evidence = data.get("evidence", {})
        if not isinstance(evidence, Mapping):
            raise VerdictError("evidence: not an object")
        job = data.get("job")
        if job is not None and not isinstance(job, str):
            raise VerdictError("job: not a string")
        return cls(check=check, fault=fault, step=step, message=message,
                   subject=Identity.from_json(data.get("subject")), evidence=dict(evidence), job=job,
                   time=float(when), id=vid)


class FutureVerdict(VerdictError):
    """Written by a newer guard than this reader: kept for a daemon that can read it."""


def _envelope(data: Any) -> None:
    # format and version before the schema: a newer version is FutureVerdict (kept until a newer
    # gpumon reads it), never a schema violation of this version
    if not isinstance(data, Mapping):
        raise VerdictError("not a JSON object")
    if data.get("format") != FORMAT:
        raise VerdictError(f"format is {data.get('format')!r}, not {FORMAT!r}")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise VerdictError(f"version {version!r} is not a positive integer")
    if version > VERSION:
        raise FutureVerdict(f"version {version} is newer than this gpumon reads ({VERSION}): "
                            "upgrade gpumon on the node; the file is kept until then")


@functools.cache
def _schema_text() -> str:
    from importlib.resources import files

    return (files(SCHEMA_PACKAGE) / SCHEMA_FILE).read_text(encoding="utf-8")


def schema() -> dict[str, Any]:
    """The verdict file's JSON Schema (draft 2020-12) as the package ships it; a fresh copy."""
    loaded: dict[str, Any] = json.loads(_schema_text())
    return loaded


@functools.cache
def validator() -> Validator:
    """The schema's validator, built once per process: the daemon validates every spool file with
    it, and checking the schema itself (``check_schema``) per file would cost more than the file."""
    from jsonschema.validators import validator_for

    loaded = schema()
    cls = validator_for(loaded)
    cls.check_schema(loaded)
    return cls(loaded)


def validate(data: Any) -> None:
    """Raise ``VerdictError`` unless ``data`` is a verdict of this version by the schema:
    ``FutureVerdict`` for a newer version, ``SchemaViolation`` (the most relevant problem, its path
    and the rule) for one the schema refuses."""
    from jsonschema.exceptions import best_match

    _envelope(data)
    errors = list(validator().iter_errors(data))
    if not errors:
        return
    best = best_match(errors)
    assert best is not None  # (errors is not empty)
    rule = "/" + "/".join(str(part) for part in best.schema_path)
    problems = len(errors)
    if best.validator == "required" and isinstance(best.instance, Mapping):
        # one error per missing key: said as one problem naming them all
        missing = [str(k) for k in best.validator_value if k not in best.instance]
        noun = "property" if len(missing) == 1 else "properties"
        problem = f"required {noun} missing: {', '.join(missing)}"
        problems -= len(missing) - 1
    else:
        # the message quotes the refused value, which can be as large as the file
        problem = best.message if len(best.message) <= 300 else best.message[:297] + "..."
    raise SchemaViolation(best.json_path, rule, problem, problems)


def spool_dir(explicit: str | Path | None = None) -> Path:
    """Where this node's verdicts go: ``explicit``, else ``$GPUMON_GUARD_DIR``, else the default."""
    if explicit:
        return Path(explicit)
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def new_id(subject: Identity, when: float) -> str:
    """A name no other verdict takes: UTC time, host, pid, rank and 48 random bits."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when)) + f"{when % 1:.6f}"[1:]
    host = _UNSAFE.sub("_", subject.host)[:64]
    return f"{stamp}Z-{host}-p{os.getpid()}-r{subject.rank}-{secrets.token_hex(6)}"


def write(verdict: Verdict, directory: str | Path | None = None) -> Path:
    """Write ``verdict`` into the spool as ``<id>.json``, atomically; returns the path. Raises OSError."""
    from gpumon.atomic import write_atomic

    path = spool_dir(directory) / f"{verdict.id}.json"
    write_atomic(path, json.dumps(verdict.to_json(), indent=1, sort_keys=True) + "\n", mode=0o644)
    return path


def read(path: Path) -> Verdict:
    """Read one verdict file, validated against the schema; raises VerdictError (bad content:
    ``SchemaViolation`` where the schema refuses it) or OSError (unreadable)."""
    with path.open("rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise VerdictError(f"larger than {MAX_BYTES} bytes: not a verdict")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerdictError(f"not JSON: {exc}") from None
    validate(data)
    return Verdict.from_json(data)


def job_id() -> str | None:
    """The scheduler's job id, where one says it (Slurm, a torchrun/elastic run)."""
    for env, prefix in (("SLURM_JOB_ID", "slurm"), ("TORCHELASTIC_RUN_ID", "torchelastic")):
        value = os.environ.get(env)
        if value and value != "none":
            return f"{prefix}:{value}"
    return None


def host_name() -> str:
    return socket.gethostname()


# -- pace: each node's GPUs' in-job pace scores (gpumon.guard.pace), for the node's metrics ------------
#
# One file per job and host, ``<spool>/pace/<job>-<host>.json``, rewritten (atomically) every window
# by the lowest rank of that host: the latest pace of each of the host's ranks. Not verdicts: the
# node's ``guard`` check exports them as readings while they are fresh (a straggler is named by a
# verdict file, above).

PACE_FORMAT = "gpumon-guard-pace"
PACE_DIR = "pace"


@dataclass(frozen=True)
class PaceRow:
    rank: int
    gpu_uuid: str | None
    pace: float
    pace_per_work: float
    slow: bool


def write_pace(directory: str | Path | None, *, job: str | None, host: str, step: int,
               rows: list[PaceRow], when: float) -> Path:
    from gpumon.atomic import write_atomic

    name = _UNSAFE.sub("_", f"{job or 'nojob'}-{host}")[:120]
    path = spool_dir(directory) / PACE_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": PACE_FORMAT, "version": 1, "time": when, "job": job, "host": host, "step": step,
           "ranks": [asdict(r) for r in rows]}
    write_atomic(path, json.dumps(doc, sort_keys=True) + "\n", mode=0o644)
    return path


def read_pace(path: Path) -> tuple[float, str | None, list[PaceRow]]:
    """(time, job, rows) of one pace file; raises VerdictError or OSError."""
    with path.open("rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise VerdictError("larger than a pace file can be")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerdictError(f"not JSON: {exc}") from None
    if not isinstance(data, Mapping) or data.get("format") != PACE_FORMAT or data.get("version") != 1:
        raise VerdictError("not a gpumon-guard-pace file of version 1")
    when, job, ranks = data.get("time"), data.get("job"), data.get("ranks")
    if not isinstance(when, (int, float)) or not isinstance(ranks, list):
        raise VerdictError("time and ranks are required")
    rows = []
    for r in ranks:
        if not isinstance(r, Mapping):
            raise VerdictError("ranks: not objects")
        try:
            rows.append(PaceRow(int(r["rank"]), r.get("gpu_uuid"), float(r["pace"]),
                                float(r["pace_per_work"]), bool(r["slow"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise VerdictError(f"ranks: {exc}") from None
    return float(when), job if isinstance(job, str) else None, rows
