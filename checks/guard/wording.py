"""What the guard check's findings say: a verdict's finding (its component, severity and action, its
attestation and confirmation), the summaries of the verdicts past ``max_faults_per_gpu``, and the
spool's own warnings (files that are not verdicts, uids past their cap, the backlog)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from gpumon.check import Check
from gpumon.guard import verdict as vf
from gpumon.hw.placement import normalize_uuid
from gpumon.model import NODE, Action, Finding, Severity, gpu

from .book import FAIL, Book
from .confirming import Confirmations, pending
from .options import GuardConfig
from .spool import FUTURE, LEFT, SUMMARY, Left, Listing, summarize


class GuardWording(Check):
    """The guard check's findings, worded (``GuardCheck`` runs the check)."""

    _confirm: Confirmations  # set by each run

    def _summaries(self, spool: Path, judged_dir: Path, book: Book, options: GuardConfig) -> list[Finding]:
        out: list[Finding] = []
        for (component, cls), (count, since, newest) in sorted(book.summaries().items()):
            where = (f"GPU {component.split('/')[1]}" if component != NODE
                     else "this node (CPU ranks, or GPUs that are not this node's)")
            files = [{"id": vid, "time": t, "fault": fault, "verdict_check": check, "job": job or None,
                      "verdict_file": str((spool if waiting else judged_dir) / name)}
                     for t, vid, name, fault, check, job, waiting in newest]
            kinds = "persistent" if cls == FAIL else "transient or unknown"
            message = (f"{count} more in-job SDC verdicts ({kinds}) on {where} since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))} than the "
                       f"{options.max_faults_per_gpu} held as faults of their own "
                       f"(checks.guard.max_faults_per_gpu): counted in this one; newest: "
                       f"{', '.join(str(f['id']) for f in files)}")
            if cls == FAIL:
                # not one of them is confirmed on its own: the GPU fails (or not) by the confirmation
                # of the ones held as faults of their own
                message += ("; the GPU is judged by the node's confirmation of those (checks.guard.confirm), "
                            "not by how many there are")
            out.append(self.finding(component, Severity.WARN, message, Action.NONE,
                                    fault_key=f"verdicts-more:{cls}",
                                    verdicts=count, since=since, newest=files,
                                    max_faults_per_gpu=options.max_faults_per_gpu))
        return out

    def _spool_warnings(self, spool: Path, listing: Listing, book: Book,
                        options: GuardConfig) -> list[Finding]:
        out: list[Finding] = []
        cached = SUMMARY.get(str(spool))
        if (cached is not None and cached[0] is LEFT.get(str(spool)) and not listing.learnt
                and listing.carried == listing.known):
            summary = cached[1]
        else:
            summary = summarize(listing.left)
        SUMMARY[str(spool)] = (listing.left, summary)
        bad, reasons, first, waiting = summary
        if bad:
            out.append(self._not_verdicts(spool, bad, reasons, first))
        for uid, n in sorted(waiting.items()):
            judged = book.judged_by(uid)
            out.append(self.finding(
                NODE, Severity.WARN,
                f"uid {uid} filed more guard verdicts than the {options.uid_max_verdicts} judged per uid "
                f"within {options.uid_window_s:g} s (checks.guard.uid_max_verdicts): {n} more of its "
                f"verdict files wait in {spool}, judged in a later window, oldest first (not deleted; "
                "a persistent verdict only waits if it is not attested)",
                fault_key=f"uid-cap:{uid}", uid=uid, waiting=n, judged=judged,
                uid_max_verdicts=options.uid_max_verdicts, uid_window_s=options.uid_window_s))
        unread = listing.fresh - listing.read
        if unread or listing.cut:
            said = (f"{unread} files in the guard spool {spool} wait beyond the {options.max_files} read per "
                    "run (checks.guard.max_files): read on later runs, in turn per owner, oldest first")
            if listing.cut:
                said += (f"; the spool holds more than the {options.max_scan} entries listed per run "
                         "(checks.guard.max_scan): those past them are not seen until it holds fewer")
            out.append(self.finding(NODE, Severity.WARN, said, spool=str(spool), waiting=unread,
                                    listed=listing.listed, listing_cut=listing.cut,
                                    fault_key="spool-backlog"))
        return out

    def _not_verdicts(self, spool: Path, bad: int, reasons: Counter[str],
                      first: list[tuple[str, Left]]) -> Finding:
        files: list[dict[str, Any]] = []
        for name, left in first:
            said: dict[str, Any] = {"file": str(spool / name), "error": left.error}
            if left.where is not None:
                said.update(schema=vf.SCHEMA_ID, schema_error_path=left.where, schema_rule=left.rule)
            files.append(said)
        if bad == 1:
            (name, left), = first
            what = ("a newer guard's verdict" if left.reason == FUTURE
                    else "not a guard verdict this gpumon reads")
            message = (f"guard spool file {spool / name}: {what}: {left.error}; left in place (remove or fix "
                       "it; it is read again every run)")
        else:
            counts = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
            errors = "; ".join(f"{name}: {left.error}" for name, left in first)
            message = (f"{bad} files in the guard spool {spool} are not guard verdicts this gpumon "
                       f"reads ({counts}); the first {len(first)} by name: {errors}; left in place (remove "
                       "or fix them; each is looked at again every run)")
        # the first file's own fields at the top, as a single bad file's warning always had them
        return self.finding(NODE, Severity.WARN, message, fault_key="spool-not-verdicts",
                            files_not_verdicts=bad, reasons=dict(reasons), files=files, **files[0])

    def _finding(self, v: vf.Verdict, path: Path, by_uuid: dict[str | None, int]) -> Finding:
        s = v.subject
        if v.fault == "application":
            job = f"job {v.job}, " if v.job else ""
            return self.ok(NODE, f"in-job SDC check {v.check} ({job}application: not a hardware fault, no "
                                 f"GPU held responsible) from rank {s.rank} on {s.host}: {v.message}",
                           verdict_file=str(path), verdict_check=v.check, fault=v.fault, step=v.step,
                           job=v.job, rank=s.rank, gpu_uuid=s.gpu_uuid, verdict_evidence=v.evidence)
        key = normalize_uuid(s.gpu_uuid)
        index = by_uuid.get(key) if key else None
        if index is not None:
            component, where = gpu(index), f"GPU {index} ({s.gpu_uuid})"
        elif key:
            component = NODE
            where = (f"GPU {s.gpu_uuid}, which is not one of this node's GPUs (written on host "
                     f"{s.host}: a spool shared between nodes, or a GPU gone from NVML)")
        else:
            component, where = NODE, f"this node, not a GPU ({s.gpu_note or f'device {s.device}'})"
        if v.fault == "persistent":
            severity, action = Severity.FAIL, Action.INSPECT_HARDWARE
        else:
            severity, action = Severity.WARN, Action.NONE
        job = f"job {v.job}, " if v.job else ""
        message = f"in-job SDC check {v.check} ({job}{v.fault}) on {where}: {v.message}"
        attestation = v.evidence.get("attestation")
        if isinstance(attestation, dict) and attestation.get("attested") is False:
            claimed = attestation.get("claimed_fault", v.fault)
            message = (f"NOT ATTESTED in-job SDC verdict {v.check} ({job}claims {claimed}; judged as a "
                       f"warning) on {where}: {attestation.get('why')}. The verdict says: {v.message}")
        fault_key = v.id
        confirmation = v.evidence.get("confirmation")
        if isinstance(confirmation, dict) and not (isinstance(attestation, dict)
                                                   and attestation.get("attested") is False):
            severity, action, message = _confirmation_words(v, confirmation, where, job, severity, action)
            if pending(v):
                fault_key = f"confirm:{v.id}"  # its own fault: cleared when the confirmation judges it
                trouble = self._confirm.ask(v)
                if trouble:
                    message += f" ({trouble})"
        if v.check == "straggler":
            message = (f"in-job straggler ({job.rstrip(', ') or 'a job'}) on {where}: {v.message}; "
                       "compare this GPU's throttle, thermal, pcie and nvlink findings (node_signals in "
                       "the evidence: read when the verdict was judged)")
        evidence: dict[str, Any] = {
            "fault_key": fault_key, "verdict_id": v.id, "verdict_file": str(path), "verdict_check": v.check,
            "fault": v.fault, "step": v.step, "job": v.job, "time": v.time, "rank": s.rank,
            "world_size": s.world_size, "host": s.host, "node_name": s.node_name, "local_rank": s.local_rank,
            "device": s.device,
            "gpu_uuid": s.gpu_uuid, "gpu_pci_bus_id": s.gpu_pci_bus_id, "verdict_evidence": v.evidence}
        return self.finding(component, severity, message, action, **evidence)


