"""``gpumon why --job ID`` on a real Slurm cluster: the four job scenarios of issue 21, and the
EpilogSlurmctld of contrib/slurm-epilog-why.sh.

The fabric tests' harness (tests/fabric: TestNet, SlurmCluster): slurmctld and munged in the switch
namespace (host ``ctl``), one slurmd per test host node0..node2 in its own network namespace, and
on each host a ``gpumon daemon --simulate`` over its own simulated node (its own sim dir and host
root), its exporter and query API on the host's address. The job is a real gloo all_reduce loop
started by ``srun`` over the hosts' eth0 (tests/why/why_job.py, collective timeout 12 s).

Faults are what a real node would show, when it would show them: the simulated node's files are
rendered by the simulator itself (``SimNode.render``) from its scenario file with the fault
appended at the node's current time (the daemon's scenario time), so the host root's sysfs, the
kernel log and the NVML state change while the daemon watches, as on hardware.

Scenarios, in this order on one cluster (each leaves the cluster as the next needs it):

3. rank 0 raises an application error -> "no infrastructure evidence", no drain;
1. node1's IB port mlx5_0/1 goes down (its veth down, and its sysfs port state DOWN) past the
   job's collective timeout -> the job dies -> node1 ib/mlx5_0/1 named, the outage's start
   relative to the job's end; the epilog drains node1 with gpumon's reason;
4. node2's daemon is down -> node2 unreachable, node0 and node1 judged: inconclusive, no drain;
2. node0's GPU 0 falls off the bus (Xid 79, NVML GPU_IS_LOST) and its rank dies -> node0 gpu/0
   named; the epilog drains node0.

The controller keeps accounting in slurmdbd over a MariaDB server (tests/fabric/slurm_accounting.py),
as production clusters do: ``why --job`` reads the job from sacct, and the epilog stores its verdict
in the job's AdminComment through ``sacctmgr modify job`` (a finished job's is in the database).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from fabric.netns import SBIN_PATH, TestNet
from fabric.probe_run import rank_env
from fabric.slurm_cluster import SlurmCluster, require_slurm

from conftest import clean_env
from live_faults import end_fault, start_fault

ROOT = Path(__file__).resolve().parents[2]
EPILOG = ROOT / "contrib" / "slurm-epilog-why.sh"
JOB = Path(__file__).with_name("why_job.py")
BIN = Path(sys.executable).parent
PORT = 9426
MASTER_PORT = 29611
COLLECTIVE_TIMEOUT_S = 12.0  # above NCCL's shortest IB retry window (7.5 s), as a real watchdog is
NODES = 3


@dataclass
class Cluster:
    net: TestNet
    slurm: SlurmCluster
    base: Path
    daemons: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)

    def host(self, node: str) -> int:
        return next(h.index for h in self.net.hosts if h.name == node)

    def sim_dir(self, node: str) -> Path:
        return self.base / node / "sim"

    def scenario(self, node: str) -> Path:
        return self.base / node / "scenario.yaml"

    def start_daemon(self, node: str) -> None:
        h = self.net.hosts[self.host(node)]
        with (self.base / node / "daemon.log").open("a") as log:
            self.daemons[node] = self.net.popen(
                h.index, [str(BIN / "gpumon"), "--config", str(self.base / node / "gpumon.yaml"), "daemon",
                          "--simulate", str(self.scenario(node)), "--sim-dir", str(self.sim_dir(node)),
                          "--listen", f"{h.ip}:{PORT}"],
                env=clean_env(), stdout=subprocess.DEVNULL, stderr=log)

    def stop_daemon(self, node: str) -> None:
        proc = self.daemons.pop(node)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def api(self, node: str, path: str) -> dict[str, Any] | None:
        """GET a node's query API from the controller's namespace (the test's own namespace has no
        route to the hosts); None when it does not answer."""
        ip = self.net.hosts[self.host(node)].ip
        code = ("import sys,urllib.request\ntry:\n"
                f" print(urllib.request.urlopen('http://{ip}:{PORT}{path}', timeout=3).read().decode())\n"
                "except Exception as e:\n print('{}')\n")
        proc = self.slurm.client([sys.executable, "-c", code], timeout=20)
        try:
            doc = json.loads(proc.stdout or "{}")
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and doc.get("api") == 1 else None

    def wait_api(self, node: str, want: Any, what: str, timeout: float = 60,
                 path: str = "/api/v1/findings") -> dict[str, Any]:
        """Poll ``node``'s ``path`` until ``want(doc)``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.api(node, path)
            if doc is not None and want(doc):
                return doc
            time.sleep(0.3)
        raise AssertionError(f"{node}: {what} not seen within {timeout} s\n"
                             + (self.base / node / "daemon.log").read_text(errors="replace")[-3000:])

    def wait_history(self, node: str) -> None:
        """Until the node's daemon watches it: its history has begun (the boot it first saw)."""
        self.wait_api(node, lambda doc: doc["count"] > 0, "the daemon's first events", path="/api/v1/events")

    def fault(self, node: str, fault: dict[str, Any]) -> dict[str, Any]:
        """``fault`` rendered into the node now, while its daemon watches (tests/live_faults.py)."""
        return start_fault(self.scenario(node), self.sim_dir(node), fault)

    def end_fault(self, node: str, kind: str) -> None:
        end_fault(self.scenario(node), self.sim_dir(node), kind)


