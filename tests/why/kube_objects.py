"""Kubernetes Jobs, PyTorchJobs and their pods as the apiserver returns them, and a loopback API that
serves them (tests/kube_stub.py) for ``gpumon why --k8s-job / --pytorchjob``.

The objects are shaped on real ones (``kubectl get -o json`` of a batch/v1 Job on Kubernetes 1.30
and of a kubeflow.org/v1 PyTorchJob of the training-operator v1.7): the fields the controllers set,
the labels they put on pods, the conditions and container states of a failure, times as RFC 3339
whole seconds. Only what the stub serves: GET a Job, GET a PyTorchJob, and GET the pods of a
namespace by ``labelSelector`` (one ``key=value``) with ``limit``/``continue``.
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from kube_stub import ApiStub, status_body

GROUP_V1 = "kubeflow.org/v1"


def ts(t: float) -> str:
    return datetime.fromtimestamp(int(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(name: str, ns: str, uid: str, t: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "48213",
            "creationTimestamp": ts(t), **extra}


def container(name: str = "train", image: str = "nvcr.io/nvidia/pytorch:24.05-py3") -> dict[str, Any]:
    return {"name": name, "image": image, "command": ["torchrun", "train.py"],
            "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}},
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent"}


def running(t: float) -> dict[str, Any]:
    return {"running": {"startedAt": ts(t)}}


def terminated(t0: float, t1: float, code: int, reason: str) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": reason, "startedAt": ts(t0), "finishedAt": ts(t1),
                           "containerID": "containerd://4f1c9e0b7d"}}


def pod(name: str, ns: str, labels: dict[str, str], owner: dict[str, Any] | None, node: str | None,
        start: float | None, state: dict[str, Any] | None, *, phase: str | None = None,
        cname: str = "train", restart_policy: str = "Never") -> dict[str, Any]:
    """A pod; ``node`` None: never scheduled (Pending, PodScheduled False Unschedulable)."""
    spec: dict[str, Any] = {"containers": [container(cname)], "restartPolicy": restart_policy,
                            "schedulerName": "default-scheduler", "serviceAccountName": "default"}
    status: dict[str, Any]
    if node is None:
        status = {"phase": "Pending", "qosClass": "Burstable", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are "
                        "available: 3 No preemption victims found for incoming pod.",
             "lastProbeTime": None, "lastTransitionTime": ts(start or 0)}]}
    else:
        spec["nodeName"] = node
        assert start is not None and state is not None
        done = "terminated" in state
        if phase is None:
            phase = ("Failed" if state["terminated"]["exitCode"] else "Succeeded") if done else "Running"
        status = {"phase": phase, "hostIP": "10.0.0.7", "podIP": "10.244.1.17", "startTime": ts(start),
                  "qosClass": "Burstable",
                  "conditions": [{"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                                  "lastTransitionTime": ts(start)},
                                 {"type": "Ready", "status": "False" if done else "True",
                                  "lastProbeTime": None, "lastTransitionTime": ts(start)}],
                  "containerStatuses": [{"name": cname, "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                                         "imageID": "nvcr.io/nvidia/pytorch@sha256:0b7d4f1c9e",
                                         "containerID": "containerd://4f1c9e0b7d", "ready": not done,
                                         "started": not done, "restartCount": 0, "state": state,
                                         "lastState": {}}]}
    meta = _meta(name, ns, f"uid-{name}", start or 0, labels=dict(labels))
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def owner(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1" if kind == "Job" else GROUP_V1, "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def job_labels(name: str, uid: str, *, legacy_only: bool = False) -> dict[str, str]:
    """What the Job controller puts on its pods (1.27 on: both forms; before: the legacy ones only)."""
    legacy = {"controller-uid": uid, "job-name": name}
    return legacy if legacy_only else {"batch.kubernetes.io/controller-uid": uid,
                                       "batch.kubernetes.io/job-name": name, **legacy}


def batch_job(name: str, ns: str, uid: str, t0: float, *, backoff_limit: int = 6,
              conditions: list[dict[str, Any]] | None = None, active: int = 0, failed: int = 0,
              succeeded: int = 0, completion: float | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"startTime": ts(t0), "terminating": 0, "ready": active,
                              "uncountedTerminatedPods": {}}
    if conditions:
        status["conditions"] = conditions
    for key, n in (("active", active), ("failed", failed), ("succeeded", succeeded)):
        if n:
            status[key] = n
    if completion is not None:
        status["completionTime"] = ts(completion)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(name, ns, uid, t0, generation=1, labels={"app": name}),
        "spec": {"parallelism": 1, "completions": 1, "backoffLimit": backoff_limit,
                 "completionMode": "NonIndexed", "suspend": False, "manualSelector": False,
                 "podReplacementPolicy": "TerminatingOrFailed",
                 "selector": {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}},
                 "template": {"metadata": {"labels": job_labels(name, uid)},
                              "spec": {"containers": [container()], "restartPolicy": "Never"}}},
        "status": status,
    }


def condition(kind: str, t: float, reason: str, message: str, status: str = "True") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastProbeTime": ts(t), "lastTransitionTime": ts(t)}


def backoff_failed(t: float) -> list[dict[str, Any]]:
    """A Job past its backoffLimit (1.31: FailureTarget first, then Failed)."""
    words = "Job has reached the specified backoff limit"
    return [condition("FailureTarget", t, "BackoffLimitExceeded", words),
            condition("Failed", t, "BackoffLimitExceeded", words)]


def pytorch_labels(name: str, kind: str, index: int, *, old_operator: bool = False) -> dict[str, str]:
    if old_operator:  # kubeflow/pytorch-operator, before the training-operator
        return {"group-name": "kubeflow.org", "pytorch-job-name": name, "pytorch-replica-type": kind,
                "pytorch-replica-index": str(index), **({"job-role": "master"} if kind == "master" else {})}
    labels = {"training.kubeflow.org/job-name": name,
              "training.kubeflow.org/operator-name": "pytorchjob-controller",
              "training.kubeflow.org/replica-type": kind, "training.kubeflow.org/replica-index": str(index)}
    if kind == "master":
        labels["training.kubeflow.org/job-role"] = "master"
    return labels


def kf_condition(kind: str, t: float, reason: str, message: str, status: str = "True") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": ts(t), "lastTransitionTime": ts(t)}


def pytorchjob(name: str, ns: str, uid: str, t0: float, *, workers: int,
               conditions: list[dict[str, Any]], replica_statuses: dict[str, Any],
               completion: float | None = None) -> dict[str, Any]:
    template = {"spec": {"containers": [container("pytorch")]}}
    status: dict[str, Any] = {"conditions": conditions, "replicaStatuses": replica_statuses,
                              "startTime": ts(t0), "lastReconcileTime": ts(t0)}
    if completion is not None:
        status["completionTime"] = ts(completion)
    return {
        "apiVersion": GROUP_V1, "kind": "PyTorchJob",
        "metadata": _meta(name, ns, uid, t0, generation=1),
        "spec": {"runPolicy": {"cleanPodPolicy": "None", "suspend": False},
                 "pytorchReplicaSpecs": {
                     "Master": {"replicas": 1, "restartPolicy": "Never", "template": template},
                     "Worker": {"replicas": workers, "restartPolicy": "Never", "template": template}}},
        "status": status,
    }


class JobApi(ApiStub):
    """Jobs, PyTorchJobs and pods by namespace; a namespace in ``forbidden`` answers 403 as RBAC does."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pytorchjobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.forbidden: set[str] = set()
        self.kubeflow = True  # False: the training-operator's CRDs are not installed
        self.user = "system:serviceaccount:ml:gpumon-why"
        super().__init__()

    def add(self, obj: dict[str, Any]) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if obj["kind"] == "Job":
            self.jobs[key] = obj
        elif obj["kind"] == "PyTorchJob":
            self.pytorchjobs[key] = obj
        else:
            self.pods.append(obj)

    def pod_lists(self) -> list[dict[str, str]]:
        return [r.query for r in self.requests if r.path.endswith("/pods")]

    def _answer(self, method: str, path: str, query: dict[str, str], ctype: str | None,
                body: Any) -> tuple[int, dict[str, Any]]:
        s = path.strip("/").split("/")
        if method != "GET":
            return 405, status_body(405, "MethodNotAllowed", f"{method} {path}")
        if s[:3] == ["api", "v1", "namespaces"] and len(s) == 5 and s[4] == "pods":
            return self._guard(s[3], "pods", "", "list") or (200, self._pods(s[3], query))
        if s[:4] == ["apis", "batch", "v1", "namespaces"] and len(s) == 7 and s[5] == "jobs":
            return self._get(self.jobs, s[4], s[6], "jobs", "batch")
        if s[:4] == ["apis", "kubeflow.org", "v1", "namespaces"] and len(s) == 7 and s[5] == "pytorchjobs" \
                and self.kubeflow:
            return self._get(self.pytorchjobs, s[4], s[6], "pytorchjobs", "kubeflow.org")
        return 404, status_body(404, "NotFound", "the server could not find the requested resource")

    def _guard(self, ns: str, resource: str, group: str, verb: str,
               name: str = "") -> tuple[int, dict[str, Any]] | None:
        if ns not in self.forbidden:
            return None
        what = f"{resource}.{group}" if group else resource
        named = f' "{name}"' if name else ""
        return 403, status_body(403, "Forbidden", f'{what}{named} is forbidden: User "{self.user}" cannot '
                                                  f'{verb} resource "{resource}" in API group "{group}" in '
                                                  f'the namespace "{ns}"')

    def _get(self, table: dict[tuple[str, str], dict[str, Any]], ns: str, name: str, resource: str,
             group: str) -> tuple[int, dict[str, Any]]:
        refused = self._guard(ns, resource, group, "get", name)
        if refused is not None:
            return refused
        obj = table.get((ns, name))
        if obj is None:
            return 404, status_body(404, "NotFound", f'{resource}.{group} "{name}" not found')
        return 200, copy.deepcopy(obj)

    def _pods(self, ns: str, query: dict[str, str]) -> dict[str, Any]:
        key, _, value = query.get("labelSelector", "").partition("=")
        items = [p for p in self.pods if p["metadata"]["namespace"] == ns
                 and (not key or p["metadata"]["labels"].get(key) == value)]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        meta: dict[str, Any] = {"resourceVersion": "48290"}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return {"apiVersion": "v1", "kind": "PodList", "metadata": meta,
                "items": copy.deepcopy(items[start:start + limit])}


