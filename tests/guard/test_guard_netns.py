"""gpumon.guard across real hosts: three test hosts in network namespaces (the fabric probe's harness,
tests/fabric/netns.py), one torchrun each (c10d rendezvous on host 0), one rank each, real gloo DDP
over the hosts' eth0, and on every host its own gpumon daemon, a real slurmd of a real Slurm cluster
(tests/fabric/slurm_cluster.py) and its own simulated GPU node (NVML injection library).

Each host is its own node to the guard: its own host name (a UTS namespace), ``NODE_NAME`` (as
Kubernetes' downward API sets it), its own guard spool (``$GPUMON_GUARD_DIR`` = the simulated
node's /var/lib/gpumon/guard, which its daemon reads) and a GPU of its own simulated node that its
CPU rank poses as (``netns_ranks.posed_identify``: the only stand-in, for CUDA's device UUID; the
GPU is then named through NVML by UUID as on a GPU node). Faults come from outside the guard's code
(the SDC fault harness in ``netns_ranks.py``; a SIGKILL from this test). Every scenario runs in one
launch (torch's import and DDP's start are paid once); the module's first test pays for it.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fabric.netns import TestNet
from fabric.probe_run import GPUMON, TORCHRUN, rank_env, stop
from fabric.slurm_cluster import SlurmCluster, require_slurm

from gpumon.guard import attestation as at
from gpumon.guard import verdict as vf
from gpumon.guard.cli import checkpoints
from gpumon.sim import nvml_inject
from gpumon.sim.nvml_state import read_state

from . import cpu_cgroup

RANKS = Path(__file__).with_name("netns_ranks.py")
SCENARIOS = "healthy,nan,audit,flip,load,slow,dies"
# the host each fault is on (the rank there is the rendezvous' choice); dies: not host 0, whose
# torchrun agent holds the job's store; load: twice the others' micro-batches; slow: a CPU quota
FAULT_HOSTS = {"nan": "node2", "audit": "node1", "flip": "node0", "load": "node2", "slow": "node1",
               "dies": "node2"}
# the GPU of its simulated node each host's rank poses as
POSED_GPU = {"node0": 3, "node1": 5, "node2": 6}
HEALTHY_STEPS = 1000
PORT = 29870
METRICS_PORT = 9426
DAEMON_WAIT_S = 30.0  # for the daemons' check, /metrics and the drain


@dataclass
class Job:
    net: TestNet
    cluster: SlurmCluster
    base: Path
    out: Path
    cgroups: Path  # the straggler scenarios' CPU cgroups (cpu_cgroup.py)
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> what its rank saw
    codes: dict[str, int | None] = field(default_factory=dict)  # host -> torchrun's exit code
    killed: dict[str, Any] = field(default_factory=dict)
    daemons: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds each part of the launch took

    def sim(self, host: str) -> Path:
        return self.base / host / "sim"

    def spool(self, host: str) -> Path:
        return self.sim(host) / "host" / vf.DEFAULT_DIR.lstrip("/")

    def rank_of(self, host: str) -> int:
        return int(self.ranks[host]["rank"])

    def index(self, host: str) -> int:
        return next(h.index for h in self.net.hosts if h.name == host)

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.base.glob("*/torchrun.log")))


def daemon_config(base: Path, host: str, ip: str) -> Path:
    """The node's gpumon.yaml: its name, the guard check every second, /metrics on its address,
    Slurm remediation enforced on its own Slurm node; the simulated node's other checks off (they
    are not what this test is about, and cost CPU the training needs)."""
    others = ("collective_hang", "fabric", "gpu_presence", "ib", "memory", "nvlink", "nvswitch", "pcie",
              "sdc_canary", "thermal", "throttle", "xid")
    # the confirmation of a persistent verdict: the canary on the posed GPU and one other (a majority
    # needs two beside it... three GPUs), one quick workload; it runs only once a verdict asks for it
    posed = POSED_GPU.get(host, 0)
    confirm_gpus = sorted({posed, (posed + 1) % 8, (posed + 2) % 8})
    lines = [f"node_name: {host}", f"state_dir: {base / host / 'state'}", "checks:",
             "  guard: {interval_s: 1}", *(f"  {c}: {{enabled: false}}" for c in others),
             f"  sdc_confirm: {{interval_s: 1, iterations: 1, workloads: [gemm_fp32], gpus: {confirm_gpus}}}",
             f"exporter: {{enabled: true, listen: '{ip}:{METRICS_PORT}'}}",
             "remediation:", "  backend: slurm", "  mode: enforce", "  interval_s: 1",
             f"  slurm: {{node_name: {host}}}"]
    path = base / host / "gpumon.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _wait(what: str, predicate: Any, timeout: float, detail: Any = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s\n{detail()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    require_slurm()
    lib_dir = nvml_inject.build_library()
    base = tmp_path_factory.mktemp("guardnet")
    out = base / "out"
    out.mkdir()
    t0 = time.monotonic()
    with (cpu_cgroup.cgroups("gpumon-guardnet", ("node0", "node1", "node2")) as groups,
          TestNet(3) as net, SlurmCluster(net) as cluster):
        j = Job(net, cluster, base, out, groups)
        j.phases["slurm"] = time.monotonic() - t0
        try:
            _run(j, lib_dir)
            yield j
        finally:
            for d in j.daemons.values():
                d.terminate()
            for d in j.daemons.values():
                stop(d)
            for h in net.hosts:
                cluster.resume(h.name)


def _run(j: Job, lib_dir: Path) -> None:
    net = j.net
    t0 = time.monotonic()
    # every node's daemon first: it renders its simulated node (the GPUs the ranks pose as)
    for h in net.hosts:
        cfg = daemon_config(j.base, h.name, h.ip)
        j.spool(h.name).mkdir(parents=True, exist_ok=True)
        j.spool(h.name).chmod(0o1777)  # as docs/guard/index.md asks of a node's spool
        with (j.base / h.name / "daemon.log").open("w") as log:
            j.daemons[h.name] = net.popen(
                h.index, [GPUMON, "daemon", "--simulate", "healthy-8xh100", "--sim-dir", str(j.sim(h.name)),
                          "--config", str(cfg)],
                env={**rank_env(), **j.cluster.env}, hostname=h.name, stdout=log, stderr=subprocess.STDOUT)
    for h in net.hosts:
        _wait(f"{h.name}'s simulated node", (j.sim(h.name) / "nvml-state.txt").is_file, 60,
              lambda h=h: (j.base / h.name / "daemon.log").read_text())
    j.phases["daemons"] = time.monotonic() - t0
    agents: dict[str, subprocess.Popen[Any]] = {}
    for h in net.hosts:
        uuid = read_state(j.sim(h.name) / "nvml-state.txt").gpus[POSED_GPU[h.name]].uuid
        env = nvml_inject.subprocess_env(lib_dir, j.sim(h.name) / "nvml-state.txt", base=rank_env(
            NODE_NAME=h.name, GPUMON_GUARD_DIR=str(j.spool(h.name)),
            GUARD_FAULT_HOSTS=json.dumps(FAULT_HOSTS), GUARD_HEALTHY_STEPS=str(HEALTHY_STEPS),
            GUARD_PACE_CGROUP=str(j.cgroups),
            GUARD_POSED_GPU_UUID=uuid.removeprefix("GPU-")))  # as torch reports a CUDA device's UUID
        argv = [TORCHRUN, "--nnodes=3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={net.hosts[0].ip}:{PORT}", "--rdzv-id=gpumon-guard-netns",
                f"--rdzv-conf=is_host={int(h.index == 0)}", f"--local-addr={h.ip}", "--max-restarts=0",
                "--monitor-interval=0.5", str(RANKS), str(j.out), SCENARIOS]
        with (j.base / h.name / "torchrun.log").open("w") as log:
            # the host's mounts kept: the ranks move themselves between CPU cgroups (the straggler
            # scenarios), and ``ip netns exec``'s fresh /sys has no cgroup tree
            agents[h.name] = net.popen(h.index, argv, env=env, hostname=h.name, stdout=log,
                                       stderr=subprocess.STDOUT, keep_mounts=True)
    # the rank that is to die stops in the audit's rebuild of a micro-batch: kill it there
    dying = j.out / "rank-dying.json"
    _wait("the rank to kill reaches the audit", lambda: dying.is_file() or any(
        a.poll() not in (None, 0) for a in agents.values()), 150, j.logs)
    assert dying.is_file(), j.logs()
    j.killed = json.loads(dying.read_text())
    os.kill(j.killed["pid"], signal.SIGKILL)
    j.killed["at"] = time.monotonic()
    j.phases["training"] = j.killed["at"] - t0 - j.phases["daemons"]
    results = [j.out / f"rank{r}.json" for r in range(3)]

    def survivors_done() -> bool:
        done = [json.loads(p.read_text()) for p in results if p.is_file()]  # written atomically
        return sum("dies" in d for d in done) == 2

    _wait("the survivors finish", survivors_done, 60, j.logs)
    j.wall_s = time.monotonic() - t0
    j.phases["after_kill"] = time.monotonic() - j.killed["at"]
    print(f"guard netns launch: {j.phases}", flush=True)
    # the survivors' agents would wait for the dead one's at torchrun's exit barrier (300 s)
    _wait("the dead rank's torchrun exits", lambda: agents[FAULT_HOSTS["dies"]].poll() is not None, 10)
    for a in agents.values():
        if a.poll() is None:
            a.terminate()
    for name, a in agents.items():
        stop(a, grace=5)
        j.codes[name] = a.returncode
    for p in results:
        got = json.loads(p.read_text())
        j.ranks[got["nodes"][got["rank"]]] = got


def _subject(v: dict[str, Any]) -> tuple[int, str, str, str | None]:
    s = v["subject"]
    return s["rank"], s["host"], s["node_name"], s["gpu_uuid"]


def _posed(j: Job, host: str) -> tuple[str, str]:
    gpu = read_state(j.sim(host) / "nvml-state.txt").gpus[POSED_GPU[host]]
    return gpu.uuid, gpu.pci_bus_id[-12:].lower()  # NVML's 00000000:5D:00.0 as gpumon.hw writes it


def test_the_job_spans_three_hosts_and_a_healthy_1000_steps_raise_no_alarm(job: Job) -> None:
    """Every rank on its own host, named by it; the audit's ring crosses hosts; 1,000 steps with the
    weight check every 50 and the audit every 100: no alarm, no verdict file, replicas equal."""
    assert sorted(job.ranks) == ["node0", "node1", "node2"], job.logs()
    idents = {h: r["healthy"]["identity"] for h, r in job.ranks.items()}
    for host, ident in idents.items():
        uuid, bus = _posed(job, host)
        assert (ident["host"], ident["node_name"], ident["node_name_source"], ident["local_rank"]) == \
            (host, host, "NODE_NAME", 0)
        assert (ident["gpu_uuid"], ident["gpu_pci_bus_id"], ident["gpu_index"]) == \
            (uuid, bus, POSED_GPU[host])
        assert "resolved through NVML by UUID" in ident["gpu_note"]
    # every rank sees the same table: rank -> its own host
    table = [(i["rank"], i["host"]) for i in job.ranks["node0"]["healthy"]["identities"]]
    assert table == sorted((job.rank_of(h), h) for h in job.ranks)
    for host, r in job.ranks.items():
        h = r["healthy"]
        assert h["alarms"] == [] and h["disabled"] is None and h["files"] == [], (host, h["alarms"])
        assert (h["steps"], h["audits"], h["agree"]) == (HEALTHY_STEPS, HEALTHY_STEPS // 100, True)
    finals = {r["healthy"]["final"][0] for r in job.ranks.values()}
    assert len(finals) == 1


def test_nan_in_one_ranks_forward_is_named_on_its_host_before_the_update(job: Job) -> None:
    bad = FAULT_HOSTS["nan"]
    rank = job.rank_of(bad)
    uuid, _ = _posed(job, bad)
    assert job.ranks[bad]["nan"]["injected"] == 1
    for host, r in job.ranks.items():
        (alarm,) = r["nan"]["alarms"]
        assert alarm["step"] == 3 and alarm["ranks"] == [rank] and alarm["skipped"] is True
        assert alarm["unchanged"] is True, host  # no rank's weights changed at step 3, bit for bit
        (v,) = alarm["verdicts"]
        assert (v["check"], v["fault"], v["step"]) == ("nonfinite_grad", "transient", 3)
        assert _subject(v) == (rank, bad, bad, uuid)
        # the rerun on another node's GPU ran on another host
        _again, other = v["evidence"]["reruns"]
        assert other["node"] != bad and other["node"] in job.ranks
    assert len({r["nan"]["final"][0] for r in job.ranks.values()}) == 1
    assert [len(job.ranks[h]["nan"]["files"]) for h in ("node0", "node1", "node2")] == [
        int(h == bad) for h in ("node0", "node1", "node2")]


def test_a_low_bit_in_one_ranks_backward_at_an_audit_step_names_it_not_its_auditor(job: Job) -> None:
    bad = FAULT_HOSTS["audit"]
    rank = job.rank_of(bad)
    uuid, _ = _posed(job, bad)
    for r in job.ranks.values():
        (alarm,) = r["audit"]["alarms"]
        assert alarm["step"] == 5 and alarm["ranks"] == [rank] and alarm["exit_code"] == 17
        assert alarm["unchanged"] is True
        (v,) = alarm["verdicts"]
        assert (v["check"], v["fault"]) == ("audit", "persistent") and _subject(v) == (rank, bad, bad, uuid)
        first = v["evidence"]["disputes"][0]
        own, audit, referee = first["computations"]
        # three computations of the bad rank's micro-batch on three hosts; its auditor is not named
        assert (own["rank"], own["node"]) == (rank, bad)
        assert len({own["node"], audit["node"], referee["node"]}) == 3
        assert audit["rank"] != rank and audit["grads_fingerprint"] == referee["grads_fingerprint"] != \
            own["grads_fingerprint"]
    assert len(job.ranks[bad]["audit"]["files"]) == 1
    assert all(r["audit"]["files"] == [] for h, r in job.ranks.items() if h != bad)


def test_a_flipped_weight_bit_is_named_with_its_parameter_and_the_verified_checkpoint(
        job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    bad = FAULT_HOSTS["flip"]
    rank = job.rank_of(bad)
    f = job.ranks[bad]["flip"]
    assert f.get("flipped_call"), f  # the harness did flip a bit in that rank's update
    expected = f["order"][f["flipped_call"] - 1]  # SGD: one add_ per parameter, in order
    for r in job.ranks.values():
        (alarm,) = r["flip"]["alarms"]
        assert alarm["step"] == 9 and alarm["ranks"] == [rank]
        (v,) = alarm["verdicts"]
        assert v["check"] == "weights" and _subject(v)[:3] == (rank, bad, bad)
        assert v["evidence"]["first_parameter"] == expected
        others = sorted(job.rank_of(h) for h in job.ranks if h != bad)
        assert sorted(v["evidence"]["majority_ranks"]) == others
    ckpt = job.out / "ckpt"
    assert [at.read(ckpt / f"step_{s}.pt{at.SUFFIX}").verified for s in (3, 6, 9)] == [True, True, False]
    # the command itself, as an operator runs it
    proc = subprocess.run([GPUMON, "guard", "checkpoints", str(ckpt)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"resume from: {ckpt / 'step_6.pt'}  (step 6, verified: all 3 replicas agreed" in proc.stdout
    # the disagreement at the save of step 9 makes step 8 suspect (the flip was in a step before it);
    # with a node's spool as its daemon left it (verdicts judged/, the guard's kept bundles/), the
    # flip's node says step 8 too, and the NaN's node (same job) moves the suspect back to step 3
    cases = ((None, 8, 6), (job.spool(bad), 8, 6), (job.spool(FAULT_HOSTS["nan"]), 3, 3))
    for verdicts, first, resume in cases:
        assert checkpoints(ckpt, verdicts=verdicts, as_json=True) == 1
        got = json.loads(capsys.readouterr().out)
        assert (got["first_suspect_step"], got["resume"]["step"], got["verdict_problems"]) == \
            (first, resume, []), (verdicts, got)


def test_a_rank_killed_during_an_audit_costs_the_others_the_guards_timeout_not_a_hang(job: Job) -> None:
    victim = FAULT_HOSTS["dies"]
    assert job.killed["rank"] == job.rank_of(victim) and job.killed["step"] == 2
    assert "dies" not in job.ranks[victim]  # it never came back from the audit
    for host, r in job.ranks.items():
        if host == victim:
            continue
        d = r["dies"]
        assert d["disabled"] and d["disabled"].startswith("the audit: "), d
        assert d["steps"] == 3 and d["alarms"] == []
        assert d["seconds"] < 3 + 5, d  # timeout_s 3
        log = (job.base / host / "torchrun.log").read_text(errors="replace")
        assert f"rank {job.rank_of(host)}: gpumon.guard: internal error in the audit (RuntimeError:" in log
        assert "the guard is off for the rest of this run, training goes on" in log
    assert job.codes[victim] not in (0, None)  # its torchrun saw the worker die


def _events(job: Job, host: str) -> list[dict[str, Any]]:
    with sqlite3.connect(job.base / host / "sim" / "state" / "health.db") as db:
        rows = db.execute("SELECT component, payload FROM events WHERE check_name = 'guard' "
                          "ORDER BY id").fetchall()
    return [{"component": c, **json.loads(p)} for c, p in rows]


def _scrape(job: Job, host: str) -> str:
    """The host's own exporter's /metrics, read in its netns."""
    url = f"http://{job.net.hosts[job.index(host)].ip}:{METRICS_PORT}/metrics"
    code = ("import sys, urllib.request\n"
            f"sys.stdout.write(urllib.request.urlopen({url!r}, timeout=5).read().decode())")
    return job.net.run(job.index(host), [sys.executable, "-c", code], timeout=20).stdout


def _metrics(job: Job, host: str) -> dict[tuple[str, str, str], float]:
    """(family, component, check/state/action) -> value of the guard's and the health store's series
    for components, as the host's own exporter serves them, read in its netns."""
    out: dict[tuple[str, str, str], float] = {}
    for line in _scrape(job, host).splitlines():
        name, _, rest = line.partition("{")
        if name not in ("gpumon_finding_severity", "gpumon_health_state", "gpumon_recommended_action"):
            continue
        labels_text, value = rest.rsplit(" ", 1)
        labels = dict(kv.split("=", 1) for kv in labels_text.rstrip("}").split(","))
        labels = {k: v.strip('"') for k, v in labels.items()}
        if name == "gpumon_finding_severity" and labels["check"] != "guard":
            continue
        key = labels.get("check") or labels.get("state") or labels.get("action") or ""
        out[(name, labels["component"], key)] = float(value)
    return out


