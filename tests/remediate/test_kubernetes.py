"""The Kubernetes backend, driven by the policy, with the real official client against a loopback API stub.

No apiserver can run here. ``ApiStub`` (on tests/kube_stub.py's loopback
server) serves the node endpoints gpumon uses (GET a node, GET the
node list with ``limit``/``continue``/``labelSelector``, PATCH a node and its
``/status``), records every request, and applies each strategic merge patch
to an in-memory node so that the next read sees it. **These tests check the
wire format** — which requests the real ``kubernetes`` client sends, to which
path, with which content type and exactly which body — **not apiserver
semantics**: the stub knows only the parts of strategic merge that gpumon's
patches use (maps merged, ``null`` deletes a key, lists replaced except
``status.conditions``, merged by ``type``) and the ``resourceVersion``
precondition. Admission, validation, defaulting and the kubelet's own status
writes are out of its reach.

The deployment manifests are checked here too, by parsing them.
"""

from __future__ import annotations

import copy
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_stub import ApiStub as LoopbackApi
from kube_stub import Request, api_client, status_body
from kubernetes import client

from gpumon.health import Health, Level
from gpumon.model import Action, Finding, Severity
from gpumon.remediate.base import Mode
from gpumon.remediate.kubernetes import (
    ANN_ACTION,
    ANN_CORDONED,
    ANN_REASON,
    ANN_SINCE,
    KubernetesBackend,
    KubernetesError,
    condition_reason,
    parse_rfc3339,
    rfc3339,
)
from gpumon.remediate.policy import Decision, PolicyResult, RemediationPolicy

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
NODE = "gpu-node-1"
NOW = 1_800_000_000.0
NOW_TEXT = "2027-01-15T08:00:00Z"  # rfc3339(NOW)
SMP = "application/strategic-merge-patch+json"
XID79 = "Xid 79 fallen off the bus on gpu/3"
REASON79 = f"gpumon: reboot_node: {XID79} (xid, gpu/3)"


# -- the API stub -----------------------------------------------------------------------------


def make_node(name: str, *, unschedulable: bool = False, taints: list[dict[str, Any]] | None = None,
              annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
              rv: str = "1") -> dict[str, Any]:
    spec: dict[str, Any] = {"podCIDR": "10.0.1.0/24"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": rv,
                     "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true",
                                **(labels or {})},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(annotations or {})}},
        "spec": spec,
        "status": {"conditions": [
            {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
             "message": "kubelet has sufficient memory available",
             "lastHeartbeatTime": "2027-01-15T07:59:00Z", "lastTransitionTime": "2027-01-01T00:00:00Z"},
            {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "kubelet is posting ready status",
             "lastHeartbeatTime": "2027-01-15T07:59:00Z", "lastTransitionTime": "2027-01-01T00:00:00Z"}]},
    }


def _merge(target: dict[str, Any], patch: dict[str, Any], path: str = "") -> None:
    """The subset of strategic merge that gpumon's patches use (see the module docstring)."""
    for key, value in patch.items():
        here = f"{path}.{key}" if path else key
        if value is None:
            target.pop(key, None)
        elif here == "status.conditions":
            conditions = target.setdefault(key, [])
            for entry in value:
                old = next((c for c in conditions if c["type"] == entry["type"]), None)
                if old is None:
                    conditions.append(dict(entry))
                else:
                    old.update(entry)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value, here)
        else:
            target[key] = copy.deepcopy(value)


