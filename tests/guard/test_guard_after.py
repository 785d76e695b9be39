"""Check 1 with ``nonfinite="after"``: no comm hook (DDP's own all-reduce), one fused NaN/Inf pass
over the reduced gradients after the backward, the rank named afterwards. Real DDP, 3 local
processes on gloo (``after_ranks.py``, one launch for every scenario), each posing as its own node;
faults from outside the guard (the SDC fault harness, a corrupting transport, the loop's own hook).

What it catches: a NaN in one rank's local gradients (every rank's reduced gradients hold it), the
update skipped on every rank, the rank named by its loss or by the reruns where ``batch_for`` and
``loss_fn`` are given, "not known" said plainly where it cannot be; one rank's corrupted result of
the all-reduce. What it misses, tested too: which rank a transient came from without a loss or a
rerun that shows it, the all-reduce's own fault told from a rank's, a NaN the loop's own comm hook
takes out of the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpumon.guard import verdict as vf
from gpumon.guard.after import first_grad_tensor, grads_of, reduced_nonfinite

RANKS = Path(__file__).with_name("after_ranks.py")
SCENARIOS = ("same-bits,nan-bare,nan-loss,nan-transient,nan-transient-loss,nan-persistent,nan-application,"
             "reduce-one,reduce-all,scrub,audit-healthy,audit-transient,pace")
Launch = tuple[Path, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def after(tmp_path_factory: pytest.TempPathFactory, launch_ranks: Any) -> Launch:
    out = tmp_path_factory.mktemp("after3")
    return out, launch_ranks(out, 3, SCENARIOS, script=RANKS)


def only_alarm(res: dict[str, Any], step: int) -> dict[str, Any]:
    (alarm,) = res["alarms"]
    assert alarm["step"] == step, res["alarms"]
    return alarm


# -- the pass itself ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_fused_pass_sees_one_nan_or_inf_in_any_gradient(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    grads = [(torch.randn(n, generator=g) * 100).to(dtype) for n in (4097, 1, 300, 64)]
    assert not bool(reduced_nonfinite(grads))
    for i in range(len(grads)):
        for bad in (float("nan"), float("inf"), float("-inf")):
            c = [t.clone() for t in grads]
            c[i][-1] = bad
            assert bool(reduced_nonfinite(c)), (dtype, i, bad)


def test_large_finite_half_gradients_are_not_called_non_finite_and_no_gradient_is_none() -> None:
    assert not bool(reduced_nonfinite([torch.full((1 << 20,), 65504.0, dtype=torch.float16)]))
    assert reduced_nonfinite([]) is None
    assert reduced_nonfinite([torch.zeros(0)]) is None
    mixed = [torch.ones(3), torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)]
    assert not bool(reduced_nonfinite(mixed))
    mixed[2][1] = float("nan")
    assert bool(reduced_nonfinite(mixed))


def test_sparse_gradients_are_read_by_their_values_and_missing_ones_skipped() -> None:
    emb = torch.nn.Embedding(10, 4, sparse=True)
    unused = torch.nn.Parameter(torch.ones(2))
    emb(torch.tensor([1, 2])).sum().backward()
    got = grads_of([emb.weight, unused])
    assert len(got) == 1 and not bool(reduced_nonfinite(got))
    assert emb.weight.grad is not None
    emb.weight.grad._values()[0, 0] = float("inf")
    assert bool(reduced_nonfinite(grads_of([emb.weight])))


def test_the_backward_of_any_output_shape_is_found() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    assert first_grad_tensor(y) is y
    assert first_grad_tensor({"logits": torch.ones(1), "loss": y}) is y
    assert first_grad_tensor((torch.ones(1), [y])) is y
    assert first_grad_tensor(torch.ones(1)) is None and first_grad_tensor("text") is None


def test_an_unknown_mode_is_refused() -> None:
    from gpumon.guard import Guard

    with pytest.raises(ValueError, match="nonfinite: 'sometimes' is not one of hook, after"):
        Guard(None, None, nonfinite="sometimes")  # type: ignore[arg-type]


# -- in real DDP ------------------------------------------------------------------------------------

def test_no_comm_hook_and_the_same_bits_as_plain_ddp(after: Launch) -> None:
    """DDP's built-in all-reduce is untouched: a guarded model trains to the very bits of a plain one
    (mode "hook" does the all-reduce itself: equal only to 1e-6), and no comm hook is registered."""
    _, ranks = after
    for res in ranks:
        sb = res["same-bits"]
        assert sb["equal"] == [True] * 8 and sb["changed"] is True
        assert sb["comm_hook"] is None and sb["alarms"] == [] and sb["disabled"] is None


def test_nan_in_one_ranks_gradients_is_caught_and_skipped_everywhere_though_not_named(after: Launch) -> None:
    """No loss handed in, no batch_for/loss_fn: the NaN is caught and the update skipped on every
    rank (the weights unchanged bit for bit, the replicas equal), and the verdict says plainly that
    the rank is not known, and why; no node gets a file (no GPU is named)."""
    _, ranks = after
    for res in ranks:
        got = res["nan-bare"]
        alarm = only_alarm(got, 3)
        assert alarm["skipped"] is True and alarm["ranks"] == [0, 1, 2]
        assert got["applied_at"] is False and got["unchanged_at"] is True
        assert got["files"] == [] and got["disabled"] is None
        for v in alarm["verdicts"]:
            assert (v["check"], v["fault"]) == ("nonfinite_grad", "unknown")
            ev = v["evidence"]
            assert ev["source_known"] is False and ev["nonfinite_mode"] == "after"
            assert ev["ranks_nonfinite_reduced"] == [0, 1, 2] and ev["parameters"]
            assert "whose gradients it came from is not known" in v["message"]
            assert "no batch_for and loss_fn" in v["message"] and "no loss to guard.step()" in v["message"]
    assert len({res["nan-bare"]["final"][0] for res in ranks}) == 1


def test_a_non_finite_loss_names_its_rank(after: Launch) -> None:
    """The loop hands its loss to ``step(loss)``: on a hit the ranks say whose loss was NaN/Inf
    (one small exchange, on the hit only), and that rank is named (not rerun: ``unknown``); it
    alone reports to its node."""
    out, ranks = after
    assert ranks[2]["nan-loss"]["injected"] == 1
    for res in ranks:
        got = res["nan-loss"]
        alarm = only_alarm(got, 3)
        assert alarm["ranks"] == [2] and alarm["skipped"] is True and got["unchanged_at"] is True
        (v,) = alarm["verdicts"]
        assert (v["check"], v["fault"], v["subject"]["rank"]) == ("nonfinite_grad", "unknown", 2)
        assert "named by its loss" in v["message"] and "no rerun" in v["message"]
        assert v["evidence"]["source_known"] is True and v["evidence"]["ranks_nonfinite_loss"] == [2]
    assert ranks[0]["nan-loss"]["files"] == ranks[1]["nan-loss"]["files"] == []
    (path,) = ranks[2]["nan-loss"]["files"]
    assert Path(path).parent == out / "spool-nan-loss-r2"
    assert vf.read(Path(path)).evidence["nonfinite_mode"] == "after"


def test_a_persistent_nan_is_named_by_the_rerun_on_its_gpu(after: Launch) -> None:
    """Rank 2's GPU computes NaN every time it computes its micro-batch at step 3 (its rerun too),
    another node's GPU computes it finite: rank 2 is named by its rerun, ``persistent``, with no
    loss handed in."""
    _, ranks = after
    assert ranks[2]["nan-persistent"]["injected"] >= 2  # the loop's computation and the rerun
    for res in ranks:
        alarm = only_alarm(res["nan-persistent"], 3)
        assert alarm["ranks"] == [2] and alarm["exit_code"] == 17
        (v,) = alarm["verdicts"]
        assert v["fault"] == "persistent" and "named by its rerun" in v["message"]
        rows = {(row["role"], row["rank"]): row["nonfinite"] for row in v["evidence"]["reruns"]}
        assert rows[("rerun_same_gpu", 2)] is True
        assert [k for k in rows if k[0] == "other_node" and k[1] != 2]
        assert list(rows.values()) == [True, False]
    assert len(ranks[2]["nan-persistent"]["files"]) == 1 and ranks[2]["nan-persistent"]["bundles"]


def test_a_nan_of_the_data_is_named_application(after: Launch) -> None:
    _, ranks = after
    for res in ranks:
        (v,) = only_alarm(res["nan-application"], 3)["verdicts"]
        assert (v["subject"]["rank"], v["fault"]) == (2, "application")
        assert [row["nonfinite"] for row in v["evidence"]["reruns"]] == [True, True]


def test_a_transient_is_named_by_its_loss_or_said_to_be_unknown(after: Launch) -> None:
    """A NaN in rank 2's forward once (the reruns compute it finite): with the loss handed in, rank
    2 is named ``transient``; without it no rerun shows the rank, and the verdict says so: a
    transient the reruns do not reproduce (of one GPU, or of the all-reduce)."""
    _, ranks = after
    for res in ranks:
        (v,) = only_alarm(res["nan-transient-loss"], 3)["verdicts"]
        assert (v["subject"]["rank"], v["fault"]) == (2, "transient")
        assert "named by its loss" in v["message"]
        alarm = only_alarm(res["nan-transient"], 3)
        assert alarm["ranks"] == [0, 1, 2] and alarm["skipped"] is True
        assert res["nan-transient"]["unchanged_at"] is True and res["nan-transient"]["files"] == []
        for v in alarm["verdicts"]:
            assert v["evidence"]["source_known"] is False
            assert "no rerun reproduces" in v["message"] and "not known" in v["message"]


def test_one_ranks_corrupted_all_reduce_result_is_named_then_its_replica(after: Launch) -> None:
    """As in mode "hook": rank 1's copy of DDP's all-reduce result NaN (a corrupting transport):
    only rank 1 sees it, names its result, skips the update the others apply, and the next weight
    check names its replica on every rank."""
    _, ranks = after
    for r, res in enumerate(ranks):
        got = res["reduce-one"]
        assert got["disabled"] is None
        weights_alarm = got["alarms"][-1]
        assert weights_alarm["step"] == 3 and weights_alarm["ranks"] == [1]
        assert weights_alarm["verdicts"][0]["check"] == "weights"
        if r == 1:
            first = got["alarms"][0]
            assert first["step"] == 2 and first["ranks"] == [1] and got["applied_at"] is False
            (v,) = first["verdicts"]
            assert v["check"] == "nonfinite_reduce" and v["evidence"]["replica_diverged"] is True
        else:
            assert got["applied_at"] is True and len(got["alarms"]) == 1


def test_missed_the_all_reduce_itself_is_not_told_from_a_ranks_gradients(after: Launch) -> None:
    """What mode "after" misses: every rank's all-reduce result NaN with finite inputs everywhere.
    Mode "hook" names the all-reduce itself (``nonfinite_reduce``, test_guard_ddp.py); here it is a
    non-finite gradient whose rank is not known. Caught and skipped all the same."""
    _, ranks = after
    for res in ranks:
        alarm = only_alarm(res["reduce-all"], 2)
        assert res["reduce-all"]["unchanged_at"] is True
        assert {v["check"] for v in alarm["verdicts"]} == {"nonfinite_grad"}
        assert all(v["evidence"]["source_known"] is False for v in alarm["verdicts"])


def test_missed_a_nan_the_loops_own_comm_hook_takes_out_of_the_result(after: Launch) -> None:
    """What mode "after" misses: the loop's comm hook replaces non-finite values in the reduced
    buckets (``nan_to_num``); rank 2's local gradients were NaN. Mode "hook" flags the bucket
    before the loop's hook; mode "after" reads only what the hook left, and the update is applied."""
    _, ranks = after
    for res in ranks:
        hook, late = res["scrub"]["hook"], res["scrub"]["after"]
        (v,) = only_alarm(hook, 2)["verdicts"]
        assert v["subject"]["rank"] == 2 and hook["applied_at"] is False
        assert late["alarms"] == [] and late["applied_at"] is True


