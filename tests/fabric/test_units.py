"""The probe's pieces without a network: launcher environments, the judgement, the fabric check, the
profile's fabric thresholds. Real ``scontrol`` output is what ``node_addr`` parses; the judgement is fed
the records ranks produce (``OpResult``), not mocks of anything."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from gpumon.check import CheckContext, KernelLog
from gpumon.config import load_config, with_profile
from gpumon.errors import StartupError
from gpumon.fabric.isolate import Isolator, PairResult
from gpumon.fabric.judge import Probe, RankInfo, judge
from gpumon.fabric.launch import detect, node_addr, tasks_per_node
from gpumon.fabric.settings import FabricConfig
from gpumon.fabric.sweep import OpResult, busbw_factor, percentile, sizes
from gpumon.model import Action, Severity
from gpumon.profiles import GENERIC, all_profiles
from gpumon.registry import load_checks
from gpumon_checks.fabric import FabricCheck

# ------------------------------------------------------------------ launchers


def test_torchrun_env() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "gpu-a", "MASTER_PORT": "41913", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch = detect(env)
    assert (launch.launcher, launch.rank, launch.world, launch.local_rank, launch.local_world) == \
        ("torchrun", 5, 16, 5, 8)
    assert (launch.master_addr, launch.master_port, launch.agent_store) == ("gpu-a", 41913, True)
    # an explicit port means a store of our own, not the agent's
    assert detect(env, port=29999).agent_store is False


def test_slurm_env_finds_the_first_node_and_its_address() -> None:
    calls: list[list[str]] = []

    def scontrol(argv: list[str]) -> str:
        calls.append(argv)
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            return "gpu17\ngpu18\n"
        # `scontrol show node gpu17` as Slurm 22.05 prints it (abridged)
        return ("NodeName=gpu17 Arch=x86_64 CoresPerSocket=1\n   CPUAlloc=0 CPUTot=2 CPULoad=0.13\n"
                "   NodeAddr=10.77.3.1 NodeHostName=gpu17 Version=22.05.8\n")

    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu[17-18]", "SLURM_JOB_ID": "4242"}
    launch = detect(env, run_tool=scontrol)
    assert (launch.launcher, launch.rank, launch.world, launch.local_rank, launch.local_world) == \
        ("slurm", 9, 16, 1, 8)
    assert launch.master_addr == "10.77.3.1" and launch.master_port == 29500 + 4242 % 2000
    assert calls[0] == ["scontrol", "show", "hostnames", "gpu[17-18]"]
    assert tasks_per_node("8(x2),4") == [8, 8, 4]
    assert node_addr("NodeName=x Arch=y", "x") == "x"


def test_openmpi_and_kubernetes_env() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "a"}
    launch = detect(ompi)
    assert (launch.launcher, launch.rank, launch.world, launch.local_rank, launch.local_world) == \
        ("openmpi", 3, 4, 1, 2)
    with pytest.raises(StartupError, match="MASTER_ADDR"):
        detect({k: v for k, v in ompi.items() if k != "MASTER_ADDR"})
    k8s = {"JOB_COMPLETION_INDEX": "1", "GPUMON_FABRIC_WORLD_SIZE": "2", "MASTER_ADDR": "probe-0.probe"}
    launch = detect(k8s)
    assert (launch.launcher, launch.rank, launch.world, launch.master_addr) == ("kubernetes", 1, 2,
                                                                               "probe-0.probe")


@pytest.mark.parametrize("env, message", [
    ({}, "not started by a launcher"),
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a"}, "outside a world of 4"),
    ({"RANK": "x", "WORLD_SIZE": "4", "MASTER_ADDR": "a"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"}, "not a TCP port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"}, "tasks per node"),
])
def test_bad_launcher_env_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(StartupError, match=message):
        detect(env, run_tool=lambda argv: "")


# ------------------------------------------------------------------ measurement arithmetic


def test_busbw_factors_and_percentiles_follow_nccl_tests_and_numpy() -> None:
    assert busbw_factor("all_reduce", 16) == pytest.approx(2 * 15 / 16)
    assert busbw_factor("all_gather", 8) == busbw_factor("alltoall", 8) == pytest.approx(7 / 8)
    assert busbw_factor("sendrecv", 8) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.95) == 5.0 and math.isnan(percentile([], 0.5))
    assert sizes(8, 2 << 30, 2)[0] == 8 and sizes(8, 2 << 30, 2)[-1] == 2 << 30
    assert len(sizes(8, 2 << 30, 2)) == 29
    assert sizes(8, 1000, 4) == (8, 32, 128, 512, 1000)


# ------------------------------------------------------------------ judgement


def _ranks(n: int) -> dict[int, RankInfo]:
    return {r: RankInfo(r, f"n{r}", 0, 100 + r) for r in range(n)}


def _op(op: str, nbytes: int, t: float, **kw: object) -> OpResult:
    return OpResult(op=op, nbytes=nbytes, iterations=10, p50_s=t, p95_s=t * 1.2, p99_s=t * 1.3, **kw)


def _probe(settings: FabricConfig, n: int = 4) -> Probe:
    p = Probe(settings=settings, ranks=_ranks(n), world=n, large_min_bytes=1 << 30, cpu=False,
              time=time.time())
    for r in range(n):
        p.collectives[r] = [_op("all_reduce", 8, 40e-6), _op("all_reduce", 2 << 30, 2 ** 31 / 180e9)]
    return p


def test_a_group_below_the_profile_with_no_node_to_blame_warns_everyone() -> None:
    settings = FabricConfig(busbw_min_gbps={"all_reduce": 330.0}, latency_p95_us_max={"all_reduce": 100.0})
    v = judge(_probe(settings))
    # 2 GiB in 11.9 ms on 4 ranks: algbw 180 GB/s, busbw 270 GB/s < 330
    assert {f.severity for f in v.findings.values()} == {Severity.WARN}
    assert all("below the profile" in f.message for f in v.findings.values())
    ok = judge(_probe(FabricConfig(busbw_min_gbps={"all_reduce": 250.0})))
    assert {f.severity for f in ok.findings.values()} == {Severity.OK}
    row = next(r for r in ok.rows if r.nbytes == 2 << 30)
    assert row.busbw_gbps == pytest.approx(2 ** 31 / (2 ** 31 / 180e9) / 1e9 * 1.5)


def test_cpu_ranks_are_never_held_against_the_profiles_gpu_floors_and_say_what_judged_them() -> None:
    """The H100 profile's floors on a gloo group: the same slow figures warn on GPUs and pass on CPU,
    and each finding names its reference."""
    settings = FabricConfig(busbw_min_gbps={"all_reduce": 330.0, "sendrecv": 41.0},
                            latency_p95_us_max={"all_reduce": 1.0})
    slow = _probe(settings)
    for r in slow.collectives:  # 1 MiB in 2 ms: 0.5 GB/s, CPU speed
        slow.collectives[r] = [_op("all_reduce", 8, 400e-6), _op("all_reduce", 2 << 30, 4.0)]
    slow.profile = "h100-sxm"
    gpu = judge(slow)
    assert {f.severity for f in gpu.findings.values()} == {Severity.WARN}
    assert all("judged against: NCCL on GPUs: profile h100-sxm" in f.message for f in gpu.findings.values())
    slow.cpu = True
    cpu = judge(slow)
    assert {f.severity for f in cpu.findings.values()} == {Severity.OK} and not cpu.misses
    for f in cpu.findings.values():
        assert "judged against: gloo on CPU: the group's own pairs, not a GPU profile" in f.message, f.message
        assert f.evidence["device"] == "cpu"
        assert "never the GPU floors of profile h100-sxm" in f.evidence["judged_against"]
        assert "slow below 0.15 x the reference busbw" in f.evidence["judged_against"]
    # wrong data fails a CPU group all the same
    slow.collectives[2][0] = _op("all_reduce", 8, 400e-6, wrong=1)
    assert judge(slow).findings["n2"].severity is Severity.FAIL


def test_corruption_names_the_sending_rank_and_a_wrong_sum_without_a_source_names_the_receiver() -> None:
    p = _probe(FabricConfig())
    p.collectives[2][0] = _op("all_reduce", 8, 40e-6, wrong=3, wrong_sources={"1": 3})
    v = judge(p)
    assert v.findings["n1"].severity is Severity.FAIL and v.findings["n1"].action is Action.INSPECT_HARDWARE
    assert "rank(s) 1 on n1" in v.findings["n1"].message
    assert {n for n, f in v.findings.items() if f.severity is Severity.OK} == {"n0", "n2", "n3"}
    q = _probe(FabricConfig())
    q.collectives[3][0] = _op("all_reduce", 8, 40e-6, wrong=5)
    w = judge(q)
    assert w.findings["n3"].severity is Severity.FAIL and "received wrong sums" in w.findings["n3"].message


def test_a_node_fault_from_the_pair_rounds_fails_that_node_only_and_carries_readings() -> None:
    p = _probe(FabricConfig())
    iso = Isolator(p.nodes)
    speed = {"n0": 48.0, "n1": 48.0, "n2": 12.0, "n3": 48.0}
    for _ in range(8):
        pairs = iso.next_round()
        if not pairs:
            break
        results = [PairResult(a, b, min(speed[a], speed[b]), 5.0) for a, b in pairs]
        p.pairs.extend(results)
        iso.add(results)
    p.isolation = iso.verdict()
    v = judge(p)
    assert (v.findings["n2"].severity, v.findings["n2"].action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert all(v.findings[n].severity is Severity.OK for n in ("n0", "n1", "n3"))
    readings = v.findings["n0"].evidence["readings"]
    names = {(r[0], r[2].get("op"), r[2].get("size_class")) for r in readings}
    assert ("fabric_busbw_bytes_per_second", "sendrecv", "large") in names
    # base units on /metrics: the rows' GB/s times 1e9 (2 GiB all_reduce on 4 ranks: 270 GB/s)
    [large] = [r[1] for r in readings if r[0] == "fabric_busbw_bytes_per_second"
               and (r[2]["op"], r[2]["size_class"]) == ("all_reduce", "large")]
    assert large == pytest.approx(270e9, rel=1e-6)
    assert large == pytest.approx(max(r.busbw_gbps for r in v.rows if r.size_class == "large") * 1e9)
    assert ("fabric_latency_p95_seconds", "all_reduce", "small") in names


def test_every_node_carries_the_groups_pair_coverage_for_metrics() -> None:
    """Issue 35: the coverage after the run (a rotation of 40 nodes, the first of its 3 runs) is in
    every node's evidence and readings, which the fabric check puts on /metrics."""
    from gpumon.fabric.schedule import Rotation

    p = _probe(FabricConfig())
    rot = Rotation()
    plan = rot.begin([f"gpu{i:02d}" for i in range(40)], 15)
    p.coverage = rot.end(plan, len(plan.rounds), 1.0, per_run=15)
    v = judge(p)
    for node in p.nodes:
        ev = v.findings[node].evidence
        assert ev["coverage"] == {"pairs_measured": 300, "pairs_total": 780, "runs_since_full_coverage": 1,
                                  "runs_per_cycle": 3}
        plain = {r[0]: r[1] for r in ev["readings"] if not r[2]}
        assert (plain["fabric_pairs_measured"], plain["fabric_pairs_in_group"],
                plain["fabric_runs_since_full_coverage"], plain["fabric_runs_per_coverage_cycle"]) == \
            (300.0, 780.0, 1.0, 3.0)
    declared = {spec.name for spec in FabricCheck.readings}
    assert {"fabric_pairs_measured", "fabric_pairs_in_group", "fabric_runs_since_full_coverage",
            "fabric_runs_per_coverage_cycle"} <= declared