def test_each_verdict_reaches_its_own_nodes_daemon_health_metrics_and_slurm(job: Job) -> None:
    """Each named rank's verdict is in its own host's spool only; that node's daemon turns it into
    a finding on the posed GPU's component, in health.db and /metrics. The persistent one (the
    audit's) drains its node in Slurm while that daemon confirms it with its own canaries
    (confirm_sdc); the simulated GPU computes right, so the verdict ends a warning "not reproduced"
    and the daemon lifts its own drain. The others (transient, unknown) warn, no node drained."""
    expect = {FAULT_HOSTS["flip"]: ("weights", "warn"), FAULT_HOSTS["audit"]: ("audit", "warn"),
              FAULT_HOSTS["nan"]: ("nonfinite_grad", "warn")}
    assert len(expect) == 3
    for host, (check, severity) in expect.items():
        comp = f"gpu/{POSED_GPU[host]}"
        state, action = "degraded", "none"

        def seen(host: str = host, comp: str = comp, state: str = state) -> bool:
            return _metrics(job, host).get(("gpumon_health_state", comp, state)) == 1

        # the audit's verdict is confirmed first: a canary round on CPU stand-ins
        _wait(f"{host}'s /metrics: {comp} {state}", seen, DAEMON_WAIT_S * (4 if check == "audit" else 1),
              lambda host=host: (job.base / host / "daemon.log").read_text())
        m = _metrics(job, host)
        assert m[("gpumon_recommended_action", comp, action)] == 1
        unwell = {c for (name, c, s), v in m.items() if name == "gpumon_health_state" and v == 1
                  and s != "healthy"}
        assert unwell == {comp, "node"}, m  # this GPU and no other, and the node's roll-up
        if severity == "warn":  # reported for its hold; a persistent one is judged once, then held by health
            assert m[("gpumon_finding_severity", comp, "guard")] == 3
        found = [e for e in _events(job, host) if e["component"] == comp and "severity" in e
                 and e["evidence"]["verdict_check"] != "straggler"]  # the straggler's: its own test
        if check == "audit":  # confirm_sdc first, then the verdict judged by its confirmation
            assert [(e["severity"], e["action"]) for e in found] == [("warn", "confirm_sdc"),
                                                                     ("warn", "none")], found
            assert "NOT reproduced on this node" in found[1]["message"], found
            found = found[1:]
        assert [e["severity"] for e in found] == [severity], found
        assert found[0]["evidence"]["verdict_check"] == check
        assert (found[0]["evidence"]["node_name"], found[0]["evidence"]["rank"]) == (host, job.rank_of(host))
        files = [*job.spool(host).glob("*.json"), *(job.spool(host) / "judged").glob("*.json")]
        spooled = [p for p in files if vf.read(p).check != "straggler"]
        assert len(spooled) == 1, spooled
    drained = FAULT_HOSTS["audit"]
    marks: list[tuple[str, dict[str, Any]]] = []

    def released() -> bool:
        nonlocal marks
        with sqlite3.connect(job.base / drained / "sim" / "state" / "health.db") as db:
            marks = [(kind, json.loads(p)) for kind, p in db.execute(
                "SELECT kind, payload FROM events WHERE kind IN ('quarantine', 'release') ORDER BY id")]
        return len(marks) >= 2

    _wait(f"{drained} drained and released by its daemon", released, DAEMON_WAIT_S,
          lambda: (job.base / drained / "daemon.log").read_text())
    assert [k for k, _ in marks] == ["quarantine", "release"], marks
    assert marks[0][1]["action"] == "confirm_sdc", marks
    assert "confirming an in-job SDC verdict on this node before the RMA path" in marks[0][1]["reason"], marks
    _wait("no node drained any more", lambda: not job.cluster.sinfo_reasons(), DAEMON_WAIT_S,
          lambda: (job.base / drained / "daemon.log").read_text())


