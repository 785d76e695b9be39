"""A persistent in-job verdict is confirmed on the node before the RMA path (checks/guard/confirming.py,
checks/sdc_canary/confirm.py, gpumon/sdc/confirm.py).

End to end on a real ``gpumon daemon`` of a simulated node whose GPU 3 computes wrong fp32 bits (the
scenario's ``sdc`` fault, which the canary's CPU stand-in for GPU 3 computes again) and whose GPU 2
runs a job (a compute process in NVML's list): the daemon's own guard and sdc_confirm checks, its own
canaries, its health state. Without a confirmation the verdict is a warning that names the commands.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nvidia_smi_capture import run_check

from conftest import clean_env
from gpumon.guard import verdict as vf
from gpumon.model import Action, Finding, Severity
from gpumon.sdc.confirm import ConfirmQueue
from gpumon.sim.nvml_state import NvmlNodeState, read_state
from gpumon_checks.guard import GuardCheck, GuardConfig

DEADLINE_S = 240.0  # a canary round on CPU stand-ins of a busy 2-core machine, with room


def verdict(uuid: str, check: str = "audit", bundle: str | None = None) -> vf.Verdict:
    who = vf.Identity(rank=1, world_size=4, host="sim-node", node_name="sim-node",
                      node_name_source="NODE_NAME", local_rank=1, device="cuda:1", gpu_uuid=uuid,
                      gpu_note="resolved through NVML by UUID")
    t = time.time()
    evidence: dict[str, Any] = {"rerun": "differs"}
    if bundle:
        evidence["bundle"] = bundle
    return vf.Verdict(check=check, fault="persistent", step=12, message="the audit's recomputation differs",
                      subject=who, evidence=evidence, job="slurm:7", time=t, id=vf.new_id(who, t))


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    base: Path
    spool: Path
    state: Path
    uuids: list[str]
    log: Path

    def report(self) -> dict[tuple[str, str, str], dict[str, Any]]:
        """(check, component, fault key) -> finding of the daemon's latest report.json."""
        try:
            data = json.loads((self.state / "report.json").read_text())
        except (OSError, ValueError):
            return {}
        return {(f["check"], f["component"], str(f["evidence"].get("fault_key", ""))): f
                for f in data["findings"]}

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state / "report.json").read_text())["health"]
        return data

    def wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, (f"{what}: not within {DEADLINE_S} s\n"
                                                 + self.log.read_text()[-4000:])
            time.sleep(0.3)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    base = tmp_path_factory.mktemp("confirm")
    scenario = base / "confirm-4xh100.yaml"
    scenario.write_text("name: confirm-4xh100\nsku: h100-sxm\ngpus: 4\nfaults:\n"
                        "  - {kind: sdc, gpu: 3, dtype: float32, rate: 1.0}\n"
                        "  - {at_s: 0, kind: compute_process, gpu: 2, pid: 1}\n")
    cfg = base / "gpumon.yaml"
    # one quick workload; the canary round compares GPUs 0, 1 and 3 (GPU 2 is busy), a majority of three
    cfg.write_text("checks:\n  guard:\n    interval_s: 1\n  sdc_canary:\n    enabled: false\n"
                   "  sdc_confirm:\n    interval_s: 1\n    iterations: 1\n    workloads: [gemm_fp32]\n")
    log = base / "daemon.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", "--config", str(cfg), "daemon", "--simulate",
                                 str(scenario), "--sim-dir", str(base / "sim"), "--listen", "127.0.0.1:0",
                                 "--duration", "900"], stdout=subprocess.DEVNULL, stderr=err, env=clean_env())
    try:
        n = Node(proc, base, base / "sim" / "host" / "var/lib/gpumon/guard", base / "sim" / "state", [], log)
        n.wait("the daemon's first report", lambda: bool(n.report()))
        n.uuids = [g.uuid for g in read_state(base / "sim" / "nvml-state.txt").gpus]
        yield n
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_verdict_the_canary_does_not_reproduce_is_a_warning_and_the_node_serves_again(node: Node) -> None:
    v = verdict(node.uuids[1])
    vf.write(v, node.spool)  # root's file: attested (an operator's tool, or the intake's)
    pending = ("guard", "gpu/1", f"confirm:{v.id}")
    # it may be judged before a report is read: the health state's history says it was there
    node.wait("the verdict judged",
              lambda: pending in node.report() or ("guard", "gpu/1", v.id) in node.report())
    node.wait("the confirmation", lambda: ("guard", "gpu/1", v.id) in node.report())
    f = node.report()[("guard", "gpu/1", v.id)]
    assert (f["severity"], f["action"]) == ("warn", "none"), f
    assert "NOT reproduced on this node" in f["message"] and "the node serves again" in f["message"]
    said = f["evidence"]["verdict_evidence"]["confirmation"]
    assert said["state"] == "not_reproduced" and said["claimed_fault"] == "persistent"
    assert said["canary"]["severity"] == "ok" and 1 in said["canary"]["gpus_judged"]
    assert pending not in node.report()
    # GPU 1 asks nothing any more (GPU 3 does: the canary round compared it too, and it computes wrong)
    node.wait("GPU 1's action back to none", lambda: node.health()["components"]["gpu/1"]["action"] == "none")
    events = _events(node, "gpu/1")
    actions = [e["action"] for e in events if "action" in e and e.get("key") in (v.id, f"confirm:{v.id}")]
    assert actions[0] == "confirm_sdc", events  # out of service while it was confirmed
    assert "warn" in [e["severity"] for e in events if e.get("key") == v.id]