def _confirmation_words(v: vf.Verdict, said: dict[str, Any], where: str, job: str, severity: Severity,
                        action: Action) -> tuple[Severity, Action, str]:
    """Severity, action and message of a persistent verdict judged by the node's confirmation."""
    commands = "; ".join(f"`{c}`" for c in said.get("commands", []))
    state = said.get("state")
    if state == "pending":
        waiting = f"; now: {said['waiting']}" if said.get("waiting") else ""
        # said first: a drain reason keeps the first 200 characters
        return Severity.WARN, Action.CONFIRM_SDC, (
            f"confirming an in-job SDC verdict on this node before the RMA path, no new work until then: "
            f"in-job SDC check {v.check} ({job}persistent) on {where}: {v.message}; the node's SDC canaries "
            f"run on GPU {said.get('gpu_index')} once it is free{waiting}")
    if state == "reproduced":
        return Severity.FAIL, Action.INSPECT_HARDWARE, (
            f"in-job SDC check {v.check} ({job}persistent) on {where}, CONFIRMED on this node: "
            f"{said.get('said')}. The verdict says: {v.message}")
    if state == "not_reproduced":
        return severity, action, (
            f"in-job SDC verdict {v.check} ({job}claims persistent) on {where} NOT reproduced on this node: "
            f"{said.get('said')}; judged as a warning, and the node serves again. The verdict says: "
            f"{v.message}" + (f". To look further: {commands}" if commands else ""))
    why = said.get("said") or said.get("why")
    return severity, action, (
        f"in-job SDC verdict {v.check} ({job}claims persistent; judged as a warning) on {where}: it could "
        f"not be confirmed on this node: {why}. The verdict says: {v.message}"
        + (f". To confirm it: {commands}" if commands else ""))
