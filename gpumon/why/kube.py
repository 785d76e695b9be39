"""The job a post-mortem is about, from Kubernetes: a Job (batch/v1) or a Kubeflow PyTorchJob
(kubeflow.org/v1), through the official client, its pods giving the nodes and the times.

Which pods are the job's: those its controller labels with the job's name, listed in the job's
namespace by label selector, and of those the ones whose owner is this job (its uid: a job
deleted and created again under the same name leaves no stranger's pods in the list).

- batch/v1 Job: ``batch.kubernetes.io/job-name=NAME``, set since Kubernetes 1.27; before that
  only ``job-name=NAME``, which the Job controller still sets too (kubernetes/kubernetes
  pkg/apis/batch/types.go: ``JobNameLabel = labelPrefix + LegacyJobNameLabel``,
  ``LegacyJobNameLabel = "job-name"``).
- PyTorchJob: ``training.kubeflow.org/job-name=NAME`` (kubeflow/common pkg/apis/common/v1/
  constants.go ``JobNameLabel``, the training-operator's); the older pytorch-operator set
  ``pytorch-job-name=NAME`` (its ``DeprecatedLabelPyTorchJobName``).

The first selector that finds pods is used. Nodes are the pods' ``spec.nodeName`` (pods never
scheduled are notes, not nodes); the start is the earliest pod's ``status.startTime`` (when the
kubelet took it), else the job's; the end is the job's completion or failure (``completionTime``,
else the terminal condition's ``lastTransitionTime``), else, once no pod runs any more, the last
container's ``finishedAt``, else None (still running). Kubernetes times are whole seconds.

Every request carries ``_request_timeout``; every failure (no configuration, 404, 403, the
apiserver unreachable or slow, an unreadable answer) is a ``JobError`` that says which call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpumon.remediate.kubernetes import KubernetesError, api_call, default_api_client, parse_rfc3339
from gpumon.why.job import Job, JobError

KUBE_TIMEOUT_S = 15.0  # per request
# one retry (a dropped connection, an apiserver restarting), not urllib3's 3: a dead apiserver
# costs 2 x 15 s per call, not 4 x
KUBE_RETRIES = 1
POD_PAGE = 500  # pods per list request: a job of thousands of pods in bounded answers
JOB_LABELS = ("batch.kubernetes.io/job-name", "job-name")
PYTORCHJOB_LABELS = ("training.kubeflow.org/job-name", "pytorch-job-name")
PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs")
_RBAC_HINT = ("gpumon why needs get on {what} and list on pods in namespace {ns} "
              "(docs/postmortem/why.md: Kubernetes)")
_NO_ROUTE = "the server could not find the requested resource"  # the apiserver's 404 for an unknown kind
_DONE_PHASES = frozenset({"Succeeded", "Failed"})

_T = TypeVar("_T")


@dataclass(frozen=True)
class PodExit:
    """A container of the job's pods that exited non-zero (now, or before its last restart)."""

    pod: str
    node: str | None
    container: str
    exit_code: int
    reason: str | None
    finished: float | None
    role: str | None = None  # "master 0", "worker 2": a PyTorchJob's replica type and index

    def words(self) -> str:
        role = f" ({self.role})" if self.role else ""
        where = f" on {self.node}" if self.node else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"pod {self.pod}{role}{where}: container {self.container} exited {self.exit_code}{why}"


def split_name(ref: str, flag: str) -> tuple[str, str]:
    namespace, slash, name = ref.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise JobError(f"{flag} {ref!r}: expected NAMESPACE/NAME")
    return namespace, name


def kubernetes_job(ref: str, *, kubeconfig: str | None = None, api_client: client.ApiClient | None = None,
                   timeout_s: float = KUBE_TIMEOUT_S, pod_page: int = POD_PAGE) -> Job:
    """A batch/v1 Job, ``NAMESPACE/NAME``."""
    namespace, name = split_name(ref, "--k8s-job")
    with _Reader(api_client, kubeconfig, timeout_s, pod_page, namespace, "jobs.batch") as r:
        obj = r.call(f"read Job {ref}", lambda: r.batch.read_namespaced_job(
            name, namespace, _request_timeout=timeout_s))
        status = obj.status or client.V1JobStatus()
        conditions = [(c.type, c.status, c.reason, _t(c.last_transition_time))
                      for c in status.conditions or []]
        pods = r.pods(JOB_LABELS, name, obj.metadata.uid if obj.metadata else None)
        failed = _true(conditions, "Failed")
        complete = _true(conditions, "Complete")
        if failed is not None:
            state: str = "FAILED" + (f" ({failed[0]})" if failed[0] else "")
            end = failed[1]
        elif complete is not None:
            state, end = "COMPLETE", _t(status.completion_time) or complete[1]
        elif _true(conditions, "Suspended") is not None:
            state, end = "SUSPENDED", None
        else:
            state, end = ("RUNNING" if status.active else "PENDING"), None
        return _job(f"{namespace}/{name}", f"kubernetes Job {namespace}/{name}", pods, r.notes, state,
                    failed is not None if (failed or complete) else None, end, _t(status.start_time))


