"""Confirming an in-job SDC verdict on the node: what the ``guard`` check asks, what ``sdc_confirm`` answers.

A training job's ``persistent`` verdict (gpumon.guard) says that one GPU computed wrong numbers. It
is one job's word, and a wrong one sends a good GPU down the RMA path, so the node confirms it
before any check fails the GPU: the ``guard`` check writes a **request** here for each such verdict
(and keeps the node out of service meanwhile, action ``confirm_sdc``); the ``sdc_confirm`` check
runs the node's own SDC canaries on that GPU once it is free (and replays the step the job kept,
as the bundle's owner) and writes the **result**; the ``guard`` check then judges the verdict by it:
reproduced -> fail/``inspect_hardware`` with the confirmation as evidence; not reproduced -> a
warning, and the node serves again; cannot be confirmed here -> a warning that names the command
that would confirm it.

Both files live in ``<state_dir>/sdc/confirm/`` (mode 0700: the daemon's alone, never the spool that
every user can write), one pair per verdict, named by a hash of the verdict id:
``<name>.request.json``, ``<name>.status.json`` (what the confirming check is waiting on, rewritten
each run: proof that a confirmer is at work) and ``<name>.result.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpumon.atomic import write_atomic

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not_reproduced"
CANNOT_CONFIRM = "cannot_confirm"
OUTCOMES = (REPRODUCED, NOT_REPRODUCED, CANNOT_CONFIRM)

# files read per run: requests come from attested persistent verdicts only (a process computing on
# the GPU it names), at most the guard's max_faults_per_gpu per GPU and hold window
MAX_REQUESTS = 256
# bytes of one file read: a request or result is a few kB; anything larger was not written by gpumon
MAX_BYTES = 1 << 20


def confirm_dir(state_dir: Path) -> Path:
    return state_dir / "sdc" / "confirm"


def name_of(verdict_id: str) -> str:
    """A file name for a verdict id: a hash, so that no id can leave or hide in the directory."""
    return hashlib.sha256(verdict_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class Request:
    """One verdict to confirm on one GPU of this node."""

    verdict_id: str
    gpu_index: int
    gpu_uuid: str
    verdict_check: str  # the in-job check that named the GPU (audit, nonfinite_grad, ...)
    job: str | None
    requested: float
    bundle: str | None = None  # the failing step the job kept (gpumon canary replay), if any

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        return cls(verdict_id=str(data["verdict_id"]), gpu_index=int(data["gpu_index"]),
                   gpu_uuid=str(data["gpu_uuid"]), verdict_check=str(data["verdict_check"]),
                   job=None if data.get("job") is None else str(data["job"]),
                   requested=float(data["requested"]),
                   bundle=None if data.get("bundle") is None else str(data["bundle"]))


@dataclass(frozen=True)
class Result:
    """How the node's own confirmation came out."""

    verdict_id: str
    outcome: str  # one of OUTCOMES
    said: str  # in words, for the verdict's finding
    time: float
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        outcome = str(data["outcome"])
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is none of {', '.join(OUTCOMES)}")
        evidence = data.get("evidence")
        return cls(verdict_id=str(data["verdict_id"]), outcome=outcome, said=str(data["said"]),
                   time=float(data["time"]), evidence=dict(evidence) if isinstance(evidence, dict) else {})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ConfirmQueue:
    """The requests, status notes and results of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = confirm_dir(state_dir)

    def _path(self, verdict_id: str, kind: str) -> Path:
        return self.dir / f"{name_of(verdict_id)}.{kind}.json"

    def _write(self, path: Path, data: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.dir, 0o700)
        write_atomic(path, json.dumps(data, sort_keys=True, default=str) + "\n", mode=0o600)

    def _read(self, path: Path) -> dict[str, Any] | None:
        """The file's JSON object; None when there is none. Raises ValueError on a damaged one."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        if len(raw) > MAX_BYTES:
            raise ValueError(f"{path}: larger than {MAX_BYTES} bytes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a JSON object")
        return data

    # -- the guard's side --------------------------------------------------------------------

    def ask(self, request: Request) -> None:
        """Write a request once (a repeat of the same verdict keeps the first). Raises OSError."""
        path = self._path(request.verdict_id, "request")
        if not path.exists():
            self._write(path, asdict(request))

    def request(self, verdict_id: str) -> Request | None:
        try:
            data = self._read(self._path(verdict_id, "request"))
            return None if data is None else Request.from_json(data)
        except (ValueError, KeyError, TypeError):
            return None

    def result(self, verdict_id: str) -> Result | None:
        """The verdict's result; None while there is none. A damaged result file is no result (the
        confirmer writes it again: its request is still open)."""
        try:
            data = self._read(self._path(verdict_id, "result"))
            return None if data is None else Result.from_json(data)
        except (ValueError, KeyError, TypeError):
            return None

    def status(self, verdict_id: str) -> dict[str, Any] | None:
        try:
            return self._read(self._path(verdict_id, "status"))
        except ValueError:
            return None

    # -- the confirmer's side ----------------------------------------------------------------

    def open_requests(self) -> tuple[list[Request], list[str]]:
        """The requests without a result, oldest first (at most MAX_REQUESTS), and what could not be
        read (file: why): a damaged request is said, never a crash, and left for an operator."""
        out: list[Request] = []
        bad: list[str] = []
        try:
            names = sorted(p.name for p in self.dir.iterdir() if p.name.endswith(".request.json"))
        except FileNotFoundError:
            return [], []
        for name in names[:MAX_REQUESTS]:
            path = self.dir / name
            try:
                data = self._read(path)
                if data is None:
                    continue
                req = Request.from_json(data)
            except (ValueError, KeyError, TypeError) as exc:
                bad.append(f"{path}: {exc}")
                continue
            if not self._path(req.verdict_id, "result").exists():
                out.append(req)
        out.sort(key=lambda r: r.requested)
        return out, bad

    def note(self, verdict_id: str, waiting: str, attempts: int = 0) -> None:
        """What the confirmer is waiting on (a busy GPU, a run under way): rewritten each run."""
        self._write(self._path(verdict_id, "status"),
                    {"verdict_id": verdict_id, "time": time.time(), "waiting": waiting, "attempts": attempts})

    def answer(self, result: Result) -> None:
        self._write(self._path(result.verdict_id, "result"), result.to_json())

    def prune(self, older_than_s: float, now: float) -> int:
        """Remove the files of verdicts answered more than ``older_than_s`` ago; how many verdicts."""
        gone = 0
        try:
            results = [p for p in self.dir.iterdir() if p.name.endswith(".result.json")]
        except FileNotFoundError:
            return 0
        for path in results:
            try:
                if now - path.stat().st_mtime <= older_than_s:
                    continue
            except OSError:
                continue
            stem = path.name.removesuffix(".result.json")
            for kind in ("request", "status", "result"):
                with contextlib.suppress(OSError):
                    (self.dir / f"{stem}.{kind}.json").unlink()
            gone += 1
        return gone


def confirm_commands(gpu_index: int, bundle: str | None) -> list[str]:
    """What an operator runs to confirm a verdict on GPU ``gpu_index`` by hand: the canaries on every
    GPU (a majority of the node's GPUs names one that dissents; ``--golden FILE`` compares with a
    golden run instead), and the replay of the step the job kept, as its owner."""
    del gpu_index  # named in the finding beside the commands; the canary compares the node's GPUs
    out = ["gpumon canary run --iterations 3"]
    if bundle:
        out.append(f"gpumon canary replay --as-owner {bundle}")
    return out