class ApiStub(LoopbackApi):
    """See the module docstring: wire format, not apiserver semantics."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.conflict_next_patch = False  # someone else changes the node just before the next PATCH
        super().__init__()

    # -- what the tests look at --

    def node(self, name: str = NODE) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.nodes[name])

    def patches(self) -> list[Request]:
        return [r for r in self.requests if r.method == "PATCH"]

    # -- serving --

    def _answer(self, method: str, path: str, query: dict[str, str], ctype: str | None,
                body: Any) -> tuple[int, dict[str, Any]]:
        segments = path.strip("/").split("/")
        if segments[:3] != ["api", "v1", "nodes"]:
            return 404, status_body(404, "NotFound", f"no route {path}")
        if method == "GET" and len(segments) == 3:
            return 200, self._list(query)
        name = segments[3] if len(segments) > 3 else ""
        node = self.nodes.get(name)
        if node is None:
            return 404, status_body(404, "NotFound", f'nodes "{name}" not found')
        subresource = segments[4] if len(segments) > 4 else ""
        if method == "GET" and not subresource:
            return 200, node
        if method != "PATCH" or subresource not in ("", "status"):
            return 405, status_body(405, "MethodNotAllowed", f"{method} {path}")
        if ctype != SMP:
            return 415, status_body(415, "UnsupportedMediaType", f"stub takes only {SMP}, got {ctype}")
        if self.conflict_next_patch:
            self.conflict_next_patch = False
            node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if wanted_rv is not None and wanted_rv != node["metadata"]["resourceVersion"]:
            return 409, status_body(409, "Conflict", "the object has been modified; please apply your "
                                                 "changes to the latest version and try again")
        # the main resource ignores status, the status subresource everything else
        body = copy.deepcopy(body)  # the recorded request stays as sent
        part = {"status": body["status"]} if subresource == "status" else {
            k: v for k, v in body.items() if k != "status"}
        part.get("metadata", {}).pop("resourceVersion", None)
        _merge(node, part)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        return 200, node

    def _list(self, query: dict[str, str]) -> dict[str, Any]:
        items = list(self.nodes.values())
        selector = query.get("labelSelector")
        if selector:
            key, _, value = selector.partition("=")
            items = [n for n in items if n["metadata"]["labels"].get(key) == value]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        page = items[start:start + limit]
        meta: dict[str, Any] = {"resourceVersion": "99"}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return {"apiVersion": "v1", "kind": "NodeList", "metadata": meta, "items": page}


# -- fixtures ---------------------------------------------------------------------------------


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


class World:
    """The stub, the real client on it, the real ``Health`` on a tmp state dir, and the policy."""

    def __init__(self, stub: ApiStub, api: client.ApiClient, state_dir: Path, clock: Clock) -> None:
        self.stub = stub
        self.api = api
        self.state_dir = state_dir
        self.clock = clock
        self.health = Health.open(state_dir, boot_id="boot-1", clock=clock)
        self.backend = KubernetesBackend(NODE, api, clock=clock, request_timeout_s=5)
        self.mode = Mode.ENFORCE

    def policy(self, mode: Mode = Mode.ENFORCE, **kwargs: Any) -> RemediationPolicy:
        return RemediationPolicy(self.backend, self.health, mode=mode, clock=self.clock, **kwargs)

    def record(self, check: str, *findings: Finding) -> None:
        self.health.record_findings(check, list(findings), complete=True)

    def reboot_and_retest(self) -> None:
        """The node rebooted (a new boot id: the daemon starts again) and the xid check is clean."""
        self.health.close()
        self.clock.t += 600
        self.health = Health.open(self.state_dir, boot_id="boot-2", clock=self.clock)
        self.record("xid", ok("xid", "gpu/3"))


def ok(check: str, component: str) -> Finding:
    return Finding(check, component, Severity.OK, "ok")


def xid79() -> Finding:
    return Finding("xid", "gpu/3", Severity.FAIL, XID79, Action.REBOOT_NODE, {"code": 79})


@pytest.fixture
def world(tmp_path: Path, clock: Clock) -> Iterator[World]:
    stub = ApiStub([make_node(NODE)])
    with api_client(stub.url) as api:
        w = World(stub, api, tmp_path / "state", clock)
        yield w
        w.health.close()
    stub.close()


def patch_bodies(stub: ApiStub) -> list[tuple[str, str, dict[str, str], str | None, Any]]:
    return [(r.method, r.path, r.query, r.content_type, r.body) for r in stub.patches()]


# -- take out, bring back ---------------------------------------------------------------------


def take_out_patches(rv: str, *, cordon: bool) -> list[tuple[str, str, dict[str, str], str | None, Any]]:
    annotations = {ANN_SINCE: NOW_TEXT, ANN_ACTION: "reboot_node", ANN_REASON: REASON79}
    spec: dict[str, Any] = {}
    if cordon:
        annotations[ANN_CORDONED] = "true"
        spec["unschedulable"] = True
    spec["taints"] = [{"key": "gpumon.io/unhealthy", "value": "reboot_node", "effect": "NoSchedule"}]
    return [
        ("PATCH", f"/api/v1/nodes/{NODE}", {"fieldManager": "gpumon"}, SMP,
         {"metadata": {"resourceVersion": rv, "annotations": annotations}, "spec": spec}),
        ("PATCH", f"/api/v1/nodes/{NODE}/status", {"fieldManager": "gpumon"}, SMP,
         {"status": {"conditions": [{"type": "GpuHealthy", "status": "False", "reason": "GpumonRebootNode",
                                     "message": REASON79, "lastHeartbeatTime": NOW_TEXT,
                                     "lastTransitionTime": NOW_TEXT}]}}),
    ]


def test_unhealthy_node_is_cordoned_tainted_conditioned_and_annotated(world: World) -> None:
    world.record("xid", xid79())
    policy = world.policy()

    result = policy.step()

    assert result.decision is Decision.TAKE_OUT and result.error is None and result.changed
    assert result.share is not None and (result.share.taken_out_recently, result.share.total) == (0, 1)
    assert world.stub.calls() == [
        ("GET", f"/api/v1/nodes/{NODE}"),  # current()
        ("GET", "/api/v1/nodes"),  # the circuit breaker
        ("GET", f"/api/v1/nodes/{NODE}"),  # take_out() reads what it changes
        ("PATCH", f"/api/v1/nodes/{NODE}"),
        ("PATCH", f"/api/v1/nodes/{NODE}/status"),
    ]
    assert world.stub.requests[1].query == {"limit": "500"}
    assert patch_bodies(world.stub) == take_out_patches("1", cordon=True)
    node = world.stub.node()
    assert node["spec"]["unschedulable"] is True
    assert node["status"]["conditions"][0]["type"] == "MemoryPressure"  # the kubelet's are kept
    assert [c["type"] for c in node["status"]["conditions"]] == ["MemoryPressure", "Ready", "GpuHealthy"]
    assert node["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"] == "0"
    q = world.health.view().node.quarantine
    assert q is not None and (q.by, q.action, q.reason) == ("gpumon", Action.REBOOT_NODE,
                                                            f"{XID79} (xid, gpu/3)")
    assert world.health.view().node.level is Level.QUARANTINED

    world.stub.reset()
    again = policy.step()
    assert again.decision is Decision.KEEP_OUT
    assert world.stub.calls() == [("GET", f"/api/v1/nodes/{NODE}")]  # once: no second cordon


def test_retest_passed_lifts_every_mark_and_uncordons(world: World) -> None:
    world.record("xid", xid79())
    assert world.policy().step().decision is Decision.TAKE_OUT
    # still unhealthy after the reboot alone: a reboot_node fault waits for the retest
    world.health.close()
    world.health = Health.open(world.state_dir, boot_id="boot-2", clock=world.clock)
    world.stub.reset()
    restarted = world.policy()  # the daemon started again after the reboot
    assert restarted.step().decision is Decision.TAKE_OUT  # reconciled once: all there, nothing sent
    assert world.stub.patches() == []
    assert restarted.step().decision is Decision.KEEP_OUT

    world.record("xid", ok("xid", "gpu/3"))  # the retest
    world.clock.t += 5
    result = restarted.step()

    assert result.decision is Decision.BRING_BACK and result.changed and result.error is None
    assert patch_bodies(world.stub) == [
        ("PATCH", f"/api/v1/nodes/{NODE}", {"fieldManager": "gpumon"}, SMP,
         {"metadata": {"resourceVersion": "3",
                       "annotations": {ANN_SINCE: None, ANN_ACTION: None, ANN_REASON: None,
                                       ANN_CORDONED: None}},
          "spec": {"unschedulable": False, "taints": []}}),
        ("PATCH", f"/api/v1/nodes/{NODE}/status", {"fieldManager": "gpumon"}, SMP,
         {"status": {"conditions": [{"type": "GpuHealthy", "status": "True", "reason": "GpumonRetestPassed",
                                     "message": "gpumon: no open faults",
                                     "lastHeartbeatTime": "2027-01-15T08:00:05Z",
                                     "lastTransitionTime": "2027-01-15T08:00:05Z"}]}}),
    ]
    node = world.stub.node()
    assert not node["spec"].get("unschedulable") and node["spec"]["taints"] == []
    assert not any(k.startswith("gpumon.io/") for k in node["metadata"]["annotations"])
    view = world.health.view()
    assert view.node.quarantine is None and view.node.level is Level.HEALTHY
    world.stub.reset()
    assert restarted.step().decision is Decision.NONE
    assert world.stub.patches() == []


def test_other_taints_are_kept_in_order(tmp_path: Path, clock: Clock) -> None:
    theirs = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
              {"key": "dedicated", "value": "training", "effect": "NoExecute",
               "timeAdded": "2027-01-01T00:00:00Z"}]
    stub = ApiStub([make_node(NODE, taints=theirs)])
    try:
        with api_client(stub.url) as api:
            backend = KubernetesBackend(NODE, api, clock=clock)
            backend.take_out(Action.RESET_GPU, "DBE on gpu/0", dry_run=False)
            assert stub.patches()[0].body["spec"]["taints"] == [
                *theirs, {"key": "gpumon.io/unhealthy", "value": "reset_gpu", "effect": "NoSchedule"}]
            # an escalation replaces gpumon's taint in place and keeps the first time
            clock.t += 60
            backend.take_out(Action.INSPECT_HARDWARE, "DBE again", dry_run=False)
            body = stub.patches()[2].body
            assert body["spec"] == {"taints": [
                *theirs, {"key": "gpumon.io/unhealthy", "value": "inspect_hardware", "effect": "NoSchedule"}]}
            assert body["metadata"]["annotations"] == {
                ANN_ACTION: "inspect_hardware", ANN_REASON: "gpumon: inspect_hardware: DBE again"}
            status = stub.patches()[3].body["status"]["conditions"][0]
            assert "lastTransitionTime" not in status  # still False: the transition time stays
            assert status["reason"] == "GpumonInspectHardware"
            stub.reset()
            out = backend.bring_back("retest passed", dry_run=False)
            assert out.done and stub.patches()[0].body["spec"] == {"unschedulable": False, "taints": theirs}
    finally:
        stub.close()


# -- someone else's cordon --------------------------------------------------------------------


def test_an_operators_cordon_is_never_lifted(tmp_path: Path, clock: Clock) -> None:
    stub = ApiStub([make_node(NODE, unschedulable=True)])
    try:
        with api_client(stub.url) as api:
            w = World(stub, api, tmp_path / "state", clock)
            policy = w.policy()
            w.record("xid", ok("xid", "gpu/3"))
            assert policy.step().decision is Decision.NONE  # healthy, operator's cordon: hands off
            assert stub.patches() == []

            w.record("xid", xid79())
            taken = policy.step()
            assert taken.node is not None and taken.node.out and not taken.node.by_gpumon
            # the node is someone else's now: gpumon sends nothing at all (no taint, condition,
            # annotation, and no cordon of its own); the fault stays in gpumon's state and metrics
            assert stub.patches() == []
            assert taken.outcome is not None and "cordoned by someone else" in taken.outcome.detail
            assert not taken.changed and w.health.view().node.quarantine is None

            w.reboot_and_retest()
            stub.reset()
            back = RemediationPolicy(w.backend, w.health, mode=Mode.ENFORCE, clock=clock).step()
            assert back.error is None
            assert stub.patches() == []  # nothing of gpumon's to lift, and the cordon stays
            assert stub.node()["spec"]["unschedulable"] is True
            assert w.health.view().node.quarantine is None
            w.health.close()
    finally:
        stub.close()


def test_gpumons_cordon_annotation_is_what_allows_an_uncordon(tmp_path: Path, clock: Clock) -> None:
    """A cordoned node with gpumon's taint but without ``gpumon.io/cordoned``: the cordon stays."""
    stub = ApiStub([make_node(NODE, unschedulable=True,
                              taints=[{"key": "gpumon.io/unhealthy", "value": "reset_gpu",
                                       "effect": "NoSchedule"}],
                              annotations={ANN_SINCE: NOW_TEXT, ANN_ACTION: "reset_gpu",
                                           ANN_REASON: "gpumon: reset_gpu: x"})])
    try:
        with api_client(stub.url) as api:
            backend = KubernetesBackend(NODE, api, clock=clock)
            current = backend.current()
            assert current.out and current.by_gpumon and current.since == NOW
            assert current.reason == "gpumon: reset_gpu: x"
            backend.bring_back("ok", dry_run=False)
            assert stub.node()["spec"]["unschedulable"] is True
            assert "unschedulable" not in stub.patches()[0].body["spec"]
    finally:
        stub.close()