def test_the_audit_takes_its_local_gradients_without_a_comm_hook(after: Launch) -> None:
    """Check 2 in mode "after": the audited rank's own gradients are fingerprinted by post-
    accumulate-grad hooks on audit steps only. A healthy run audits with no alarm (the local
    gradients, not the reduced ones, were taken); one low bit of rank 1's backward is found and
    rank 1 named, as in mode "hook"."""
    _, ranks = after
    for res in ranks:
        healthy = res["audit-healthy"]
        assert healthy["alarms"] == [] and healthy["audits"] == 4 and healthy["disabled"] is None
        (v,) = only_alarm(res["audit-transient"], 4)["verdicts"]
        assert (v["check"], v["fault"], v["subject"]["rank"]) == ("audit", "transient", 1)


def test_the_straggler_meter_stops_at_the_end_of_each_ranks_own_backward(after: Launch) -> None:
    """Without a comm hook the end of the backward is an autograd callback, before DDP waits for
    the other ranks: rank 2's forward sleeps 30 ms a step, it alone is slow, the others' waiting for
    it is not counted as their compute."""
    _, ranks = after
    for res in ranks:
        first = res["pace"]["windows"][0]
        assert first["named"] == [2], first
        assert first["pace"][2] < 0.5 and min(first["pace"][:2]) > 0.5, first
        # the others' compute leaves out their wait for rank 2: 20 ms short of its (a 30 ms sleep
        # in it), whatever a busy machine adds to everyone's work (with the wait counted, theirs
        # would be about rank 2's)
        slow = first["compute_ms"][2]
        assert slow > 25 and max(first["compute_ms"][:2]) < slow - 20, first