def _epilog_wrapper(base: Path) -> Path:
    """EpilogSlurmctld: the contrib script with its settings file, its output kept per job.
    slurmctld runs it with the job's variables, no PATH and no SLURM_CONF."""
    wrapper = base / "epilog-slurmctld"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"out={base}/epilog-$SLURM_JOB_ID\n"
        'env > "$out.env"\n'
        f"GPUMON_WHY_DEFAULTS={base / 'gpumon-why.defaults'} {EPILOG} >\"$out.log\" 2>&1\n"
        'echo "$?" > "$out.rc"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def _epilog_defaults(base: Path, net: TestNet, slurm_conf: Path) -> None:
    """What a site's /etc/default/gpumon-why says: where gpumon, Slurm's config and the nodes' APIs
    are (the controller's namespace resolves no node name: by address), a textfile for the counter."""
    urls = " ".join(f"--node-url {h.name}=http://{h.ip}:{PORT}" for h in net.hosts)
    (base / "gpumon-why.defaults").write_text(
        f"PATH={SBIN_PATH}\n"
        f"GPUMON={BIN / 'gpumon'}\n"
        f"SLURM_CONF={slurm_conf}\n"
        f"GPUMON_WHY_ARGS='{urls} --timeout 5 --watchdog-timeout {COLLECTIVE_TIMEOUT_S:g}'\n"
        f"GPUMON_WHY_METRICS_FILE={base / 'textfile' / 'gpumon_why.prom'}\n"
        # 1 node of 3 is 33 %: the default 20 % breaker would refuse the first drain
        "GPUMON_WHY_MAX_PERCENT=50\n")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_slurm()
    base = tmp_path_factory.mktemp("whyslurm")
    # the hosts file names the nodes inside the namespaces: `why --api-url http://{node}:9426` as
    # on a cluster with DNS
    with TestNet(NODES, hosts_file=True) as net:
        wrapper = _epilog_wrapper(base)
        with SlurmCluster(net, extra_conf=[f"EpilogSlurmctld={wrapper}"], accounting=True) as slurm:
            _epilog_defaults(base, net, slurm.conf)
            made = Cluster(net, slurm, base)
            for h in net.hosts:
                d = base / h.name
                d.mkdir()
                made.scenario(h.name).write_text(yaml.safe_dump(
                    {"name": h.name, "sku": "h100-sxm", "gpus": 8, "faults": []}))
                (d / "gpumon.yaml").write_text(f"node_name: {h.name}\n")
                made.start_daemon(h.name)
            try:
                for h in net.hosts:
                    made.wait_history(h.name)
                yield made
            finally:
                for node in list(made.daemons):
                    made.stop_daemon(node)


@dataclass
class Run:
    job: str
    pids: dict[str, int]  # node -> its rank's pid
    proc: subprocess.Popen[str]
    out: Path
    started: float

    def text(self) -> str:
        return self.out.read_text(errors="replace")