# -- action none ------------------------------------------------------------------------------


def test_a_finding_with_no_action_never_cordons(world: World) -> None:
    world.record("gpu_presence", Finding("gpu_presence", "gpu/2", Severity.FAIL,
                                         "hung after 5 s in nvmlDeviceGetHandleByIndex(gpu/2)"))
    world.record("thermal", Finding("thermal", "gpu/0", Severity.WARN, "HBM 12 C above core"))
    assert world.health.view().node.level is Level.DEGRADED
    result = world.policy().step()
    assert result.decision is Decision.NONE and result.error is None
    assert world.stub.patches() == []
    assert world.stub.calls() == [("GET", f"/api/v1/nodes/{NODE}")]


def test_gpumons_cordon_is_lifted_when_only_no_action_findings_remain(world: World) -> None:
    world.record("ib", Finding("ib", "ib/mlx5_0/1", Severity.FAIL, "mlx5_0 port 1 down 9 s",
                               Action.CHECK_CABLES))
    policy = world.policy()
    assert policy.step().decision is Decision.TAKE_OUT
    assert world.stub.node()["spec"]["unschedulable"] is True
    # the port is back; a warning with no action is left (NVSentinel #911: must not keep it out)
    world.record("ib", ok("ib", "ib/mlx5_0/1"))
    world.record("thermal", Finding("thermal", "gpu/0", Severity.WARN, "HBM 12 C above core"))
    world.stub.reset()
    result = policy.step()
    assert result.decision is Decision.BRING_BACK and result.error is None
    assert world.stub.patches()[0].body["spec"] == {"unschedulable": False, "taints": []}
    node = world.stub.node()
    assert not node["spec"].get("unschedulable")
    assert node["status"]["conditions"][-1]["status"] == "True"
    assert world.health.view().node.level is Level.DEGRADED


