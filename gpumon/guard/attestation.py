"""Checkpoint attestations: what the weight check said when a checkpoint was saved, and which
checkpoint to resume from. Pure file logic, no torch: ``gpumon guard checkpoints`` reads these on
any machine.

An attestation is a JSON file beside its checkpoint, ``<checkpoint>.attestation.json``, written
atomically by the rank that saved the checkpoint (every rank, for a sharded save). Format
``gpumon-guard-attestation``, ``version`` 1::

    {"format": "gpumon-guard-attestation", "version": 1,
     "checkpoint": "step_200.pt",          # the file's name, in this directory
     "step": 200,                          # optimizer steps done: the step a resume starts at
     "world": 3, "time": 1800000000.0, "job": "slurm:1234" | null,
     "verdict": "verified" | "disagreement" | "unchecked",
     "verified": true,
     "agree": [0, 1, 2],                   # the ranks whose weights equal the saved ones
     "fingerprint": "32 hex digits" | null,   # of the saved replica's parameter fingerprints
     "groups": [{"ranks": [0, 1, 2], "fingerprint": "..."}],   # ranks with equal weights
     "suspects": [{"rank": 1, "where": "...", "first_parameter": "...", "subject": {...}}],
     "saved_by": {"rank": 0, "host": "..."},
     "shard": null | {"rank": 0, "of": 3},
     "parameters": 12,
     "file": {"size": 123456, "sha256": "..." | null},
     "message": "..."}

Steps are counted as the guard counts them: a checkpoint at step ``k`` holds the weights after
``k`` optimizer steps (steps 0..k-1); a verdict at step ``s`` judged step ``s``. So a checkpoint is
before a suspect step ``s`` when ``k <= s``; a checkpoint whose replicas disagree at step ``k``
makes step ``k - 1`` suspect (the fault happened in a step before it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from gpumon.guard.verdict import PACE_DIR

FORMAT = "gpumon-guard-attestation"
VERSION = 1
SUFFIX = ".attestation.json"
VERDICTS = ("verified", "disagreement", "unchecked")
MAX_BYTES = 1 << 20  # an attestation is a few KiB


class AttestationError(ValueError):
    """A file that is not an attestation this reader can judge; says why."""


def path_for(checkpoint: str | Path) -> Path:
    """Where the attestation of ``checkpoint`` goes: beside it, its name plus ``.attestation.json``."""
    p = Path(checkpoint)
    return p.with_name(p.name + SUFFIX)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


@dataclass(frozen=True)
class Attestation:
    checkpoint: str  # file name, beside the attestation
    step: int
    world: int
    verdict: str
    time: float
    job: str | None = None
    agree: list[int] = field(default_factory=list)
    fingerprint: str | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    suspects: list[dict[str, Any]] = field(default_factory=list)
    saved_by: dict[str, Any] = field(default_factory=dict)
    shard: dict[str, int] | None = None
    parameters: int = 0
    file: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    @property
    def verified(self) -> bool:
        return self.verdict == "verified"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "checkpoint": self.checkpoint, "step": self.step,
                "world": self.world, "time": self.time, "job": self.job, "verdict": self.verdict,
                "verified": self.verified, "agree": self.agree, "fingerprint": self.fingerprint,
                "groups": self.groups, "suspects": self.suspects, "saved_by": self.saved_by,
                "shard": self.shard, "parameters": self.parameters, "file": self.file,
                "message": self.message}

    @classmethod
    def from_json(cls, data: Any) -> Attestation:
        if not isinstance(data, Mapping):
            raise AttestationError("not a JSON object")
        if data.get("format") != FORMAT:
            raise AttestationError(f"format is {data.get('format')!r}, not {FORMAT!r}: not a gpumon "
                                   "checkpoint attestation")
        version = data.get("version")
        if not _is_int(version) or version < 1:
            raise AttestationError(f"version {version!r} is not a positive integer")
        if version > VERSION:
            raise AttestationError(f"version {version} is newer than this gpumon reads ({VERSION}): "
                                   "upgrade gpumon")
        name, step, world, verdict = (data.get(k) for k in ("checkpoint", "step", "world", "verdict"))
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise AttestationError(f"checkpoint {name!r} is not a file name")
        if not _is_int(step) or step < 0:
            raise AttestationError(f"step {step!r} is not a non-negative integer")
        if not _is_int(world) or world < 1:
            raise AttestationError(f"world {world!r} is not a positive integer")
        if verdict not in VERDICTS:
            raise AttestationError(f"verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
        if data.get("verified") is not (verdict == "verified"):
            raise AttestationError(f"verified {data.get('verified')!r} contradicts verdict {verdict!r}")
        when = data.get("time")
        if not isinstance(when, (int, float)) or isinstance(when, bool):
            raise AttestationError(f"time {when!r} is not a number")
        job, fp, message = data.get("job"), data.get("fingerprint"), data.get("message", "")
        if job is not None and not isinstance(job, str):
            raise AttestationError("job: not a string")
        if fp is not None and not isinstance(fp, str):
            raise AttestationError("fingerprint: not a string")
        if verdict == "verified" and not fp:
            raise AttestationError("verified, but no fingerprint")
        if not isinstance(message, str):
            raise AttestationError("message: not a string")
        agree = data.get("agree", [])
        if not isinstance(agree, list) or not all(_is_int(r) for r in agree):
            raise AttestationError("agree: not a list of ranks")
        groups, suspects = data.get("groups", []), data.get("suspects", [])
        for key, value in (("groups", groups), ("suspects", suspects)):
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise AttestationError(f"{key}: not a list of objects")
        saved_by, file_ = data.get("saved_by", {}), data.get("file", {})
        if not isinstance(saved_by, Mapping) or not isinstance(file_, Mapping):
            raise AttestationError("saved_by and file must be objects")
        size = file_.get("size")
        if size is not None and (not _is_int(size) or size < 0):
            raise AttestationError(f"file.size {size!r} is not a size")
        shard = data.get("shard")
        if shard is not None:
            if (not isinstance(shard, Mapping) or not _is_int(shard.get("rank"))
                    or not _is_int(shard.get("of")) or not 0 <= shard["rank"] < shard["of"]):
                raise AttestationError("shard: not {rank, of} with 0 <= rank < of")
            shard = {"rank": int(shard["rank"]), "of": int(shard["of"])}
        params = data.get("parameters", 0)
        if not _is_int(params):
            raise AttestationError("parameters: not an integer")
        return cls(checkpoint=name, step=step, world=world, verdict=verdict, time=float(when), job=job,
                   agree=list(agree), fingerprint=fp, groups=[dict(g) for g in groups],
                   suspects=[dict(s) for s in suspects], saved_by=dict(saved_by), shard=shard,
                   parameters=params, file=dict(file_), message=message)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def write(att: Attestation, checkpoint: str | Path) -> Path:
    """Write ``att`` beside ``checkpoint``, atomically; returns its path. Raises OSError."""
    from gpumon.atomic import write_atomic

    path = path_for(checkpoint)
    write_atomic(path, json.dumps(att.to_json(), indent=1, sort_keys=True) + "\n", mode=0o644)
    return path


def read(path: Path) -> Attestation:
    """One attestation file; raises AttestationError (bad content) or OSError (unreadable)."""
    with path.open("rb") as fh:
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise AttestationError(f"larger than {MAX_BYTES} bytes: not an attestation")
    if not raw.strip():
        raise AttestationError("empty (a save that did not finish?)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise AttestationError("not UTF-8 text: not an attestation") from None
    except json.JSONDecodeError as exc:
        raise AttestationError(f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
                               "truncated or not an attestation") from None
    return Attestation.from_json(data)


# -- which checkpoint to resume from --------------------------------------------------------------


@dataclass
class Entry:
    """One checkpoint (all its shards) and what is wrong with it, if anything."""

    step: int
    attestations: list[tuple[Path, Attestation]]
    problems: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.problems and all(a.verified for _, a in self.attestations)

    @property
    def verdict(self) -> str:
        verdicts = {a.verdict for _, a in self.attestations}
        for v in ("disagreement", "unchecked"):
            if v in verdicts:
                return v
        return "verified"


@dataclass(frozen=True)
class Suspect:
    step: int  # the first step that may have been computed wrongly
    source: str  # what says so
    path: str


@dataclass
class Scan:
    directory: Path
    entries: list[Entry]
    bad_files: list[tuple[Path, str]]
    suspects: list[Suspect]
    verdict_problems: list[tuple[Path, str]]
    jobs: list[str]

    @property
    def first_suspect(self) -> Suspect | None:
        return min(self.suspects, key=lambda s: s.step) if self.suspects else None

    @property
    def resume(self) -> Entry | None:
        """The newest verified checkpoint before the first suspect step."""
        first = self.first_suspect
        ok = [e for e in self.entries if e.verified and (first is None or e.step <= first.step)]
        return max(ok, key=lambda e: e.step) if ok else None


def scan(directory: Path, *, verdicts: Path | None = None, job: str | None = None,
         check_hash: bool = False) -> Scan:
    """Every attestation under ``directory`` (recursively), its checkpoint file checked; suspect
    steps from unverified attestations and, with ``verdicts``, from the guard's verdict files of
    ``job`` (default: the jobs the attestations name; every verdict when they name none).
    Raises OSError when ``directory`` cannot be listed."""
    from gpumon.guard import verdict as vf

    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a directory")
    by_step: dict[int, Entry] = {}
    bad: list[tuple[Path, str]] = []
    for path in _find(directory, SUFFIX, bad):
        try:
            att = read(path)
        except (AttestationError, OSError) as exc:
            bad.append((path, str(exc)))
            continue
        entry = by_step.setdefault(att.step, Entry(att.step, []))
        entry.attestations.append((path, att))
        entry.problems.extend(_file_problems(path, att, check_hash))
    for entry in by_step.values():
        entry.problems.extend(_shard_problems(entry))
    suspects = [Suspect(max(a.step - 1, -1), f"attestation of step {a.step}: {a.message}", str(p))
                for e in by_step.values() for p, a in e.attestations if a.verdict == "disagreement"]
    jobs = sorted({a.job for e in by_step.values() for _, a in e.attestations if a.job})
    problems: list[tuple[Path, str]] = []
    if verdicts is not None:
        if not verdicts.is_dir():
            raise NotADirectoryError(f"{verdicts}: not a directory")
        wanted = {job} if job else set(jobs)
        for path in _find(verdicts, ".json", problems, skip_bundles=True):
            try:
                v = vf.read(path)
            except (vf.VerdictError, OSError) as exc:
                problems.append((path, str(exc)))
                continue
            if wanted and v.job not in wanted:
                continue
            suspects.append(Suspect(v.step, f"verdict {v.check}: {v.message}", str(path)))
    return Scan(directory, sorted(by_step.values(), key=lambda e: e.step), bad, suspects, problems,
                [job] if job else jobs)


# A replay bundle (gpumon.sdc.bundle: a directory with this manifest) holds no verdicts: the guard
# keeps the failing step as one beside its verdict, under <spool>/bundles/<verdict id>/ by default.
_BUNDLE_MANIFEST = "manifest.json"
_BUNDLE_FORMAT = "gpumon-sdc-bundle/"


def _is_bundle(directory: Path) -> bool:
    try:
        with (directory / _BUNDLE_MANIFEST).open("rb") as fh:
            manifest = json.loads(fh.read(1 << 22))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(_BUNDLE_FORMAT)


def _find(directory: Path, suffix: str, bad: list[tuple[Path, str]], *,
          skip_bundles: bool = False) -> list[Path]:
    """Files named ``*suffix`` under ``directory``, not following links to directories (and not
    inside replay bundles, with ``skip_bundles``). A subdirectory that cannot be read is reported;
    one that vanished while listed is not."""
    found: list[Path] = []

    def onerror(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            bad.append((Path(exc.filename or directory), f"cannot list: {exc.strerror or exc}"))

    for root, dirs, files in os.walk(directory, onerror=onerror):
        if skip_bundles:
            # nor the spool's pace files (gpumon.guard.verdict.PACE_DIR: scores, not verdicts)
            dirs[:] = [d for d in dirs if not _is_bundle(Path(root, d))
                       and not (Path(root) == directory and d == PACE_DIR)]
        # a name starting with "." is an atomic write's temporary file that did not finish
        found.extend(Path(root, f) for f in files if f.endswith(suffix) and not f.startswith("."))
    return sorted(found)


def _file_problems(path: Path, att: Attestation, check_hash: bool) -> list[str]:
    ckpt = path.parent / att.checkpoint
    if not ckpt.exists():
        return [f"checkpoint file {ckpt} is missing (the attestation is there, the checkpoint is not)"]
    size = att.file.get("size")
    try:
        actual = ckpt.stat().st_size if ckpt.is_file() else None
    except OSError as exc:
        return [f"checkpoint file {ckpt}: {exc.strerror or exc}"]
    if actual is not None and isinstance(size, int) and actual != size:
        return [f"checkpoint file {ckpt} is {actual} bytes, the attestation says {size}: changed or "
                "truncated after it was attested"]
    digest = att.file.get("sha256")
    if check_hash and actual is not None and isinstance(digest, str):
        try:
            if sha256_file(ckpt) != digest:
                return [f"checkpoint file {ckpt}: sha256 differs from the attestation's"]
        except OSError as exc:
            return [f"checkpoint file {ckpt}: {exc.strerror or exc}"]
    return []


def _shard_problems(entry: Entry) -> list[str]:
    shards = [a.shard for _, a in entry.attestations if a.shard is not None]
    if not shards:
        if len(entry.attestations) > 1:
            return [f"{len(entry.attestations)} attestations of step {entry.step} that are not shards "
                    "of one save (two runs in one directory?)"]
        return []
    of = {s["of"] for s in shards}
    have = {s["rank"] for s in shards}
    if len(shards) != len(entry.attestations) or len(of) != 1:
        return [f"step {entry.step}: shards of different saves mixed"]
    (n,) = of
    missing = sorted(set(range(n)) - have)
    if missing:
        return [f"step {entry.step}: shard(s) of rank {', '.join(map(str, missing))} have no attestation"]
    return []
