"""``gpumon why``: why did this job die (or crawl)? Reads the nodes' history; changes nothing.

Exit codes (the Nagios convention of every gpumon command, so an epilog can act on 2 only):
0 no infrastructure evidence (every node answered, none recorded a fault that explains the
failure: look at the application); 1 inconclusive (no suspect on the nodes that answered, but
some did not answer); 2 at least one infrastructure suspect; 3 cannot answer (bad usage, the job
cannot be resolved, no node answered).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumon.distribution import ExtraMissing, require
from gpumon.errors import ConfigError
from gpumon.why import prom
from gpumon.why.collect import DEFAULT_TEMPLATE, Access, collect
from gpumon.why.job import Job, JobError, explicit_job, slurm_job
from gpumon.why.joblog import JobLog, parse_file
from gpumon.why.reason import LEAD_S, ONSET_MARGIN_S, Reasoner, nccl_settings
from gpumon.why.report import print_verdict, to_json


def add_parser(sub: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "why", parents=list(parents),
        help="post-mortem of a job: which node, part and moment explain its failure",
        description="Asks every node of a job for its health history (the exporter's query API, in "
                    "parallel), reads the job's log if given, and names the infrastructure events "
                    "that explain the failure, ranked; or says there are none. Exit 0 no "
                    "infrastructure evidence, 1 inconclusive (nodes unreachable), 2 suspect(s) found, "
                    "3 cannot answer.")
    which = p.add_argument_group("the job (--job, --k8s-job, --pytorchjob, or --nodes with --start)")
    which.add_argument("--job", metavar="ID", help="a Slurm job id (sacct, else scontrol show job)")
    which.add_argument("--k8s-job", metavar="NAMESPACE/NAME",
                       help="a Kubernetes Job (batch/v1): its pods' nodes and times")
    which.add_argument("--pytorchjob", metavar="NAMESPACE/NAME",
                       help="a Kubeflow PyTorchJob (kubeflow.org/v1): its pods' nodes and times")
    which.add_argument("--kubeconfig", metavar="FILE",
                       help="with --k8s-job/--pytorchjob: this kubeconfig (default: in-cluster, else "
                            "$KUBECONFIG or ~/.kube/config)")
    which.add_argument("--job-nodes", metavar="HOSTLIST",
                       help="with --job: the job's nodes as a Slurm hostlist (an EpilogSlurmctld's "
                            "$SLURM_JOB_NODELIST), in place of those Slurm lists (a completing job lists "
                            "only the nodes still completing)")
    which.add_argument("--nodes", metavar="A,B,..", help="the job's nodes, by name")
    which.add_argument("--start", metavar="TIME", help="the job's start: Unix seconds or ISO 8601 "
                       "(without a zone: this host's local time)")
    which.add_argument("--end", metavar="TIME", help="the job's end / failure (default: now)")
    src = p.add_argument_group("the evidence")
    src.add_argument("--api-url", default=DEFAULT_TEMPLATE, metavar="TEMPLATE",
                     help=f"each node's API base URL, {{node}} replaced by its name "
                          f"(default {DEFAULT_TEMPLATE})")
    src.add_argument("--node-url", action="append", default=[], metavar="NODE=URL",
                     help="this node's API base URL instead of the template's (repeatable)")
    src.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                     help="per node, for all it is asked (default 10)")
    src.add_argument("--workers", type=int, default=64, metavar="N", help="nodes asked at once (default 64)")
    src.add_argument("--cacert", metavar="FILE", help="CA certificate of the exporters' TLS")
    src.add_argument("--cert", metavar="FILE", help="client certificate (exporters requiring one)")
    src.add_argument("--key", metavar="FILE", help="its key")
    src.add_argument("--user", metavar="NAME", help="basic auth user of the exporters' web config")
    src.add_argument("--password-file", type=Path, metavar="FILE", help="basic auth password (first line)")
    src.add_argument("--log", type=Path, metavar="FILE",
                     help="the job's log: NCCL watchdog lines, NCCL warnings and settings")
    src.add_argument("--flight-recorder", type=Path, metavar="DIR",
                     help="the job's PyTorch Flight Recorder dumps (<prefix><rank> files; a folder per "
                          "node names the node): the ranks that never entered the stuck collective")
    src.add_argument("--nccl-env", action="append", default=[], metavar="NAME=VALUE",
                     help="the job's NCCL settings (NCCL_IB_TIMEOUT=.., NCCL_IB_RETRY_CNT=..; repeatable); "
                          "default: what the log says NCCL read, else NCCL's defaults")
    src.add_argument("--nccl-version", metavar="X.Y.Z", help="the job's NCCL (default: from the log)")
    src.add_argument("--watchdog-timeout", type=float, metavar="SECONDS",
                     help="the job's collective timeout (default: from the log, else PyTorch's 600)")
    src.add_argument("--onset-margin", type=float, default=ONSET_MARGIN_S, metavar="SECONDS",
                     help="how long before the expected cause (the failure minus the watchdog timeout) a "
                          "fault may have set off the failure: the onset window runs from there to the "
                          f"failure (default {ONSET_MARGIN_S:g}: a step and a teardown)")
    prom.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the JSON verdict (schema gpumon.why/v1)")
    p.add_argument("--metrics-file", type=Path, metavar="FILE",
                   help="count this post-mortem in a node_exporter textfile-collector file "
                        "(gpumon_why_verdicts_total{verdict}; e.g. /var/lib/prometheus/node-exporter/"
                        "gpumon_why.prom)")


def _pairs(values: Sequence[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{flag} {v!r}: expected NAME=VALUE", key=flag)
        out[key.strip()] = value.strip()
    return out


def _count(path: Path, verdict: str) -> None:
    from gpumon.why.metrics import count_verdict
    try:
        count_verdict(path, verdict)
    except OSError as exc:
        # the verdict matters more than its count: said, not fatal
        print(f"gpumon why: cannot update {path}: {exc.strerror or exc}", file=sys.stderr)


def resolve(args: argparse.Namespace) -> Job:
    given = [flag for flag, value in (("--job", args.job), ("--k8s-job", args.k8s_job),
                                      ("--pytorchjob", args.pytorchjob),
                                      ("--nodes/--start/--end", args.nodes or args.start or args.end))
             if value]
    if len(given) > 1:
        raise ConfigError(f"one job at a time: {' and '.join(given)} given", key="why")
    if args.job_nodes and not args.job:
        raise ConfigError("--job-nodes goes with --job", key="why")
    if args.kubeconfig and not (args.k8s_job or args.pytorchjob):
        raise ConfigError("--kubeconfig goes with --k8s-job or --pytorchjob", key="why")
    if args.job:
        return slurm_job(args.job, nodes=args.job_nodes)
    if args.k8s_job or args.pytorchjob:
        flag = "--k8s-job" if args.k8s_job else "--pytorchjob"
        try:
            require("kubernetes", extra="kubernetes", library="the kubernetes client",
                    needed_by="reading the job from Kubernetes")
        except ExtraMissing as exc:
            raise ConfigError(str(exc), key=flag) from None
        from gpumon.why import kube  # the kubernetes client only where it is used
        if args.k8s_job:
            return kube.kubernetes_job(args.k8s_job, kubeconfig=args.kubeconfig)
        return kube.pytorch_job(args.pytorchjob, kubeconfig=args.kubeconfig)
    if not (args.nodes and args.start):
        raise ConfigError("which job? --job ID (Slurm), --k8s-job or --pytorchjob NAMESPACE/NAME "
                          "(Kubernetes), or --nodes A,B and --start TIME [--end TIME]", key="why")
    return explicit_job(args.nodes, args.start, args.end)


def main(args: argparse.Namespace) -> int:
    if args.timeout <= 0 or args.workers < 1:
        raise ConfigError("--timeout must be > 0 and --workers >= 1", key="why")
    if not args.onset_margin >= 0:
        raise ConfigError("--onset-margin must be >= 0", key="why")
    try:
        job = resolve(args)
    except JobError:
        if args.metrics_file is not None:  # a post-mortem that could not even find its job counts too
            _count(args.metrics_file, "cannot_answer")
        raise
    log: JobLog | None = None
    if args.log is not None:
        try:
            log = parse_file(args.log)
        except OSError as exc:
            raise ConfigError(f"cannot read the job log: {exc.strerror or exc}", file=str(args.log)) from None
    flight = None
    if args.flight_recorder is not None:
        from gpumon.why.flight import read_dir
        try:
            flight = read_dir(args.flight_recorder)
        except OSError as exc:
            raise ConfigError(f"cannot read the Flight Recorder dumps: {exc.strerror or exc}",
                              file=str(args.flight_recorder)) from None
    env = dict(log.nccl_env) if log is not None else {}
    env.update(_pairs(args.nccl_env, "--nccl-env"))
    nccl = nccl_settings(env, args.nccl_version or (log.nccl_version if log is not None else None))
    password = None
    if args.password_file is not None:
        try:
            lines = args.password_file.read_text().splitlines()
            password = lines[0] if lines else ""
        except OSError as exc:
            raise ConfigError(f"cannot read the password file: {exc.strerror or exc}",
                              file=str(args.password_file)) from None
    access = Access(args.api_url, _pairs(args.node_url, "--node-url"), args.user, password, args.cacert,
                    args.cert, args.key)
    now = time.time()
    end = job.end if job.end is not None else now
    # a minute after the end: a check that saw the fault a sample late, the reboot that followed
    since, until = job.start - LEAD_S, end + 60.0
    # Prometheus: only for the nodes whose API does not answer (theirs is the richer history), or
    # for all with --prometheus-only
    prom_access = prom.from_args(args)
    if prom_access is not None and args.prometheus_only:
        nodes = prom.fetch(job.nodes, prom_access, since, min(until, now))
    else:
        nodes = collect(job.nodes, access, since, until, timeout_s=args.timeout, workers=args.workers)
        if prom_access is not None:
            nodes = prom.fill_in(nodes, prom_access, since, min(until, now))
    verdict = Reasoner(job, nodes, log, nccl, now=now, watchdog_s=args.watchdog_timeout,
                       flight=flight, onset_margin_s=args.onset_margin).judge()
    if args.metrics_file is not None:
        _count(args.metrics_file, verdict.verdict)
    if args.json:
        print(json.dumps(to_json(verdict), indent=2, default=str))
    else:
        from gpumon.report import console_for
        print_verdict(verdict, console_for())
    return verdict.exit_code