# -- the scenarios -------------------------------------------------------------------------------


def failed_backoff_job(t0: float, t1: float, nodes: tuple[str, str], *, name: str = "train-oom",
                       ns: str = "ml") -> list[dict[str, Any]]:
    """backoffLimit 1: the first pod OOMKilled on nodes[0], its replacement exits 1 on nodes[1] just
    before ``t1``, when the Job is Failed (BackoffLimitExceeded); and a pod left by an earlier Job
    of the same name (its labels, another owner) on a third node."""
    uid = "7c0f5a1e-8d2b-4b6e-9a43-1f2e3d4c5b6a"
    mid = t0 + (t1 - t0) / 2
    labels, mine = job_labels(name, uid), owner("Job", name, uid)
    return [
        batch_job(name, ns, uid, t0 - 3, backoff_limit=1, failed=2, conditions=backoff_failed(t1)),
        pod(f"{name}-2bq7x", ns, labels, mine, nodes[0], t0, terminated(t0 + 1, mid, 137, "OOMKilled")),
        pod(f"{name}-9fq4d", ns, labels, mine, nodes[1], mid + 2, terminated(mid + 3, t1 - 1, 1, "Error")),
        pod(f"{name}-k4w8n", ns, job_labels(name, "uid-earlier"), owner("Job", name, "uid-earlier"),
            "gpu-old", t0 - 86400, terminated(t0 - 86399, t0 - 80000, 0, "Completed")),
    ]


