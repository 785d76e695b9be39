"""``gpumon guard ...``: the in-job guard's commands that run outside the job (no torch).

``gpumon guard checkpoints DIR``: every attested checkpoint under DIR, and the newest one verified
before the first suspect step: the one to resume from. Exit 0: the newest checkpoint is verified and
nothing is suspect; 1: a checkpoint to resume from is named, but something is suspect or unreadable
(resume from the one named, not the newest); 2: no verified checkpoint before the first suspect step
(none to resume from); 3: could not run (DIR missing, bad usage).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumon.guard import attestation as at

EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2, 3


def add_parser(sub: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("guard", parents=list(parents),
                       help="the in-job SDC guard's files: verified checkpoints",
                       description="Files the in-job guard (gpumon.guard) writes, read outside the job.")
    gsub = p.add_subparsers(dest="guard_command", required=True, metavar="COMMAND")
    c = gsub.add_parser(
        "checkpoints", parents=list(parents),
        help="list attested checkpoints; name the one to resume from",
        description="List the checkpoints under DIR with their attestations (written beside each by "
                    "gpumon.guard.save_checkpoint) and name the newest checkpoint that was verified "
                    "before the first suspect step: the one to resume from. Suspect steps come from "
                    "attestations whose replicas disagreed and, with --verdicts, from the guard's "
                    "verdict files. Exit 0: resume from the newest, nothing suspect; 1: resume from "
                    "the one named (something is suspect or unreadable); 2: no checkpoint to resume "
                    "from; 3: could not run.")
    c.add_argument("dir", type=Path, metavar="DIR", help="where the checkpoints are (searched recursively)")
    c.add_argument("--verdicts", type=Path, metavar="DIR",
                   help="the guard's verdict files too (a node's spool, $GPUMON_GUARD_DIR, or a "
                        "directory the job's verdicts were collected into)")
    c.add_argument("--job", metavar="ID",
                   help="with --verdicts: only this job's verdicts (as the verdicts say it, e.g. "
                        "slurm:1234; default: the jobs the attestations name, every verdict if none)")
    c.add_argument("--hash", action="store_true",
                   help="check each checkpoint file's sha256 against its attestation (reads every file)")
    c.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    if args.guard_command == "checkpoints":
        return checkpoints(args.dir, verdicts=args.verdicts, job=args.job, check_hash=args.hash,
                           as_json=args.json)
    print(f"gpumon guard: unknown command {args.guard_command}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def checkpoints(directory: Path, *, verdicts: Path | None = None, job: str | None = None,
                check_hash: bool = False, as_json: bool = False) -> int:
    try:
        result = at.scan(directory, verdicts=verdicts, job=job, check_hash=check_hash)
    except OSError as exc:
        print(f"gpumon guard checkpoints: cannot run: {exc.strerror or exc}"
              + (f": {exc.filename}" if getattr(exc, "filename", None) else ""), file=sys.stderr)
        return EXIT_CANNOT_RUN
    resume, first = result.resume, result.first_suspect
    newest = result.entries[-1] if result.entries else None
    if resume is None:
        code = EXIT_FAIL
    elif resume is newest and first is None and not result.bad_files and not result.verdict_problems:
        code = EXIT_OK
    else:
        code = EXIT_WARN
    if as_json:
        print(json.dumps(_json(result, code), indent=1))
    else:
        _text(result, code)
    return code


def _entry_json(e: at.Entry) -> dict[str, Any]:
    return {"step": e.step, "verdict": e.verdict, "verified": e.verified, "problems": e.problems,
            "checkpoints": [str(p.parent / a.checkpoint) for p, a in e.attestations],
            "attestations": [{"path": str(p), **a.to_json()} for p, a in e.attestations]}


def _json(result: at.Scan, code: int) -> dict[str, Any]:
    first, resume = result.first_suspect, result.resume
    return {"status": {EXIT_OK: "ok", EXIT_WARN: "warn", EXIT_FAIL: "fail"}[code],
            "dir": str(result.directory), "jobs": result.jobs,
            "checkpoints": [_entry_json(e) for e in result.entries],
            "bad_files": [{"path": str(p), "error": why} for p, why in result.bad_files],
            "verdict_problems": [{"path": str(p), "error": why} for p, why in result.verdict_problems],
            "suspects": [{"step": s.step, "source": s.source, "path": s.path}
                         for s in sorted(result.suspects, key=lambda s: s.step)],
            "first_suspect_step": first.step if first else None,
            "resume": _entry_json(resume) if resume else None}


def _text(result: at.Scan, code: int) -> None:
    out = sys.stdout
    print(f"attested checkpoints under {result.directory}: {len(result.entries)}", file=out)
    for e in result.entries:
        path, att = e.attestations[0]
        agree = f"{len(att.agree)}/{att.world}" if att.verdict != "unchecked" else f"?/{att.world}"
        label = "verified" if e.verified else ("NOT verified" if e.verdict != "verified" else "unusable")
        shards = f" ({len(e.attestations)} shards)" if att.shard else ""
        print(f"  step {e.step:>8}  {label:<12}  replicas agree {agree:<6} "
              f"{path.parent / att.checkpoint}{shards}", file=out)
        for _, a in e.attestations:
            if not a.verified:
                print(f"      {a.message}", file=out)
        for why in e.problems:
            print(f"      problem: {why}", file=out)
    for p, why in result.bad_files:
        print(f"  unreadable attestation {p}: {why}", file=out)
    for p, why in result.verdict_problems:
        print(f"  unreadable verdict file {p}: {why}", file=out)
    if result.suspects:
        print(f"suspect steps ({len(result.suspects)}"
              + (f", jobs {', '.join(result.jobs)}" if result.jobs else "") + "):", file=out)
        for s in sorted(result.suspects, key=lambda s: s.step)[:10]:
            print(f"  step {s.step}: {s.source}", file=out)
    first, resume = result.first_suspect, result.resume
    if first is not None:
        print(f"first suspect step: {first.step} (a checkpoint of step <= {first.step} was saved "
              "before it)", file=out)
    if resume is not None:
        path, att = resume.attestations[0]
        where = (str(path.parent / att.checkpoint) if not att.shard
                 else f"{path.parent} (the {len(resume.attestations)} shards of step {resume.step})")
        print(f"resume from: {where}  (step {resume.step}, verified: all {att.world} replicas agreed, "
              f"fingerprint {att.fingerprint})", file=out)
        if code == EXIT_WARN:
            print("  (" + ("the newest checkpoint, but" if resume is result.entries[-1] else
                           "not the newest checkpoint:")
                  + " a step or a file above is suspect or unreadable)", file=out)
    elif not result.entries:
        print(f"no checkpoint to resume from: no attested checkpoint under {result.directory} "
              f"(attestations are files named *{at.SUFFIX})", file=out)
    elif first is not None:
        print(f"no checkpoint to resume from: none was verified before the first suspect step "
              f"{first.step}", file=out)
    else:
        print("no checkpoint to resume from: none of them is verified and usable", file=out)
