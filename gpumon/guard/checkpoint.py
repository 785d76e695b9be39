"""Verified checkpoints: the weight check on every rank, then the save, then an attestation beside
the checkpoint saying whether the replicas agreed (imports torch; ``gpumon.guard`` loads it on first
use). The file format and the choice of a checkpoint to resume from are in ``attestation``.

    from gpumon.guard import save_checkpoint
    save_checkpoint(guard, {"model": model.module.state_dict(), ...}, f"ckpt/step_{guard.steps}.pt")

Called on every rank (it runs collectives). A disagreement does not stop the save (the user decides
what to do with it): the attestation says ``disagreement`` and names the suspect, and with
``on_alarm="raise"`` the ``GuardAlarm`` is raised once the checkpoint and its attestation are written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpumon.guard import attestation as at
from gpumon.guard.alarm import GuardAlarm
from gpumon.guard.core import Guard
from gpumon.guard.verdict import job_id
from gpumon.guard.weights import WeightReport
from gpumon.sdc.fingerprint import fingerprint, fingerprint_tensor

log = logging.getLogger("gpumon.guard")

SaveFn = Callable[[Any, Path], Any]


def weights_fingerprint(module: torch.nn.Module) -> str:
    """One fingerprint of every trainable parameter's fingerprint, in ``named_parameters`` order
    (the parameters the weight check compares; buffers are not compared: BatchNorm statistics, for
    one, differ between replicas by design). After loading a checkpoint, compare this with the
    attestation's ``fingerprint`` to know the weights are the ones attested."""
    with torch.no_grad():
        pairs = [fingerprint_tensor(p.detach()) for p in module.parameters() if p.requires_grad]
        stacked = torch.stack(pairs) if pairs else torch.zeros(0, 2, dtype=torch.int64)
        return fingerprint(stacked.to("cpu")).hex()


def _torch_save(state: Any, path: Path) -> None:
    torch.save(state, path)


def save_checkpoint(guard: Guard, state: Any, path: str | Path, *, save_fn: SaveFn | None = None,
                    sharded: bool = False, hash_file: bool = True) -> at.Attestation:
    """Check the weights on every rank, save ``state`` to ``path`` and write its attestation beside
    it (``<path>.attestation.json``); the attestation is returned on every rank (``file`` and
    ``saved_by.host`` filled in only on the rank that saved).

    ``save_fn(state, path)``: how to save (default ``torch.save``). Without ``sharded`` one rank
    saves: rank 0, or, when rank 0's weights are outside a strict majority, the lowest rank of the
    majority (so the checkpoint holds the weights most replicas agree on; ``path`` must then be on
    storage that rank reaches, as it is for any job that resumes on other nodes). ``sharded``:
    every rank saves its own ``path`` (which must differ per rank) and writes its own attestation.
    ``hash_file``: record the checkpoint file's sha256 (reads the file once more after the save).
    """
    path = Path(path)
    save = save_fn if save_fn is not None else _torch_save
    alarm: GuardAlarm | None = None
    report: WeightReport | None = None
    try:
        report = guard.check_weights()
    except GuardAlarm as exc:
        alarm = exc
    mine = weights_fingerprint(guard.model.module)
    prints, reason = _gather(guard, mine, report is not None or alarm is not None)
    att = _judge(guard, path.name, prints, alarm, reason, sharded)
    saver = att.saved_by["rank"]
    if sharded or guard.rank == saver:
        path.parent.mkdir(parents=True, exist_ok=True)
        save(state, path)
        try:
            size = path.stat().st_size
            digest = at.sha256_file(path) if hash_file else None
        except OSError as exc:  # save_fn wrote somewhere else (a directory checkpoint, say)
            log.warning("gpumon.guard: cannot read back the checkpoint %s: %s", path, exc)
            size, digest = None, None
        att = replace(att, file={"size": size, "sha256": digest},
                    saved_by={**att.saved_by, "host": guard.identity.host})
        at.write(att, path)
        (log.info if att.verified else log.error)("gpumon.guard: checkpoint %s: %s", path, att.message)
    if alarm is not None:
        raise alarm
    return att


def _gather(guard: Guard, mine: str, checked: bool) -> tuple[list[str], str | None]:
    """Every rank's weights fingerprint (only these travel), or why not."""
    if not checked:
        return [mine] * guard.world, f"the weight check did not run (guard off: {guard.disabled})"
    got: list[Any] = [None] * guard.world
    try:
        # the guard's own gloo group: bounded by its timeout, never on the training's NCCL group
        dist.all_gather_object(got, mine, group=guard._group)
    except Exception as exc:
        guard._internal("gathering the checkpoint fingerprints", exc)
        return [mine] * guard.world, f"gathering the replicas' fingerprints failed: {exc}"
    return [str(g) for g in got], None


def _judge(guard: Guard, name: str, prints: list[str], alarm: GuardAlarm | None, reason: str | None,
           sharded: bool) -> at.Attestation:
    world, rank = guard.world, guard.rank
    step = guard.steps
    base: dict[str, Any] = {
        "checkpoint": name, "step": step, "world": world, "time": time.time(), "job": job_id(),
        "parameters": sum(1 for p in guard.model.module.parameters() if p.requires_grad),
        "shard": {"rank": rank, "of": world} if sharded else None}
    if reason is not None:
        return at.Attestation(verdict="unchecked", agree=[], fingerprint=prints[rank], groups=[],
                              saved_by={"rank": rank if sharded else 0},
                              message=f"step {step}: NOT verified: {reason}", **base)
    keys: dict[str, list[int]] = {}
    for r, fp in enumerate(prints):
        keys.setdefault(fp, []).append(r)
    groups = sorted(keys.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    group_json = [{"ranks": ranks, "fingerprint": fp} for fp, ranks in groups]
    if len(groups) == 1:
        return at.Attestation(verdict="verified", agree=list(range(world)), fingerprint=prints[0],
                              groups=group_json, saved_by={"rank": rank if sharded else 0},
                              message=f"step {step}: verified, all {world} replicas' weights agree "
                                      f"(fingerprint {prints[0]})", **base)
    majority = groups[0][1] if world >= 3 and len(groups[0][1]) * 2 > world else None
    suspects_ranks = (sorted(r for _, g in groups[1:] for r in g) if majority is not None
                      else list(range(world)))
    first = {v.subject.rank: v.evidence.get("first_parameter") for v in (alarm.verdicts if alarm else [])}
    suspects = [{"rank": r, "where": guard.identities[r].describe(), "first_parameter": first.get(r),
                 "subject": asdict(guard.identities[r])} for r in suspects_ranks]
    saver = rank if sharded else (0 if majority is None or 0 in majority else min(majority))
    saved_fp = prints[saver]
    agree = next(g for fp, g in groups if fp == saved_fp)
    named = "; ".join(f"{s['where']}" + (f", first at parameter {s['first_parameter']!r}"
                                         if s["first_parameter"] else "") for s in suspects)
    if majority is not None:
        what = (f"{len(majority)} of {world} replicas agree; suspect: {named}; the checkpoint holds "
                f"the majority's weights (saved by rank {saver})")
    else:
        what = (f"no strict majority among {world} replicas ({' / '.join(str(g) for _, g in groups)}): "
                f"which is wrong is unknown; suspects: {named}; saved by rank {saver}")
    return at.Attestation(verdict="disagreement", agree=agree, fingerprint=saved_fp, groups=group_json,
                          suspects=suspects, saved_by={"rank": saver},
                          message=f"step {step}: NOT verified: replicas disagree: {what}", **base)