def test_lost_ranks_fail_their_node_unless_rank_0_lost_most_of_the_group() -> None:
    p = _probe(FabricConfig())
    p.lost, p.hung = {2: "all_gather 64 B warm-up"}, "deadline"
    v = judge(p)
    assert (v.findings["n2"].severity, v.findings["n2"].action) == (Severity.FAIL, Action.CHECK_CABLES)
    assert {v.findings[n].severity for n in ("n0", "n1", "n3")} == {Severity.UNKNOWN}
    q = _probe(FabricConfig())
    q.lost, q.hung = {1: "x", 2: "x", 3: "x"}, "deadline"
    w = judge(q)
    assert {f.severity for f in w.findings.values()} == {Severity.UNKNOWN}


# ------------------------------------------------------------------ the fabric check


def _ctx(state_dir: Path | None) -> CheckContext:
    return CheckContext(hw=None, inventory=None, profile=GENERIC, options=FabricConfig(), state={},  # type: ignore[arg-type]
                        kernel_log=KernelLog(), state_dir=state_dir)


def test_fabric_check_reports_the_last_probe_or_says_why_not(tmp_path: Path) -> None:
    check = FabricCheck()
    [none] = check.run(_ctx(tmp_path))
    assert none.severity is Severity.SKIPPED and "no fabric probe has run" in none.message
    latest = tmp_path / "fabric" / "latest.json"
    latest.parent.mkdir()
    latest.write_text("{not json")
    [bad] = check.run(_ctx(tmp_path))
    assert bad.severity is Severity.UNKNOWN and "unreadable" in bad.message
    latest.write_text(json.dumps({"time": time.time() - 30, "node": "n", "finding": {
        "check": "fabric", "component": "node", "severity": "fail", "action": "check_cables",
        "message": "n is slow with every partner", "evidence": {"readings": []}}}))
    [got] = check.run(_ctx(tmp_path))
    assert (got.severity, got.action, got.message) == (Severity.FAIL, Action.CHECK_CABLES,
                                                       "n is slow with every partner")
    assert 25 <= got.evidence["age_s"] <= 60
    latest.write_bytes(b" " * (2 << 20))
    [big] = check.run(_ctx(tmp_path))
    assert big.severity is Severity.UNKNOWN


