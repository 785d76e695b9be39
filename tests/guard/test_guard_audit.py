"""The ring re-execution audit (check 2), the reruns (transient / persistent / application) and the
kept failing step, in real DDP training: 3 (and 2) local processes on gloo, each posing as its own
node (``NODE_NAME``), no mock of torch.distributed.

Faults come from outside the guard's code: ``audit_ranks.py``'s ``loss_fn``/``backward`` (the
functions the loop and the guard both call) enter the SDC fault harness (gpumon.sdc.inject) on one
rank. The scenarios run in the launch ``conftest.py`` shares with test_guard_ddp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import clean_env
from gpumon.guard import rerun
from gpumon.guard import verdict as vf
from gpumon.sdc.bundle import read_manifest

Launch = tuple[Path, list[dict[str, Any]]]


def one_alarm(res: dict[str, Any], step: int) -> dict[str, Any]:
    (alarm,) = res["alarms"]
    assert alarm["step"] == step
    return alarm


def test_a_low_bit_flipped_in_one_ranks_backward_names_that_rank_not_its_auditor(three: Launch) -> None:
    """Rank 1's own backward at audit step 5 gets one low mantissa bit flipped (finite, wrong), once:
    rank 0 (its auditor, node-0) disagrees, rank 2 (node-2) settles it, rank 1's rerun on its own
    GPU computes the right bits: rank 1 is named, transient, and no rank applies the update."""
    out, ranks = three
    assert ranks[1]["transient"]["injected"] == 1
    for res in ranks:
        alarm = one_alarm(res["transient"], 5)
        assert alarm["ranks"] == [1] and alarm["skipped"] is True and alarm["exit_code"] == 16
        assert alarm["unchanged"] is True  # the weights on every rank, bit for bit
        (v,) = alarm["verdicts"]
        assert (v["check"], v["fault"], v["step"]) == ("audit", "transient", 5)
        assert v["subject"]["rank"] == 1 and v["subject"]["node_name"] == "node-1"
        assert "the audit names rank 1" in v["message"] and "on its own micro-batch" in v["message"]
        (d,) = v["evidence"]["disputes"]
        assert (d["micro_batch_of"], d["audited_by"], d["referee"], d["majority_ranks"]) == (1, 0, 2, [0, 2])
        own, audit, referee = d["computations"]
        assert (own["rank"], audit["rank"], referee["rank"]) == (1, 0, 2)
        assert (own["node"], audit["node"], referee["node"]) == ("node-1", "node-0", "node-2")
        assert own["grads_fingerprint"] != audit["grads_fingerprint"] == referee["grads_fingerprint"]
        assert own["loss_bits"] == audit["loss_bits"]  # a backward fault: the loss is right
        assert own["rerun_same_gpu"]["same_as_first"] is False
        assert own["rerun_same_gpu"]["grads_fingerprint"] == audit["grads_fingerprint"]
        assert d["parameters_differing"] >= 1 and d["differing_parameters"][0]["own"] != \
            d["differing_parameters"][0]["audit"]
    assert ranks[0]["transient"]["final"] == ranks[1]["transient"]["final"] == ranks[2]["transient"]["final"]
    # only the named rank reports to its node, with the failing step kept as a replay bundle
    assert ranks[0]["transient"]["files"] == ranks[2]["transient"]["files"] == []
    (path,) = ranks[1]["transient"]["files"]
    got = vf.read(Path(path))
    spool = out / "spool-transient-r1"
    assert got.check == "audit" and got.fault == "transient" and Path(path).parent == spool
    bundle = Path(got.evidence["bundle"])
    assert ranks[1]["transient"]["bundles"] == [str(bundle)] and bundle.parent == spool / "bundles"
    assert got.evidence["bundle_kind"] == "replay" and got.evidence["bundle_replay"] == \
        f"gpumon canary replay {bundle}"
    manifest = read_manifest(bundle)
    # capture replayed the step twice from the bundle and stored its fingerprints: replayable offline
    assert manifest["kind"] == "capture" and manifest["seed"] == got.evidence["bundle_seed"]
    assert (manifest["model_factory"]["qualname"], manifest["loss_fn"]["qualname"]) == ("make_net", "loss_fn")
    assert {p[0] for p in manifest["expected"]["points"]} >= {"loss", "batch.x", "grad.0.weight"}
    # the step it holds is the disputed one: its loss is the loss rank 1 computed at step 5
    own = got.evidence["disputes"][0]["computations"][0]
    (loss,) = [p for p in manifest["expected"]["points"] if p[0] == "loss"]
    assert own["rank"] == 1 and own["loss_bits"] in loss[3], (own, loss)
    # and `gpumon canary replay` replays it offline, from the bundle alone, in a new process
    replay = subprocess.run(
        [str(Path(sys.executable).parent / "gpumon"), "canary", "replay", str(bundle), "--device", "cpu",
         "--workers", "2", "--json", "--state-dir", str(out / "replay-state")],
        capture_output=True, text=True, timeout=120, env=clean_env())
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    doc = json.loads(replay.stdout)
    assert doc["status"] == "ok" and len(doc["findings"]) == 2, doc["findings"]
    assert all(f["severity"] == "ok" and f["message"].startswith("bit-exact") and
               f["evidence"]["workloads"] == ["capture:guard-audit-step5-rank1"] for f in doc["findings"])


def test_a_persistent_fault_is_named_on_its_own_micro_batch_and_the_one_it_audited(three: Launch) -> None:
    """Every backward rank 1 runs at step 5 flips the same bit (a fresh harness each time): its own
    step, its audit of rank 2, both reruns. Two disputes, settled by ranks 2 and 0: persistent."""
    _, ranks = three
    assert ranks[1]["persistent"]["injected"] == 4
    for res in ranks:
        alarm = one_alarm(res["persistent"], 5)
        assert alarm["ranks"] == [1] and alarm["exit_code"] == 17 and alarm["unchanged"] is True
        (v,) = alarm["verdicts"]
        assert v["fault"] == "persistent" and v["subject"]["node_name"] == "node-1"
        assert "its own micro-batch and rank 2's micro-batch, which it audited" in v["message"]
        first, second = v["evidence"]["disputes"]
        assert (first["micro_batch_of"], first["audited_by"], first["referee"]) == (1, 0, 2)
        assert (second["micro_batch_of"], second["audited_by"], second["referee"]) == (2, 1, 0)
        assert first["computations"][0]["rerun_same_gpu"]["same_as_first"] is True
        assert second["computations"][1]["rerun_same_gpu"]["same_as_first"] is True
        assert v["evidence"]["audits"] == 2 and v["evidence"]["audited_by"] == [0]
    assert len(ranks[1]["persistent"]["files"]) == 1 and ranks[0]["persistent"]["files"] == []



def test_no_rank_leaves_an_alarm_before_the_named_rank_has_written_its_verdict(three: Launch) -> None:
    """A loop that exits on the alarm, under a launcher that stops the other ranks when one exits
    (torchrun): the ranks not named must not get out of the alarm before the named rank's verdict
    file is written (it keeps the failing step first, which takes longest), or the node's daemon
    never hears of the GPU. Seen in CI: rank 1 stopped by torchrun, its spool empty."""
    _, ranks = three
    (written,) = ranks[1]["persistent"]["written_ns"]
    for r, res in enumerate(ranks):
        left = one_alarm(res["persistent"], 5)["left_ns"]
        assert left >= written, f"rank {r} left the alarm {(written - left) / 1e6:.1f} ms before rank 1 wrote"

def test_a_healthy_run_audited_every_5_steps_raises_no_alarm(three: Launch) -> None:
    """200 steps with dropout (seed_step), zero_grad(set_to_none=False), 40 audits: no alarm."""
    _, ranks = three
    for res in ranks:
        h = res["audit-healthy"]
        assert h["alarms"] == [] and h["disabled"] is None and (h["steps"], h["audits"]) == (200, 40)
    assert ranks[0]["audit-healthy"]["final"] == ranks[1]["audit-healthy"]["final"] == \
        ranks[2]["audit-healthy"]["final"]


def test_a_loop_that_forgets_seed_step_is_an_application_problem_not_three_gpus(three: Launch) -> None:
    _, ranks = three
    for res in ranks:
        alarm = res["unseeded"]["alarm"]
        assert alarm is not None and alarm["skipped"] is True
        assert [(v["subject"]["rank"], v["fault"]) for v in alarm["verdicts"]] == \
            [(0, "application"), (1, "application"), (2, "application")]
        assert "guard.seed_step()" in alarm["verdicts"][0]["message"]


def test_check_1_reruns_say_transient_persistent_or_application(three: Launch) -> None:
    """NaN in rank 2's forward at step 3: once (transient), on every computation of rank 2
    (persistent: rank 1 on node-1 computes it finite), or from the data itself (application)."""
    _, ranks = three
    for kind, fault, code in (("transient", "transient", 16), ("persistent", "persistent", 17),
                              ("application", "application", 16)):
        for res in ranks:
            alarm = one_alarm(res[f"nan-{kind}"], 3)
            assert alarm["ranks"] == [2] and alarm["exit_code"] == code and alarm["unchanged"] is True
            (v,) = alarm["verdicts"]
            assert (v["check"], v["fault"]) == ("nonfinite_grad", fault)
            again, other = v["evidence"]["reruns"]
            assert (again["rank"], again["nonfinite"]) == (2, kind != "transient")
            assert (other["rank"], other["node"]) == (1, "node-1")
            assert other["nonfinite"] is (kind == "application")
        (path,) = ranks[2][f"nan-{kind}"]["files"]
        got = vf.read(Path(path))
        assert got.fault == fault and Path(got.evidence["bundle"]).is_dir()


def test_a_rerun_that_cannot_rebuild_the_micro_batch_still_skips_the_update(three: Launch) -> None:
    """batch_for raises when check 1's rerun rebuilds rank 2's micro-batch: the NaN step is still
    skipped on every rank, the fault stays unknown and says why; the guard stays on."""
    _, ranks = three
    for res in ranks:
        r = res["nan-rerun-fails"]
        alarm = one_alarm(r, 3)
        (v,) = alarm["verdicts"]
        assert alarm["unchanged"] is True and (v["fault"], v["subject"]["rank"]) == ("unknown", 2)
        assert "the data set's shard is gone" in v["evidence"]["rerun_error"]
        assert r["disabled"] is None and r["steps"] == 5


def _checks(alarm: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(v["check"], v["fault"], v["subject"]["rank"]) for v in alarm["verdicts"]]


def test_a_replica_diverged_by_its_optimizer_state_is_check_3s_never_a_persistent_gpu(three: Launch) -> None:
    """A bit flipped in rank 1's momentum after step 1 makes its weights differ from step 2's update
    on. Whatever the periods (no weight check, a later one, one at a period that is not a multiple
    of the audit's), every alarm is check 3's: rank 1 by majority, ``unknown``, exit 16; an audit
    due while the replicas differ is not judged (before: the audit named rank 1 persistent, 17)."""
    out, ranks = three
    # (the alarm's step, found before the audit of that step?) per scenario (periods in audit_ranks)
    expected = {"diverged-w0": [(3, True)], "diverged-w5": [(3, True), (4, False)],
                "diverged-a2w3": [(2, False), (4, True), (5, False)]}
    for name, alarms in expected.items():
        for res in ranks:
            got = res[name]["alarms"]
            assert [a["step"] for a in got] == [s for s, _ in alarms], (name, got)
            for alarm, (step, audit) in zip(got, alarms, strict=True):
                assert _checks(alarm) == [("weights", "unknown", 1)], (name, alarm)
                assert alarm["exit_code"] == 16 and alarm["ranks"] == [1]
                (v,) = alarm["verdicts"]
                assert v["evidence"]["majority_ranks"] == [0, 2]
                assert v["evidence"]["first_parameter"] == "0.weight"
                if audit:
                    assert v["evidence"]["found_before"] == "the audit"
                    assert v["evidence"]["not_judged_step"] == step
                    assert f"found before the audit of step {step}, which is not judged" in v["message"]
                    assert alarm["skipped"] is True and alarm["unchanged"] is True
                else:
                    assert "found_before" not in v["evidence"]
            assert res[name]["disabled"] is None
        # rank 1 reports its node, never as a persistent fault (the node's RMA path)
        files = ranks[1][name]["files"]
        assert len(files) == len(alarms)
        assert {vf.read(Path(f)).fault for f in files} == {"unknown"}
        assert ranks[0][name]["files"] == ranks[2][name]["files"] == []
        assert all(Path(f).parent == out / f"spool-{name}-r1" for f in files)


def test_check_1s_rerun_is_not_judged_when_the_nan_comes_from_a_diverged_replica(three: Launch) -> None:
    """Rank 2's weight storage holds 3e38 from step 2 on: its gradients overflow, and its rerun on
    its own GPU overflows again while node-1 computes finite gradients from its own weights (before:
    'persistent', exit 17). The weights are compared first: check 3 names rank 2 (unknown), the
    NaN verdict says why it was not rerun, every rank skips the update, exit 16."""
    _, ranks = three
    for res in ranks:
        r = res["nan-diverged"]
        assert [a["step"] for a in r["alarms"]] == [2, 3]
        for alarm in r["alarms"]:
            assert _checks(alarm) == [("weights", "unknown", 2), ("nonfinite_grad", "unknown", 2)]
            assert alarm["exit_code"] == 16 and alarm["skipped"] is True and alarm["unchanged"] is True
            weights, nan = alarm["verdicts"]
            assert weights["evidence"]["found_before"] == "the rerun of check 1"
            assert weights["evidence"]["first_parameter"] == "3.weight"
            assert nan["evidence"]["rerun_skipped"] == "replicas_diverged"
            assert nan["evidence"]["replica_groups"] == [[0, 1], [2]]
            assert "reruns" not in nan["evidence"]
            assert "not rerun: the replicas' weights differ" in nan["message"]
        assert r["disabled"] is None
    assert {vf.read(Path(f)).fault for f in ranks[2]["nan-diverged"]["files"]} == {"unknown"}


def test_a_non_deterministic_setup_is_refused_on_every_rank(three: Launch) -> None:
    _, ranks = three
    for res in ranks:
        error = res["refuse"]["error"]
        assert error is not None and "audit_every=10" in error and "this run is not deterministic" in error
        assert "rank 1: torch.are_deterministic_algorithms_enabled() is False" in error
        assert "call gpumon.guard.deterministic() at the start of every rank, before CUDA" in error


def test_a_rebuilt_micro_batch_of_another_shape_is_a_clear_error_naming_both(three: Launch) -> None:
    _, ranks = three
    for res in ranks:
        assert res["shape"]["steps"] == 0
        assert ("rank 1 rebuilt rank 2's micro-batch of step 0 as {x: float32[6, 16], y: float32[6, 4]}, but "
                "rank 2 trained on {x: float32[8, 16], y: float32[8, 4]}") in res["shape"]["error"]


def test_a_rebuilt_micro_batch_with_other_contents_is_a_clear_error(three: Launch) -> None:
    _, ranks = three
    for res in ranks:
        assert res["contents"]["steps"] == 0
        assert "has the audited rank's shape but other contents" in res["contents"]["error"]
        assert "rank 0's batch_for(1, 0) differs from what rank 1 trained on" in res["contents"]["error"]


def test_a_micro_batch_that_no_longer_rebuilds_later_turns_the_audit_off_not_the_training(
        three: Launch) -> None:
    """Step 0's audit passed; at step 3's rank 1 rebuilds rank 2's micro-batch with another shape:
    no AuditError reaches the loop (it would end a long run for one shard of data), every rank turns
    the audit off with the reason, and the run, check 1 and the weight check go on."""
    _, ranks = three
    finals = set()
    for r, res in enumerate(ranks):
        ls = res["later-shape"]
        assert ls["steps"] == 7 and ls["audits"] == 1 and ls["alarms"] == [] and ls["disabled"] is None, r
        assert "another shape than the audited rank's" in ls["audit_off"], r
        assert "rank 1 rebuilt rank 2's micro-batch of step 3" in ls["audit_off"], r
        finals.add(ls["final"][0])
    assert len(finals) == 1


def test_a_rank_that_dies_during_an_audit_costs_the_others_at_most_the_timeout(three: Launch) -> None:
    """Rank 1's step 2 is wrong and rank 2 exits while it settles the disagreement (timeout_s 3):
    ranks 0 and 1 come back, skip the disputed update, name both GPUs of the dispute ``unknown``,
    log it and switch the guard off; no hang."""
    _, ranks = three
    assert ranks[2]["dies"] == {"died_at": 2}
    for res in ranks[:2]:
        d = res["dies"]
        assert d["disabled"].startswith("settling the audit's disagreement: SettleFailed: RuntimeError")
        assert d["steps"] == 3 and d["audits"] == 2 and d["unchanged"] is True
        assert d["seconds"] < 3 + 5
        alarm = d["alarm"]
        assert alarm["skipped"] is True and alarm["ranks"] == [0, 1]
        assert {v["fault"] for v in alarm["verdicts"]} == {"unknown"}
        assert "the round that would settle it failed" in alarm["verdicts"][0]["message"]
        for v in alarm["verdicts"]:  # the dispute in disputes, audited_by a list as in every audit verdict
            (dispute,) = v["evidence"]["disputes"]
            assert (dispute["micro_batch_of"], dispute["audited_by"]) == (1, 0)
            assert isinstance(v["evidence"]["audited_by"], list) and "settle_error" in v["evidence"]
            vf.validate(v)


def test_with_two_nodes_a_rerun_that_changes_to_the_other_result_is_transient(two: Launch) -> None:
    _, ranks = two
    for res in ranks:
        alarm = one_alarm(res["transient"], 5)
        (v,) = alarm["verdicts"]
        assert v["fault"] == "transient" and v["subject"]["rank"] == 1
        (d,) = v["evidence"]["disputes"]
        assert d["referee"] is None and d["majority_ranks"] == [0]


def _id(rank: int, node: str) -> vf.Identity:
    return vf.Identity(rank=rank, world_size=4, host="h", node_name=node, node_name_source="NODE_NAME",
                       local_rank=rank % 2, device="cpu")


def test_the_ring_crosses_nodes_and_says_so_when_it_cannot() -> None:
    targets, note = rerun.ring([_id(0, "a"), _id(1, "a"), _id(2, "b"), _id(3, "b")])
    assert targets == [2, 3, 0, 1] and note is None  # every rank audited once, by another node
    targets, note = rerun.ring([_id(r, "a") for r in range(3)])
    assert targets == [1, 2, 0] and note is not None and "every rank is on one node (a)" in note


def test_the_judgement_without_a_majority() -> None:
    a, b, c = b"a", b"b", b"c"
    # two nodes, each GPU reproduces its own result: which one is wrong is unknown
    both = rerun.judge(1, [rerun.Computation(1, "own", a, a), rerun.Computation(0, "audit", b, b)])
    assert both.culprits == {1: "unknown", 0: "unknown"} and not both.application
    # three nodes, three answers: not deterministic, no GPU blamed
    three = rerun.judge(1, [rerun.Computation(1, "own", a, a), rerun.Computation(0, "audit", b, b),
                            rerun.Computation(2, "referee", c)])
    assert three.application and not three.culprits
    # a majority GPU whose rerun differs: the computation is not reproducible anywhere
    shaky = rerun.judge(1, [rerun.Computation(1, "own", a, a), rerun.Computation(0, "audit", b, c),
                            rerun.Computation(2, "referee", b)])
    assert shaky.application and not shaky.culprits
    assert rerun.nonfinite_fault(True, None)[0] == "unknown"