def pytorch_job(ref: str, *, kubeconfig: str | None = None, api_client: client.ApiClient | None = None,
                timeout_s: float = KUBE_TIMEOUT_S, pod_page: int = POD_PAGE) -> Job:
    """A Kubeflow PyTorchJob (kubeflow.org/v1), ``NAMESPACE/NAME``."""
    namespace, name = split_name(ref, "--pytorchjob")
    group, version, plural = PYTORCHJOB
    with _Reader(api_client, kubeconfig, timeout_s, pod_page, namespace, "pytorchjobs.kubeflow.org") as r:
        obj = r.call(f"read PyTorchJob {ref}", lambda: r.custom.get_namespaced_custom_object(
            group, version, namespace, plural, name, _request_timeout=timeout_s))
        if not isinstance(obj, dict):
            raise JobError(f"read PyTorchJob {ref}: not an object: {str(obj)[:200]}")
        status = obj.get("status") or {}
        conditions = [(c.get("type"), c.get("status"), c.get("reason"),
                       parse_rfc3339(str(c.get("lastTransitionTime") or "")))
                      for c in status.get("conditions") or [] if isinstance(c, dict)]
        uid = (obj.get("metadata") or {}).get("uid")
        pods = r.pods(PYTORCHJOB_LABELS, name, uid)
        completion = parse_rfc3339(str(status.get("completionTime") or ""))
        failed = _true(conditions, "Failed")
        succeeded = _true(conditions, "Succeeded")
        end: float | None
        if failed is not None:
            state, end = "FAILED" + (f" ({failed[0]})" if failed[0] else ""), completion or failed[1]
        elif succeeded is not None:
            state, end = "SUCCEEDED", completion or succeeded[1]
        else:
            # the training-operator keeps one condition True at a time: the current one
            now = [c for c in conditions if c[1] == "True"]
            state, end = (str(now[-1][0]).upper() if now else "CREATED"), None
        return _job(f"{namespace}/{name}", f"kubernetes PyTorchJob {namespace}/{name}", pods, r.notes, state,
                    failed is not None if (failed or succeeded) else None, end,
                    parse_rfc3339(str(status.get("startTime") or "")))