def failed_pytorchjob(t0: float, t1: float, nodes: tuple[str, str, str], *, name: str = "bert",
                      ns: str = "ml") -> list[dict[str, Any]]:
    """Master on nodes[0], Worker 0 on nodes[1], Worker 1 on nodes[2] exits 1 two seconds before the
    PyTorchJob is Failed at ``t1``; the other two still run (cleanPodPolicy None), hung."""
    uid = "e4b7d2c1-3a5f-4e8d-b6c9-0a1b2c3d4e5f"
    mine = owner("PyTorchJob", name, uid)
    words = f"PyTorchJob {ns}/{name} is failed because 1 Worker replica(s) failed."
    return [
        pytorchjob(name, ns, uid, t0 - 2, workers=2, completion=t1,
                   conditions=[kf_condition("Created", t0 - 2, "PyTorchJobCreated",
                                            f"PyTorchJob {name} is created."),
                               kf_condition("Running", t1, "PyTorchJobRunning",
                                            f"PyTorchJob {ns}/{name} is running.", status="False"),
                               kf_condition("Failed", t1, "PyTorchJobFailed", words)],
                   replica_statuses={"Master": {"active": 1}, "Worker": {"active": 1, "failed": 1}}),
        pod(f"{name}-master-0", ns, pytorch_labels(name, "master", 0), mine, nodes[0], t0, running(t0 + 1),
            cname="pytorch"),
        pod(f"{name}-worker-0", ns, pytorch_labels(name, "worker", 0), mine, nodes[1], t0, running(t0 + 1),
            cname="pytorch"),
        pod(f"{name}-worker-1", ns, pytorch_labels(name, "worker", 1), mine, nodes[2], t0,
            terminated(t0 + 1, t1 - 2, 1, "Error"), cname="pytorch"),
    ]