def test_a_stale_gpumon_cordon_is_lifted_on_a_healthy_node(tmp_path: Path, clock: Clock) -> None:
    """gpumon's marks left from before (state dir wiped, or an earlier install): lifted once checks report."""
    stub = ApiStub([make_node(NODE, unschedulable=True,
                              taints=[{"key": "gpumon.io/unhealthy", "value": "none",
                                       "effect": "NoSchedule"}],
                              annotations={ANN_SINCE: NOW_TEXT, ANN_ACTION: "none", ANN_CORDONED: "true",
                                           ANN_REASON: "gpumon: none: old"})])
    try:
        with api_client(stub.url) as api:
            w = World(stub, api, tmp_path / "state", clock)
            policy = w.policy()
            assert policy.step().decision is Decision.WAIT  # no check has reported: nothing decided
            assert stub.requests == []
            w.record("thermal", Finding("thermal", "gpu/0", Severity.WARN, "HBM 12 C above core"))
            assert policy.step().decision is Decision.BRING_BACK
            assert not stub.node()["spec"].get("unschedulable")
            w.health.close()
    finally:
        stub.close()


# -- circuit breaker --------------------------------------------------------------------------


def fleet(recent: int, *, old: int = 0, total: int = 10) -> list[dict[str, Any]]:
    nodes = [make_node(NODE)]
    for i in range(1, total):
        annotations: dict[str, str] = {}
        if i <= recent:
            annotations = {ANN_SINCE: rfc3339(NOW - 60 * i), ANN_ACTION: "reboot_node",
                           ANN_REASON: "gpumon: reboot_node: Xid 79", ANN_CORDONED: "true"}
        elif i <= recent + old:
            annotations = {ANN_SINCE: rfc3339(NOW - 3600), ANN_ACTION: "reboot_node",
                           ANN_REASON: "gpumon: reboot_node: Xid 79"}
        nodes.append(make_node(f"gpu-node-{i + 1}", unschedulable=bool(annotations), annotations=annotations))
    return nodes


