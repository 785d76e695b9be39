"""gpumon.fabric.schedule without a network: the circle method, the rotation above the cut-off (every
pair within the bound, kept across runs and restarts, nodes coming and going), and a stored rotation
that cannot be read (a clear error, a fresh rotation, nothing else touched).

A "run" here is what the probe does with a rotation: load it from the node's state directory,
``begin`` with the run's nodes, measure the rounds (all, or a prefix when the run ends early), ``end``,
write it back. Every run reloads from the file, as every probe run is a new process.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.fabric.cli import read_rotation, write_rotation
from gpumon.fabric.isolate import Isolator, PairResult
from gpumon.fabric.schedule import (
    Coverage,
    Plan,
    Rotation,
    RotationError,
    circle_round,
    preference,
    runs_per_cycle,
    slot_partner,
    slot_round,
)
from gpumon.fabric.settings import FabricConfig

PER_RUN = FabricConfig().coverage_rounds
CUT_OFF = PER_RUN + 1  # the largest group whose whole tournament fits in one run


def names(n: int) -> list[str]:
    return [f"gpu{i:03d}" for i in range(n)]


def key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def one_run(state: Path, members: list[str], per_run: int = PER_RUN, played: int | None = None,
            now: float = 0.0) -> tuple[Plan, Coverage]:
    """One probe run against the rotation kept in ``state``: load, plan, measure ``played`` rounds (all
    by default), record, write back."""
    rot = read_rotation(state) or Rotation()
    plan = rot.begin(members, per_run)
    done = len(plan.rounds) if played is None else played
    cov = rot.end(plan, done, now, per_run=per_run)
    write_rotation(state, rot.dumps())
    return plan, cov


def measured_pairs(plan: Plan, played: int | None = None) -> set[tuple[str, str]]:
    rounds = plan.rounds if played is None else plan.rounds[:played]
    return {key(a, b) for _, pairs in rounds for a, b in pairs}


# -- the tournament -------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [2, 4, 6, 16, 18, 64])
def test_the_circle_method_meets_every_pair_of_slots_once_in_disjoint_rounds(slots: int) -> None:
    m = slots - 1
    met: dict[frozenset[int], int] = {}
    for r in range(m):
        pairs = circle_round(slots, r)
        assert sorted(x for p in pairs for x in p) == list(range(slots))  # disjoint, everyone plays
        for i, j in pairs:
            assert frozenset((i, j)) not in met
            met[frozenset((i, j))] = r
            assert slot_round(m, i, j) == slot_round(m, j, i) == r
            assert slot_partner(m, i, r) == j and slot_partner(m, j, r) == i
    assert len(met) == slots * (slots - 1) // 2


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 15, CUT_OFF])
def test_a_group_up_to_the_cut_off_has_every_pair_measured_in_every_run(tmp_path: Path, n: int) -> None:
    nodes = names(n)
    for run in range(1, 3):
        plan, cov = one_run(tmp_path, nodes)
        assert plan.whole and len(plan.rounds) == (n - 1 if n % 2 == 0 else n)
        for _, pairs in plan.rounds:  # N/2 disjoint pairs a round (odd N: one node sits out)
            assert len(pairs) == n // 2 and len({x for p in pairs for x in p}) == 2 * len(pairs)
        assert measured_pairs(plan) == set(itertools.combinations(nodes, 2))
        assert (cov.pairs_measured, cov.pairs_total, cov.runs_since_full_coverage, cov.runs_per_cycle) == \
            (n * (n - 1) // 2, n * (n - 1) // 2, 0, 1)
        assert cov.rotation_runs == run


def test_one_node_more_than_the_cut_off_is_a_rotation() -> None:
    plan = Rotation().begin(names(CUT_OFF + 1), PER_RUN)
    assert not plan.whole and len(plan.rounds) == PER_RUN


# -- above the cut-off ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [CUT_OFF + 1, CUT_OFF + 2, 31, 32, 64, 101])
def test_above_the_cut_off_every_pair_is_measured_within_the_bound_and_the_rotation_survives_restarts(
        tmp_path: Path, n: int) -> None:
    """Three cycles of runs, each run a new process reading the rotation back from its file: every
    cycle measures every pair exactly once in ceil(rounds / 15) runs (the bound), no run measures more
    than 15 rounds, and the coverage counts say so."""
    nodes = names(n)
    rounds = n - 1 if n % 2 == 0 else n
    bound = math.ceil(rounds / PER_RUN)
    assert runs_per_cycle(rounds, PER_RUN) == bound
    for cycle in range(3):
        seen: list[tuple[str, str]] = []
        for k in range(bound):
            plan, cov = one_run(tmp_path, nodes, now=float(cycle * bound + k))
            assert not plan.whole and 0 < len(plan.rounds) <= PER_RUN
            seen += [key(a, b) for _, pairs in plan.rounds for a, b in pairs]
            assert cov.pairs_measured == len(seen) and cov.pairs_total == n * (n - 1) // 2
            assert cov.runs_per_cycle == bound
            last = k == bound - 1
            # runs since the last full coverage (the first cycle: since the rotation began)
            assert cov.runs_since_full_coverage == (0 if last else k + 1), (cycle, k)
            if last:
                assert cov.full_coverage_time == float(cycle * bound + k)
        assert sorted(seen) == sorted(itertools.combinations(nodes, 2)), cycle  # every pair, each once


def test_a_run_that_ends_early_leaves_its_rounds_to_the_next(tmp_path: Path) -> None:
    nodes = names(40)  # 39 rounds: 15 + 15 + 9
    plan, cov = one_run(tmp_path, nodes, played=4)
    assert [r for r, _ in plan.rounds] == list(range(15)) and cov.rounds_played == (0, 1, 2, 3)
    plan, cov = one_run(tmp_path, nodes)
    assert [r for r, _ in plan.rounds] == list(range(4, 19))
    assert cov.pairs_measured == 19 * 20 and cov.runs_since_full_coverage == 2


def test_a_node_away_mid_cycle_keeps_its_slot_and_the_others_are_still_covered_in_the_cycle(
        tmp_path: Path) -> None:
    nodes = names(20)  # 19 rounds: 15 + 4
    one_run(tmp_path, nodes)
    rest = [n for n in nodes if n != "gpu005"]
    plan, cov = one_run(tmp_path, rest)
    assert any("not in this run: gpu005" in note for note in plan.notes), plan.notes
    assert all("gpu005" not in p for _, pairs in plan.rounds for p in pairs)
    # the cycle ends on time, and every pair of the 19 nodes of this run was measured in it
    assert (cov.pairs_measured, cov.pairs_total, cov.runs_since_full_coverage) == (171, 171, 0)
    # back next cycle: the table is rebuilt from this run's nodes (a new cycle loses nothing)
    plan, cov = one_run(tmp_path, nodes)
    assert cov.pairs_total == 190 and cov.pairs_measured == 15 * 10


def test_a_node_back_in_the_same_cycle_has_its_missed_pairs_measured_next_cycle(tmp_path: Path) -> None:
    nodes = names(40)  # 39 rounds: 15 + 15 + 9
    one_run(tmp_path, nodes)
    one_run(tmp_path, [n for n in nodes if n != "gpu007"])
    _, cov = one_run(tmp_path, nodes)  # back for the cycle's last run: 15 of its 39 pairs missed
    assert cov.pairs_measured == 780 - 15 and cov.runs_since_full_coverage == 3
    assert any("15 pair(s) not measured" in note for note in cov.notes), cov.notes
    for _ in range(3):  # the next cycle measures every pair
        _, cov = one_run(tmp_path, nodes)
    assert (cov.pairs_measured, cov.runs_since_full_coverage) == (780, 0)


def test_a_new_node_takes_a_free_slot_mid_cycle_and_is_covered_by_the_end_of_the_next_cycle(
        tmp_path: Path) -> None:
    nodes = names(39)  # odd: 40 slots, one empty; 39 rounds
    one_run(tmp_path, nodes)
    plan, cov = one_run(tmp_path, [*nodes, "new"])
    assert any("joined mid-cycle: new in slot 39" in note for note in plan.notes), plan.notes
    assert any("new" in p for _, pairs in plan.rounds for p in pairs)  # it plays from its first run
    _, cov = one_run(tmp_path, [*nodes, "new"])  # the cycle ends: new's pairs of rounds 0-14 missing
    assert cov.pairs_total == 780 and cov.pairs_measured == 780 - 15 and cov.runs_since_full_coverage == 3
    for _ in range(3):
        _, cov = one_run(tmp_path, [*nodes, "new"])
    assert (cov.pairs_measured, cov.runs_since_full_coverage) == (780, 0)  # within two cycles of joining


def test_a_new_node_with_no_free_slot_restarts_the_rotation(tmp_path: Path) -> None:
    nodes = names(40)
    one_run(tmp_path, nodes)
    plan, cov = one_run(tmp_path, [*nodes, "new"])
    assert any("no free slot: the rotation restarts at round 0" in note for note in plan.notes), plan.notes
    assert plan.rounds[0][0] == 0 and cov.cycle_rounds == 41
    assert cov.runs_since_full_coverage == 2  # the runs go on counting across the restart
    for _ in range(2):
        _, cov = one_run(tmp_path, [*nodes, "new"])
    assert (cov.pairs_measured, cov.pairs_total, cov.runs_since_full_coverage) == (820, 820, 0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_counted_coverage_is_what_was_measured_whatever_comes_and_goes(data: st.DataObject) -> None:
    """Random groups over random runs (nodes away, back, new; runs ending early): ``pairs_measured`` is
    exactly the pairs of this run's nodes measured in the current cycle while both held their slots,
    counted by hand from the plans; and a cycle of unchanged, complete runs covers every pair."""
    pool = names(24)
    per_run = data.draw(st.integers(1, 6))
    rot = Rotation()
    cycle: set[tuple[str, str]] = set()
    for _ in range(data.draw(st.integers(1, 12))):
        members = sorted(data.draw(st.sets(st.sampled_from(pool), min_size=2, max_size=len(pool))))
        before = rot.to_json()
        plan = rot.begin(members, per_run)
        if plan.whole or before["next_round"] == 0 or any("restarts" in n for n in plan.notes):
            cycle = set()
        # a node given a slot mid-cycle (new, or back after giving its slot up): what it measured
        # before in this cycle was with another slot's rounds, and no longer counts
        for n in {x for x in rot.slots if x is not None} - set(before["slots"]):
            cycle = {p for p in cycle if n not in p}
        played = data.draw(st.integers(0, len(plan.rounds)))
        cycle |= measured_pairs(plan, played)
        cov = rot.end(plan, played, 0.0, per_run=per_run)
        present = set(members)
        assert cov.pairs_measured == len({p for p in cycle if p[0] in present and p[1] in present}), \
            (plan, played, cov)
        rot = Rotation.from_json(json.loads(json.dumps(rot.to_json())))
    # then an unchanged group, complete runs: full coverage within the bound
    members = pool[:data.draw(st.integers(2, len(pool)))]
    runs = 0
    while True:
        plan = rot.begin(members, per_run)
        cov = rot.end(plan, len(plan.rounds), 0.0, per_run=per_run)
        runs += 1
        if cov.runs_since_full_coverage == 0:
            break
        # at most the rest of a cycle begun with other nodes (a table of <= 24 slots), then one of these
        assert runs < 2 * runs_per_cycle(23, per_run), cov
    assert cov.pairs_measured == cov.pairs_total == len(members) * (len(members) - 1) // 2


# -- the stored rotation --------------------------------------------------------------------------


def test_a_truncated_or_corrupt_rotation_is_a_clear_error_a_fresh_rotation_and_touches_nothing_else(
        tmp_path: Path) -> None:
    nodes = names(40)
    one_run(tmp_path, nodes)
    fabric = tmp_path / "fabric"
    (fabric / "latest.json").write_text('{"finding": "this node\'s last verdict"}\n')
    (fabric / "group-latest.json").write_text("{}\n")
    others = {p.name: p.read_bytes() for p in fabric.iterdir() if p.name != "rotation.json"}
    good = (fabric / "rotation.json").read_text()
    for broken, why in ((good[: len(good) // 2], "not JSON"), ("", "not JSON"),
                        ("[1, 2]", "not a JSON object"),
                        (good.replace('"version":1', '"version":7'), "version 7"),
                        (good.replace('"next_round":15', '"next_round":99'), "next_round: 99")):
        (fabric / "rotation.json").write_text(broken)
        with pytest.raises(RotationError) as err:
            read_rotation(tmp_path)
        assert str(err.value).startswith(f"{fabric / 'rotation.json'}: ") and why in str(err.value), err.value
        # what the probe does then (no other node with a copy): a fresh rotation from round 0
        plan = Rotation().begin(nodes, PER_RUN)
        assert plan.rounds[0][0] == 0
    cov = one_run_tolerant(tmp_path, nodes)  # the probe's way: a fresh rotation, written back
    assert cov.rounds_played[0] == 0 and cov.rotation_runs == 1
    assert {p.name: p.read_bytes() for p in fabric.iterdir() if p.name != "rotation.json"} == others
    assert read_rotation(tmp_path) is not None


def one_run_tolerant(state: Path, members: list[str]) -> Coverage:
    try:
        rot = read_rotation(state) or Rotation()
    except RotationError:
        rot = Rotation()
    plan = rot.begin(members, PER_RUN)
    cov = rot.end(plan, len(plan.rounds), 0.0, per_run=PER_RUN)
    write_rotation(state, rot.dumps())
    return cov


def test_after_a_corrupt_copy_the_fresh_rotation_is_kept_and_continued(tmp_path: Path) -> None:
    nodes = names(40)
    (tmp_path / "fabric").mkdir()
    (tmp_path / "fabric" / "rotation.json").write_bytes(b'{"version": 1, "slots": ["a", "b"')
    covs = [one_run_tolerant(tmp_path, nodes) for _ in range(3)]
    assert [c.rounds_played[0] for c in covs] == [0, 15, 30]
    assert covs[-1].runs_since_full_coverage == 0


def test_a_missing_rotation_is_none_and_an_oversized_one_an_error(tmp_path: Path) -> None:
    assert read_rotation(tmp_path) is None
    (tmp_path / "fabric").mkdir()
    (tmp_path / "fabric" / "rotation.json").write_bytes(b" " * ((8 << 20) + 2))
    with pytest.raises(RotationError, match="larger than"):
        read_rotation(tmp_path)


def test_the_copy_with_the_most_runs_is_continued_first() -> None:
    assert preference({"b": 4, "a": 4, "c": 9, "d": 1}) == ["c", "a", "b", "d"]


# -- the isolator's first pass --------------------------------------------------------------------


def test_the_isolator_measures_the_coverage_rounds_as_given_then_follows_up() -> None:
    nodes = names(4)
    plan = Rotation().begin(nodes, PER_RUN)
    first = [list(pairs) for _, pairs in plan.rounds]
    iso = Isolator(nodes, seed=123, first=first)
    asked = []
    while pairs := iso.next_round():
        asked.append(pairs)
        # gpu001-gpu002 is a slow path; everything else at full speed
        iso.add(PairResult(a, b, 1.0 if {a, b} == {"gpu001", "gpu002"} else 40.0, 5.0) for a, b in pairs)
    assert asked[: len(first)] == first and iso.first_pass == 3
    v = iso.verdict()
    assert [(lf.a, lf.b) for lf in v.link_faults] == [("gpu001", "gpu002")] and not v.node_faults
    with pytest.raises(ValueError, match="disjoint"):
        Isolator(nodes, first=[[("gpu000", "gpu001"), ("gpu001", "gpu002")]])
