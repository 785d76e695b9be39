"""gpumon.guard under FSDP and HSDP: 6 real processes, gloo, CPU, no mock of torch.distributed.

HSDP as 3 replicas x 2 shards (a strict majority per shard group) and 2 x 3 (none), FSDP1
``HYBRID_SHARD`` and FSDP2 ``fully_shard`` on a 2-D mesh, and pure sharding (one replica). Faults
come from outside the guard (``fsdp_ranks.py``): one bit of one rank's local shard flipped after
``optimizer.step()``, the SDC fault harness around one rank's forward. One launch runs every
scenario (torch is imported once and the ranks are forked from it: six imports of torch and FSDP
cost ~45 s on a busy 2-core machine).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumon.guard import verdict as vf

RANKS = Path(__file__).with_name("fsdp_ranks.py")
SCENARIOS = "fsdp2-healthy,fsdp2-flip,fsdp2-nan,fsdp2-two,fsdp2-full,fsdp1-flip,fsdp1-nan,fsdp1-full"
WORLD = 6


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp6")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SLURMD_NODENAME", None)
    proc = subprocess.Popen([sys.executable, str(RANKS), str(WORLD), str(port), str(out), SCENARIOS],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the forked ranks too
            proc.wait()
    assert proc.returncode == 0, text
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_healthy_hsdp_training_raises_no_alarm(six: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = six
    for r, res in enumerate(ranks):
        h = res["fsdp2-healthy"]
        assert h["alarms"] == [] and h["disabled"] is None and h["steps"] == 12 and h["files"] == []
        assert h["place"] == {"replica": r // 2, "replicas": 3, "shard": r % 2, "shards": 2,
                              "strategy": "FSDP2 2-D mesh (replicate, shard)"}
        assert h["checks"]["weights"] == "on: shard by shard across 3 replicas"
        assert h["checks"]["audit"].startswith("not applicable")
    # the replicas of each shard hold the same bits (the check had nothing to miss)
    for j in range(2):
        assert len({json.dumps(ranks[r]["fsdp2-healthy"]["final"]) for r in range(j, WORLD, 2)}) == 1


@pytest.mark.parametrize("scenario,parameter,strategy", [
    ("fsdp2-flip", "2.weight", "FSDP2 2-D mesh (replicate, shard)"),
    # FSDP1, use_orig_params=False: the flat parameter's local element 64 of shard 1 is 2.bias
    ("fsdp1-flip", "2.bias", "FSDP1 HYBRID_SHARD")])
def test_a_bit_flipped_in_one_ranks_local_shard_names_rank_replica_shard_and_parameter(
        six: tuple[Path, list[dict[str, Any]]], scenario: str, parameter: str, strategy: str) -> None:
    out, ranks = six
    step = 2 if scenario == "fsdp2-flip" else 1
    for res in ranks:
        (alarm,) = res[scenario]["alarms"]  # every rank learns it at once
        assert alarm["step"] == step and alarm["ranks"] == [3] and alarm["skipped"] is False
        (v,) = alarm["verdicts"]
        ev = v["evidence"]
        assert v["check"] == "weights" and v["subject"]["rank"] == 3 and v["subject"]["node_name"] == "node-3"
        assert (ev["replica"], ev["shard"], ev["strategy"]) == (1, 1, strategy)
        assert ev["first_parameter"] == parameter and ev["parameters_differing"] == 1
        assert ev["shard_group"] == [1, 3, 5] and ev["majority_ranks"] == [1, 5]
        assert ev["fingerprint"] != ev["majority_fingerprint"]
        assert (f"rank 3 (replica 1, shard 1) holds shard 1 differently from the other replicas (2 of 3 "
                f"agree: ranks [1, 5]), first at parameter {parameter!r}") in v["message"]
    assert [len(r[scenario]["files"]) for r in ranks] == [0, 0, 0, 1, 0, 0]
    got = vf.read(Path(ranks[3][scenario]["files"][0]))
    assert got.check == "weights" and got.subject.rank == 3 and Path(ranks[3][scenario]["files"][0]).parent \
        == out / f"spool-{scenario}-r3"


def test_with_two_replicas_a_shard_mismatch_is_unknown_and_names_both(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = six
    for res in ranks:
        (alarm,) = res["fsdp2-two"]["alarms"]
        assert alarm["ranks"] == [1, 4]  # shard 1's two replicas; shards 0 and 2 agree
        for v in alarm["verdicts"]:
            assert v["fault"] == "unknown" and v["evidence"]["shard"] == 1
            assert v["evidence"]["first_parameter"] == "0.weight"
            assert "the replicas of shard 1 disagree (two replicas cannot outvote each other)" in v["message"]
    assert [len(r["fsdp2-two"]["files"]) for r in ranks] == [0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("scenario,strategy", [("fsdp2-full", "FSDP2 1-D mesh (shard)"),
                                               ("fsdp1-full", "FSDP1 FULL_SHARD")])
def test_pure_sharding_says_the_weight_check_is_not_applicable(
        six: tuple[Path, list[dict[str, Any]]], scenario: str, strategy: str) -> None:
    _, ranks = six
    for res in ranks:
        f = res[scenario]
        reason = (f"1 replica(s) x 6 shard(s), {strategy}: every shard is held by one rank only, there is "
                  "no other replica to compare it with")
        assert f["checks"]["weights"] == f"not applicable: {reason}"
        # every check_weights() says so: never agree=True (in fsdp2-full a bit was flipped on rank 1)
        assert f["reports"] and all(rep == {"applicable": False, "agree": None, "reason": reason}
                                    for rep in f["reports"])
        assert f["alarms"] == [] and f["disabled"] is None


def test_nan_in_one_ranks_forward_under_fsdp2_names_it_and_no_rank_updates(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = six
    assert ranks[4]["fsdp2-nan"]["flips"] == 1  # the harness made rank 4's forward non-finite
    for res in ranks:
        n = res["fsdp2-nan"]
        (alarm,) = n["alarms"]
        assert alarm["step"] == 2 and alarm["ranks"] == [4] and alarm["skipped"] is True
        (v,) = alarm["verdicts"]
        assert v["check"] == "nonfinite_grad" and (v["evidence"]["replica"], v["evidence"]["shard"]) == (2, 0)
        assert "rank 4's local gradients have NaN/Inf before the reduce-scatter" in v["message"]
        assert n["applied_at"] is False and n["unchanged_at"] is True  # bit-exact, every rank
        assert all(rep["agree"] is True for rep in n["reports"])  # the weight check after it: equal
    assert [len(r["fsdp2-nan"]["files"]) for r in ranks] == [0, 0, 0, 0, 1, 0]


def test_nan_under_fsdp1_hybrid_skips_the_update_and_says_the_source_is_unknown(
        six: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = six
    assert ranks[4]["fsdp1-nan"]["flips"] == 1
    for res in ranks:
        n = res["fsdp1-nan"]
        (alarm,) = n["alarms"]
        assert alarm["step"] == 1 and alarm["skipped"] is True
        assert n["applied_at"] is False and n["unchanged_at"] is True
        for v in alarm["verdicts"]:
            assert v["check"] == "nonfinite_grad" and v["evidence"]["source_known"] is False
            assert "which rank's gradients caused it is unknown" in v["message"]
            assert "FSDP1 gives no hook before it for hybrid sharding" in v["message"]
        assert all(rep["agree"] is True for rep in n["reports"])
        assert n["files"] == []  # no GPU is named: nothing for a node's daemon
    for r, res in enumerate(ranks):  # each rank names its own parameters, by FQN (not FSDP1's flat ones)
        own = next(v for v in res["fsdp1-nan"]["alarms"][0]["verdicts"] if v["subject"]["rank"] == r)
        assert own["evidence"]["parameters"]
        assert set(own["evidence"]["parameters"]) <= {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ranks[0]["fsdp1-nan"]["checks"]["nonfinite_grad"] == (
        "on: reduced gradient shards after the backward (the source rank is not known: FSDP1 gives no "
        "hook before it for hybrid sharding)")