def test_circuit_breaker_blocks_a_mass_cordon(tmp_path: Path, clock: Clock) -> None:
    stub = ApiStub(fleet(3))  # 10 nodes, 3 taken out by gpumon within the window: 30 % > 20 %
    try:
        with api_client(stub.url) as api:
            w = World(stub, api, tmp_path / "state", clock)
            w.record("xid", xid79())
            policy = w.policy(breaker_share=0.2, breaker_window_s=600)
            result = policy.step()
            assert result.decision is Decision.BLOCKED and result.breaker_open
            assert result.share is not None
            assert (result.share.taken_out_recently, result.share.total) == (3, 10)
            assert stub.calls() == [("GET", f"/api/v1/nodes/{NODE}"), ("GET", "/api/v1/nodes")]
            assert stub.patches() == []
            assert w.health.view().node.quarantine is None
            assert not stub.node()["spec"].get("unschedulable")

            # two of the three are brought back by their own gpumon: 1/10 is under the limit
            for name in ("gpu-node-2", "gpu-node-3"):
                for key in (ANN_SINCE, ANN_ACTION, ANN_REASON, ANN_CORDONED):
                    stub.nodes[name]["metadata"]["annotations"].pop(key)
            stub.reset()
            result = policy.step()
            assert result.decision is Decision.TAKE_OUT and not result.breaker_open
            assert stub.node()["spec"]["unschedulable"] is True
            w.health.close()
    finally:
        stub.close()