def test_a_verdict_the_canary_reproduces_fails_its_gpu_with_the_confirmation_as_evidence(node: Node) -> None:
    v = verdict(node.uuids[3], bundle=str(node.spool / "bundles" / "x"))
    vf.write(v, node.spool)
    # a confirmed persistent verdict is reported by one guard run (its fault then stays in the health
    # state): read from health.db, not report.json, which the next run rewrites within a second
    node.wait("the confirmation", lambda: _finding(node, "gpu/3", v.id) is not None)
    f = _finding(node, "gpu/3", v.id)
    assert f is not None
    assert (f["severity"], f["action"]) == ("fail", "inspect_hardware"), f
    assert ("CONFIRMED on this node: the node's SDC canary reproduced it: GPU 3 computed wrong bits"
            in f["message"])
    said = f["evidence"]["verdict_evidence"]["confirmation"]
    assert said["state"] == "reproduced" and said["canary"]["severity"] == "fail"
    # the job's kept step is not replayed by the daemon (it would run the job's code): the command is said
    assert said["replay"]["run"] is False
    assert said["replay"]["command"].endswith("--as-owner " + v.evidence["bundle"])
    # the canary's own finding, as sdc_canary words it, held by the health state
    own = [e for e in _events(node, "gpu/3", "sdc_confirm") if "severity" in e]
    assert own and {(e["severity"], e["action"]) for e in own} == {("fail", "inspect_hardware")}, own
    node.wait("GPU 3 unhealthy", lambda: node.health()["components"]["gpu/3"]["action"] == "inspect_hardware")


def test_a_verdict_on_a_busy_gpu_waits_for_it_with_the_node_out(node: Node) -> None:
    v = verdict(node.uuids[2])
    vf.write(v, node.spool)
    key = ("guard", "gpu/2", f"confirm:{v.id}")
    queue = ConfirmQueue(node.state)

    def waiting() -> bool:
        status = queue.status(v.id)
        return key in node.report() and status is not None and "busy" in str(status.get("waiting"))

    node.wait("the confirmation waiting for GPU 2", waiting)
    f = node.report()[key]
    assert (f["severity"], f["action"]) == ("warn", "confirm_sdc"), f
    assert "confirming an in-job SDC verdict on this node before the RMA path" in f["message"]
    # the confirmer's own word on GPU 2 (report.json leaves skipped findings out; the log has it)
    said = "sdc_confirm gpu/2: new -> skipped: GPU 2 busy: 1 compute process(es): pids 1"
    assert said in node.log.read_text()
    assert "confirmed once it is free" in str((queue.status(v.id) or {}).get("waiting"))
    assert queue.result(v.id) is None


def _finding(node: Node, component: str, key: str) -> dict[str, Any] | None:
    """The guard's finding event on ``component`` for fault ``key`` (a verdict id) in health.db."""
    for e in _events(node, component):
        if "severity" in e and e.get("key") == key:
            return e
    return None


def _events(node: Node, component: str, check: str = "guard") -> list[dict[str, Any]]:
    """A check's events on ``component`` in the daemon's health.db, oldest first."""
    with sqlite3.connect(node.state / "health.db") as db:
        rows = db.execute("SELECT payload FROM events WHERE check_name = ? AND component = ? "
                          "ORDER BY id", (check, component)).fetchall()
    return [json.loads(p) for (p,) in rows]


# -- without a confirmer: a warning that names the commands -------------------------------------------

NODE_STATE = NvmlNodeState.hgx(8)


def _run(nvml_state: Path, tmp_path: Path, spool: Path, state: dict[str, Any], **cfg: Any) -> list[Finding]:
    return run_check(GuardCheck, NODE_STATE, nvml_state, tmp_path / "host",
                     options=GuardConfig(spool_dir=str(spool), **cfg), state=state,
                     state_dir=tmp_path / "state-dir")


@pytest.mark.parametrize("why", ["confirm off", "nobody confirms"])
def test_a_verdict_nobody_confirms_is_a_warning_that_names_the_commands(nvml_state: Path, tmp_path: Path,
                                                                        why: str) -> None:
    spool = tmp_path / "spool"
    bundle = str(tmp_path / "bundles" / "b1")
    v = verdict(NODE_STATE.gpus[5].uuid, bundle=bundle)
    vf.write(v, spool)
    state: dict[str, Any] = {}
    if why == "confirm off":
        (f,) = _run(nvml_state, tmp_path, spool, state, confirm=False)
        assert "checks.guard.confirm is off" in f.message
    else:
        (f,) = _run(nvml_state, tmp_path, spool, state, confirm_wait_s=1)
        assert (f.severity, f.action) == (Severity.WARN, Action.CONFIRM_SDC)  # asked, out of service
        assert ConfirmQueue(tmp_path / "state-dir").request(v.id) is not None
        # nothing noted the request: no sdc_confirm at work on this node
        time.sleep(1.1)
        (f,) = _run(nvml_state, tmp_path, spool, state, confirm_wait_s=1)
        assert "is the sdc_confirm check enabled on this node?" in f.message
    assert (f.component, f.severity, f.action) == ("gpu/5", Severity.WARN, Action.NONE)
    assert f.evidence["fault_key"] == v.id
    assert "could not be confirmed on this node" in f.message
    assert f"`gpumon canary run --iterations 3`; `gpumon canary replay --as-owner {bundle}`" in f.message
