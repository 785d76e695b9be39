"""``bench/guard_overhead.py``'s cost model of check 1 (fixed per step + per bucket + per gradient
byte, least squares) and its entry point for a model of the user's (``--model``/``--batch``), run
for real on 2 local ranks with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def make_model() -> torch.nn.Module:
    """A user's model factory (no arguments), as ``--model`` names it."""
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def make_batch(device: torch.device) -> torch.Tensor:
    """A user's micro-batch (``--batch``): the model is called on it, the loss is its output's mean."""
    return torch.randn(8, 16, device=device)


@pytest.fixture(scope="module")
def bench() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import guard_overhead
    finally:
        sys.path.remove(str(BENCH))
    return guard_overhead


def test_the_fit_recovers_a_fixed_a_per_bucket_and_a_per_byte_cost(bench: object) -> None:
    fixed, per_bucket, per_byte = 120e-6, 15e-6, 0.08e-9
    points = [(b, g, fixed + per_bucket * b + per_byte * g)
              for b in (1, 6, 14) for g in (1.4e6, 4e6, 13e6)]
    fit = bench.fit_cost("hook", points)  # type: ignore[attr-defined]
    assert fit.fixed_s == pytest.approx(fixed, rel=1e-6)
    assert fit.per_bucket_s == pytest.approx(per_bucket, rel=1e-6)
    assert fit.per_byte_s == pytest.approx(per_byte, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.predict(80, 2e9) == pytest.approx(fixed + per_bucket * 80 + per_byte * 2e9)
    assert "us per bucket" in fit.describe() and "us per MB" in fit.describe()


def test_a_users_model_is_measured_in_both_modes_and_projected(tmp_path: Path, bench: object) -> None:
    fit = tmp_path / "fit.json"
    fits = [bench.fit_cost(mode, [(1, 1e6, 1e-4), (5, 1e6, 2e-4), (1, 4e6, 3e-4)])  # type: ignore[attr-defined]
            for mode in ("hook", "after")]
    from dataclasses import asdict

    fit.write_text(json.dumps({"fits": [asdict(f) for f in fits]}))
    me = Path(__file__).stem
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "guard_overhead.py"), "--model", f"{me}:make_model",
                           "--batch", f"{me}:make_batch", "--launches", "1", "--rounds", "1", "--steps", "3",
                           "--warmup", "2", "--device", "cpu", "--fit-file", str(fit)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "your model: 1,348 parameters, 0.01 MB of gradients, 1 buckets" in out, out
    for kind in ("none", "after", "check1"):
        assert f"\n{kind} " in out, out
    assert "GUARD OFF" not in out
    projected = [line.split()[0] for line in out.splitlines()
                 if " projected " in line and "; measured " in line]
    assert projected == ["nonfinite='hook'", "nonfinite='after'"], out


def test_the_paired_cost_model_turns_the_check_on_and_off_on_one_guarded_model(tmp_path: Path) -> None:
    """--fit --paired: per point and mode one launch whose rounds run with the check on and off in turn
    (mode "hook" through one registered comm hook that is the guard's or the bare one); the guard
    stays on, and the fit is printed and saved."""
    fit = tmp_path / "fit.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "guard_overhead.py"), "--fit", "--paired", "--points",
                           "small:2:25,small:2:0.25", "--launches", "1", "--rounds", "2", "--steps", "2",
                           "--warmup", "2", "--device", "cpu", "--save-fit", str(fit)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 pairs of rounds (check on, check off)" in out and "WARNING" not in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("small ")]
    assert [r[3] for r in rows] == ["1.36", "1.36"] and rows[0][4] != rows[1][4], out  # 25 MB: fewer buckets
    saved = json.loads(fit.read_text())
    assert saved["method"] == "paired" and [f["mode"] for f in saved["fits"]] == ["hook", "after"]
