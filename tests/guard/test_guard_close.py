"""A guarded job ends cleanly: ``close()``, the ``with`` form, the guard's state, and launch after launch
of real 3-rank DDP jobs that end as a user's script ends, with a busy core beside them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env

EXIT_RANKS = Path(__file__).with_name("exit_ranks.py")
Launch = tuple[Path, list[dict[str, Any]]]
# how many launches of each ending the test runs (docs/guard/adopting.md says the same: checked below)
LAUNCHES = {"alarm": 20, "with": 4, "rerun": 4}


def test_close_ends_the_guard_and_destroys_its_groups_and_training_goes_on(three: Launch) -> None:
    _, ranks = three
    for res in ranks:
        c = res["close"]
        closed = c["closed"]["reason"]
        assert closed.startswith("closed (guard.close()")
        assert c["groups_made"] == 2  # the guard's own group and its reduce-exchange group
        assert c["on"] == {"on": True, "audit": "not configured", "reason": None, "closed": False}
        assert c["closed"] == {"on": False, "audit": "not configured", "reason": closed, "closed": True}
        assert c["groups_left"] == 0 and c["held"] == [True, True, True]
        assert c["applied_after"] == [True, True, True]  # unguarded now, and still trained
        assert c["weight_check_after"] is None  # the guard is off: no report
        assert c["with_applied"] is True and c["with_on"]["on"] is True
        assert c["with_closed"] == {"on": False, "audit": "not configured", "reason": closed, "closed": True}
        assert c["with_groups_left"] == 0
        assert c["with_strict_after"] is True  # closed is no internal error, even with strict=True
    # after close the comm hook still does DDP's all-reduce: the replicas stay equal
    assert ranks[0]["close"]["weights"] == ranks[1]["close"]["weights"] == ranks[2]["close"]["weights"]


@pytest.fixture
def busy_core() -> Any:
    """One core kept busy for the test's length (a pure-Python loop, as a neighbour's job would)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


@pytest.mark.parametrize("ending", sorted(LAUNCHES))
def test_a_guarded_job_ends_cleanly_launch_after_launch_beside_a_busy_core(
        ending: str, tmp_path: Path, busy_core: Any) -> None:
    """Every rank of every launch exits with the code its script returned (16 after the alarm) and
    none aborts at the interpreter's exit (``terminate called without an active exception``, SIGABRT:
    seen once in eight such launches before ``close()`` ran at exit)."""
    n = LAUNCHES[ending]
    proc = subprocess.run([sys.executable, str(EXIT_RANKS), str(tmp_path), str(n), "3", ending],
                          capture_output=True, text=True, timeout=60 + 15 * n,
                          env=clean_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launches = json.loads((tmp_path / "launches.json").read_text())
    assert len(launches) == n
    bad = [(x["launch"], e) for x in launches for e in x["ranks"] if e["aborted"] or e.get("exit") != 16]
    print(f"{ending}: {n} launches of 3 ranks, {sum(x['seconds'] for x in launches):.1f} s")
    assert not bad, bad[:3]


def test_the_docs_say_how_many_launches_this_test_runs() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "guard" / "adopting.md"
    text = " ".join(page.read_text().split())
    assert (f"runs {sum(LAUNCHES.values())} three-rank jobs on real gloo ({LAUNCHES['alarm']} that end "
            f"after check 1's alarm, {LAUNCHES['with']} inside `with Guard(...)`, {LAUNCHES['rerun']} with "
            "check 1's reruns and the kept step)") in text