def test_a_result_file_from_before_the_rename_reports_busbw_in_bytes_per_second(tmp_path: Path) -> None:
    latest = tmp_path / "fabric" / "latest.json"
    latest.parent.mkdir()
    old = {"op": "sendrecv", "size_class": "large"}
    latest.write_text(json.dumps({"time": time.time() - 30, "node": "n", "finding": {
        "check": "fabric", "component": "node", "severity": "ok", "action": "none", "message": "ok",
        "evidence": {"readings": [["fabric_busbw_gbps", 46.5, old], ["fabric_last_probe_passed", 1.0, {}],
                                  ["fabric_busbw_gbps", "x", old], "not a reading"]}}}))
    [got] = FabricCheck().run(_ctx(tmp_path))
    assert got.evidence["readings"] == [["fabric_busbw_bytes_per_second", 46.5e9, old],
                                        ["fabric_last_probe_passed", 1.0, {}],
                                        ["fabric_busbw_gbps", "x", old], "not a reading"]  # malformed: as is


# ------------------------------------------------------------------ settings and profiles


def test_profiles_set_sourced_fabric_floors_and_bad_values_are_refused(tmp_path: Path) -> None:
    checks = load_checks()
    profiles = all_profiles([])
    config = load_config(None, checks, site_file=tmp_path / "none.yaml")
    h100 = with_profile(config, checks, profiles["h100-sxm"]).settings(checks["fabric"]).options
    assert h100.busbw_min_gbps["all_reduce"] > 0 and h100.busbw_min_gbps["sendrecv"] > 0
    assert "fabric" in profiles["h100-sxm"].checks
    for spec in ({"collectives": ["broadcast"]}, {"busbw_min_gbps": {"allreduce": 1.0}},
                 {"latency_p95_us_max": {"all_reduce": 0}}, {"min_bytes": 64, "max_bytes": 8}):
        with pytest.raises(ValueError):
            FabricConfig(**spec)  # type: ignore[arg-type]
