"""Units of ``gpumon why`` that the Slurm scenarios rely on: the reboot rule, the culprits an
epilog may drain, the AdminComment's bound, and the verdict counter's textfile."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import need_tool
from gpumon.why.collect import NodeEvidence
from gpumon.why.job import Job
from gpumon.why.metrics import count_verdict, read_counts
from gpumon.why.reason import Reasoner, nccl_settings
from gpumon.why.report import ADMIN_COMMENT_BYTES, admin_comment, to_json

T0 = 1_800_000_000.0
BOOT = "b0b0b0b0-0000-4000-8000-000000000001"


def _node(name: str, events: list[dict[str, Any]], *, boot_time: float = T0 - 86400) -> NodeEvidence:
    return NodeEvidence(name, f"http://{name}:9426", identity={"node": name, "boot_id": BOOT,
                                                                "boot_time": boot_time},
                        events=events, history_from=T0 - 7200)


def _judge(*nodes: NodeEvidence) -> dict[str, Any]:
    job = Job(tuple(n.node for n in nodes), T0, T0 + 600, "42", "FAILED", "1:0", "scontrol")
    verdict = Reasoner(job, list(nodes), None, nccl_settings({}, None), now=T0 + 700,
                       watchdog_s=60).judge()
    return to_json(verdict)


def _boot(t: float, boot_id: str = BOOT) -> dict[str, Any]:
    return {"id": 1, "time": t, "last_seen": t, "kind": "boot", "check": "", "component": "node",
            "boot_id": boot_id, "evidence": {}, "payload": {"previous": ""}}


def _finding(t: float, check: str, component: str, severity: str, action: str, message: str,
             **evidence: Any) -> dict[str, Any]:
    return {"id": 2, "time": t, "last_seen": t + 1, "kind": "finding", "check": check, "component": component,
            "boot_id": BOOT, "severity": severity, "action": action, "message": message, "evidence": evidence}


def test_a_daemon_started_during_the_job_is_not_a_reboot() -> None:
    """The daemon's first sight of a boot older than the job: context, not a tier-1 reboot."""
    doc = _judge(_node("n1", [_boot(T0 + 100)]))
    assert doc["verdict"] == "no_infrastructure_evidence", doc["suspects"]
    assert [i["what"] for i in doc["timeline"]] == ["daemon_start"]


def test_a_boot_during_the_job_is_a_reboot_but_not_a_drain() -> None:
    doc = _judge(_node("n1", [_boot(T0 + 100, "other-boot")], boot_time=T0 + 90))
    assert doc["verdict"] == "infrastructure"
    assert [s["what"] for s in doc["suspects"]] == ["reboot"]
    assert doc["culprits"] == []  # a reboot may be an operator's: never drained for


def test_culprits_are_tier1_hardware_one_per_node_with_gpumons_reason() -> None:
    doc = _judge(
        _node("n1", [_finding(T0 + 500, "xid", "gpu/3", "fail", "reboot_node",
                              "Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS on gpu/3", code=79)]),
        _node("n2", [_finding(T0 + 500, "pcie", "gpu/0", "fail", "inspect_hardware", "AER fatal")]))
    assert doc["verdict"] == "infrastructure"
    assert {s["node"] for s in doc["suspects"]} == {"n1", "n2"}
    # n2's is a tier-2 "may explain it": named, not drained
    assert doc["culprits"] == [{"node": "n1", "component": "gpu/3", "what": "xid", "action": "reboot_node",
                                "relative_s": -100.0, "in_onset_window": True, "drain_reason":
                                "gpumon: reboot_node: why job 42: gpu/3: Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS "
                                "on gpu/3"}]


def test_a_loss_an_nvml_check_saw_before_its_xid_was_read_is_named_by_the_xid() -> None:
    """GPU 3 falls off the bus: the thermal check's NVML call answered GPU_IS_LOST 2 s before the
    xid check read Xid 79 from the kernel log (a busy node). One fault, named by its Xid (the drain
    reason says Xid 79 whichever check saw it first), from when it was first seen."""
    def lost(t: float) -> dict[str, Any]:
        return _finding(t, "thermal", "gpu/3", "fail", "reboot_node",
                        "GPU lost (nvmlDeviceGetTemperature(gpu/3)): GPU is lost", gpu_lost=True)

    def xid(t: float) -> dict[str, Any]:
        return {**_finding(t, "xid", "gpu/3", "fail", "reboot_node",
                           "Xid 79 GPU_HAS_FALLEN_OFF_THE_BUS on gpu/3", code=79, gpu_lost=True), "id": 3}

    # the NVML check first, then the Xid; and the usual order, the Xid first
    for events in ([lost(T0 + 498), xid(T0 + 500)], [xid(T0 + 498), lost(T0 + 500)]):
        doc = _judge(_node("n1", events))
        assert [(s["what"], s["component"]) for s in doc["suspects"]] == [("xid", "gpu/3")], doc["suspects"]
        assert doc["suspects"][0]["relative_s"] == -102.0, doc["suspects"]
        [culprit] = doc["culprits"]
        assert culprit["drain_reason"].startswith("gpumon: reboot_node: why job 42: gpu/3: Xid 79"), culprit


