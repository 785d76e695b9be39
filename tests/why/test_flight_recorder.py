"""``gpumon why --flight-recorder``: the job's PyTorch Flight Recorder dumps -> the ranks that never
entered the stuck collective, and their nodes (issue 21).

The dumps are real: a 3-rank gloo job (tests/why/fr_job.py, torch.distributed over loopback, Flight
Recorder on by ``TORCH_FR_BUFFER_SIZE``) where rank 2 stops taking part and the others' all_reduce
times out after 2 s. This torch (2.13) records gloo collectives but only ProcessGroupNCCL dumps on a
timeout, so each rank writes PyTorch's own dump bytes (``_dump_fr_trace()``) to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` itself (fr_job.py says why). Each rank gets its own prefix
``<dir>/<node>/rank_``, a folder per node as docs/postmortem/why.md tells a job to do, so that the
ranks' nodes are known. Both jobs run at once, once for the module (about 15 s on two cores).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import clean_env, run_gpumon
from gpumon.why.collect import NodeEvidence
from gpumon.why.flight import Flight, read_dir
from gpumon.why.job import Job
from gpumon.why.reason import Reasoner, nccl_settings
from gpumon.why.report import to_json

JOB = Path(__file__).with_name("fr_job.py")
NODES = ("gpu-a", "gpu-b", "gpu-c")  # rank r runs on NODES[r]
T0 = 1_800_000_000.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(out: Path, *extra: str) -> list[subprocess.Popen[str]]:
    port = _free_port()
    procs = []
    for rank, node in enumerate(NODES):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                        WORLD_SIZE=str(len(NODES)), TORCH_FR_BUFFER_SIZE="64",
                        TORCH_FR_DUMP_TEMP_FILE=str(out / node / "rank_"), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(JOB), "--stall", "2", *extra], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> str:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    return "\n".join(outs)


@dataclass
class Dumps:
    stall: Path  # rank 2 sleeps past the timeout: it never enters all_reduce #4
    mismatch: Path  # rank 2 issues a broadcast as #4 where 0 and 1 issue all_reduce
    stall_log: str


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Dumps:
    base = tmp_path_factory.mktemp("fr")
    stall, mismatch = base / "stall", base / "mismatch"
    a = _start(stall, "--mode", "stall")
    b = _start(mismatch, "--mode", "mismatch")
    log_a, log_b = _finish(a), _finish(b)
    for d, log in ((stall, log_a), (mismatch, log_b)):
        files = sorted(str(p.relative_to(d)) for p in d.rglob("rank_*"))
        assert files == [f"{n}/rank_{r}" for r, n in enumerate(NODES)], log
    # the job did hang: the ranks that entered #4 timed out in gloo
    assert log_a.count("Timed out waiting") == 2, log_a
    return Dumps(stall, mismatch, log_a)


def test_a_real_gloo_hang_names_the_rank_that_never_entered_and_its_node(dumps: Dumps) -> None:
    f = read_dir(dumps.stall)
    assert f.errors == {} and sorted(f.dumps) == [0, 1, 2]
    assert f.hosts == {0: "gpu-a", 1: "gpu-b", 2: "gpu-c"}
    [g] = f.groups
    assert (g.pg, g.desc, g.members, g.seq, g.op) == ("0", "default_pg", [0, 1, 2], 4, "gloo:all_reduce")
    assert (g.entered, g.missing, g.no_dump, g.mismatched) == ([0, 1], [2], [], {})
    assert g.not_completed is None  # gloo does not record completion: not guessed
    assert g.timeout_ms == 2000 and f.timeout_s == 2.0
    [finding] = f.findings()
    assert (finding.rank, finding.host, finding.kind) == (2, "gpu-c", "never_entered")
    assert finding.words == ("rank 2 on gpu-c never entered gloo:all_reduce #4 of process group 0 "
                             "(default_pg), which rank(s) 0,1 entered (its last was gloo:all_reduce #3)")
    # PyTorch's own analyzer, on the same dumps (gloo's pg_config re-keyed), says the same
    assert f.pytorch["used"] is True
    assert [(x["seq"], x["missing_ranks"]) for x in f.pytorch["findings"]] == [(4, [2])]


def test_a_real_desync_names_the_rank_that_issued_another_collective(dumps: Dumps) -> None:
    f = read_dir(dumps.mismatch)
    [g] = f.groups
    assert (g.seq, g.op, g.missing) == (4, "gloo:all_reduce", [])
    assert g.mismatched == {2: "gloo:broadcast [[64]]"}
    [finding] = f.findings()
    assert (finding.rank, finding.host, finding.kind) == (2, "gpu-c", "mismatch")
    assert "issued gloo:broadcast [[64]] as #4" in finding.words and "desync" in finding.words
    assert [(x["seq"], x["mismatched_ranks"]) for x in f.pytorch["findings"]] == [(4, [2])]


def test_a_rank_without_a_dump_is_unknown_not_guessed(dumps: Dumps, tmp_path: Path) -> None:
    for r, n in enumerate(NODES[:2]):
        (tmp_path / n).mkdir()
        shutil.copy(dumps.stall / n / f"rank_{r}", tmp_path / n / f"rank_{r}")
    f = read_dir(tmp_path)
    [g] = f.groups
    assert (g.seq, g.entered, g.missing, g.no_dump) == (4, [0, 1], [], [2])
    [finding] = f.findings()
    assert (finding.rank, finding.kind, finding.host) == (2, "no_dump", None)
    assert "whether it entered gloo:all_reduce #4 of process group 0 (default_pg) is unknown" in finding.words
    assert any("does not record completion" in n for n in f.notes)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_bad_truncated_and_foreign_files_are_each_said_and_the_others_still_read(dumps: Dumps,
                                                                                 tmp_path: Path) -> None:
    d = tmp_path / "dumps"
    for n in NODES:
        (d / n).mkdir(parents=True)
    shutil.copy(dumps.stall / "gpu-a" / "rank_0", d / "gpu-a" / "rank_0")
    shutil.copy(dumps.stall / "gpu-c" / "rank_2", d / "gpu-c" / "rank_2")
    whole = (dumps.stall / "gpu-b" / "rank_1").read_bytes()
    (d / "gpu-b" / "rank_1").write_bytes(whole[: len(whole) // 2])  # a dump cut short (disk full, kill)
    marker = tmp_path / "pwned"
    (d / "gpu-c" / "evil_7").write_bytes(pickle.dumps(_Evil(marker)))
    (d / "gpu-c" / "notes_5").write_text("not a dump\n")
    (d / "gpu-c" / "empty_6").write_bytes(b"")
    (d / "gpu-c" / "other_8").write_bytes(pickle.dumps({"hello": [1, 2]}))
    (d / "gpu-c" / "json_9").write_text('{"entries": [}')
    (d / "README").write_text("dumps of job 42\n")
    (d / "gpu-a" / "rank_3.tmp").write_bytes(b"half")  # a dump still being written: not a rank's
    f = read_dir(d)
    assert sorted(f.dumps) == [0, 2]
    assert not marker.exists()  # the pickle's code was never run
    assert set(f.errors) == {"gpu-b/rank_1", "gpu-c/evil_7", "gpu-c/notes_5", "gpu-c/empty_6",
                             "gpu-c/other_8", "gpu-c/json_9"}
    assert f.errors["gpu-b/rank_1"].startswith("not a readable pickle")
    assert f.errors["gpu-c/evil_7"].startswith("refused: the pickle asks for posix.system")
    assert f.errors["gpu-c/empty_6"].startswith("empty")
    assert f.errors["gpu-c/other_8"] == "not a Flight Recorder dump (no 'entries' and 'version')"
    assert f.errors["gpu-c/json_9"].startswith("not valid JSON")
    assert f.ignored == 1
    # what the two good dumps tell still stands: rank 2 behind, rank 1 unknown
    [g] = f.groups
    assert (g.seq, g.entered, g.missing, g.no_dump) == (4, [0], [2], [1])


def _node(name: str, events: list[dict[str, Any]], *, reachable: bool = True) -> NodeEvidence:
    if not reachable:
        return NodeEvidence(name, f"http://{name}:9426", error="connection refused")
    return NodeEvidence(name, f"http://{name}:9426", identity={"node": name, "boot_time": T0 - 86400},
                        events=events, history_from=T0 - 7200)


def _judge(flight: Flight, *nodes: NodeEvidence) -> dict[str, Any]:
    job = Job(tuple(n.node for n in nodes), T0, T0 + 600, "42", "FAILED", "1:0", "scontrol")
    return to_json(Reasoner(job, list(nodes), None, nccl_settings({}, None), now=T0 + 700,
                            flight=flight).judge())


def _hung(node: str, t: float) -> dict[str, Any]:
    return {"id": 1, "time": t, "last_seen": t, "kind": "finding", "check": "nvml", "component": "gpu0",
            "severity": "fail", "action": "none", "message": "nvmlDeviceGetUtilizationRates hung 30 s",
            "evidence": {"hung_in": "nvmlDeviceGetUtilizationRates"}}


def test_the_reasoner_uses_it_as_evidence_on_a_suspect_never_as_a_hardware_finding(dumps: Dumps) -> None:
    f = read_dir(dumps.stall)
    # no event on any node: still no infrastructure evidence; the note says which rank to look at
    v = _judge(f, _node("gpu-a", []), _node("gpu-b", []), _node("gpu-c", []))
    assert v["verdict"] == "no_infrastructure_evidence" and v["suspects"] == []
    assert ("Flight Recorder: rank 2 on gpu-c never entered gloo:all_reduce #4 of process group 0 "
            "(default_pg), which rank(s) 0,1 entered (its last was gloo:all_reduce #3); no infrastructure "
            "event recorded on gpu-c explains it: look at what that rank was doing (its own log, its stack)"
            ) in v["notes"]
    assert v["flight_recorder"]["findings"][0]["host"] == "gpu-c"
    assert v["watchdog_timeout_s"] == 2.0 and "Flight Recorder" in v["watchdog_source"]
    # the same tier-2 suspect on gpu-a and gpu-c: the one on the rank's node is ranked first, and says why
    v = _judge(f, _node("gpu-a", [_hung("gpu-a", T0 + 590)]), _node("gpu-b", []),
               _node("gpu-c", [_hung("gpu-c", T0 + 100)]))
    assert [s["node"] for s in v["suspects"]] == ["gpu-c", "gpu-a"]
    assert "the Flight Recorder says rank 2 on gpu-c never entered" in v["suspects"][0]["why"]
    assert "Flight Recorder" not in v["suspects"][1]["why"]
    assert v["culprits"] == []  # a rank that did not enter is no reason to drain a node
    # its node did not answer
    v = _judge(f, _node("gpu-a", []), _node("gpu-b", []), _node("gpu-c", [], reachable=False))
    assert v["verdict"] == "inconclusive"
    assert any(n.endswith("gpu-c did not answer: its health history is unknown") for n in v["notes"])


def test_cli_flag_reads_the_folder_and_a_missing_one_cannot_answer(dumps: Dumps, tmp_path: Path) -> None:
    port = _free_port()  # nobody listens: the nodes do not answer, the dumps are still read
    args = ["why", "--nodes", ",".join(NODES), "--start", "1800000000", "--end", "1800000600",
            "--api-url", f"http://127.0.0.1:{port}", "--timeout", "2", "--json"]
    proc = run_gpumon(*args, "--flight-recorder", str(dumps.stall), timeout=60)
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert [(x["rank"], x["host"], x["kind"]) for x in out["flight_recorder"]["findings"]] == [
        (2, "gpu-c", "never_entered")]
    assert any(n.startswith("Flight Recorder: rank 2 on gpu-c never entered") and "did not answer" in n
               for n in out["notes"])
    # the dumps were written now, the job given is in 2027: said, not silently joined
    assert any("outside the job's run: dumps of another job or run?" in n for n in out["notes"])
    proc = run_gpumon(*args, "--flight-recorder", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 3 and "cannot read the Flight Recorder dumps" in proc.stderr
