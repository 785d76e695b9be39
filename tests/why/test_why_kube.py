"""``gpumon why --k8s-job / --pytorchjob``: the job from Kubernetes, read by the real official client
from a loopback API (tests/why/kube_objects.py: objects shaped on real ones; wire format, not
apiserver semantics). The end-to-end run against real daemons is in test_why_e2e.py."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kube_objects import (
    JobApi,
    complete_legacy_job,
    failed_backoff_job,
    failed_pytorchjob,
    running_old_pytorchjob,
    serve,
    write_kubeconfig,
)
from kube_stub import api_client

from conftest import run_gpumon
from gpumon.errors import ConfigError
from gpumon.why.cli import resolve
from gpumon.why.job import JobError
from gpumon.why.kube import kubernetes_job, pytorch_job

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
T1 = T0 + 3600.0


@pytest.fixture
def api() -> Iterator[JobApi]:
    stub = serve(failed_backoff_job(T0, T1, ("gpu-a", "gpu-b")),
                 failed_pytorchjob(T0, T1, ("gpu-1", "gpu-2", "gpu-3")),
                 running_old_pytorchjob(T0, "gpu-1"), complete_legacy_job(T0, T1, "gpu-9"))
    yield stub
    stub.close()


def test_failed_job_past_its_backoff_limit(api: JobApi) -> None:
    with api_client(api.url) as c:
        job = kubernetes_job("ml/train-oom", api_client=c)
    assert job.nodes == ("gpu-a", "gpu-b")  # both tries' nodes, not the earlier job's gpu-old
    assert (job.start, job.end) == (T0, T1)  # the first pod's start, the Failed condition
    assert job.state == "FAILED (BackoffLimitExceeded)" and job.failed is True
    assert job.exit_code == "137"  # the first non-zero exit
    assert (job.id, job.source, job.resolution_s) == ("ml/train-oom", "kubernetes Job ml/train-oom", 1.0)
    assert job.notes[0] == ("non-zero exits: pod train-oom-2bq7x on gpu-a: container train exited 137 "
                            "(OOMKilled); pod train-oom-9fq4d on gpu-b: container train exited 1 (Error)")
    assert "came 1800 s before the job's end" in job.notes[1]
    assert any("pod train-oom-k4w8n has the job's label but another owner" in n for n in job.notes)
    assert api.calls() == [("GET", "/apis/batch/v1/namespaces/ml/jobs/train-oom"),
                           ("GET", "/api/v1/namespaces/ml/pods")]
    assert api.pod_lists() == [{"labelSelector": "batch.kubernetes.io/job-name=train-oom", "limit": "500"}]
    assert job.to_json()["failed"] is True


def test_failed_pytorchjob_names_the_worker_that_exited(api: JobApi) -> None:
    with api_client(api.url) as c:
        job = pytorch_job("ml/bert", api_client=c)
    assert job.nodes == ("gpu-1", "gpu-2", "gpu-3")  # master first, then the workers
    assert (job.start, job.end) == (T0, T1)  # its completionTime, though two pods still run
    assert job.state == "FAILED (PyTorchJobFailed)" and job.failed is True and job.exit_code == "1"
    assert job.source == "kubernetes PyTorchJob ml/bert"
    assert job.notes[0] == ("non-zero exits: pod bert-worker-1 (worker 1) on gpu-3: container pytorch "
                            "exited 1 (Error)")
    assert api.calls()[0] == ("GET", "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs/bert")
    assert api.pod_lists() == [{"labelSelector": "training.kubeflow.org/job-name=bert", "limit": "500"}]


def test_running_pytorchjob_of_the_old_operator_lists_its_unscheduled_pod(api: JobApi) -> None:
    with api_client(api.url) as c:
        job = pytorch_job("ml/bert-live", api_client=c)
    assert [q["labelSelector"] for q in api.pod_lists()] == ["training.kubeflow.org/job-name=bert-live",
                                                             "pytorch-job-name=bert-live"]
    assert job.nodes == ("gpu-1",) and job.start == T0 + 1 and job.end is None
    assert job.state == "RUNNING" and job.failed is None and job.exit_code is None
    (note,) = job.notes
    assert note.startswith("pod bert-live-worker-0 was never scheduled (phase Pending: Unschedulable "
                           "(0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")


def test_complete_job_of_a_cluster_before_1_27(api: JobApi) -> None:
    with api_client(api.url) as c:
        job = kubernetes_job("ml/etl", api_client=c)
    assert [q["labelSelector"] for q in api.pod_lists()] == ["batch.kubernetes.io/job-name=etl",
                                                             "job-name=etl"]
    assert job.nodes == ("gpu-9",) and (job.start, job.end) == (T0, T1)
    assert job.state == "COMPLETE" and job.failed is False and job.exit_code is None and job.notes == ()


def test_pods_are_read_page_by_page(api: JobApi) -> None:
    with api_client(api.url) as c:
        job = pytorch_job("ml/bert", api_client=c, pod_page=2)
    assert job.nodes == ("gpu-1", "gpu-2", "gpu-3")
    assert api.pod_lists() == [{"labelSelector": "training.kubeflow.org/job-name=bert", "limit": "2"},
                               {"labelSelector": "training.kubeflow.org/job-name=bert", "limit": "2",
                                "continue": "2"}]


def test_a_job_without_pods_left_asks_for_its_nodes(api: JobApi) -> None:
    api.pods = [p for p in api.pods if not p["metadata"]["name"].startswith("etl-")]
    with api_client(api.url) as c, pytest.raises(JobError, match=r"kubernetes Job ml/etl: no pod of it is "
                                                                 r"left .*cleanPodPolicy.*give its nodes"):
        kubernetes_job("ml/etl", api_client=c)


def test_not_found_forbidden_slow_and_unreachable_are_job_errors(api: JobApi) -> None:
    with api_client(api.url) as c:
        with pytest.raises(JobError, match=r'read Job ml/gone: HTTP 404 Not Found: jobs.batch "gone" '
                                           r'not found'):
            kubernetes_job("ml/gone", api_client=c)
        with pytest.raises(JobError, match=r'read PyTorchJob ml/train-oom: HTTP 404 .*'
                                           r'pytorchjobs.kubeflow.org "train-oom" not found'):
            pytorch_job("ml/train-oom", api_client=c)
        api.kubeflow = False
        with pytest.raises(JobError, match=r"read PyTorchJob ml/bert: HTTP 404 Not Found: the server could "
                                           r"not find the requested resource; this apiserver serves no "
                                           r"pytorchjobs.kubeflow.org \(is its operator installed\?\)"):
            pytorch_job("ml/bert", api_client=c)
        api.kubeflow = True
        api.forbidden.add("ml")
        with pytest.raises(JobError, match=r'HTTP 403 Forbidden: pytorchjobs.kubeflow.org "bert" is '
                                           r'forbidden: User "system:serviceaccount:ml:gpumon-why" cannot '
                                           r'get .*; gpumon why needs get on pytorchjobs.kubeflow.org and '
                                           r'list on pods in namespace ml'):
            pytorch_job("ml/bert", api_client=c)
        api.forbidden.clear()
    # each request is bounded (the stub answers after 1 s, the call gives up after 0.2 s), the
    # pod list as the read of the Job
    api.delay_s, api.delay_match = 1.0, "/pods"
    with api_client(api.url, retries=0) as c:
        t = time.monotonic()
        with pytest.raises(JobError, match=r"list pods batch.kubernetes.io/job-name=train-oom in ml: "
                                           r".*timed out"):
            kubernetes_job("ml/train-oom", api_client=c, timeout_s=0.2)
        api.delay_match = "/jobs/"
        with pytest.raises(JobError, match=r"read Job ml/train-oom: .*timed out"):
            kubernetes_job("ml/train-oom", api_client=c, timeout_s=0.2)
        assert time.monotonic() - t < 0.9
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with api_client(dead, retries=0) as c, \
            pytest.raises(JobError, match=r"read Job ml/train-oom: .*(Connection refused|Max retries)"):
        kubernetes_job("ml/train-oom", api_client=c)


def test_a_missing_kubeconfig_and_a_bad_name_are_job_errors(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"no Kubernetes configuration: .*nowhere"):
        kubernetes_job("ml/x", kubeconfig=str(tmp_path / "nowhere"))
    for bad in ("train", "/train", "ml/", "ml/a/b"):
        with pytest.raises(JobError, match="expected NAMESPACE/NAME"):
            pytorch_job(bad)


def _args(**given: str) -> argparse.Namespace:
    base = dict.fromkeys(("job", "job_nodes", "k8s_job", "pytorchjob", "kubeconfig", "nodes", "start", "end"))
    base.update(given)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(("given", "words"), [
    ({"k8s_job": "ml/a", "nodes": "n1", "start": "1"},
     "one job at a time: --k8s-job and --nodes/--start/--end"),
    ({"k8s_job": "ml/a", "pytorchjob": "ml/b"}, "one job at a time: --k8s-job and --pytorchjob"),
    ({"job": "12", "pytorchjob": "ml/b"}, "one job at a time: --job and --pytorchjob"),
    ({"kubeconfig": "k", "nodes": "n1", "start": "1"}, "--kubeconfig goes with --k8s-job or --pytorchjob"),
    ({"job_nodes": "n1", "k8s_job": "ml/a"}, "--job-nodes goes with --job"),
])
def test_cli_takes_one_job(given: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        resolve(_args(**given))


def test_cli_reads_the_kubeconfig_and_an_unknown_job_exits_3(api: JobApi, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    job = resolve(_args(k8s_job="ml/train-oom", kubeconfig=str(kubeconfig)))
    assert job.nodes == ("gpu-a", "gpu-b")
    assert {r.authorization for r in api.requests} == {"Bearer t0ken"}
    proc = run_gpumon("why", "--pytorchjob", "ml/nope", "--kubeconfig", str(kubeconfig), timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert 'pytorchjobs.kubeflow.org "nope" not found' in proc.stderr and "Traceback" not in proc.stderr


def test_the_why_role_grants_exactly_what_the_calls_need(api: JobApi) -> None:
    """deploy/kubernetes/why-rbac.yaml: each request gpumon why sends is one of its rules, and it has
    no other rule."""
    (role,) = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "why-rbac.yaml").read_text()))
    assert role["kind"] == "ClusterRole"
    rules = sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"])
    assert rules == [(("",), ("pods",), ("list",)), (("batch",), ("jobs",), ("get",)),
                     (("kubeflow.org",), ("pytorchjobs",), ("get",))]
    with api_client(api.url) as c:
        kubernetes_job("ml/train-oom", api_client=c)
        pytorch_job("ml/bert", api_client=c)
    used = set()
    for r in api.requests:
        s = r.path.strip("/").split("/")
        group = "" if s[0] == "api" else s[1]
        resource = s[-1] if s[-1] == "pods" else s[-2]
        used.add(((group,), (resource,), ("list",) if resource == "pods" else ("get",)))
    assert used == set(rules)