def test_no_culprit_on_an_inconclusive_verdict_and_the_comment_says_who_did_not_answer() -> None:
    down = NodeEvidence("n2", "http://n2:9426", error="cannot connect: refused")
    doc = _judge(_node("n1", []), down)
    assert doc["verdict"] == "inconclusive" and doc["culprits"] == []
    assert doc["admin_comment"] == ("gpumon why: inconclusive (no suspect on the nodes that answered); "
                                    "unreachable: n2")


def test_the_admin_comment_is_one_bounded_line() -> None:
    events = [_finding(T0 + 10 * i, "xid", f"gpu/{i}", "fail", "reset_gpu", "Xid 48 é\n" + "x" * 300, code=48)
              for i in range(6)]
    job = Job(("n1",), T0, T0 + 600, "42", "FAILED", "1:0", "scontrol")
    v = Reasoner(job, [_node("n1", events)], None, nccl_settings({}, None), now=T0 + 700).judge()
    text = admin_comment(v)
    assert len(text.encode()) <= ADMIN_COMMENT_BYTES and "\n" not in text and text.endswith("...")
    assert text.startswith("gpumon why: infrastructure; #1 n1 gpu/")


def test_the_verdict_counter_is_a_valid_textfile_that_counts(tmp_path: Path) -> None:
    path = tmp_path / "textfile" / "gpumon_why.prom"
    count_verdict(path, "infrastructure")
    count_verdict(path, "infrastructure")
    counts = count_verdict(path, "inconclusive")
    assert counts == read_counts(path) == {"infrastructure": 2, "no_infrastructure_evidence": 0,
                                           "inconclusive": 1, "cannot_answer": 0}
    assert list(path.parent.glob("*.tmp")) == []
    assert [p.name for p in path.parent.glob("*.prom")] == [path.name]
    promtool = need_tool("promtool", "prometheus")  # a failure under CI, where .ci/run installs it
    proc = subprocess.run([promtool, "check", "metrics"], input=path.read_text(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path.write_text("garbage\n")  # not ours: a counter reset, not an error
    assert count_verdict(path, "cannot_answer")["cannot_answer"] == 1
    with pytest.raises(ValueError):
        count_verdict(path, "guess")


def test_an_event_in_the_second_slurm_floored_the_end_to_is_the_jobs() -> None:
    """Slurm says End=..:10 for a job that ended at ..:10.8: a GPU lost at ..:10.4 killed it."""
    xid = _finding(T0 + 600.4, "xid", "gpu/0", "fail", "reboot_node", "Xid 79 on gpu/0", code=79)
    for resolution, verdict in ((1.0, "infrastructure"), (0.0, "no_infrastructure_evidence")):
        job = Job(("n1",), T0, T0 + 600, "42", "FAILED", "1:0", "scontrol", resolution)
        v = Reasoner(job, [_node("n1", [xid])], None, nccl_settings({}, None), now=T0 + 700).judge()
        assert v.verdict == verdict, (resolution, v.suspects)


def test_an_outage_seen_open_and_then_closed_is_one_outage() -> None:
    """The open reading's estimated start and the closed record's differ by a sample: one suspect."""
    open_ = _finding(T0 + 108.6, "ib", "ib/mlx5_0/1", "fail", "check_cables", "down", ongoing_outage_s=7.9)
    closed = dict(_finding(T0 + 115, "ib", "ib/mlx5_0/1", "fail", "check_cables", "outage",
                           recent_outages=[{"start": T0 + 99.9, "end": T0 + 112.8, "down_s": 12.9}]), id=3)
    doc = _judge(_node("n1", [open_, closed]))
    outages = [i for i in doc["timeline"] if i["what"] == "ib_outage"]
    assert len(outages) == 1 and outages[0]["evidence"]["end"] == T0 + 112.8, outages


def _stuck(t: float, gpu: int, held: float = 70.0) -> dict[str, Any]:
    return {**_finding(t, "collective_hang", f"gpu/{gpu}", "warn", "none",
                       f"GPU {gpu} looks stuck in a collective: util 100 %, power 118 W, memory 0 %",
                       activity="stuck", since=t - held, held_s=held), "id": 100 + gpu}


def _watching(node: NodeEvidence, judging: frozenset[str] | None = frozenset({"collective_hang"})
              ) -> NodeEvidence:
    node.judging = judging
    return node


def test_the_node_the_hung_signature_is_missing_from_corroborates_its_suspect() -> None:
    """Two nodes' GPUs spin in a collective (the signature); the third, whose GPU fell off the bus,
    does not show it: its suspect says the job waited for it, and is ranked first."""
    waiting = [_watching(_node(f"n{i}", [_stuck(T0 + 480, g) for g in range(8)])) for i in (1, 2)]
    # a tier-1 suspect on n1 at the expected moment (one watchdog timeout before the end) ranks
    # above n3's earlier loss unless the signature says whom the job waited for
    waiting[0].events.append({**_finding(T0 + 540, "nvlink", "nvlink/0/3", "fail", "reset_gpu",
                                         "NVLink 3 of GPU 0 down"), "id": 99})
    lost = _watching(_node("n3", [_finding(T0 + 400, "xid", "gpu/3", "fail", "reboot_node",
                                           "Xid 79 on gpu/3", code=79)]))
    doc = _judge(*waiting, lost)
    top = doc["suspects"][0]
    assert (top["node"], top["what"]) == ("n3", "xid"), doc["suspects"]
    assert top["evidence"]["hang_signature"] == {"shown_on": ["n1", "n2"], "gpus": 16, "since": T0 + 410}
    assert "not on n3: the job's collectives waited for n3" in top["why"]
    assert [(x["node"], x["what"]) for x in doc["suspects"]] == [("n3", "xid"), ("n1", "nvlink_down")]
    # the signature itself is context on the timeline, never a suspect
    assert {i["what"] for i in doc["timeline"] if i["node"] in ("n1", "n2")} >= {"hang_signature"}
    assert all(s["what"] != "hang_signature" for s in doc["suspects"])


def test_a_node_missing_the_hung_signature_without_evidence_is_a_note_not_a_finding() -> None:
    """The late rank's node has no infrastructure event (a checkpoint write, a data loader): the
    verdict stays "no infrastructure evidence" and a note says where the job waited."""
    doc = _judge(_watching(_node("n1", [_stuck(T0 + 500, 0)])), _watching(_node("n2", [_stuck(T0 + 500, 1)])),
                 _watching(_node("n3", [])))
    assert doc["verdict"] == "no_infrastructure_evidence", doc["suspects"]
    [note] = [n for n in doc["notes"] if "hung-collective" in n]
    assert ("showed on n1, n2 (2 GPU(s), from -2.8 min), not on n3: the job's collectives waited for n3"
            in note)
    assert "no infrastructure event recorded on n3" in note


def test_no_node_is_named_when_every_node_or_an_unwatched_one_lacks_the_signature() -> None:
    # every node shows it: nothing says which rank the collective waited for
    doc = _judge(_watching(_node("n1", [_stuck(T0 + 500, 0)])), _watching(_node("n2", [_stuck(T0 + 500, 0)])))
    assert any("on every node: a collective no rank could complete" in n for n in doc["notes"])
    # ... but not when a node did not answer: the job may have waited for that one
    gone = NodeEvidence("n3", "http://n3:9426", error="cannot connect: refused")
    doc = _judge(_watching(_node("n1", [_stuck(T0 + 500, 0)])), _watching(_node("n2", [_stuck(T0 + 500, 0)])),
                 gone)
    assert any("on every node that answered: the job may have waited for n3, which did not" in n
               for n in doc["notes"]), doc["notes"]
    # a node whose check did not judge it (skipped, no NVML, an older daemon): not known, not named
    doc = _judge(_watching(_node("n1", [_stuck(T0 + 500, 0)])), _watching(_node("n2", []), None),
                 _watching(_node("n3", []), frozenset({"xid"})))
    notes = [n for n in doc["notes"] if "hung-collective" in n]
    assert notes == ["n2, n3: not known whether the hung-collective signature showed there (its "
                     "collective_hang check did not judge the node at the last reading)"], notes
    # a signature outside the job's run says nothing about it
    doc = _judge(_watching(_node("n1", [_stuck(T0 - 3000, 0)])), _watching(_node("n2", [])))
    assert not [n for n in doc["notes"] if "hung-collective" in n]