def test_circuit_breaker_counts_only_recent_take_outs_and_pages(tmp_path: Path, clock: Clock) -> None:
    cpu_node = make_node("cpu-node-1", labels={"nvidia.com/gpu.present": "false"},
                         annotations={ANN_SINCE: NOW_TEXT})
    stub = ApiStub([*fleet(1, old=5, total=12), cpu_node])
    try:
        with api_client(stub.url) as api:
            backend = KubernetesBackend(NODE, api, clock=clock, node_selector="nvidia.com/gpu.present=true",
                                        list_page=5)
            share = backend.fleet_share(600)
            assert (share.taken_out_recently, share.total) == (1, 12)
            lists = [r.query for r in stub.requests]
            assert lists == [{"labelSelector": "nvidia.com/gpu.present=true", "limit": "5"},
                             {"labelSelector": "nvidia.com/gpu.present=true", "limit": "5", "continue": "5"},
                             {"labelSelector": "nvidia.com/gpu.present=true", "limit": "5", "continue": "10"}]
            assert backend.fleet_share(7200).taken_out_recently == 6
    finally:
        stub.close()


# -- observe mode -----------------------------------------------------------------------------


def test_observe_mode_sends_no_patch_and_reports_the_changes(world: World) -> None:
    world.record("xid", xid79())
    policy = world.policy(Mode.OBSERVE)
    events_before = world.health.store.count()
    result = policy.step()
    assert result.decision is Decision.TAKE_OUT and result.error is None and not result.changed
    assert [r.method for r in world.stub.requests] == ["GET", "GET", "GET"]
    assert result.would_change == [
        "cordon (spec.unschedulable: true)",
        "taint gpumon.io/unhealthy=reboot_node:NoSchedule",
        f"annotate {ANN_SINCE}={NOW_TEXT}, {ANN_ACTION}=reboot_node, {ANN_REASON}={REASON79}, "
        f"{ANN_CORDONED}=true",
        "condition GpuHealthy=False (GpumonRebootNode)",
    ]
    assert result.to_json()["outcome"]["changes"] == result.would_change
    assert world.stub.node() == make_node(NODE)
    assert world.health.view().node.quarantine is None
    assert world.health.store.count() == events_before  # nothing recorded in the health state
    policy.step()
    assert world.stub.patches() == []