def running_old_pytorchjob(t0: float, node: str, *, name: str = "bert-live",
                           ns: str = "ml") -> list[dict[str, Any]]:
    """An older pytorch-operator's labels; the master runs, the worker waits for a GPU node."""
    uid = "0a9b8c7d-6e5f-4a3b-8c2d-1e0f9a8b7c6d"
    mine = owner("PyTorchJob", name, uid)
    return [
        pytorchjob(name, ns, uid, t0, workers=1,
                   conditions=[kf_condition("Created", t0, "PyTorchJobCreated",
                                            f"PyTorchJob {name} is created."),
                               kf_condition("Running", t0 + 5, "PyTorchJobRunning",
                                            f"PyTorchJob {ns}/{name} is running.")],
                   replica_statuses={"Master": {"active": 1}, "Worker": {}}),
        pod(f"{name}-master-0", ns, pytorch_labels(name, "master", 0, old_operator=True), mine, node, t0 + 1,
            running(t0 + 4), cname="pytorch"),
        pod(f"{name}-worker-0", ns, pytorch_labels(name, "worker", 0, old_operator=True), mine, None, t0,
            None, cname="pytorch"),
    ]


def complete_legacy_job(t0: float, t1: float, node: str, *, name: str = "etl",
                        ns: str = "ml") -> list[dict[str, Any]]:
    """A Job of a cluster before 1.27 (its pods carry only job-name=, controller-uid=), Complete."""
    uid = "5d4c3b2a-1f0e-4d9c-8b7a-6f5e4d3c2b1a"
    return [
        batch_job(name, ns, uid, t0, succeeded=1, completion=t1,
                  conditions=[condition("Complete", t1, "", "")]),
        pod(f"{name}-z8r2m", ns, job_labels(name, uid, legacy_only=True), owner("Job", name, uid), node, t0,
            terminated(t0 + 1, t1 - 1, 0, "Completed")),
    ]


def serve(*objects: list[dict[str, Any]]) -> JobApi:
    api = JobApi()
    for group in objects:
        for obj in group:
            api.add(obj)
    return api


def write_kubeconfig(path: Path, url: str, token: str = "t0ken") -> Path:
    """A kubeconfig of one context: ``url`` with a bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "why", "user": {"token": token}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "why"}}]}))
    return path
