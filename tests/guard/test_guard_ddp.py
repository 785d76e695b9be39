"""gpumon.guard in real DDP training: 3 (and 2) local processes, gloo, no mock of torch.distributed.

Faults come from outside the guard's code, through the SDC fault harness (gpumon.sdc.inject) that
``ddp_ranks.py`` wraps around one rank's forward or optimizer step. Every rank runs the same
scenarios in one process group (one launch, ``conftest.py``: torch's import and DDP's first start
dominate the cost; the audit's scenarios, test_guard_audit.py, run in the same launch).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from gpumon.guard import verdict as vf


def test_a_healthy_run_of_200_steps_raises_no_alarm(three: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = three
    for r, res in enumerate(ranks):
        h = res["healthy"]
        assert h["alarms"] == [] and h["disabled"] is None and h["steps"] == 200
        assert h["agree"] is True  # the on-demand weight check (before a checkpoint save)
        assert h["user_hook_calls"] == 200  # the user's own comm hook is the one wrapped
        ident = h["identity"]
        assert (ident["rank"], ident["world_size"], ident["node_name"], ident["node_name_source"],
                ident["local_rank"], ident["device"]) == (r, 3, f"node-{r}", "NODE_NAME", 0, "cpu")
        assert ident["gpu_uuid"] is None and ident["gpu_note"] == "device cpu: no GPU"
        assert ident["host"] == socket.gethostname()


def test_the_guards_own_all_reduce_gives_plain_ddps_mean_and_equal_replicas(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    """The guard all-reduces the buckets itself (the flags ride the last one): the weights after
    every step are plain DDP's up to the order of the sum (a wrong divisor, a missing bucket or the
    wrong group would be off by far more than 1e-6), and every replica holds the same bits."""
    _, ranks = three
    for res in ranks:
        sb = res["same-bits"]
        # DDP rebuilds its buckets after the first step: then the last bucket and another
        assert min(sb["buckets"][1:]) >= 2, sb["buckets"]
        assert len(sb["worst"]) == 6 and max(sb["worst"]) < 1e-6, sb["worst"]
        assert sb["changed"] is True  # the steps did train
        assert sb["alarms"] == []
    bits = [res["same-bits"]["weights"] for res in ranks]
    assert bits[0] == bits[1] == bits[2]


def test_ddp_over_a_group_smaller_than_the_job_is_refused(three: tuple[Path, list[dict[str, Any]]]) -> None:
    """Data parallel inside a larger job (DDP's process_group a subgroup): the guard would take
    ranks of other groups for replicas, and its all-reduce must not mix their gradients."""
    _, ranks = three
    for r, res in enumerate(ranks):
        said = res["subgroup"]["refused"]
        assert said is not None, r
        assert f"has {2 if r < 2 else 1} of the job's 3 ranks" in said and "ShardedGuard" in said


def test_recomputations_are_refused_with_syncbatchnorm_on_every_rank(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    """SyncBatchNorm all-gathers in its forward: the audit's, the reruns' and a kept step's
    forwards run on some ranks only, and would wait on the others until NCCL's timeout."""
    _, ranks = three
    for r, res in enumerate(ranks):
        said = res["syncbn"]
        assert said["refused"] is not None, r
        assert "SyncBatchNorm (1)" in said["refused"] and "checks 1 and 3 still apply" in said["refused"]
        assert said["plain_on"] is True


def test_nan_in_one_ranks_forward_is_named_before_the_update_and_no_weight_changes(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = three
    assert ranks[2]["nan"]["flips"] == 1  # the harness did make rank 2's forward non-finite
    for res in ranks:
        n = res["nan"]
        assert [a["step"] for a in n["alarms"]] == [5]
        alarm = n["alarms"][0]
        assert alarm["ranks"] == [2] and alarm["skipped"] is True and alarm["exit_code"] == 16
        (v,) = alarm["verdicts"]
        assert v["check"] == "nonfinite_grad" and v["step"] == 5
        assert v["subject"]["rank"] == 2 and v["subject"]["node_name"] == "node-2"
        assert "rank 2's local gradients have NaN/Inf before the all-reduce" in v["message"]
        assert n["applied_at"] is False and n["unchanged_at"] is True  # bit-exact, every rank
    # the replicas are still equal after the skipped step and two more
    assert ranks[0]["nan"]["final"] == ranks[1]["nan"]["final"] == ranks[2]["nan"]["final"]
    # only the named rank hands a verdict to its node's daemon
    assert ranks[0]["nan"]["files"] == ranks[1]["nan"]["files"] == []
    (path,) = ranks[2]["nan"]["files"]
    assert Path(path).parent == out / "spool-r2"
    got = vf.read(Path(path))
    assert got.check == "nonfinite_grad" and got.subject.rank == 2 and got.fault == "unknown"
    assert got.evidence["ranks_nonfinite_local"] == [2]
    assert got.evidence["parameters"]  # the named rank says which of its gradients


def test_an_internal_error_after_a_step_is_judged_bad_still_skips_its_update_on_every_rank(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    """The guard fails on the NaN rank while it describes the step (its look at the gradients):
    that rank's guard is off, but the update it knew to be bad is not applied there either; the
    other ranks raise the alarm, wait for it (bounded: timeout_s) and skip too. Before, that rank
    applied the NaN gradients and the replicas diverged, one of them NaN."""
    _, ranks = three
    for r, res in enumerate(ranks):
        ie = res["nan-internal-error"]
        assert ie["applied_at"] is False and ie["unchanged_at"] is True, r
        assert ie["skipped"] == [3] and ie["finite"] is True, r
    bad = ranks[2]["nan-internal-error"]
    assert bad["alarms"] == [] and "out of memory (injected" in bad["disabled"]
    for res in ranks[:2]:
        (alarm,) = res["nan-internal-error"]["alarms"]
        assert alarm["step"] == 3 and alarm["ranks"] == [2]
    assert len({res["nan-internal-error"]["final"][0] for res in ranks}) == 1  # the replicas agree


def test_nan_after_the_reduce_with_finite_inputs_names_the_result_or_the_reduce(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    """Check 1's second half: every rank's local gradients finite, the all-reduce's result NaN (the
    loop's own comm hook corrupts it, the guard wrapping that hook). On one rank only: that rank's
    result is named, and it hands a verdict to its node; on every rank: the reduce itself is named,
    and no node gets a file (no GPU is to blame). The update is skipped on every rank either way."""
    _, ranks = three
    for res in ranks:
        one, every = res["reduce-nan"], res["reduce-nan-all"]
        for got in (one, every):
            assert [a["step"] for a in got["alarms"]] == [3], got["alarms"]
            assert got["applied_at"] is False and got["unchanged_at"] is True
            assert got["told"] == [3]  # callback= was called with the alarm, before it was raised
        (a,) = one["alarms"]
        assert a["ranks"] == [1] and a["skipped"] is True
        (v,) = a["verdicts"]
        assert v["check"] == "nonfinite_reduce" and v["subject"]["rank"] == 1
        assert "NaN/Inf after the all-reduce with finite inputs everywhere: rank 1's result" in v["message"]
        assert v["evidence"]["ranks_nonfinite_reduced"] == [1]
        (a,) = every["alarms"]
        assert sorted(v["subject"]["rank"] for v in a["verdicts"]) == [0, 1, 2]
        assert all("the all-reduce itself" in v["message"] and v["evidence"]["reduce_on_every_rank"]
                   for v in a["verdicts"])
        assert every["files"] == []
    assert ranks[0]["reduce-nan"]["files"] == ranks[2]["reduce-nan"]["files"] == []
    (path,) = ranks[1]["reduce-nan"]["files"]
    assert vf.read(Path(path)).check == "nonfinite_reduce"
    # the replicas did not diverge: nobody applied the poisoned step
    finals = [r["reduce-nan"]["final"] for r in ranks]
    assert finals[0] == finals[1] == finals[2]


def test_nan_in_one_ranks_result_of_the_guards_own_all_reduce_is_named_then_its_replica(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    """The guard's own all-reduce (the flags riding the last bucket), corrupted below it by the DDP
    model's transport on rank 1 only: only rank 1 sees NaN/Inf; it names its own result, skips the
    update the others apply (nobody else knows), and the guard stays on, so that the next weight
    check names rank 1's replica on every rank (before: rank 1's guard went off after the wait, the
    others' weight check timed out waiting for it, and the diverged replica trained on unnamed).
    On every rank: the reduce itself, every rank skips, no node file."""
    _, ranks = three
    for r, res in enumerate(ranks):
        one, every = res["reduce-nan-own"], res["reduce-nan-own-all"]
        assert one["disabled"] is None and every["disabled"] is None
        weights_alarm = one["alarms"][-1]
        assert weights_alarm["step"] == 3 and weights_alarm["ranks"] == [1]
        (v,) = weights_alarm["verdicts"]
        assert v["check"] == "weights" and v["evidence"]["majority_ranks"] == [0, 2]
        assert v["evidence"]["first_parameter"] == "0.weight"
        if r == 1:
            assert one["applied_at"] is False and one["unchanged_at"] is True
            (a, _) = one["alarms"]
            assert a["step"] == 2 and a["ranks"] == [1] and a["skipped"] is True
            (v,) = a["verdicts"]
            assert v["check"] == "nonfinite_reduce" and v["evidence"]["replica_diverged"] is True
            assert "skipped on this rank only" in v["message"]
            assert sorted(vf.read(Path(p)).check for p in one["files"]) == ["nonfinite_reduce", "weights"]
        else:
            assert one["applied_at"] is True and len(one["alarms"]) == 1 and one["files"] == []
        (a,) = every["alarms"]
        assert a["step"] == 2 and a["skipped"] is True and every["unchanged_at"] is True
        assert sorted(v["subject"]["rank"] for v in a["verdicts"]) == [0, 1, 2]
        assert all("the all-reduce itself" in v["message"] for v in a["verdicts"])
        assert every["files"] == []
    assert ranks[0]["reduce-nan-own"]["final"] == ranks[2]["reduce-nan-own"]["final"]
    assert len({res["reduce-nan-own-all"]["final"][0] for res in ranks}) == 1


def test_a_bit_flipped_in_one_ranks_weights_names_that_rank_and_the_parameter(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = three
    flipped = ranks[1]["flip"]["flipped_call"]
    assert flipped is not None
    # SGD updates the parameters in order, one add_ each: the harness's call number is the parameter
    expected = ranks[1]["flip"]["order"][flipped - 1]
    for res in ranks:
        (alarm,) = res["flip"]["alarms"]
        assert alarm["step"] == 4 and alarm["ranks"] == [1] and alarm["skipped"] is False
        (v,) = alarm["verdicts"]
        assert v["check"] == "weights" and v["step"] == 4
        assert v["evidence"]["first_parameter"] == expected
        assert v["evidence"]["majority_ranks"] == [0, 2]
        assert v["evidence"]["fingerprint"] != v["evidence"]["majority_fingerprint"]
        assert f"first at parameter {expected!r}" in v["message"]
    assert ranks[0]["flip"]["files"] == ranks[2]["flip"]["files"] == []
    assert len(ranks[1]["flip"]["files"]) == 1


def test_with_two_replicas_a_weight_mismatch_is_unknown_and_names_both(
        two: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = two
    for res in ranks:
        (alarm,) = res["flip"]["alarms"]
        assert alarm["ranks"] == [0, 1]
        assert all(v["fault"] == "unknown" for v in alarm["verdicts"])
        assert all("two replicas cannot outvote each other" in v["message"] for v in alarm["verdicts"])
    # each replica reports itself on its own node
    assert [len(res["flip"]["files"]) for res in ranks] == [1, 1]


def test_a_wedged_peer_costs_the_guards_timeout_not_a_hang(three: tuple[Path, list[dict[str, Any]]]) -> None:
    """Rank 2 reaches the guard's all-reduce 3.75 s late; the guard's group times out after 1.5 s.
    Every rank logs it, switches the guard off and trains on: all steps done, replicas equal."""
    _, ranks = three
    for res in ranks:
        w = res["wedged"]  # the loop's own comm hook: check 1's flags on the guard's group
        assert w["steps"] == 5
        assert w["disabled"] and w["disabled"].startswith("the gradient check: RuntimeError")
        assert w["seconds"] < 20
    assert ranks[0]["wedged"]["final"] == ranks[1]["wedged"]["final"] == ranks[2]["wedged"]["final"]
    # the guard's own all-reduce: check 1's flags ride the gradients (no collective to time out);
    # the weight check due after the late step is where the others wait, and give up
    for res in ranks:
        w = res["wedged-weights"]
        assert w["steps"] == 5
        assert w["disabled"] and w["disabled"].startswith("the weight check: RuntimeError"), w["disabled"]
        assert w["seconds"] < 20
    finals = [r["wedged-weights"]["final"] for r in ranks]
    assert finals[0] == finals[1] == finals[2]
