"""Kubernetes backend: cordon, taint, condition and annotations on this node, all owned by gpumon.

What gpumon sets on an unhealthy node, and lifts again after its retest:

=====================================  =========================================================
``spec.unschedulable: true``           only if the node was schedulable; then also the
                                       annotation ``gpumon.io/cordoned: "true"``. A node someone
                                       else cordoned first is left entirely alone (nothing of
                                       gpumon's is added); gpumon never lifts a cordon it did
                                       not set.
taint ``gpumon.io/unhealthy=<action>:  keeps new pods off even if someone uncordons the node
NoSchedule``                           (running pods stay: NoSchedule, not NoExecute)
condition ``GpuHealthy``               ``False`` with reason and message (``nodes/status``);
                                       ``True`` again on bring-back
annotations ``gpumon.io/quarantined-   that gpumon did it, when (RFC 3339, UTC; read by the
at``, ``gpumon.io/action``,            circuit breaker), why (``gpumon: <action>: <summary>``,
``gpumon.io/reason``                   the same words as a Slurm drain reason)
=====================================  =========================================================

**Patch type: strategic merge patch**, for every write:

- The condition must go through the ``nodes/status`` subresource, and
  ``status.conditions`` is a list merged by ``type`` under strategic merge:
  sending only the ``GpuHealthy`` entry leaves the kubelet's conditions alone
  (node-problem-detector writes its conditions the same way). A JSON patch
  would need the entry's index, and a JSON merge patch would replace the whole
  list.
- Annotations are a map: a key set to a value is added, a key set to ``null``
  is removed, and no other key is touched.
- ``spec.taints`` is an atomic list (no merge key) under every patch type, so
  the whole list is sent: the taints as read, with gpumon's own entry added,
  replaced or removed in place. That patch carries ``metadata.resourceVersion``
  as read, which the apiserver takes as a precondition (409 Conflict if the
  node changed since): a taint someone added in between is not lost, and the
  decision "the node was schedulable, so gpumon cordons it and says so" is made
  on the node as it is. A conflict is an error; the policy's next step reads
  the node again.
- Cordon, taint and annotations go in one patch, so the record of what gpumon
  did (``gpumon.io/cordoned``) lands with the change itself or not at all.

Every request is bounded by ``request_timeout_s``; every failure (HTTP error,
connection refused, timeout, an unreadable answer) becomes ``KubernetesError``.
``take_out`` and ``bring_back`` are idempotent: they read the node first and
send only what differs, nothing when nothing does.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from gpumon.errors import GpumonError
from gpumon.model import Action
from gpumon.remediate.base import OWNER_PREFIX, FleetShare, NodeOut, Outcome

TAINT_KEY = "gpumon.io/unhealthy"
TAINT_EFFECT = "NoSchedule"
CONDITION_TYPE = "GpuHealthy"
ANN_SINCE = "gpumon.io/quarantined-at"
ANN_ACTION = "gpumon.io/action"
ANN_REASON = "gpumon.io/reason"
ANN_CORDONED = "gpumon.io/cordoned"
ANNOTATIONS = (ANN_SINCE, ANN_ACTION, ANN_REASON, ANN_CORDONED)
# the condition's reason on bring-back (CamelCase, as Kubernetes reasons are)
REASON_HEALTHY = "GpumonRetestPassed"
# nodes per list request for the circuit breaker: bounds the memory one answer
# takes on a large cluster (a node object is tens of kB)
LIST_PAGE = 500

_T = TypeVar("_T")


class KubernetesError(GpumonError):
    """The API server could not be asked or refused the request."""


def condition_reason(action: Action) -> str:
    """``reboot_node`` -> ``GpumonRebootNode``: a Kubernetes-style reason naming the action."""
    return "Gpumon" + "".join(word.capitalize() for word in action.value.split("_"))


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float | None:
    # Python 3.10's fromisoformat does not take the "Z" suffix
    value = text.strip()
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def default_api_client(kubeconfig: str | None = None, *, retries: int | None = None) -> client.ApiClient:
    """``kubeconfig`` if given; else in-cluster config (the DaemonSet's service account), else the
    default kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``: a developer's, or a systemd install's).
    ``retries``: urllib3's, per request (None: its default, 3 retries, each with the full timeout).

    Loaded into a private Configuration, not the client library's global default,
    and never written back (``persist_config=False``): gpumon does not edit anyone's kubeconfig.
    """
    configuration = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration)
            configuration.retries = retries
            return client.ApiClient(configuration)
        except config.ConfigException as exc:
            in_cluster = f"not in a cluster ({exc}); "
    else:
        in_cluster = ""
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration, persist_config=False)
    except (config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = kubeconfig or "the default kubeconfig"
        raise KubernetesError(f"no Kubernetes configuration: {in_cluster}{where}: {exc}") from exc
    configuration.retries = retries
    return client.ApiClient(configuration)


class KubernetesBackend:
    """``SchedulerBackend`` for one Kubernetes node (``node_name``: the name the API knows it by)."""

    name = "kubernetes"

    def __init__(self, node_name: str, api_client: client.ApiClient | None = None, *,
                 clock: Callable[[], float] = time.time, request_timeout_s: float = 10.0,
                 node_selector: str = "", field_manager: str = OWNER_PREFIX,
                 list_page: int = LIST_PAGE, kubeconfig: str | None = None) -> None:
        if not node_name:
            raise KubernetesError("no node name: set remediation.kubernetes.node_name (the Downward "
                                  "API's spec.nodeName in the DaemonSet)")
        self.node_name = node_name
        self.api_client = api_client if api_client is not None else default_api_client(kubeconfig)
        self.api = client.CoreV1Api(self.api_client)
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        # which nodes make up "the fleet" for the circuit breaker: on a cluster
        # with CPU nodes too, GPU nodes only (e.g. "nvidia.com/gpu.present=true"),
        # or 20 % of the fleet could be more than every GPU node there is
        self.node_selector = node_selector
        # shown in managedFields and audit logs as the writer of gpumon's fields
        self.field_manager = field_manager
        self.list_page = list_page

    # -- SchedulerBackend -------------------------------------------------------------------

    def current(self) -> NodeOut:
        node = self._read()
        ann = _annotations(node)
        has_taint = any(t.get("key") == TAINT_KEY for t in self._taints(node))
        unschedulable = bool(node.spec is not None and node.spec.unschedulable)
        since = ann.get(ANN_SINCE)
        return NodeOut(out=unschedulable or has_taint,
                       by_gpumon=has_taint or any(k in ann for k in ANNOTATIONS),
                       reason=ann.get(ANN_REASON, ""),
                       since=None if since is None else parse_rfc3339(since))

    def take_out(self, action: Action, summary: str, *, dry_run: bool) -> Outcome:
        node = self._read()
        now = self.clock()
        ann = _annotations(node)
        reason = f"{OWNER_PREFIX}: {action.value}: {summary}"
        changes: list[str] = []
        notes: list[str] = []
        spec: dict[str, Any] = {}

        cordoned_by_gpumon = ann.get(ANN_CORDONED) == "true"
        if not (node.spec is not None and node.spec.unschedulable):
            spec["unschedulable"] = True
            cordoned_by_gpumon = True
            changes.append("cordon (spec.unschedulable: true)")
        elif not cordoned_by_gpumon:
            if ANN_SINCE not in ann:
                # Someone else took the node out first: it is theirs. gpumon changes nothing on
                # it (no taint, condition or annotation either), so lifting later can never
                # touch their work; the fault stays visible in gpumon's metrics and status.
                return Outcome(False, "the node was already cordoned by someone else: gpumon leaves "
                                      "it alone", [])
            notes.append("the node was cordoned by someone else after gpumon marked it: that cordon "
                         "is left as it is")

        taint = {"key": TAINT_KEY, "value": action.value, "effect": TAINT_EFFECT}
        taints = self._taints(node)
        mine = [i for i, t in enumerate(taints) if t.get("key") == TAINT_KEY]
        if [_taint_triple(taints[i]) for i in mine] != [_taint_triple(taint)]:
            kept = [t for i, t in enumerate(taints) if i not in mine[1:]]
            if mine:
                kept[mine[0]] = taint  # in place: other taints keep their order
            else:
                kept.append(taint)
            spec["taints"] = kept
            changes.append(f"taint {TAINT_KEY}={action.value}:{TAINT_EFFECT}")

        wanted = {ANN_SINCE: ann.get(ANN_SINCE) or rfc3339(now), ANN_ACTION: action.value,
                  ANN_REASON: reason}
        if cordoned_by_gpumon:
            wanted[ANN_CORDONED] = "true"
        annotations: dict[str, str | None] = {k: v for k, v in wanted.items() if ann.get(k) != v}
        if annotations:
            changes.append("annotate " + ", ".join(f"{k}={v}" for k, v in annotations.items()))

        status = self._condition_patch(node, "False", condition_reason(action), reason, now)
        if status is not None:
            changes.append(f"condition {CONDITION_TYPE}=False ({condition_reason(action)})")

        return self._apply(node, annotations, spec, status, changes, notes, dry_run,
                           "taken out", "already out: nothing to change")

    def bring_back(self, summary: str, *, dry_run: bool) -> Outcome:
        node = self._read()
        now = self.clock()
        ann = _annotations(node)
        changes: list[str] = []
        notes: list[str] = []
        spec: dict[str, Any] = {}

        unschedulable = bool(node.spec is not None and node.spec.unschedulable)
        if unschedulable and ann.get(ANN_CORDONED) == "true":
            spec["unschedulable"] = False
            changes.append("uncordon (spec.unschedulable: false)")
        elif unschedulable:
            # never lift a cordon gpumon did not set (NVSentinel #1424, #363)
            notes.append("the cordon is not gpumon's: left in place")

        taints = self._taints(node)
        kept = [t for t in taints if t.get("key") != TAINT_KEY]
        if len(kept) != len(taints):
            spec["taints"] = kept
            changes.append(f"remove taint {TAINT_KEY}")

        annotations: dict[str, str | None] = {k: None for k in ANNOTATIONS if k in ann}
        if annotations:
            changes.append("remove annotations " + ", ".join(annotations))

        status = None
        if _condition(node) is not None:
            status = self._condition_patch(node, "True", REASON_HEALTHY, f"{OWNER_PREFIX}: {summary}", now)
            if status is not None:
                changes.append(f"condition {CONDITION_TYPE}=True ({REASON_HEALTHY})")

        return self._apply(node, annotations, spec, status, changes, notes, dry_run,
                           "brought back", "nothing of gpumon's to lift")

    def _apply(self, node: Any, annotations: dict[str, str | None], spec: dict[str, Any],
               status: Any, changes: list[str], notes: list[str], dry_run: bool, done: str,
               nothing: str) -> Outcome:
        """Send the node patch and the status patch (or, observing, send nothing)."""
        detail = "; ".join(notes)
        if dry_run:
            return Outcome(False, _joined("observe: nothing sent", detail), changes)
        if spec or annotations:
            self._patch(node, annotations, spec)
        if status is not None:
            self._call("patch node status", lambda: self.api.patch_node_status(
                self.node_name, status, field_manager=self.field_manager,
                _request_timeout=self.request_timeout_s))
        return Outcome(True, _joined(done if changes else nothing, detail), changes)

    def fleet_share(self, window_s: float) -> FleetShare:
        now = self.clock()
        recent = total = 0
        token: str | None = None
        while True:
            page = self._call("list nodes", functools.partial(
                self.api.list_node, label_selector=self.node_selector or None, limit=self.list_page,
                _continue=token, _request_timeout=self.request_timeout_s))
            for node in page.items:
                total += 1
                since = _annotations(node).get(ANN_SINCE)
                if since is None:
                    continue
                t = parse_rfc3339(since)
                # an unreadable or future time counts as recent: when unsure, the
                # breaker errs on the side of not taking more nodes out
                if t is None or now - t <= window_s:
                    recent += 1
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                return FleetShare(recent, total)

    # -- plumbing ---------------------------------------------------------------------------

    def _read(self) -> client.V1Node:
        return self._call("read node", lambda: self.api.read_node(
            self.node_name, _request_timeout=self.request_timeout_s))

    @staticmethod
    def _taints(node: client.V1Node) -> list[dict[str, Any]]:
        """The node's taints as the API writes them: taints gpumon sends back (the list is atomic)
        must be what was read, so they are rebuilt field by field in the wire format."""
        if node.spec is None or not node.spec.taints:
            return []
        out: list[dict[str, Any]] = []
        for t in node.spec.taints:
            taint: dict[str, Any] = {"key": t.key}
            if t.value:
                taint["value"] = t.value
            taint["effect"] = t.effect
            if t.time_added is not None:
                # metav1.Time: RFC 3339, whole seconds, UTC with "Z"
                taint["timeAdded"] = rfc3339(t.time_added.timestamp())
            out.append(taint)
        return out

    def _patch(self, node: client.V1Node, annotations: dict[str, str | None], spec: dict[str, Any]) -> None:
        metadata: dict[str, Any] = {}
        if node.metadata is not None and node.metadata.resource_version:
            metadata["resourceVersion"] = node.metadata.resource_version
        if annotations:
            metadata["annotations"] = annotations
        body: dict[str, Any] = {"metadata": metadata}
        if spec:
            body["spec"] = spec
        # a dict body is sent as application/strategic-merge-patch+json by the client
        self._call("patch node", lambda: self.api.patch_node(
            self.node_name, body, field_manager=self.field_manager,
            _request_timeout=self.request_timeout_s))

    def _condition_patch(self, node: client.V1Node, status: str, reason: str, message: str,
                         now: float) -> dict[str, Any] | None:
        """The ``nodes/status`` patch that sets gpumon's condition, or None if it is already so."""
        old = _condition(node)
        if old is not None and (old.status, old.reason, old.message) == (status, reason, message):
            return None
        entry: dict[str, Any] = {"type": CONDITION_TYPE, "status": status, "reason": reason,
                                 "message": message, "lastHeartbeatTime": rfc3339(now)}
        if old is None or old.status != status:
            # unchanged status keeps its transition time (merged by type, the field is kept)
            entry["lastTransitionTime"] = rfc3339(now)
        return {"status": {"conditions": [entry]}}

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        return api_call(f"{what} {self.node_name}", call)