def test_a_rank_slowed_by_a_cpu_quota_on_one_host_is_named_with_that_host_and_its_gpu(job: Job) -> None:
    """The straggler scenarios across hosts (pace windows of 8 steps, named when slow in 2 of the last
    3): the rank on ``slow``'s host, limited to 20 % of a CPU, is named by its second slow window,
    once, with its host and posed GPU, in that host's spool only; the rank given twice the work on
    ``load``'s host is not named (slower per step, not per unit of work)."""
    bad = FAULT_HOSTS["slow"]
    rank = job.rank_of(bad)
    uuid, _ = _posed(job, bad)
    for host, r in job.ranks.items():
        slow = r["slow"]
        assert slow["disabled"] is None, slow
        first = next(i for i, w in enumerate(slow["windows"]) if w["named"])
        assert first <= 2 and slow["windows"][first]["named"] == [rank], slow["windows"]
        assert all(w["named"] in ([], [rank]) for w in slow["windows"]), slow["windows"]
        (verdicts,) = slow["named"]
        (v,) = verdicts
        assert (v["check"], v["fault"]) == ("straggler", "unknown") and _subject(v) == (rank, bad, bad, uuid)
        assert v["evidence"]["pace"] < 0.75 and v["evidence"]["pace_per_work"] < 0.75
        assert len(slow["files"]) == int(host == bad), (host, slow["files"])
        load = r["load"]
        assert load["named"] == [] and load["files"] == [], load["windows"]
        loaded = job.rank_of(FAULT_HOSTS["load"])
        assert all(w["per_work"][loaded] >= 0.75 for w in load["windows"]), load["windows"]


