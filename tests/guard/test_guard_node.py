"""The node side of gpumon.guard: rank -> GPU through NVML, and the ``guard`` check reading the spool.

NVML is the injection library of gpumon/sim under the real nvidia-ml-py (an 8-GPU HGX state): the
verdicts name GPUs by the UUIDs it serves, and the check resolves them against the node's inventory
as the daemon does. The health round trip goes through the real SQLite store, reopened as a
restarted daemon would.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from nvidia_smi_capture import run_check

from gpumon.guard import identity
from gpumon.guard import verdict as vf
from gpumon.health.keeper import Health
from gpumon.health.state import Level
from gpumon.model import NODE, Action, Finding, Severity
from gpumon.sdc.confirm import REPRODUCED, ConfirmQueue, Result
from gpumon.sim.nvml_state import NvmlNodeState
from gpumon_checks.guard import GuardCheck, GuardConfig

NODE_STATE = NvmlNodeState.hgx(8)
GPU5 = NODE_STATE.gpus[5]


def subject(uuid: str | None = GPU5.uuid, device: str = "cuda:1", rank: int = 7) -> vf.Identity:
    return vf.Identity(rank=rank, world_size=16, host="trn-a07", node_name="a07",
                       node_name_source="SLURMD_NODENAME", local_rank=1, device=device, gpu_uuid=uuid,
                       gpu_pci_bus_id="0000:bb:00.0" if uuid else None, gpu_index=5 if uuid else None,
                       gpu_note="resolved through NVML by UUID" if uuid else "device cpu: no GPU")


def put(spool: Path, fault: str = "unknown", who: vf.Identity | None = None, when: float | None = None,
        check: str = "weights") -> Path:
    who = who or subject()
    t = time.time() if when is None else when
    v = vf.Verdict(check=check, fault=fault, step=41, message=f"rank {who.rank}'s weights differ",
                   subject=who, evidence={"first_parameter": "layers.3.mlp.weight"}, job="slurm:991",
                   time=t, id=vf.new_id(who, t))
    return vf.write(v, spool)


def run(nvml_state: Path, tmp_path: Path, spool: Path, state: dict[str, Any], **cfg: Any) -> list[Finding]:
    return run_check(GuardCheck, NODE_STATE, nvml_state, tmp_path / "host",
                     options=GuardConfig(spool_dir=str(spool), **cfg), state=state,
                     state_dir=tmp_path / "state-dir")


def reproduced(tmp_path: Path, path: Path) -> None:
    """The node's confirmation of the verdict in ``path``, as the sdc_confirm check writes it when its
    canary reproduced it (that check's own runs: tests/guard/test_guard_confirm.py)."""
    v = vf.read(path)
    ConfirmQueue(tmp_path / "state-dir").answer(Result(
        v.id, REPRODUCED, "the node's SDC canary reproduced it: GPU 5 computed wrong bits", time.time(),
        {"canary": {"gpu": 5, "severity": "fail"}}))


def test_a_cuda_device_is_named_through_nvml_by_its_uuid(nvml_state: Path) -> None:
    # torch reports the UUID without NVML's "GPU-" prefix
    got = identity.resolve_gpu(GPU5.uuid.removeprefix("GPU-"))
    assert (got.uuid, got.pci_bus_id, got.index) == (GPU5.uuid, "0000:bb:00.0", 5)
    missing = identity.resolve_gpu("00000000-0000-0000-0000-000000000000")
    assert missing.index is None and "no GPU with it among NVML's" in missing.note
    assert identity.resolve_gpu(None).note == "the CUDA device reports no UUID"


def test_the_scheduler_node_name_comes_from_slurm_or_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.setenv("NODE_NAME", "k8s-node-3")  # the downward API's spec.nodeName
    assert identity.node_name() == ("k8s-node-3", "NODE_NAME")
    monkeypatch.setenv("SLURMD_NODENAME", "a07")
    assert identity.node_name() == ("a07", "SLURMD_NODENAME")


@pytest.mark.parametrize(("fault", "severity", "action"), [
    ("persistent", Severity.WARN, Action.CONFIRM_SDC),  # confirmed on the node before the RMA path
    ("transient", Severity.WARN, Action.NONE),
    ("unknown", Severity.WARN, Action.NONE)])
def test_a_verdict_becomes_a_finding_on_the_gpu_with_its_uuid(nvml_state: Path, tmp_path: Path, fault: str,
                                                              severity: Severity, action: Action) -> None:
    spool = tmp_path / "spool"
    path = put(spool, fault)
    (f,) = run(nvml_state, tmp_path, spool, {})
    assert (f.check, f.component, f.severity, f.action) == ("guard", "gpu/5", severity, action)
    assert f"GPU 5 ({GPU5.uuid})" in f.message and "job slurm:991" in f.message
    key = f"confirm:{path.stem}" if fault == "persistent" else path.stem
    assert f.evidence["fault_key"] == key and f.evidence["rank"] == 7
    assert f.evidence["node_name"] == "a07" and f.evidence["gpu_pci_bus_id"] == "0000:bb:00.0"


def test_a_cpu_verdict_or_an_unknown_uuid_goes_on_the_node_saying_why(nvml_state: Path,
                                                                      tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    put(spool, who=subject(uuid=None, device="cpu"))
    put(spool, who=subject(uuid="GPU-00000000-1111-2222-3333-444444444444", rank=3))
    found = sorted(run(nvml_state, tmp_path, spool, {}), key=lambda f: f.evidence["rank"])
    assert [f.component for f in found] == [NODE, NODE]
    assert "which is not one of this node's GPUs" in found[0].message
    assert "this node, not a GPU (device cpu: no GPU)" in found[1].message


def test_bad_and_future_files_are_named_kept_and_never_crash_the_check(nvml_state: Path,
                                                                      tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "garbage.json").write_text("{not json")
    future = json.loads(put(spool).read_text())
    future["version"] = vf.VERSION + 1
    newer = spool / "from-a-newer-guard.json"
    newer.write_text(json.dumps(future))
    (spool / "missing.json").write_text(json.dumps({"format": vf.FORMAT, "version": 1}))
    (spool / ".half-written.json.123.456.tmp").write_text("{")  # write_atomic's temp file: not yet
    state: dict[str, Any] = {}
    for _ in range(3):  # said every run, never moved, never lost
        (said,) = [f for f in run(nvml_state, tmp_path, spool, state) if f.component == NODE]
        assert said.severity is Severity.WARN and said.evidence["fault_key"] == "spool-not-verdicts"
        assert said.evidence["files_not_verdicts"] == 3
        bad = {Path(f["file"]).name: f for f in said.evidence["files"]}
        assert set(bad) == {"garbage.json", "from-a-newer-guard.json", "missing.json"}
        assert bad["garbage.json"]["error"].startswith("not JSON")
        assert "newer than this gpumon reads" in bad["from-a-newer-guard.json"]["error"]
        assert (bad["missing.json"]["error"] == "$: required properties missing: id, time, check, fault, "
                "step, message, subject (schema verdict-v1.schema.json, /required)")
        assert bad["missing.json"]["schema_error_path"] == "$"
        assert said.evidence["reasons"] == {"not JSON": 1, "of a newer version": 1,
                                            "refused by the schema": 1}
        assert said.message.startswith(f"3 files in the guard spool {spool} are not guard verdicts")
        assert all(name in said.message for name in bad)
    assert sorted(p.name for p in spool.glob("*.json")) == sorted(
        ["garbage.json", "from-a-newer-guard.json", "missing.json", *[p.name for p in spool.glob("2*.json")]])


def test_a_file_the_schema_refuses_is_named_with_its_path_and_the_valid_ones_are_judged_as_ever(
        nvml_state: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    good = put(spool, "transient")
    data = json.loads(good.read_text())
    data["subject"]["rank"] = "seven"  # JSON, the right format and version, not what the schema allows
    bad = spool / "hand-written.json"
    bad.write_text(json.dumps(data))
    state: dict[str, Any] = {}
    for n in range(3):
        found = run(nvml_state, tmp_path, spool, state)
        (refused,) = [f for f in found if f.evidence.get("file") == str(bad)]
        assert refused.component == NODE and refused.severity is Severity.WARN
        assert refused.message == (
            f"guard spool file {bad}: not a guard verdict this gpumon reads: $.subject.rank: 'seven' is not "
            "of type 'integer' (schema verdict-v1.schema.json, /properties/subject/properties/rank/type); "
            "left in place (remove or fix it; it is read again every run)")
        assert refused.evidence["schema_error_path"] == "$.subject.rank"
        assert refused.evidence["schema_rule"] == "/properties/subject/properties/rank/type"
        assert refused.evidence["schema"] == vf.SCHEMA_ID
        # one warning for every file that is not a verdict, however many: a flood is one fault
        assert refused.evidence["fault_key"] == "spool-not-verdicts"
        assert bad.exists()  # never moved to judged/, never lost
        # the valid verdict beside it: reported, then judged once (moved by this process's second run)
        assert good.exists() == (n == 0) and (spool / "judged" / good.name).exists() == (n > 0)
        assert any(f.component == "gpu/5" for f in found)


def test_a_schema_the_install_lacks_is_said_once_and_the_spool_left_alone(
        nvml_state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = tmp_path / "spool"
    path = put(spool, "persistent")
    vf.validator.cache_clear()
    vf._schema_text.cache_clear()
    monkeypatch.setattr(vf, "SCHEMA_FILE", "verdict-v0.schema.json")
    try:
        state: dict[str, Any] = {}
        for _ in range(2):
            (f,) = run(nvml_state, tmp_path, spool, state)
            assert (f.component, f.severity) == (NODE, Severity.UNKNOWN)
            assert ("cannot load the guard verdict schema (gpumon.guard.schema/verdict-v0.schema.json)"
                    in f.message)
        assert path.exists() and not (spool / "judged").exists()
    finally:
        vf.validator.cache_clear()
        vf._schema_text.cache_clear()


def test_a_verdict_is_judged_once_kept_through_a_restart_and_stays_in_health(
        nvml_state: Path, tmp_path: Path) -> None:
    spool, db = tmp_path / "spool", tmp_path / "state"
    path = put(spool, "persistent")
    reproduced(tmp_path, path)
    health = Health.open(db, boot_id="boot-1")
    state: dict[str, Any] = {}

    def once(h: Health, st: dict[str, Any]) -> list[Finding]:
        found = run(nvml_state, tmp_path, spool, st)
        h.record_findings("guard", found, complete=True)
        return found

    first = once(health, state)
    assert [f.component for f in first] == ["gpu/5"] and path.exists()
    # a daemon that dies after saving the check's state, before its next run: the restarted one
    # (a new process, its own token) reports the verdict again rather than moving it unseen
    health.close()
    health = Health.open(db, boot_id="boot-1")
    state = {"reported": {path.name: "an-earlier-daemon-process"}}
    again = once(health, state)
    assert [f.component for f in again] == ["gpu/5"] and path.exists()
    # the next run of this process moves it to judged/ (reported earlier by this very process)
    moved = once(health, state)
    assert not path.exists() and (spool / "judged" / path.name).exists()
    assert moved == [] or all(f.severity is Severity.OK for f in moved)
    raised = [e for e in health.store.events() if e.kind.value == "finding" and e.component == "gpu/5"]
    assert len(raised) == 1  # judged once: the repeats were the same fault, not new ones
    # persistent: the fault stays (fail, inspect_hardware) though no longer reported, across a restart
    health.close()
    health = Health.open(db, boot_id="boot-1")
    once(health, state)
    gpu5 = health.view().components["gpu/5"]
    assert (gpu5.level, gpu5.action) == (Level.UNHEALTHY, Action.INSPECT_HARDWARE)
    health.close()


def test_a_warning_holds_for_its_window_then_resolves(nvml_state: Path, tmp_path: Path) -> None:
    spool, db = tmp_path / "spool", tmp_path / "state"
    fresh = put(spool, "transient")
    old = put(spool, "unknown", who=subject(rank=9), when=time.time() - 7200)
    health = Health.open(db, boot_id="boot-1")
    state: dict[str, Any] = {}
    for _ in range(3):  # reported, then judged and still held
        found = run(nvml_state, tmp_path, spool, state, warn_hold_s=3600)
        health.record_findings("guard", found, complete=True)
    assert not fresh.exists() and (spool / "judged" / fresh.name).exists()
    assert not old.exists()  # past its hold: judged and no longer reported
    assert [f.evidence["fault_key"] for f in found] == [fresh.stem]
    assert health.view().components["gpu/5"].level is Level.DEGRADED
    # the hold ends: the warning's condition is gone, like any warning
    os.utime(spool / "judged" / fresh.name)
    found = run(nvml_state, tmp_path, spool, state, warn_hold_s=0)
    health.record_findings("guard", found, complete=True)
    assert health.view().components["gpu/5"].level is Level.HEALTHY
    health.close()


def test_the_guard_findings_reach_metrics_like_any_checks(nvml_state: Path, tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpumon.export.prometheus import Snapshot, SnapshotHolder, make_registry
    from gpumon.model import CheckRun

    spool = tmp_path / "spool"
    reproduced(tmp_path, put(spool, "persistent"))
    found = run(nvml_state, tmp_path, spool, {})
    runs = {"guard": CheckRun("guard", found, 1000.0, 0.01, "completed")}
    snap = Snapshot("a07", "h100-sxm", "0.1.0", runs, {"gpu/5": ("unhealthy", "inspect_hardware")})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(generate_latest(
                   make_registry(SnapshotHolder(snap))).decode()) for s in fam.samples}
    assert samples[("gpumon_finding_severity", (("check", "guard"), ("component", "gpu/5")))] == 4
    assert samples[("gpumon_check_outcome", (("check", "guard"), ("outcome", "completed")))] == 1


def test_an_application_verdict_fails_no_gpu_and_leaves_its_other_faults(nvml_state: Path,
                                                                         tmp_path: Path) -> None:
    """The rerun reproduced the result on another node's GPU: the data or the program. An ok on
    ``node`` that says so; the same GPU's persistent fault from another verdict stays."""
    spool, db = tmp_path / "spool", tmp_path / "state"
    health = Health.open(db, boot_id="boot-1")
    state: dict[str, Any] = {}
    reproduced(tmp_path, put(spool, "persistent", check="audit"))
    health.record_findings("guard", run(nvml_state, tmp_path, spool, state), complete=True)
    app = put(spool, "application", check="nonfinite_grad", when=time.time() + 1)
    for _ in range(3):  # reported, judged, then no longer held: never a fault
        found = run(nvml_state, tmp_path, spool, state)
        health.record_findings("guard", found, complete=True)
        mine = [f for f in found if f.evidence.get("verdict_file", "").endswith(app.name)]
        assert all((f.component, f.severity) == (NODE, Severity.OK) for f in mine)
        if mine:
            assert "application: not a hardware fault, no GPU held responsible" in mine[0].message
    assert not app.exists() and (spool / "judged" / app.name).exists()
    view = health.view().components
    assert (view["gpu/5"].level, view["gpu/5"].action) == (Level.UNHEALTHY, Action.INSPECT_HARDWARE)
    assert NODE not in view or view[NODE].level is Level.HEALTHY
    health.close()


def test_a_straggler_verdict_is_a_warning_on_its_gpu_with_the_nodes_own_signals(
        nvml_state: Path, tmp_path: Path) -> None:
    """The job says GPU 5 is slow; the node says why it may be: HW slowdown on, PCIe trained x8."""
    import dataclasses

    from gpumon.hw.nvml import CLOCK_EVENT_REASONS

    node = NvmlNodeState.hgx(8)
    node.gpus[5] = dataclasses.replace(node.gpus[5], clocks_event_reasons=CLOCK_EVENT_REASONS["hw_slowdown"],
                                       pcie_width_current=8)
    spool = tmp_path / "spool"
    put(spool, check="straggler")
    findings = run_check(GuardCheck, node, nvml_state, tmp_path / "host",
                         options=GuardConfig(spool_dir=str(spool)), state={})
    (f,) = [f for f in findings if f.component == "gpu/5"]
    assert (f.severity, f.action) == (Severity.WARN, Action.NONE)
    assert f.message.startswith("in-job straggler (job slurm:991) on GPU 5")
    signals = f.evidence["node_signals"]
    assert signals["clock_event_reasons"] == ["hw_slowdown"]
    assert signals["pcie_link"]["width"] == 8 and signals["pcie_link"]["degraded"] is True
    assert signals["nvlink_up"].endswith(f"/{signals['nvlink_up'].split('/')[1]}")
    # a healthy GPU's signals say nothing is wrong
    put(spool, check="straggler", who=subject(uuid=NODE_STATE.gpus[2].uuid))
    findings = run(nvml_state, tmp_path, spool, {})
    (g,) = [f for f in findings if f.component == "gpu/2"]
    assert g.evidence["node_signals"]["clock_event_reasons"] == []
    assert g.evidence["node_signals"]["pcie_link"]["degraded"] is False


def test_fresh_pace_files_are_exported_per_gpu_and_the_slowest(nvml_state: Path, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    now = time.time()
    g = NODE_STATE.gpus
    vf.write_pace(spool, job="slurm:991", host="a07", step=99, when=now, rows=[
        vf.PaceRow(0, g[0].uuid, 1.01, 1.0, False), vf.PaceRow(1, g[3].uuid, 0.42, 0.41, True)])
    # an old job's file: not exported; a foreign GPU: not this node's
    vf.write_pace(spool, job="slurm:5", host="a07", step=9, when=now - 3600,
                  rows=[vf.PaceRow(0, g[6].uuid, 0.1, 0.1, True)])
    vf.write_pace(spool, job="slurm:6", host="b01", step=9, when=now,
                  rows=[vf.PaceRow(0, "GPU-00000000-0000-0000-0000-000000000000", 0.2, 0.2, True)])
    findings = run(nvml_state, tmp_path, spool, {})
    (n,) = [f for f in findings if f.component == NODE]
    got = {(r[0], r[2].get("gpu")): r[1] for r in n.evidence["readings"]}
    assert got == {("guard_pace_score", "0"): 1.01, ("guard_pace_score", "3"): 0.42,
                   ("guard_pace_slowest_score", None): 0.42}
    # a malformed pace file is skipped, never a crash
    (spool / vf.PACE_DIR / "bad.json").write_text("{not json")
    assert any(f.component == NODE for f in run(nvml_state, tmp_path, spool, {}))


def _owned_by_nobody(path: Path, forged_attestation: bool = False) -> int:
    import pwd

    if forged_attestation:
        data = json.loads(path.read_text())
        data["attestation"] = {"attested": True, "why": "trust me"}
        path.write_text(json.dumps(data))
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    return nobody.pw_uid


@pytest.mark.parametrize("forged", [False, True])
def test_a_persistent_verdict_in_a_file_of_another_user_is_a_warning_that_says_it_is_not_attested(
        nvml_state: Path, tmp_path: Path, forged: bool) -> None:
    """Anyone can write the spool: a file of nobody's claiming a persistent fault on GPU 5 is not
    hardware evidence (before: fail / inspect_hardware, the RMA path), whatever it says of itself."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the file is given to another user")
    spool = tmp_path / "spool"
    uid = _owned_by_nobody(put(spool, "persistent"), forged)
    (f,) = run(nvml_state, tmp_path, spool, {})
    assert (f.component, f.severity, f.action) == ("gpu/5", Severity.WARN, Action.NONE)
    assert f.message.startswith("NOT ATTESTED in-job SDC verdict weights (job slurm:991, claims persistent")
    att = f.evidence["verdict_evidence"]["attestation"]
    assert (att["attested"], att["writer_uid"], att["writer_user"], att["claimed_fault"]) == (
        False, uid, "nobody", "persistent")
    assert f"owned by uid {uid} (nobody)" in att["why"]
    assert ("its own 'attestation' member is ignored" in att["why"]) is forged


def test_a_persistent_verdict_in_a_file_of_roots_fails_its_gpu_once_confirmed(nvml_state: Path,
                                                                                 tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the file must be root's")
    spool = tmp_path / "spool"
    reproduced(tmp_path, put(spool, "persistent"))
    (f,) = run(nvml_state, tmp_path, spool, {})
    assert (f.severity, f.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.evidence["verdict_evidence"]["attestation"] == {
        "attested": True, "why": "the spool file is owned by uid 0 (root)"}