def api_call(what: str, call: Callable[[], _T]) -> _T:
    """``call()``, its every failure a ``KubernetesError`` that starts with ``what`` (an
    ``ApiException`` stays its ``__cause__``: its ``status`` tells a 403 from a 404)."""
    try:
        return call()
    except ApiException as exc:
        raise KubernetesError(f"{what}: HTTP {exc.status} {exc.reason}{_api_message(exc)}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubernetesError(f"{what}: {exc}") from exc
    except ValueError as exc:
        # an answer the client could not decode (pydantic's ValidationError is a ValueError)
        raise KubernetesError(f"{what}: unreadable answer: {exc}") from exc


def _annotations(node: client.V1Node) -> dict[str, str]:
    if node.metadata is None or not node.metadata.annotations:
        return {}
    return dict(node.metadata.annotations)


def _condition(node: client.V1Node) -> client.V1NodeCondition | None:
    if node.status is None or not node.status.conditions:
        return None
    for cond in node.status.conditions:
        if cond.type == CONDITION_TYPE:
            return cond
    return None


def _taint_triple(taint: dict[str, Any]) -> tuple[Any, Any, Any]:
    return taint.get("key"), taint.get("value"), taint.get("effect")


def _api_message(exc: ApiException) -> str:
    """The ``message`` of a Kubernetes Status body, when there is one."""
    body = exc.body
    if not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    return f": {message}" if message else ""


def _joined(head: str, tail: str) -> str:
    return f"{head}; {tail}" if tail else head
