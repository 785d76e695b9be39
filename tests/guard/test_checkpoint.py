"""Verified checkpoints: ``save_checkpoint`` in real DDP training (3 local processes, gloo, no mock of
torch.distributed), and ``gpumon guard checkpoints`` naming the checkpoint to resume from.

The weight fault is made by the rank script (``ckpt_ranks.py``), outside the guard's code: one bit
of one rank's parameter flipped in place after ``optimizer.step()``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpumon.guard import attestation as at
from gpumon.guard import verdict as vf
from gpumon.guard.cli import checkpoints

RANKS = Path(__file__).with_name("ckpt_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ckpt3")
    port, world = _free_port(), 3
    procs = []
    for rank in range(world):
        env = {**os.environ, "NODE_NAME": f"node-{rank}", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
               "SLURM_JOB_ID": "4242"}
        env.pop("SLURMD_NODENAME", None)
        procs.append(subprocess.Popen([sys.executable, str(RANKS), str(rank), str(world), str(port),
                                       str(out), "healthy,flip1,flip0,off"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, logs, strict=True):
        assert p.returncode == 0, text
    return out, [json.loads((out / f"ckpt-rank{r}.json").read_text()) for r in range(world)]


def test_a_healthy_save_is_attested_verified_and_the_loaded_weights_match_it(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = three
    for step in (3, 6):
        att = at.read(out / "healthy" / f"step_{step}.pt{at.SUFFIX}")
        assert att.verified and att.verdict == "verified" and att.step == step and att.world == 3
        assert att.agree == [0, 1, 2] and att.suspects == [] and att.job == "slurm:4242"
        assert att.saved_by == {"rank": 0, "host": socket.gethostname()}
        ckpt = out / "healthy" / f"step_{step}.pt"
        assert att.file["size"] == ckpt.stat().st_size and att.file["sha256"] == at.sha256_file(ckpt)
        assert f"all 3 replicas' weights agree (fingerprint {att.fingerprint})" in att.message
    # every rank got the same verdict; the fingerprint is that of the weights the file holds
    assert {r["healthy"]["saves"][1]["fingerprint"] for r in ranks} == {att.fingerprint}
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    net.load_state_dict(torch.load(out / "healthy" / "step_6.pt")["model"])
    from gpumon.guard import weights_fingerprint
    assert weights_fingerprint(net) == att.fingerprint == ranks[0]["healthy"]["fingerprint"]
    # only rank 0 saved
    assert sorted(p.name for p in (out / "healthy").iterdir()) == [
        "step_3.pt", f"step_3.pt{at.SUFFIX}", "step_6.pt", f"step_6.pt{at.SUFFIX}"]


def test_one_ranks_flipped_weight_bit_makes_the_attestation_name_that_rank(
        three: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = three
    flipped = ranks[1]["flip1"]["flipped"]
    att = at.read(out / "flip1" / f"step_9.pt{at.SUFFIX}")
    assert not att.verified and att.verdict == "disagreement" and att.step == 9
    assert att.agree == [0, 2] and [g["ranks"] for g in att.groups] == [[0, 2], [1]]
    (s,) = att.suspects
    assert s["rank"] == 1 and s["first_parameter"] == flipped and s["subject"]["node_name"] == "node-1"
    assert "NOT verified: replicas disagree: 2 of 3 replicas agree; suspect: rank 1 on" in att.message
    assert f"first at parameter {flipped!r}" in att.message
    # the checkpoint is still saved (the user decides), then the alarm reaches the loop on every rank
    assert (out / "flip1" / "step_9.pt").is_file() and att.saved_by["rank"] == 0
    for r in ranks:
        assert r["flip1"]["alarms"] == [{"step": 9, "ranks": [1], "exit_code": 16}]
        assert r["flip1"]["saves"][2]["raised"] is True
    assert ranks[0]["flip1"]["saves"][2]["exists"] is True  # raised after the save (other ranks race it)
    # the rank 0 fingerprint in the attestation is the majority's, not rank 1's
    assert att.fingerprint == ranks[0]["flip1"]["fingerprint"] != ranks[1]["flip1"]["fingerprint"]
    # the two earlier saves were verified
    assert [at.read(out / "flip1" / f"step_{k}.pt{at.SUFFIX}").verified for k in (3, 6)] == [True, True]


def test_when_rank_0_is_the_suspect_the_majority_saves(three: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = three
    att = at.read(out / "flip0" / f"step_2.pt{at.SUFFIX}")
    assert att.verdict == "disagreement" and [s["rank"] for s in att.suspects] == [0]
    assert att.saved_by["rank"] == 1 and att.agree == [1, 2]
    assert att.fingerprint == ranks[1]["flip0"]["fingerprint"] != ranks[0]["flip0"]["fingerprint"]
    assert "saved by rank 1" in att.message
    # on_alarm="skip": no raise, every rank returned the same attestation
    assert {r["flip0"]["saves"][0]["verdict"] for r in ranks} == {"disagreement"}
    assert all(r["flip0"]["alarms"] == [] for r in ranks)


def test_a_save_with_the_guard_off_is_attested_unchecked_and_never_named_to_resume_from(
        three: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = three
    att = at.read(out / "off" / f"step_2.pt{at.SUFFIX}")
    assert att.verdict == "unchecked" and not att.verified and att.agree == []
    assert att.message == ("step 2: NOT verified: the weight check did not run (guard off: the weight "
                           "check: RuntimeError: made up by the test)")
    assert (out / "off" / "step_2.pt").is_file()
    assert checkpoints(out / "off") == 2
    assert "no checkpoint to resume from: none of them is verified and usable" in capsys.readouterr().out


def test_the_command_names_the_last_checkpoint_verified_before_the_flip(
        three: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = three
    assert checkpoints(out / "flip1") == 1  # a checkpoint to resume from, not the newest
    text = capsys.readouterr().out
    assert f"resume from: {out / 'flip1' / 'step_6.pt'}  (step 6, verified" in text
    assert "first suspect step: 8" in text
    assert checkpoints(out / "healthy", as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["resume"]["step"] == 6 and doc["first_suspect_step"] is None


# -- the command over attestation files (the format is the contract it reads) ---------------------


def attest(directory: Path, step: int, verdict: str = "verified", job: str | None = "slurm:7",
           body: bytes = b"weights") -> Path:
    ckpt = directory / f"step_{step}.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ckpt.write_bytes(body)
    ok = verdict == "verified"
    att = at.Attestation(
        checkpoint=ckpt.name, step=step, world=3, verdict=verdict, time=1.8e9 + step, job=job,
        agree=[0, 1, 2] if ok else [0, 2], fingerprint="00ab:00cd",
        groups=[{"ranks": [0, 1, 2], "fingerprint": "00ab:00cd"}],
        suspects=[] if ok else [{"rank": 1, "where": "rank 1 on h1, cpu", "first_parameter": "0.weight"}],
        saved_by={"rank": 0, "host": "h0"}, parameters=4,
        file={"size": len(body), "sha256": at.sha256_file(ckpt)},
        message=f"step {step}: " + ("verified" if ok else "NOT verified: replicas disagree: rank 1"))
    return at.write(att, ckpt)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon", "guard", "checkpoints", *args],
                          capture_output=True, text=True, timeout=60)


def test_verified_100_200_and_unverified_300_resume_from_200(tmp_path: Path) -> None:
    for step, verdict in ((100, "verified"), (200, "verified"), (300, "disagreement")):
        attest(tmp_path / "ckpt", step, verdict)
    proc = run_cli(str(tmp_path / "ckpt"))
    assert proc.returncode == 1, proc.stderr
    assert f"resume from: {tmp_path / 'ckpt' / 'step_200.pt'}  (step 200, verified" in proc.stdout
    assert "step      300  NOT verified" in proc.stdout and "first suspect step: 299" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_verdict_file_of_the_job_moves_the_first_suspect_step_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (100, 200, 300):
        attest(tmp_path / "ckpt", step)
    subject = vf.Identity(rank=1, world_size=3, host="h1", node_name=None, node_name_source=None,
                          local_rank=0, device="cpu")

    def verdict(step: int, job: str) -> None:
        vf.write(vf.Verdict(check="nonfinite_grad", fault="unknown", step=step, message=f"nan at {step}",
                            subject=subject, job=job, time=1.8e9, id=f"v{step}{job[-1]}"), tmp_path / "spool")

    verdict(150, "slurm:7")
    verdict(50, "slurm:8")  # another job's verdict on the same node: not this run's
    # without the verdicts every checkpoint is verified and nothing is suspect
    assert checkpoints(tmp_path / "ckpt") == 0
    assert "resume from:" in capsys.readouterr().out
    assert checkpoints(tmp_path / "ckpt", verdicts=tmp_path / "spool", as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_suspect_step"] == 150 and doc["resume"]["step"] == 100 and doc["jobs"] == ["slurm:7"]
    # the other job's verdict, asked for, puts the suspect before every checkpoint
    assert checkpoints(tmp_path / "ckpt", verdicts=tmp_path / "spool", job="slurm:8") == 2
    text = capsys.readouterr().out
    assert "no checkpoint to resume from: none was verified before the first suspect step 50" in text


def test_a_nodes_spool_with_kept_bundles_reads_as_verdicts_only(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--verdicts`` on a node's spool as the guard and the daemon leave it: verdicts judged/ by the
    daemon, and the failing steps the guard kept under <spool>/bundles/<id>/ (a replay bundle's
    manifest.json is not an unreadable verdict)."""
    for step in (100, 200):
        attest(tmp_path / "ckpt", step)
    spool = tmp_path / "spool"
    subject = vf.Identity(rank=1, world_size=3, host="h1", node_name=None, node_name_source=None,
                          local_rank=0, device="cpu")
    path = vf.write(vf.Verdict(check="audit", fault="transient", step=150, message="rank 1 differs",
                               subject=subject, job="slurm:7", time=1.8e9, id="v150"), spool)
    (spool / "judged").mkdir()
    path.rename(spool / "judged" / path.name)
    bundle = spool / "bundles" / "v150"
    bundle.mkdir(parents=True)
    (bundle / "manifest.json").write_text(json.dumps({"format": "gpumon-sdc-bundle/1", "kind": "capture"}))
    (bundle / "state.pt").write_bytes(b"tensors")
    # and the pace files the job's ranks keep for the node's metrics (gpumon.guard.pace)
    vf.write_pace(spool, job="slurm:7", host="h1", step=99, when=1.8e9,
                  rows=[vf.PaceRow(1, None, 0.98, 0.97, False)])
    assert checkpoints(tmp_path / "ckpt", verdicts=spool, as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict_problems"] == [] and doc["first_suspect_step"] == 150 and doc["resume"]["step"] == 100
    # a file that is neither, outside a bundle, is still named
    (spool / "bundles" / "stray.json").write_text("{}")
    assert checkpoints(tmp_path / "ckpt", verdicts=spool, as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [Path(p["path"]).name for p in doc["verdict_problems"]] == ["stray.json"]


def test_no_verified_checkpoint_is_said_and_exits_2(tmp_path: Path) -> None:
    attest(tmp_path, 100, "disagreement")
    proc = run_cli(str(tmp_path), "--json")
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["status"] == "fail" and doc["resume"] is None and doc["first_suspect_step"] == 99
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli(str(empty))
    assert proc.returncode == 2 and "no checkpoint to resume from: no attested checkpoint" in proc.stdout
    proc = run_cli(str(tmp_path / "missing"))
    assert proc.returncode == 3 and "cannot run" in proc.stderr and "not a directory" in proc.stderr


def test_bad_attestations_and_a_missing_checkpoint_are_named_never_a_traceback(tmp_path: Path) -> None:
    good = attest(tmp_path, 100)
    attest(tmp_path, 200)
    (tmp_path / "step_200.pt").unlink()  # the attestation is there, the checkpoint is not
    attest(tmp_path, 300)
    (tmp_path / "step_300.pt").write_bytes(b"short")  # truncated after it was attested
    truncated = tmp_path / f"step_400.pt{at.SUFFIX}"
    truncated.write_text(good.read_text()[:40])
    foreign = tmp_path / f"other.pt{at.SUFFIX}"
    foreign.write_text(json.dumps({"format": "something-else", "step": 500}))
    newer = tmp_path / f"new.pt{at.SUFFIX}"
    newer.write_text(json.dumps({**json.loads(good.read_text()), "version": 99}))
    (tmp_path / f"empty.pt{at.SUFFIX}").write_bytes(b"")
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    out = proc.stdout
    assert "Traceback" not in proc.stderr + out
    assert f"problem: checkpoint file {tmp_path / 'step_200.pt'} is missing" in out
    assert "is 5 bytes, the attestation says 7: changed or truncated after it was attested" in out
    assert f"unreadable attestation {truncated}: not valid JSON" in out and "truncated" in out
    assert "format is 'something-else', not 'gpumon-guard-attestation'" in out
    assert "version 99 is newer than this gpumon reads (1)" in out
    assert "empty (a save that did not finish?)" in out
    assert f"resume from: {tmp_path / 'step_100.pt'}" in out


def test_hash_finds_a_checkpoint_changed_in_place(tmp_path: Path) -> None:
    attest(tmp_path, 100)
    (tmp_path / "step_100.pt").write_bytes(b"WEIGHTS")  # same size, other bytes
    assert run_cli(str(tmp_path)).returncode == 0  # the size alone cannot see it
    proc = run_cli(str(tmp_path), "--hash")
    assert proc.returncode == 2 and "sha256 differs from the attestation's" in proc.stdout


def test_shards_count_only_when_every_rank_attested(tmp_path: Path) -> None:
    for rank in range(3):
        ckpt = tmp_path / f"step_100-r{rank}.pt"
        ckpt.write_bytes(b"x")
        at.write(at.Attestation(checkpoint=ckpt.name, step=100, world=3, verdict="verified", time=1.0,
                                agree=[0, 1, 2], fingerprint="1:2", shard={"rank": rank, "of": 3},
                                file={"size": 1}), ckpt)
    assert run_cli(str(tmp_path)).returncode == 0
    shutil.move(str(tmp_path / f"step_100-r2.pt{at.SUFFIX}"), str(tmp_path.parent / "gone.json"))
    proc = run_cli(str(tmp_path))
    assert proc.returncode == 2 and "shard(s) of rank 2 have no attestation" in proc.stdout
