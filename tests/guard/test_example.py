"""examples/guard_ddp.py run as docs/guard/adopting.md shows it: ``torchrun --standalone
--nproc_per_node 3``, healthy and with each ``--demo-fault`` (the three launches run at once: torch's
import dominates).

What is checked is what a platform engineer sees: the launcher's exit code and its per-rank
``exitcode``, the alarm on rank 0, the verdict file in the spool, the attestations, and what
``gpumon guard checkpoints`` names to resume from.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumon.guard import attestation as at
from gpumon.guard import verdict as vf
from gpumon.guard.cli import checkpoints

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "guard_ddp.py"
STEPS = 20  # checks and checkpoints every 5 steps, the fault at step 11
Run = tuple[Path, "subprocess.CompletedProcess[str]"]


def torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON_GUARD_DIR", "SLURM_JOB_ID")}
    procs = {}
    for name in ("healthy", "nan", "weight-flip"):
        cwd = tmp_path_factory.mktemp(name)
        fault = [] if name == "healthy" else ["--demo-fault", name]
        cmd = [*torchrun(), "--standalone", "--nproc_per_node", "3", str(EXAMPLE), "--steps", str(STEPS),
               *fault]
        procs[name] = (cwd, cmd, subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True))
    done = {}
    try:
        for name, (cwd, cmd, p) in procs.items():
            out, _ = p.communicate(timeout=180)
            done[name] = (cwd, subprocess.CompletedProcess(cmd, p.returncode, out, ""))
    finally:
        for _, _, p in procs.values():
            if p.poll() is None:
                p.kill()
    return done


def exit_codes_ok(out: str) -> None:
    """torchrun's failure summary: the first rank to exit left with 16; each other rank either
    exited 16 too or was still on its way out when torchrun stopped it (SIGTERM). The ranks leave
    the alarm together, after the named rank's verdict is written (the tests read it)."""
    first = re.search(r"exitcode  : (-?\d+)", out[out.index("Root Cause (first observed failure)"):])
    assert first is not None and first.group(1) == "16", out
    codes = re.findall(r"exitcode  : (-?\d+)", out)
    assert len(codes) == 3 and set(codes) <= {"16", "-15"} and "16" in codes, out

def resume_point(capsys: pytest.CaptureFixture[str], ckpt: Path,
                 spool: Path | None = None) -> tuple[int, dict[str, Any]]:
    """What ``gpumon guard checkpoints CKPT [--verdicts SPOOL] --json`` says (in this process: the
    command's own tests run it as a command)."""
    capsys.readouterr()
    code = checkpoints(ckpt, verdicts=spool, as_json=True)
    return code, json.loads(capsys.readouterr().out)


def verdicts(spool: Path) -> list[vf.Verdict]:
    return [vf.read(p) for p in sorted(spool.glob("*.json"))]


def test_healthy_training_ends_0_with_every_checkpoint_verified(
        runs: dict[str, Run],
        capsys: pytest.CaptureFixture[str]) -> None:
    cwd, proc = runs["healthy"]
    assert proc.returncode == 0, proc.stdout
    assert f"done: {STEPS} steps, no alarm" in proc.stdout and "GUARD ALARM" not in proc.stdout
    atts = sorted((at.read(p) for p in (cwd / "guard-demo" / "ckpt").glob("*" + at.SUFFIX)),
                  key=lambda a: a.step)
    assert [(a.step, a.verdict, a.agree) for a in atts] == [(k, "verified", [0, 1, 2])
                                                            for k in (5, 10, 15, 20)]
    assert not (cwd / "guard-demo" / "spool").exists()  # no verdict
    code, doc = resume_point(capsys, cwd / "guard-demo" / "ckpt")
    assert code == 0 and doc["resume"]["step"] == 20


def test_nan_in_one_ranks_forward_exits_16_names_it_and_resume_is_before_it(
        runs: dict[str, Run],
        capsys: pytest.CaptureFixture[str]) -> None:
    cwd, proc = runs["nan"]
    out = proc.stdout
    assert proc.returncode != 0  # torchrun's own code is 1; it lists what each rank exited with
    exit_codes_ok(out)
    assert "GUARD ALARM: step 11: rank 2's local gradients have NaN/Inf before the all-reduce" in out
    assert "ranks named: [2]; update skipped: True; exit code 16" in out
    (v,) = verdicts(cwd / "guard-demo" / "spool")
    assert (v.check, v.step, v.subject.rank, v.fault) == ("nonfinite_grad", 11, 2, "unknown")
    # the named rank says so in the job's log before the ranks leave (a line printed after the alarm
    # is raised is lost when torchrun stops that rank for the first one's exit)
    said = f"gpumon.guard: rank 2: verdict written for this node's daemon: guard-demo/spool/{v.id}.json"
    assert said in out
    code, doc = resume_point(capsys, cwd / "guard-demo" / "ckpt", cwd / "guard-demo" / "spool")
    assert code == 1 and doc["first_suspect_step"] == 11 and doc["resume"]["step"] == 10


def test_a_flipped_weight_bit_exits_16_at_the_next_weight_check_and_names_rank_1(
        runs: dict[str, Run],
        capsys: pytest.CaptureFixture[str]) -> None:
    cwd, proc = runs["weight-flip"]
    out = proc.stdout
    assert proc.returncode != 0
    exit_codes_ok(out)
    assert "GUARD ALARM: after step 14: rank 1's weights differ from the majority (2 of 3" in out
    assert "ranks named: [1]; update skipped: False; exit code 16" in out
    (v,) = verdicts(cwd / "guard-demo" / "spool")
    assert (v.check, v.step, v.subject.rank) == ("weights", 14, 1) and v.evidence["first_parameter"]
    ckpt = cwd / "guard-demo" / "ckpt"
    assert sorted(a.step for a in map(at.read, ckpt.glob("*" + at.SUFFIX))) == [5, 10]
    code, doc = resume_point(capsys, ckpt, cwd / "guard-demo" / "spool")
    assert code == 1 and doc["first_suspect_step"] == 14 and doc["resume"]["step"] == 10