def test_the_stragglers_node_warns_on_its_gpu_with_its_hardware_signals_and_its_pace(job: Job) -> None:
    bad = FAULT_HOSTS["slow"]
    comp = f"gpu/{POSED_GPU[bad]}"
    found: list[dict[str, Any]] = []

    def judged() -> bool:
        nonlocal found
        found = [e for e in _events(job, bad) if e["component"] == comp and "severity" in e
                 and e["evidence"]["verdict_check"] == "straggler"]
        return bool(found)

    _wait(f"{bad}'s daemon judges the straggler verdict", judged, DAEMON_WAIT_S,
          lambda: (job.base / bad / "daemon.log").read_text())
    (e,) = found
    assert e["severity"] == "warn" and e["action"] == "none", e
    assert "in-job straggler" in e["message"] and e["evidence"]["node_name"] == bad
    signals = e["evidence"]["node_signals"]  # read from this host's simulated GPU through NVML
    # a healthy simulated node: no hardware explains the slowness, and the operator can see so
    assert signals["clock_event_reasons"] == [] and signals["pcie_link"]["degraded"] is False, signals

    def slowest(host: str) -> float | None:
        for line in _scrape(job, host).splitlines():
            if line.startswith("gpumon_guard_pace_slowest_score"):
                return float(line.rsplit(" ", 1)[1])
        return None

    _wait(f"{bad}'s /metrics: the pace of its slowed GPU", lambda: (slowest(bad) or 1.0) < 0.75,
          DAEMON_WAIT_S, lambda: _scrape(job, bad))
    for host in job.ranks:
        if host != bad:
            got = slowest(host)
            assert got is not None and got >= 0.75, (host, got)