def _start_job(c: Cluster, name: str, *args: str, timeout: float = 90) -> Run:
    out = c.base / f"{name}.out"
    env = rank_env(MASTER_ADDR=c.net.hosts[0].ip, MASTER_PORT=str(MASTER_PORT))
    with out.open("w") as fh:
        proc = c.slurm.srun_popen(
            [f"--job-name={name}", sys.executable, str(JOB), "--timeout", f"{COLLECTIVE_TIMEOUT_S:g}", *args],
            nodes=NODES, env=env, text=True, stdout=fh, stderr=subprocess.STDOUT)
    started = time.time()
    run = Run("", {}, proc, out, started)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = proc.poll() is not None
        ready = [json.loads(line) for line in run.text().splitlines() if line.startswith('{"ready"')]
        if len(ready) == NODES:
            run.job = str(ready[0]["job"])
            run.pids = {r["host"]: int(r["pid"]) for r in ready}
            return run
        if ended:
            break
        time.sleep(0.2)
    proc.kill()
    c.slurm.cancel_all()
    raise AssertionError(f"job {name} never had every rank ready:\n{run.text()[-4000:]}\n{c.slurm.logs()}")


def _wait_end(c: Cluster, run: Run, timeout: float = 90) -> int:
    try:
        return run.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        c.slurm.cancel_all()
        raise AssertionError(f"job {run.job} did not end:\n{run.text()[-4000:]}") from None


def _epilog(c: Cluster, job: str, timeout: float = 90) -> str:
    """The EpilogSlurmctld's output for ``job`` once it finished (its exit status must be 0)."""
    rc = c.base / f"epilog-{job}.rc"
    deadline = time.monotonic() + timeout
    while not rc.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rc.exists(), f"no EpilogSlurmctld for job {job}\n{c.slurm.logs()}"
    log = (c.base / f"epilog-{job}.log").read_text(errors="replace")
    assert rc.read_text().strip() == "0", log
    return log


def _why(c: Cluster, job: str) -> tuple[int, dict[str, Any]]:
    """``gpumon why --job ID`` where Slurm's clients run (the controller's namespace), the nodes by
    name (the hosts file resolves them there)."""
    proc = c.slurm.client([str(BIN / "gpumon"), "why", "--job", job, "--api-url", "http://{node}:9426",
                           "--timeout", "5", "--watchdog-timeout", f"{COLLECTIVE_TIMEOUT_S:g}", "--json"],
                          env=clean_env(SLURM_CONF=str(c.slurm.conf), PATH=SBIN_PATH), timeout=60)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _explain(c: Cluster, doc: dict[str, Any]) -> str:
    """What a failed verdict needs to be understood after the run: the verdict, its notes whole,
    the job and nodes as `why` saw them, and each daemon's log (the test's tmp dir is gone by then)."""
    parts = [json.dumps({k: doc.get(k) for k in ("verdict", "notes", "job", "nodes", "suspects")},
                        indent=1, default=str)]
    for h in c.net.hosts:
        path = c.base / h.name / "daemon.log"
        if path.exists():
            parts.append(f"--- {h.name} daemon.log (tail)\n" + path.read_text(errors="replace")[-2500:])
    return "\n".join(parts)