# -- the API failing --------------------------------------------------------------------------


def test_apiserver_500_is_an_error_and_the_next_step_retries(world: World) -> None:
    world.record("xid", xid79())
    policy = world.policy()
    world.stub.fail = [500]
    first = policy.step()
    assert first.error is not None and "HTTP 500" in first.error and "etcdserver" in first.error
    assert world.stub.patches() == []
    assert world.health.view().node.quarantine is None

    world.stub.reset()
    second = policy.step()
    assert second.decision is Decision.TAKE_OUT and second.error is None
    assert world.stub.node()["spec"]["unschedulable"] is True


def test_a_take_out_cut_short_is_finished_next_step(world: World) -> None:
    """The cordon patch lands, the condition patch fails: the next step sends only the condition."""
    world.record("xid", xid79())
    policy = world.policy()
    original = world.stub._answer
    calls = {"n": 0}

    def flaky(method: str, path: str, query: dict[str, str], ctype: str | None,
              body: Any) -> tuple[int, dict[str, Any]]:
        if path.endswith("/status") and calls["n"] == 0:
            calls["n"] += 1
            return 503, {"kind": "Status", "code": 503, "message": "unavailable"}
        return original(method, path, query, ctype, body)

    world.stub._answer = flaky  # type: ignore[method-assign]
    first = policy.step()
    assert first.error is not None and "HTTP 503" in first.error
    assert world.stub.node()["spec"]["unschedulable"] is True
    assert world.health.view().node.quarantine is None  # recorded only once the take-out is whole

    world.stub.reset()
    second = policy.step()
    assert second.error is None and second.decision is Decision.TAKE_OUT
    assert [(r.method, r.path) for r in world.stub.patches()] == [("PATCH", f"/api/v1/nodes/{NODE}/status")]
    assert world.health.view().node.quarantine is not None


def test_a_conflicting_change_is_not_overwritten(world: World) -> None:
    """resourceVersion is a precondition: a node changed since the read gets a 409, then a fresh read."""
    world.record("xid", xid79())
    policy = world.policy()
    world.stub.conflict_next_patch = True
    first = policy.step()
    assert first.error is not None and "HTTP 409" in first.error
    second = policy.step()
    assert second.error is None
    assert world.stub.patches()[-2].body["metadata"]["resourceVersion"] == "2"


def test_connection_refused_is_an_error_and_the_next_step_retries(tmp_path: Path, clock: Clock) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    stub = ApiStub([make_node(NODE)])
    try:
        with api_client(dead, retries=0) as api:
            w = World(stub, api, tmp_path / "state", clock)
            w.record("xid", xid79())
            policy = w.policy()
            results: list[PolicyResult] = [policy.step(), policy.step()]
            assert all(r.error is not None and "read node" in r.error for r in results)
            api.configuration.host = stub.url  # the apiserver is back
            result = policy.step()
            assert result.error is None and result.decision is Decision.TAKE_OUT
            assert stub.node()["spec"]["unschedulable"] is True
            w.health.close()
    finally:
        stub.close()


def test_backend_errors_name_the_call(tmp_path: Path, clock: Clock) -> None:
    stub = ApiStub([make_node("other")])
    try:
        with api_client(stub.url) as api:
            backend = KubernetesBackend(NODE, api, clock=clock)
            with pytest.raises(KubernetesError, match=r'read node gpu-node-1: HTTP 404.*not found'):
                backend.current()
    finally:
        stub.close()
    with pytest.raises(KubernetesError, match="no node name"):
        KubernetesBackend("", client.ApiClient(client.Configuration()))


