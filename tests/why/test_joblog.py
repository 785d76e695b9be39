"""The job-log reader and the NCCL retry window on lines as PyTorch and NCCL print them (issue 21).

Every line below is quoted from a public report (source above each); only what the parser must find
is asserted.
"""

from __future__ import annotations

import pytest

from gpumon.why.job import scontrol_fields
from gpumon.why.joblog import parse_lines
from gpumon.why.reason import nccl_settings

# OFA-Sys/OFA issue #271 (PyTorch 1.x: no NumelIn/NumelOut, no [rankN]: prefix)
OLD = ("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: "
       "WorkNCCL(SeqNum=469508, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before "
       "timing out.")
# hiyouga/LlamaFactory issue #6269 (PyTorch 2.x)
NEW = ("[rank4]:[E1206 18:44:12.755262105 ProcessGroupNCCL.cpp:607] [Rank 4] Watchdog caught collective "
       "operation timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, "
       "NumelOut=68124672, Timeout(ms)=600000) ran for 600099 milliseconds before timing out.")
AT_WORK = ("[rank4]:[E1206 18:44:12.755468433 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 4] Exception (either an "
           "error or timeout) detected by watchdog at work: 7753, last enqueued NCCL work: 7755, last "
           "completed NCCL work: 7752.")
# NVIDIA/nccl-tests issue #166
PEER = ("gpu004:2200689:2200706 [3] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote "
        "peer gpu004.ds-a4-r02.abc.com<55693>")
# NVIDIA/nccl-tests issue #252
IB = ("kolyoz2:25146:25854 [0] ib_plugin.c:1105 NCCL WARN NET/IB : Got completion from peer 10.0.35.1<49189> "
      "with error 4, opcode 5327, len 5327, vendor err 81 (Send)")
# NVIDIA/nccl issue #1814
ENV = ["hostname-test:986:1338 [6] NCCL INFO NCCL_IB_TIMEOUT set by environment to 18.",
       "hostname-test:986:1338 [6] NCCL INFO NCCL_IB_RETRY_CNT set by environment to 15."]
# NVIDIA/nccl issue #529
VERSION = "NCCL version 2.5.6+cuda10.0"


def test_both_watchdog_formats_give_the_collective_and_the_timeout() -> None:
    log = parse_lines([OLD, NEW, AT_WORK])
    old, new = log.timeouts
    assert (old.rank, old.seq, old.op) == (1, 469508, "ALLREDUCE")
    assert (old.timeout_ms, old.ran_ms) == (1800000, 1802212)
    assert (new.rank, new.seq, new.op, new.timeout_ms) == (4, 7753, "_REDUCE_SCATTER_BASE", 600000)
    assert new.fields["NumelIn"] == "544997376"
    assert log.watchdog_timeout_s == 1800.0  # the longest timeout seen
    assert log.stuck is new  # the lowest sequence number timed out
    assert log.progress == {4: (7753, 7755, 7752)}


def test_nccl_lines_give_the_peer_the_ib_error_the_version_and_the_settings() -> None:
    log = parse_lines([PEER, IB, *ENV, VERSION])
    assert log.peers_closed == {"gpu004.ds-a4-r02.abc.com": 1}
    assert log.ib_completions == {"10.0.35.1": [4]}
    assert log.nccl_env == {"NCCL_IB_TIMEOUT": "18", "NCCL_IB_RETRY_CNT": "15"}
    assert log.nccl_version == "2.5.6"
    assert parse_lines(["loss 3.2", "epoch 1"]).timeouts == []


@pytest.mark.parametrize(("env", "version", "window_s", "said"), [
    ({}, "2.18.5", 4.096e-6 * 2**18 * 7, "NCCL 2.18.5: default NCCL_IB_TIMEOUT 18"),  # 7.5 s
    ({}, "2.23.4", 4.096e-6 * 2**20 * 7, "NCCL 2.23.4: default NCCL_IB_TIMEOUT 20"),  # 30 s
    ({}, None, 4.096e-6 * 2**18 * 7, "NCCL version unknown"),
    ({"NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "15"}, "2.23.4", 4.096e-6 * 2**22 * 15, "from the job's"),
])
def test_the_ib_retry_window_follows_ncclss_documented_formula(env: dict[str, str], version: str | None,
                                                               window_s: float, said: str) -> None:
    s = nccl_settings(env, version)
    assert s.retry_window_s == pytest.approx(window_s)
    assert said in s.source


def test_scontrol_one_line_fields() -> None:
    # scontrol show job -o, as Slurm 22.05 prints it (shortened)
    text = ("JobId=42 JobName=train UserId=alice(1000) JobState=FAILED Reason=NonZeroExitCode "
            "ExitCode=1:0 StartTime=2024-06-10T06:00:00 EndTime=2024-06-10T13:12:40 NodeList=gpu[001-002]")
    f = scontrol_fields(text)
    assert (f["JobState"], f["ExitCode"], f["NodeList"], f["EndTime"]) == (
        "FAILED", "1:0", "gpu[001-002]", "2024-06-10T13:12:40")