def _comment(c: Cluster, job: str, log: str) -> str:
    """The job's AdminComment as the accounting database has it (``sacct -o AdminComment``): the
    one the epilog logged, lower-cased and without quotes (what sacctmgr 22.05 stores of it)."""
    lines = [line.split(": ", 2)[2] for line in log.splitlines()
             if line.startswith(f"gpumon-why-epilog: job {job}: gpumon why: ")]
    assert len(lines) == 1, log
    assert "AdminComment not stored" not in log, log
    out = c.slurm.client([c.slurm.exe["sacct"], "--noheader", "--parsable2", "-X", "-j", job,
                          "-o", "AdminComment%400"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == lines[0].lower().replace('"', "").replace("'", ""), (out.stdout, log)
    return lines[0]


def _metrics(c: Cluster) -> dict[str, float]:
    text = (c.base / "textfile" / "gpumon_why.prom").read_text()
    out = {}
    for line in text.splitlines():
        if line.startswith("gpumon_why_verdicts_total{"):
            key, value = line.rsplit(" ", 1)
            out[key.split('"')[1]] = float(value)
    return out


def _common(doc: dict[str, Any], run: Run, job_end: float) -> None:
    job = doc["job"]
    assert job["id"] == run.job and job["source"] == "sacct", job
    assert job["nodes"] == ["node0", "node1", "node2"]
    # Slurm's local times without a zone, read as local time: they agree with this host's clock
    # (Slurm counts whole seconds). ``job_end`` is when srun's exit was seen: after the job's end, by
    # however long a busy machine's srun took to hear of it (3 s beside a CPU hog) — a zone read
    # wrong would be hours off
    assert run.started - 2 <= job["start"] <= run.started + 30, (job, run.started)
    assert job_end - 30 <= job["end"] <= job_end + 2, (job, job_end)


# -- the scenarios, in order -----------------------------------------------------------------------


def test_application_exception_is_no_infrastructure_evidence(cluster: Cluster) -> None:
    c = cluster
    run = _start_job(c, "app-bug", "--raise-at", "20")
    rc = _wait_end(c, run)
    ended = time.time()
    assert rc != 0 and "loss is NaN at step 20" in run.text()
    log = _epilog(c, run.job)
    code, doc = _why(c, run.job)
    assert code == 0 and doc["verdict"] == "no_infrastructure_evidence", _explain(c, doc)
    _common(doc, run, ended)
    assert doc["suspects"] == [] and doc["unreachable"] == [] and doc["culprits"] == []
    assert all(n["reachable"] for n in doc["nodes"])
    # the epilog: the verdict in the AdminComment, nobody drained
    comment = _comment(c, run.job, log)
    assert comment == "gpumon why: no infrastructure evidence (look at the application)", (comment, log)
    assert c.slurm.sinfo_reasons() == {}
    env = dict(line.split("=", 1) for line in (c.base / f"epilog-{run.job}.env").read_text().splitlines()
               if "=" in line)
    # what the controller gives an EpilogSlurmctld: wait statuses, the job's and its steps' highest
    # (which of them says the failure varies: srun's kill of the other ranks races rank 0's exit)
    assert env["SLURM_JOB_ID"] == run.job, env
    assert (env["SLURM_JOB_EXIT_CODE"], env["SLURM_JOB_DERIVED_EC"]) != ("0", "0"), env
    assert env["SLURM_SCRIPT_CONTEXT"] == "epilog_slurmctld" and "SLURM_CONF" not in env
    assert _metrics(c) == {"infrastructure": 0, "no_infrastructure_evidence": 1, "inconclusive": 0,
                           "cannot_answer": 0}, log


def test_ib_port_down_past_the_collective_timeout_names_the_node_and_port(cluster: Cluster) -> None:
    c = cluster
    run = _start_job(c, "ib-down")
    i = c.host("node1")
    cut = time.time()
    c.net.link_down(i)
    c.fault("node1", {"kind": "ib_down", "device": "mlx5_0", "port": 1})
    rendered = time.time()  # a busy machine may take seconds to cut the link and render the port down
    try:
        # the ranks on node0 and node2 give up after the collective timeout
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S + 60
        while time.monotonic() < deadline and "Timed out" not in run.text() and run.proc.poll() is None:
            time.sleep(0.2)
        died = time.time()
        assert died - cut >= COLLECTIVE_TIMEOUT_S - 1, run.text()
    finally:
        # node1 back (its veth carries Slurm's traffic too: the job ends once its slurmstepd reports)
        c.net.link_up(i)
        c.end_fault("node1", "ib_down")
    rc = _wait_end(c, run)
    ended = time.time()
    assert rc != 0, run.text()
    try:
        log = _epilog(c, run.job)
        # the port's recovery in node1's history (its outage then has an end and a length)
        c.wait_api("node1", lambda doc: not any(
            f["component"] == "ib/mlx5_0/1" and "ongoing_outage_s" in f["evidence"] for f in doc["findings"]),
            "the IB port back up")
        code, doc = _why(c, run.job)
        assert code == 2 and doc["verdict"] == "infrastructure", _explain(c, doc)
        _common(doc, run, ended)
        top = doc["suspects"][0]
        assert (top["node"], top["component"], top["what"], top["tier"]) == ("node1", "ib/mlx5_0/1",
                                                                           "ib_outage", 1), doc["suspects"]
        # the outage's start, relative to the job's end: before it, by about the collective timeout
        # and more (the job ends once node1 is back)
        assert cut - 2.0 <= top["evidence"]["start"] <= rendered + 2.0, (cut, rendered, top)
        # (counted from the recorded start: beside a CPU hog the port was rendered down 2.5 s after
        # the cut, and the job still failed a collective timeout after the cut, not after that)
        late = top["evidence"]["start"] - cut
        assert -60 < top["relative_s"] <= late - (COLLECTIVE_TIMEOUT_S - 2), (late, top)
        assert top["evidence"]["down_s"] > doc["nccl"]["retry_window_s"] and top["evidence"]["end"], top
        assert not [s for s in doc["suspects"] if s["node"] != "node1"], doc["suspects"]
        # the epilog: the suspect in the AdminComment, node1 drained with gpumon's reason
        comment = _comment(c, run.job, log)
        assert comment.startswith("gpumon why: infrastructure; #1 node1 ib/mlx5_0/1 -"), (comment, log)
        reasons = c.slurm.sinfo_reasons()
        assert set(reasons) == {"node1"}, (reasons, log)
        assert reasons["node1"][1].startswith(
            f"gpumon: check_cables: why job {run.job}: ib/mlx5_0/1 down"), reasons
        assert _metrics(c)["infrastructure"] == 1
    finally:
        c.slurm.resume("node1")


def test_a_node_whose_daemon_is_down_is_unreachable_and_the_others_are_judged(cluster: Cluster) -> None:
    c = cluster
    c.stop_daemon("node2")
    try:
        run = _start_job(c, "daemon-down", "--raise-at", "10")
        rc = _wait_end(c, run)
        ended = time.time()
        assert rc != 0
        log = _epilog(c, run.job)
        code, doc = _why(c, run.job)
        assert code == 1 and doc["verdict"] == "inconclusive", _explain(c, doc)
        _common(doc, run, ended)
        assert doc["unreachable"] == ["node2"]
        by_node = {n["node"]: n for n in doc["nodes"]}
        assert by_node["node2"]["reachable"] is False and "cannot connect" in by_node["node2"]["error"]
        # node0 and node1 answered and were judged: node1's IB outage of the last job is not this job's
        assert by_node["node0"]["reachable"] and by_node["node1"]["reachable"]
        assert by_node["node1"]["events"] > 0 and doc["suspects"] == []
        assert any(i["node"] == "node1" and i["what"] == "ib_outage" for i in doc["timeline"])
        comment = _comment(c, run.job, log)
        assert comment == ("gpumon why: inconclusive (no suspect on the nodes that answered); "
                           "unreachable: node2"), (comment, log)
        assert c.slurm.sinfo_reasons() == {}, "never a drain on an inconclusive verdict"
        assert _metrics(c)["inconclusive"] == 1
    finally:
        c.start_daemon("node2")


def test_gpu_fallen_off_the_bus_and_its_rank_dead_is_named(cluster: Cluster) -> None:
    c = cluster
    c.wait_history("node2")
    run = _start_job(c, "gpu-lost")
    c.fault("node0", {"kind": "xid", "gpu": 0, "code": 79})
    # the GPU is gone once the node's daemon says so; then its rank's next CUDA call fails: here
    # the rank is killed, as the process of a rank whose GPU fell off the bus dies
    c.wait_api("node0", lambda doc: any(f["check"] == "xid" and f["component"] == "gpu/0"
                                        for f in doc["health"]["faults"]), "Xid 79 on gpu/0")
    lost = time.time()
    os.kill(run.pids["node0"], signal.SIGKILL)
    rc = _wait_end(c, run)
    ended = time.time()
    assert rc != 0
    try:
        log = _epilog(c, run.job)
        code, doc = _why(c, run.job)
        assert code == 2 and doc["verdict"] == "infrastructure", _explain(c, doc)
        _common(doc, run, ended)
        top = doc["suspects"][0]
        assert (top["node"], top["component"], top["tier"]) == ("node0", "gpu/0", 1), doc["suspects"]
        assert top["what"] in ("xid", "gpu_lost"), top
        assert any(s["what"] == "xid" and s["evidence"] == {"code": 79, "action": "reboot_node"}
                   for s in doc["suspects"] if s["node"] == "node0"), doc["suspects"]
        # at the end, within the second Slurm floors the end to (the rank died with its GPU)
        assert top["time"] == pytest.approx(lost, abs=5.0) and -10 <= top["relative_s"] <= 1.0, top
        assert not [s for s in doc["suspects"] if s["node"] != "node0"], doc["suspects"]
        assert doc["unreachable"] == []
        comment = _comment(c, run.job, log)
        assert comment.startswith("gpumon why: infrastructure; #1 node0 gpu/0 "), (comment, log)
        reasons = c.slurm.sinfo_reasons()
        assert set(reasons) == {"node0"}, (reasons, log)
        assert reasons["node0"][1].startswith(f"gpumon: reboot_node: why job {run.job}: gpu/0"), reasons
        assert _metrics(c) == {"infrastructure": 2, "no_infrastructure_evidence": 1, "inconclusive": 1,
                               "cannot_answer": 0}
    finally:
        c.slurm.resume("node0")
