"""deploy/kubernetes/fabric-probe.yaml: checked against the kubernetes client's models, and its intent.

This checks the manifest against the official Python client's models, not against an apiserver's
semantics (no apiserver can run here): every document's fields, at every depth, must be fields of
the model its apiVersion/kind names (``openapi_types``/``attribute_map``), every value must have the
model's type, and every model is constructed, so the client's own validation enforces required
fields. What an apiserver would add (defaulting, cross-field validation such as "Indexed needs
completions", admission) and what the scheduler does with the result are not simulated: the
project's intent for them (preemptible, one pod per node, runs on a node gpumon took out, shares
the node's health state with the DaemonSet) is asserted field by field below.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpumon.model import Action
from gpumon.remediate.kubernetes import TAINT_EFFECT, TAINT_KEY

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFEST = DEPLOY / "fabric-probe.yaml"

# (apiVersion, kind) -> the client's model. Only kinds these manifests use: an unknown pair fails.
MODELS: dict[tuple[str, str], str] = {
    ("scheduling.k8s.io/v1", "PriorityClass"): "V1PriorityClass",
    ("v1", "Service"): "V1Service",
    ("batch/v1", "Job"): "V1Job",
    # the DaemonSet's manifests, validated too so that the validator is known to pass good ones
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
}

# `gpumon probe-fabric`'s flags and the global ones it takes: name -> takes a value
PROBE_FLAGS = {"--json": False, "--device": True, "--max-bytes": True, "--deadline": True,
               "--port": True, "--host-root": True, "--config": True}
TORCHRUN_FLAGS = {"--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port"}


# -- the validator ----------------------------------------------------------------------------


class ManifestError(AssertionError):
    pass


# both spellings the generator has used: List[X] / Dict[str, X] and list[X] / dict(str, X)
_LIST = re.compile(r"[Ll]ist\[(.+)\]")
_DICT = re.compile(r"(?:Dict\[str, (.+)\]|dict\(str, (.+)\))")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fail(path: str, message: str) -> ManifestError:
    return ManifestError(f"{path}: {message}")


def build(type_name: str, value: Any, path: str) -> Any:
    """The client-side value of ``value`` as ``type_name`` (an ``openapi_types`` entry); every
    deviation raises ManifestError naming its path."""
    if value is None:  # `key:` with nothing after it: as good as a typo in a manifest
        raise _fail(path, f"null where {type_name} is expected")
    if m := _LIST.fullmatch(type_name):
        if not isinstance(value, list):
            raise _fail(path, f"{_type_name(value)} where a list ({type_name}) is expected")
        return [build(m.group(1), item, f"{path}[{i}]") for i, item in enumerate(value)]
    if m := _DICT.fullmatch(type_name):
        if not isinstance(value, dict):
            raise _fail(path, f"{_type_name(value)} where a map ({type_name}) is expected")
        inner = m.group(1) or m.group(2)
        for key in value:
            if not isinstance(key, str):
                raise _fail(path, f"map key {key!r} is {_type_name(key)}, not str")
        return {key: build(inner, item, f"{path}.{key}") for key, item in value.items()}
    scalar = _scalar(type_name, value, path)
    if scalar is not None:
        return scalar
    model = getattr(client, type_name, None)
    if model is None or not hasattr(model, "openapi_types"):
        raise _fail(path, f"the client has no model {type_name}")
    return build_model(model, value, path)


def _scalar(type_name: str, value: Any, path: str) -> Any:
    ok: bool
    if type_name == "str":
        ok = isinstance(value, str)
    elif type_name == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif type_name == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif type_name == "bool":
        ok = isinstance(value, bool)
    elif type_name == "object":  # int-or-string (ports), or a free-form object (managedFields)
        ok = isinstance(value, (str, int, dict)) and not isinstance(value, bool)
    elif type_name == "datetime":
        ok = isinstance(value, (str, datetime.datetime))
    else:
        return None
    if not ok:
        raise _fail(path, f"{_type_name(value)} {value!r} where {type_name} is expected")
    return value


def build_model(model: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise _fail(path, f"{_type_name(value)} where an object ({model.__name__}) is expected")
    types: dict[str, str] = model.openapi_types  # type: ignore[attr-defined]
    keys: dict[str, str] = model.attribute_map  # type: ignore[attr-defined]
    known = {key: attr for attr, key in keys.items()}
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise _fail(path, f"unknown key(s) {unknown} in {model.__name__}")
    kwargs = {known[key]: build(types[known[key]], item, f"{path}.{key}") for key, item in value.items()}
    try:
        return model(**kwargs)
    except (ValueError, TypeError) as e:  # the client's validation (pydantic's is a ValueError)
        raise _fail(path, f"{model.__name__}: {e}") from e


def validate(doc: Any) -> Any:
    """The client's model object for one manifest document."""
    if not isinstance(doc, dict):
        raise ManifestError(f"a document is {_type_name(doc)}, not an object")
    pair = (doc.get("apiVersion"), doc.get("kind"))
    if pair not in MODELS:
        raise ManifestError(f"no model for apiVersion/kind {pair}")
    name = doc.get("metadata", {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
    return build_model(getattr(client, MODELS[pair]), doc, f"{pair[1]}/{name}")  # type: ignore[arg-type]


# -- the manifests ----------------------------------------------------------------------------


def load_docs(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)} documents"
    return found[0]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return load_docs(MANIFEST)


@pytest.fixture(scope="module")
def job(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return by_kind(docs, "Job")


@pytest.fixture(scope="module")
def pod(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["containers"]
    assert not pod.get("initContainers")
    return c  # type: ignore[no-any-return]


def command_of(container: dict[str, Any]) -> list[str]:
    return [str(x) for x in container.get("command", []) + container.get("args", [])]


def split_command(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """torchrun's --k=v flags, and the gpumon command line after --no-python."""
    command = command_of(container)
    assert command[0] == "torchrun", command
    cut = command.index("--no-python")
    flags: dict[str, str] = {}
    for arg in command[1:cut]:
        key, eq, val = arg.partition("=")
        assert eq and key not in flags, f"torchrun flag {arg!r}: use --flag=value, once"
        flags[key] = val
    return flags, command[cut + 1:]


def probe_options(gpumon_argv: list[str]) -> dict[str, str | None]:
    """`gpumon probe-fabric`'s options; fails on anything not among PROBE_FLAGS."""
    assert gpumon_argv[:2] == ["gpumon", "probe-fabric"], gpumon_argv
    opts: dict[str, str | None] = {}
    args = iter(gpumon_argv[2:])
    for arg in args:
        flag, eq, val = arg.partition("=")
        assert flag in PROBE_FLAGS, f"{arg!r} is not a flag of gpumon probe-fabric"
        assert flag not in opts, f"{flag} given twice"
        if PROBE_FLAGS[flag]:
            opts[flag] = val if eq else next(args, None)
            assert opts[flag], f"{flag} without a value"
        else:
            assert not eq, f"{flag} takes no value"
            opts[flag] = None
    return opts


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist) against labels."""
    if not selector:
        return False  # an empty selector in an anti-affinity term matches nothing useful here
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, str]) -> bool:
    """Kubernetes' rule: key (empty + Exists: any key), operator Exists/Equal, effect (empty: any)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("key") and t["key"] != taint["key"]:
            continue
        if not t.get("key") and t.get("operator") != "Exists":
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def mount_source(pod: dict[str, Any], container: dict[str, Any], mount_path: str) -> tuple[dict[str, Any],
                                                                                         dict[str, Any]]:
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"{mount_path}: {len(mounts)} mounts"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return mounts[0], volume


def daemonset_state() -> tuple[dict[str, Any], str, str]:
    """daemonset.yaml's ConfigMap, its state_dir, and the hostPath mounted there."""
    docs = load_docs(DEPLOY / "daemonset.yaml")
    configmap = by_kind(docs, "ConfigMap")
    ds = by_kind(docs, "DaemonSet")
    ds_pod = ds["spec"]["template"]["spec"]
    (ds_container,) = ds_pod["containers"]
    state_dir = yaml.safe_load(configmap["data"]["gpumon.yaml"])["state_dir"]
    _, volume = mount_source(ds_pod, ds_container, state_dir)
    return configmap, state_dir, volume["hostPath"]["path"]


# -- the client's models ----------------------------------------------------------------------


def test_every_document_is_a_valid_client_model(docs: list[dict[str, Any]]) -> None:
    kinds = []
    for doc in docs:
        obj = validate(doc)
        assert type(obj).__name__ == MODELS[(doc["apiVersion"], doc["kind"])]
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Job", "PriorityClass", "Service"]


@pytest.mark.parametrize("name", ["daemonset.yaml", "rbac.yaml", "why-rbac.yaml"])
def test_the_validator_passes_the_daemonsets_manifests(name: str) -> None:
    for doc in load_docs(DEPLOY / name):
        validate(doc)


def _set(path: list[str | int], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target: Any = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return mutate


def _rename(path: list[str | int], new_key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target: Any = doc
        for step in path[:-1]:
            target = target[step]
        target[new_key] = target.pop(path[-1])
    return mutate


def _delete(path: list[str | int]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target: Any = doc
        for step in path[:-1]:
            target = target[step]
        del target[path[-1]]
    return mutate


CONTAINER: list[str | int] = ["spec", "template", "spec", "containers", 0]


@pytest.mark.parametrize(("mutate", "expected"), [
    # a misspelled key, deep down and at the top
    (_rename([*CONTAINER, "volumeMounts", 0, "mountPath"], "mountpath"),
     r"^Job/gpumon-fabric-probe\.spec\.template\.spec\.containers\[0\]\.volumeMounts\[0\]: "
     r"unknown key\(s\) \['mountpath'\] in V1VolumeMount$"),
    (_rename(["spec", "template", "spec", "tolerations"], "toleration"),
     r"\.spec\.template\.spec: unknown key\(s\) \['toleration'\] in V1PodSpec"),
    (_rename(["spec", "completionMode"], "completionmode"), r"\.spec: unknown key\(s\) \['completionmode'\]"),
    (_set(["specs"], {}), r"^Job/gpumon-fabric-probe: unknown key\(s\) \['specs'\] in V1Job$"),
    # wrong types: a quoted int, a quoted bool, an int for a string, a map for a list and back
    (_set(["spec", "backoffLimit"], "0"), r"\.spec\.backoffLimit: str '0' where int is expected"),
    (_set(["spec", "template", "spec", "hostNetwork"], "true"),
     r"\.spec\.template\.spec\.hostNetwork: str 'true' where bool is expected"),
    (_set(["spec", "completions"], True), r"\.spec\.completions: bool True where int is expected"),
    (_set([*CONTAINER, "env", 0, "value"], 2), r"\.containers\[0\]\.env\[0\]\.value: int 2 where str"),
    (_set([*CONTAINER, "resources", "limits", "nvidia.com/gpu"], 8),
     r"\.resources\.limits\.nvidia\.com/gpu: int 8 where str is expected"),
    (_set(["spec", "template", "spec", "tolerations"], {"key": "gpumon.io/unhealthy"}),
     r"\.tolerations: dict where a list \(List\[V1Toleration\]\) is expected"),
    (_set([*CONTAINER, "securityContext", "capabilities"], ["IPC_LOCK"]),
     r"\.securityContext\.capabilities: list where an object \(V1Capabilities\) is expected"),
    (_set([*CONTAINER, "command", 1], None), r"\.command\[1\]: null where str is expected"),
    # required fields, enforced by the client's own model
    (_delete([*CONTAINER, "name"]), r"(?s)\.containers\[0\]: V1Container: .*\bname\b"),
    (_delete(["spec", "template"]), r"(?s)^Job/gpumon-fabric-probe\.spec: V1JobSpec: .*\btemplate\b"),
    # a kind the client has no model for under that apiVersion
    (_set(["apiVersion"], "batch/v2"), r"no model for apiVersion/kind \('batch/v2', 'Job'\)"),
])
def test_the_validator_names_the_path_of_what_is_wrong(
        job: dict[str, Any], mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    bad = copy.deepcopy(job)
    mutate(bad)
    with pytest.raises(ManifestError, match=expected):
        validate(bad)


def test_the_validator_checks_the_other_documents_too(docs: list[dict[str, Any]]) -> None:
    service = copy.deepcopy(by_kind(docs, "Service"))
    service["spec"]["clusterIp"] = "None"
    with pytest.raises(ManifestError, match=r"^Service/gpumon-fabric-probe\.spec: unknown key\(s\) "
                                            r"\['clusterIp'\] in V1ServiceSpec$"):
        validate(service)
    del service["spec"]["clusterIp"]
    del service["spec"]["ports"][0]["port"]
    with pytest.raises(ManifestError, match=r"(?s)^Service/gpumon-fabric-probe\.spec\.ports\[0\]: "
                                            r"V1ServicePort: .*\bport\b"):
        validate(service)  # port is required
    priority = copy.deepcopy(by_kind(docs, "PriorityClass"))
    priority["value"] = "-1000"
    with pytest.raises(ManifestError, match=r"^PriorityClass/gpumon-fabric-probe\.value: str '-1000' "):
        validate(priority)


# -- what the manifest is for -----------------------------------------------------------------


def test_the_probe_yields_to_every_job(docs: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    priority = by_kind(docs, "PriorityClass")
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    # below the 0 of a pod without a priority class: every job may preempt it
    assert priority["value"] < 0
    assert priority["preemptionPolicy"] == "Never"  # and it preempts nothing itself
    assert priority.get("globalDefault") is not True
    assert "yields to every job" in priority["description"]


def test_an_indexed_job_of_one_pod_per_node(job: dict[str, Any], pod: dict[str, Any],
                                            container: dict[str, Any]) -> None:
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 2
    env = env_of(container)
    assert env["NNODES"]["value"] == str(spec["completions"])
    assert spec["backoffLimit"] == 0
    assert spec["ttlSecondsAfterFinished"] > 0
    assert pod["restartPolicy"] == "Never"
    labels = job["spec"]["template"]["metadata"]["labels"]
    # one pod per node: a required anti-affinity on the host name against its own pods, or a
    # spread of at most 1 that must hold
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    by_host = [term for term in anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
               if term["topologyKey"] == "kubernetes.io/hostname"
               and label_selector_matches(term.get("labelSelector", {}), labels)]
    spread = [c for c in pod.get("topologySpreadConstraints", [])
              if c["topologyKey"] == "kubernetes.io/hostname" and c["maxSkew"] == 1
              and c["whenUnsatisfiable"] == "DoNotSchedule"
              and label_selector_matches(c.get("labelSelector", {}), labels)]
    assert by_host or spread
    # the whole node: all its GPUs, one rank each
    torchrun, _ = split_command(container)
    gpus = str(torchrun["--nproc-per-node"])
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == gpus == "8"
    assert resources.get("requests", {}).get("nvidia.com/gpu", gpus) == gpus


def test_the_deadline_covers_the_probes_own(job: dict[str, Any], container: dict[str, Any]) -> None:
    _, argv = split_command(container)
    deadline = probe_options(argv)["--deadline"]
    assert deadline is not None
    assert float(deadline) < job["spec"]["activeDeadlineSeconds"] <= 2 * float(deadline)


def test_the_rendezvous_host_is_index_0_behind_the_headless_service(
        docs: list[dict[str, Any]], job: dict[str, Any], pod: dict[str, Any],
        container: dict[str, Any]) -> None:
    service = by_kind(docs, "Service")
    name = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"]
    assert pod["subdomain"] == name
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] and service["spec"]["selector"].items() <= labels.items()
    # the name resolves before index 0 is ready: the other nodes connect while it starts
    assert service["spec"]["publishNotReadyAddresses"] is True
    torchrun, _ = split_command(container)
    assert torchrun["--master-addr"] == f"{job['metadata']['name']}-0.{name}"
    assert [p["port"] for p in service["spec"]["ports"]] == [int(torchrun["--master-port"])]
    assert torchrun["--nnodes"] == "$(NNODES)"
    assert torchrun["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert set(torchrun) == TORCHRUN_FLAGS


def test_every_expanded_variable_is_defined(container: dict[str, Any]) -> None:
    # Kubernetes leaves an undefined $(VAR) as it is: a typo would reach torchrun verbatim.
    # JOB_COMPLETION_INDEX is the one the Job controller adds to an Indexed Job's pods.
    defined = set(env_of(container)) | {"JOB_COMPLETION_INDEX"}
    used = {m for arg in command_of(container) for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg)}
    assert used and used <= defined, used - defined


def test_the_command_is_gpumon_probe_fabric_with_its_own_flags(pod: dict[str, Any],
                                                              container: dict[str, Any]) -> None:
    _, argv = split_command(container)
    opts = probe_options(argv)
    assert "--json" in opts  # rank 0's report, in the pod's log
    assert opts.get("--device", "auto") in ("auto", "cuda", "cpu")
    host_root = opts["--host-root"]
    assert host_root is not None
    mount, volume = mount_source(pod, container, host_root)
    assert mount["readOnly"] is True and volume["hostPath"]["path"] == "/"


def test_findings_land_in_the_nodes_health_state(pod: dict[str, Any], container: dict[str, Any]) -> None:
    configmap, ds_state_dir, ds_state_host_path = daemonset_state()
    _, argv = split_command(container)
    config = probe_options(argv)["--config"]
    assert config is not None
    # the daemon's own config (the same ConfigMap), so the same state_dir
    _, config_volume = mount_source(pod, container, str(Path(config).parent))
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert Path(config).name in configmap["data"]
    assert ds_state_dir == "/var/lib/gpumon"
    mount, volume = mount_source(pod, container, ds_state_dir)
    assert not mount.get("readOnly")
    assert volume["hostPath"]["path"] == ds_state_host_path == "/var/lib/gpumon"
    assert container["env"] and env_of(container)["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] \
        == "spec.nodeName"


def test_it_runs_on_a_node_gpumon_took_out_and_nowhere_tainted_else(pod: dict[str, Any]) -> None:
    tolerations = pod["tolerations"]
    for action in Action:  # gpumon's taint, whatever action it names
        assert tolerates(tolerations, {"key": TAINT_KEY, "value": action.value, "effect": TAINT_EFFECT})
    # gpumon's cordon: spec.unschedulable, which the scheduler treats as this taint
    assert tolerates(tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    # no blanket toleration
    assert not tolerates(tolerations, {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"})
    assert not tolerates(tolerations, {"key": "example.com/drain", "value": "x", "effect": "NoSchedule"})


def test_the_host_fabric_is_reachable(pod: dict[str, Any], container: dict[str, Any]) -> None:
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # the rendezvous name is a cluster name
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    _, ib = mount_source(pod, container, "/dev/infiniband")
    assert ib["hostPath"]["path"] == "/dev/infiniband"
    _, shm = mount_source(pod, container, "/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_its_pods_are_not_the_daemons(job: dict[str, Any]) -> None:
    labels = job["spec"]["template"]["metadata"]["labels"]
    ds = by_kind(load_docs(DEPLOY / "daemonset.yaml"), "DaemonSet")
    assert not label_selector_matches(ds["spec"]["selector"], labels)
    metrics = by_kind(load_docs(DEPLOY / "servicemonitor.yaml"), "Service")
    assert not metrics["spec"]["selector"].items() <= labels.items()
    namespace = by_kind(load_docs(DEPLOY / "rbac.yaml"), "Namespace")["metadata"]["name"]
    assert job["metadata"]["namespace"] == namespace