def test_kubeconfig_is_read_and_a_missing_one_is_named(tmp_path: Path, clock: Clock) -> None:
    stub = ApiStub([make_node(NODE)])
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": stub.url}}],
        "users": [{"name": "gpumon", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "gpumon"}}]}))
    before = kubeconfig.read_text()
    try:
        backend = KubernetesBackend(NODE, kubeconfig=str(kubeconfig), clock=clock)
        assert not backend.current().out
        assert [(r.path, r.authorization) for r in stub.requests] == [(f"/api/v1/nodes/{NODE}",
                                                                        "Bearer t0ken")]
        backend.api_client.close()  # type: ignore[no-untyped-call]
    finally:
        stub.close()
    assert kubeconfig.read_text() == before  # never written back
    with pytest.raises(KubernetesError, match=r"no Kubernetes configuration: .*nowhere"):
        KubernetesBackend(NODE, kubeconfig=str(tmp_path / "nowhere"))


# -- small parts ------------------------------------------------------------------------------


def test_time_and_reason_formats() -> None:
    assert rfc3339(NOW) == NOW_TEXT
    assert parse_rfc3339(NOW_TEXT) == NOW
    assert parse_rfc3339("2027-01-15T08:00:00.5+00:00") == NOW + 0.5
    assert parse_rfc3339("yesterday") is None
    assert condition_reason(Action.REBOOT_NODE) == "GpumonRebootNode"
    assert condition_reason(Action.INSPECT_HARDWARE) == "GpumonInspectHardware"


# -- manifests --------------------------------------------------------------------------------


def load_docs(name: str) -> list[dict[str, Any]]:
    with open(DEPLOY / name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} documents"
    return found[0]


def test_rbac_is_exactly_the_minimal_set() -> None:
    docs = load_docs("rbac.yaml")
    role = by_kind(docs, "ClusterRole")
    rules = sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])))
                   for r in role["rules"])
    assert rules == [(("",), ("nodes",), ("get", "list", "patch")), (("",), ("nodes/status",), ("patch",))]
    assert all(set(r) <= {"apiGroups", "resources", "verbs"} for r in role["rules"])  # no resourceNames etc.
    sa = by_kind(docs, "ServiceAccount")
    binding = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def test_daemonset_runs_the_agent_as_a_node_agent() -> None:
    docs = load_docs("daemonset.yaml")
    ds = by_kind(docs, "DaemonSet")
    sa = by_kind(load_docs("rbac.yaml"), "ServiceAccount")
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == sa["metadata"]["namespace"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = pod["containers"]
    command = container["command"] + container.get("args", [])
    assert command[:2] == ["gpumon", "daemon"] and command[command.index("--host-root") + 1] == "/host"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    host = mounts["/host"]
    assert host["readOnly"] is True and volumes[host["name"]]["hostPath"]["path"] == "/"
    kmsg = mounts["/dev/kmsg"]
    assert volumes[kmsg["name"]]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    state = mounts["/var/lib/gpumon"]
    assert not state.get("readOnly") and volumes[state["name"]]["hostPath"]["path"] == "/var/lib/gpumon"
    # NVIDIA devices and NVML without taking a GPU away from the jobs
    env = {e["name"]: e for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    (port,) = container["ports"]
    assert port["containerPort"] == 9426
    probe = container["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/metrics", port["name"])
    # runs on a node gpumon itself took out: it has to, to retest it and lift its marks
    assert any(t.get("key") == "gpumon.io/unhealthy" and t.get("operator") == "Exists"
               for t in pod["tolerations"])
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["data"]["gpumon.yaml"])
    assert config["remediation"]["backend"] == "kubernetes" and config["remediation"]["mode"] == "observe"
    assert config["kmsg_path"] == "/dev/kmsg"


def test_servicemonitor_scrapes_the_metrics_port() -> None:
    docs = load_docs("servicemonitor.yaml")
    ds = by_kind(load_docs("daemonset.yaml"), "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    service = by_kind(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 9426 and port["targetPort"] == "metrics"
    monitor = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (port["name"], "/metrics")