class _Reader:
    """The API client (given, or gpumon's usual configuration with ``kubeconfig``) and the calls."""

    def __init__(self, api_client: client.ApiClient | None, kubeconfig: str | None, timeout_s: float,
                 pod_page: int, namespace: str, what: str) -> None:
        self.owned = api_client is None
        try:
            self.api = api_client if api_client is not None else default_api_client(kubeconfig,
                                                                                    retries=KUBE_RETRIES)
        except KubernetesError as exc:
            raise JobError(str(exc)) from None
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.timeout_s = timeout_s
        self.pod_page = pod_page
        self.namespace = namespace
        self.what = what
        self.notes: list[str] = []

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.api.close()  # type: ignore[no-untyped-call]

    def call(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return api_call(what, call)
        except KubernetesError as exc:
            cause = exc.__cause__
            hint = ""
            if isinstance(cause, ApiException) and cause.status in (401, 403):
                hint = "; " + _RBAC_HINT.format(what=self.what, ns=self.namespace)
            elif isinstance(cause, ApiException) and cause.status == 404 and _NO_ROUTE in str(exc):
                # the kind itself is unknown here, not the object: a CRD that is not installed
                hint = f"; this apiserver serves no {self.what} (is its operator installed?)"
            raise JobError(f"{exc}{hint}") from None

    def pods(self, labels: tuple[str, ...], name: str, uid: str | None) -> list[Any]:
        for label in labels:
            found = self._list(f"{label}={name}")
            if found:
                break
        else:
            return []
        mine = []
        for pod in found:
            owners = pod.metadata.owner_references or [] if pod.metadata else []
            if uid and owners and all(o.uid != uid for o in owners):
                self.notes.append(f"pod {pod.metadata.name} has the job's label but another owner: "
                                  "left out (an earlier job of the same name?)")
                continue
            mine.append(pod)
        return sorted(mine, key=lambda p: p.metadata.name or "")

    def _list(self, selector: str) -> list[Any]:
        out: list[Any] = []
        token: str | None = None
        while True:
            page = self.call(f"list pods {selector} in {self.namespace}", functools.partial(
                self.core.list_namespaced_pod, self.namespace, label_selector=selector, limit=self.pod_page,
                _continue=token, _request_timeout=self.timeout_s))
            out.extend(page.items or [])
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                return out


def _t(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


_Condition = tuple[Any, Any, Any, "float | None"]  # type, status, reason, lastTransitionTime


def _true(conditions: list[_Condition], kind: str) -> tuple[str | None, float | None] | None:
    """(reason, since) of the condition ``kind`` if it is True."""
    for ctype, status, reason, since in conditions:
        if ctype == kind and status == "True":
            return (str(reason) if reason else None), since
    return None


def _role(pod: Any) -> str | None:
    labels = pod.metadata.labels or {}
    kind = labels.get("training.kubeflow.org/replica-type") or labels.get("pytorch-replica-type")
    index = labels.get("training.kubeflow.org/replica-index") or labels.get("pytorch-replica-index")
    return f"{kind} {index}".strip() if kind else None


def _exits(pod: Any) -> tuple[list[PodExit], list[float]]:
    """Non-zero exits of the pod's containers (the current state and, after a restart, the last
    one), and every container's finish time."""
    exits: list[PodExit] = []
    finished: list[float] = []
    status = pod.status
    for cs in (status.container_statuses or []) if status else []:
        for state in (cs.state, cs.last_state):
            term = state.terminated if state is not None else None
            if term is None:
                continue
            done = _t(term.finished_at)
            if done is not None:
                finished.append(done)
            if term.exit_code:
                exits.append(PodExit(pod.metadata.name, pod.spec.node_name if pod.spec else None, cs.name,
                                     int(term.exit_code), term.reason, done, _role(pod)))
    return exits, finished


def _job(job_id: str, source: str, pods: list[Any], reader_notes: list[str], state: str,
         failed: bool | None, end: float | None, job_start: float | None) -> Job:
    nodes: dict[str, None] = {}
    notes: list[str] = list(reader_notes)
    starts: list[float] = []
    exits: list[PodExit] = []
    finished: list[float] = []
    running = False
    for pod in pods:
        node = pod.spec.node_name if pod.spec else None
        phase = pod.status.phase if pod.status else None
        if not node:
            why = ""
            for c in (pod.status.conditions or []) if pod.status else []:
                if c.type == "PodScheduled" and c.status != "True":
                    why = f": {c.reason}" + (f" ({c.message})" if c.message else "")
            notes.append(f"pod {pod.metadata.name} was never scheduled (phase {phase}{why}): "
                         "not a node of the job")
            continue
        nodes[node] = None
        start = _t(pod.status.start_time) if pod.status else None
        if start is not None:
            starts.append(start)
        if phase not in _DONE_PHASES:
            running = True
        e, f = _exits(pod)
        exits += e
        finished += f
    if not nodes:
        why = (f"{len(pods)} pod(s), none scheduled" if pods else
               "no pod of it is left (deleted by the job's cleanPodPolicy or ttlSecondsAfterFinished?)")
        raise JobError(f"{source}: {why}: give its nodes with --nodes/--start/--end")
    start = min(starts) if starts else job_start
    if start is None:
        raise JobError(f"{source} has not started (state {state})")
    if end is None and not running and finished:
        # no condition says it ended, but no pod runs any more: the last container's exit is the end
        end = max(finished)
    exits.sort(key=lambda x: (x.finished if x.finished is not None else float("inf"), x.pod))
    if exits:
        first = exits[0]
        notes.insert(0, "non-zero exits: " + "; ".join(x.words() for x in exits[:8])
                     + (f"; and {len(exits) - 8} more" if len(exits) > 8 else ""))
        if first.finished is not None and end is not None and end - first.finished > 1.0:
            notes.insert(1, f"the first non-zero exit ({first.pod}) came {end - first.finished:.0f} s before "
                            "the job's end: a cause is expected one watchdog timeout before that exit")
    return Job(tuple(nodes), start, end, job_id, state, str(exits[0].exit_code) if exits else None, source,
               1.0, tuple(notes), failed)
