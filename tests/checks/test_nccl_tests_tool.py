"""The nccl check measuring with nccl-tests' ``all_reduce_perf`` (``checks.nccl.nccl_tests``).

``all_reduce_perf`` is a small real executable on a temporary tool path (handed to the check through
the ToolRunner's search_path, as tests/checks/test_rdma.py does with ib_write_bw). It records its
argv, one line per call, and prints a real capture from tests/data/nccl-tests (provenance in its
SOURCES.md): ``1.txt`` on the first call, ``2.txt`` on the second (the re-measurement), else
``default.txt``. Where a test needs wrong elements, no capture has any: the text is the real modern
capture with one ``#wrong`` cell and the footer changed the way a failing run prints them (or the
legacy capture's footer), and the test says so.

On the simulated node torch sees no CUDA device, so ``auto`` uses the torch sweep here (tested);
``always`` runs the tool with ``-g`` = the GPUs NVML sees (8).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.errors import ConfigError
from gpumon.hw import nccltests
from gpumon.hw.tools import ToolResult, ToolRunner
from gpumon.model import NODE, Action, Finding, Severity
from gpumon_checks.nccl import MEASURED_BY_TOOL, NcclCheck, _bus_key, nccl_tests_findings, tool_rows

DATA = Path(__file__).resolve().parents[1] / "data" / "nccl-tests"
A3MEGA = (DATA / "all_reduce_perf_gcp-a3mega_h100x16_2node_tcp.txt").read_text()
LEGACY = (DATA / "issue_nccl-340_legacy-format_2gpu_rtx2080ti_PARTIAL.txt").read_text()
HEADER_ONLY = (DATA / "issue_nccl-tests-389_b200x16_2node_all_reduce_header_PARTIAL.txt").read_text()
SCENARIO = "name: t\nsku: h100-sxm\ngpus: 8\nfaults: []\n"


def config(mode: str = "always", **options: Any) -> str:
    lines = [f"    nccl_tests: {mode}\n"] + [f"    {k}: {v}\n" for k, v in options.items()]
    return "checks:\n  nccl:\n" + "".join(lines)


def fake_tool(tmp_path: Path, outputs: dict[str, str], *, status: int = 0,
              sleep: float = 0) -> tuple[Path, Path]:
    """A directory holding an all_reduce_perf that replays ``outputs`` (see the module docstring)."""
    bin_dir, out_dir = tmp_path / "bin", tmp_path / "outputs"
    bin_dir.mkdir(parents=True)
    out_dir.mkdir()
    for name, text in outputs.items():
        (out_dir / f"{name}.txt").write_text(text)
    log = tmp_path / "argv.log"
    script = bin_dir / "all_reduce_perf"
    script.write_text(f"""#!/bin/sh
# replays a real nccl-tests capture (see the test module's docstring)
echo "$*" >> {log}
echo "${{NCCL_TESTS_MIN_BW-unset}}" >> {tmp_path / "env.log"}
n=$(wc -l < {log} | tr -d ' ')
f={out_dir}/$n.txt
[ -f "$f" ] || f={out_dir}/default.txt
[ -f "$f" ] && cat "$f"
sleep {sleep}
exit {status}
""")
    script.chmod(0o755)
    return bin_dir, log


def run(sim: Callable[..., Any], tmp_path: Path, bin_dir: Path | None, config_text: str) -> list[Finding]:
    h = sim(SCENARIO, config_text)
    ctx = h.context(NcclCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir if bin_dir else tmp_path / "empty"))
    result: list[Finding] = NcclCheck().run(ctx)
    return result


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


DEFAULT_SWEEP = "-b 1048576 -e 17179869184 -f 4 -g 8 -n 20 -w 5 -c 1"


def test_healthy_capture_passes_with_busbw_and_the_tool_table_in_evidence(
        sim: Callable[..., Any], tmp_path: Path, monkeypatch: Any) -> None:
    # the capture's own sweep (-b 8 -e 8G -f 2, 20 iterations, 5 warm-up), judged at 8 GiB
    monkeypatch.setenv("NCCL_TESTS_MIN_BW", "1000")  # a site's own floor must not reach the tool
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(sim, tmp_path, bin_dir, config(min_bytes=8, max_bytes=8589934592, step_factor=2,
                                              judged_from_bytes=8589934592, busbw_min_gbps=300))
    assert (f.component, f.severity, f.action) == (NODE, Severity.OK, Action.NONE), f.message
    assert f.message == "all-reduce over 16 GPUs exact; busbw 338.8 GB/s (profile minimum 300)"
    assert calls(log) == ["-b 8 -e 8589934592 -f 2 -g 8 -n 20 -w 5 -c 1"]
    assert (tmp_path / "env.log").read_text() == "unset\n"
    ev = f.evidence
    assert ev["measured_by"] == MEASURED_BY_TOOL == "nccl-tests all_reduce_perf"
    assert ev["command"] == "all_reduce_perf -b 8 -e 8589934592 -f 2 -g 8 -n 20 -w 5 -c 1"
    assert (ev["judged_busbw_gbps"], ev["busbw_min_gbps"], ev["attempts"], ev["retryable"]) == (
        338.82, 300, 1, True)
    assert len(ev["sweep"]) == 31 and ev["sweep"][0]["bytes"] == 8
    # the better half of the capture's last row (out-of-place 338.82 beats in-place 337.35)
    assert ev["sweep"][-1] == {"bytes": 8589934592, "time_us": 47535.0, "algbw_gbps": 180.71,
                               "busbw_gbps": 338.82, "wrong": 0}
    assert ev["nccl_tests_table"][1].split()[:4] == ["#", "size", "count", "type"]
    assert ev["nccl_tests_table"][-2:] == ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 70.742"]
    assert (ev["nccl_tests_avg_busbw_gbps"], ev["out_of_bounds"], ev["exit_status"]) == (70.742, 0, 0)
    # a two-node capture replayed on one node: its ranks are named as the tool printed them
    assert ev["ranks"] == 16 and ev["devices"][0] == "ztan-mig-235z cuda:0 [0000:04:00] NVIDIA H100 80GB HBM3"
    assert ev["ranks_note"] == "the tool ran 16 rank(s) where -g asked for 8"
    assert "retry_command" not in ev


def test_busbw_below_the_profile_fails_when_the_re_measurement_is_low_too(
        sim: Callable[..., Any], tmp_path: Path) -> None:
    # h100-sxm's profile floor is 460 GB/s (Azure's ND H100 v5); the capture reaches 338.82 at 8 GiB
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(sim, tmp_path, bin_dir, config(judged_from_bytes=8589934592))
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert f.message == ("all-reduce busbw 338.8 GB/s is below the profile's 460 (sizes >= 8 GiB; low again "
                         "on a second measurement)")
    # the configured sweep, then only the judged size (the capture's 8 GiB row) again
    assert calls(log) == [DEFAULT_SWEEP, "-b 8589934592 -e 8589934592 -f 4 -g 8 -n 20 -w 5 -c 1"]
    ev = f.evidence
    assert (ev["attempts"], ev["retryable"], ev["busbw_min_gbps"]) == (2, True, 460)
    assert ev["source"].startswith("Azure/azurehpc-health-checks")
    assert ev["retry_command"].endswith("-b 8589934592 -e 8589934592 -f 4 -g 8 -n 20 -w 5 -c 1")
    assert "retry_table" in ev and ev["retry_nccl_tests_table"][-1].startswith("# Avg bus bandwidth")


def test_a_low_first_sweep_passes_when_the_re_measurement_is_above_the_floor(
        sim: Callable[..., Any], tmp_path: Path) -> None:
    # first the legacy capture (2x RTX 2080 Ti: 21.86 GB/s at 128 MiB), then the H100 capture (338.82
    # at 8 GiB): only a second low result fails
    bin_dir, log = fake_tool(tmp_path, {"1": LEGACY, "2": A3MEGA})
    (f,) = run(sim, tmp_path, bin_dir, config(judged_from_bytes=134217728, busbw_min_gbps=300))
    assert f.severity is Severity.OK, f.message
    assert (f.evidence["attempts"], f.evidence["judged_busbw_gbps"]) == (2, 338.82)
    assert calls(log) == [DEFAULT_SWEEP, "-b 134217728 -e 134217728 -f 4 -g 8 -n 20 -w 5 -c 1"]
    # the legacy capture has no rank list: ranks are named by -g
    assert f.evidence["devices"] == [f"cuda:{r}" for r in range(8)]


def test_wrong_elements_fail_at_once_with_their_count(sim: Callable[..., Any], tmp_path: Path) -> None:
    # the real capture with 3 wrong elements in the 4 GiB row's out-of-place half and the footer a
    # failing run prints; nccl-tests then exits with EXIT_FAILURE (src/common.cu)
    text = A3MEGA.replace("330.58      0", "330.58      3").replace("values : 0 OK", "values : 3 FAILED")
    assert text.count("      3    24365") == 1
    bin_dir, log = fake_tool(tmp_path, {"default": text}, status=1)
    (f,) = run(sim, tmp_path, bin_dir, config(judged_from_bytes=8589934592))
    assert (f.component, f.severity, f.action) == (NODE, Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.message == ("all_reduce_perf found 3 wrong element(s) in the all-reduce results (at 4 GiB; "
                         "'Out of bounds values : 3 FAILED')")
    assert f.evidence["retryable"] is False and f.evidence["exit_status"] == 1
    assert calls(log) == [DEFAULT_SWEEP]  # wrong sums are not measured again


def test_out_of_bounds_count_of_a_legacy_build_fails(sim: Callable[..., Any], tmp_path: Path) -> None:
    # legacy rows carry a deviation, not a count: the footer (here as a failing run prints it) counts
    text = LEGACY.replace("values : 0 OK", "values : 2 FAILED")
    bin_dir, _ = fake_tool(tmp_path, {"default": text}, status=1)
    (f,) = run(sim, tmp_path, bin_dir, config())
    assert (f.severity, f.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.message == ("all_reduce_perf found 2 wrong element(s) in the all-reduce results "
                         "('Out of bounds values : 2 FAILED')")


def test_cut_off_output_is_unknown_with_the_reason(sim: Callable[..., Any], tmp_path: Path) -> None:
    # the real 2.19 capture that ends after its rank list, then the modern one cut after its 1 GiB row
    cut = A3MEGA[: A3MEGA.index("  2147483648")]
    for i, (text, why) in enumerate([
            (HEADER_ONLY, "no result rows (the output ends after the rank list)"),
            (cut, "no '# Avg bus bandwidth' footer after 28 row(s): the output was cut off at "
                  "1073741824 bytes")]):
        bin_dir, _ = fake_tool(tmp_path / str(i), {"default": text})
        (f,) = run(sim, tmp_path, bin_dir, config())
        assert (f.severity, f.action) == (Severity.UNKNOWN, Action.NONE)
        assert f.message == f"all_reduce_perf gave no result that can be judged: {why}"
        assert f.evidence["measured_by"] == MEASURED_BY_TOOL


def test_no_output_and_a_failing_exit_status_is_unknown(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_tool(tmp_path, {}, status=1)
    (f,) = run(sim, tmp_path, bin_dir, config())
    assert f.severity is Severity.UNKNOWN
    assert f.message.startswith("all_reduce_perf gave no result that can be judged: exit status 1: "
                                "no nccl-tests output found")


def test_hung_tool_is_killed_at_its_deadline_and_reported(sim: Callable[..., Any], tmp_path: Path) -> None:
    # prints the real 2.19 header (up to its rank list), then never finishes; one size: 1 + 1 s
    bin_dir, log = fake_tool(tmp_path, {"default": HEADER_ONLY}, sleep=60)
    started = time.monotonic()
    (f,) = run(sim, tmp_path, bin_dir, config(min_bytes=8589934592, max_bytes=8589934592, startup_s=1,
                                              per_size_s=1))
    assert time.monotonic() - started < 10
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert f.message.startswith("all_reduce_perf hung: all_reduce_perf -b 8589934592 ... did not finish "
                                "within 2 s (killed); last output: ")
    assert "NVIDIA B200" in f.message  # the tail of what it printed before it hung
    assert f.evidence["timeout_s"] == 2 and f.evidence["command"].startswith("all_reduce_perf -b 8589934592")
    assert calls(log) == ["-b 8589934592 -e 8589934592 -f 4 -g 8 -n 20 -w 5 -c 1"]


def test_always_without_the_tool_is_skipped_with_the_reason(sim: Callable[..., Any], tmp_path: Path) -> None:
    (f,) = run(sim, tmp_path, None, config("always"))
    assert (f.severity, f.action) == (Severity.SKIPPED, Action.NONE)
    assert f.message == ("nccl-tests' all_reduce_perf is not installed (not found on the tool path) and "
                         "checks.nccl.nccl_tests is 'always': all-reduce not measured")


def test_auto_and_never_leave_the_measurement_to_the_torch_sweep(sim: Callable[..., Any],
                                                                 tmp_path: Path) -> None:
    """``nccl_tests_findings`` answering None is what makes ``run`` go on to the torch sweep (the
    torch sweep itself on this node is tests/checks/test_nccl.py's; running it here would take most
    of this file's time budget): 'auto' without the tool; 'auto' with the tool where torch sees no
    CUDA device (a simulated node); 'never' with the tool. The tool is never started."""
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    for mode, tools in (("auto", None), ("auto", bin_dir), ("never", bin_dir)):
        h = sim(SCENARIO, config(mode))
        ctx = h.context(NcclCheck, 0.0)
        ctx.hw.tools = ToolRunner(30, search_path=str(tools or tmp_path / "empty"))
        assert ctx.params.nccl_tests == mode
        assert nccl_tests_findings(ctx, ctx.params) is None, (mode, tools)
    assert calls(log) == []


def test_the_option_takes_only_its_three_modes(sim: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="must be one of auto, always, never; got 'sometimes'"):
        sim(SCENARIO, config("sometimes"))


# ------------------------------------------------------------------ the judgement on any output


SPEC = nccltests.PerfSpec(8, 8589934592, 2, 8, 20, 5)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(A3MEGA)))
def test_any_cut_of_the_capture_is_unknown_until_its_footer(cut: int) -> None:
    text = A3MEGA[:cut]
    run_ = nccltests.judge_output(tuple(SPEC.argv()), ToolResult(tuple(SPEC.argv()), 0, text, "", 1.0))
    out = tool_rows(run_, SPEC)
    if "# Avg bus bandwidth    : 7" in text:
        assert isinstance(out, list) and len(out) == 31
    else:
        assert isinstance(out, Finding) and out.severity is Severity.UNKNOWN, text[-200:]


@given(st.text(max_size=400), st.integers(min_value=0, max_value=3))
def test_any_output_and_exit_status_gives_rows_or_a_finding(text: str, status: int) -> None:
    run_ = nccltests.judge_output(tuple(SPEC.argv()), ToolResult(tuple(SPEC.argv()), status, text, text, 0.1))
    out = tool_rows(run_, SPEC)
    if isinstance(out, Finding):
        assert out.severity in (Severity.UNKNOWN, Severity.FAIL, Severity.SKIPPED)
    else:
        assert status == 0 and all(r.busbw >= 0 for r in out)


@given(st.text(max_size=40))
def test_bus_ids_of_any_shape_never_crash(text: str) -> None:
    key = _bus_key(text)
    assert key is None or len(key) == 3
    assert _bus_key("0000:8c:00") == _bus_key("00000000:8C:00.0") == (0, 0x8C, 0)


def test_a_sweep_without_correctness_counts_is_unknown() -> None:
    # the real capture as a run without checking prints it (nccl-tests prints N/A in the #wrong
    # columns and 'validation: 0'): an exact all-reduce cannot be claimed
    def unchecked(line: str) -> str:
        cells = line.split()
        if not line.strip()[:1].isdigit():
            return line
        cells[8] = cells[12] = "N/A"
        return " ".join(cells)

    text = "\n".join(unchecked(ln) for ln in A3MEGA.replace("validation: 1", "validation: 0").splitlines())
    run_ = nccltests.judge_output(tuple(SPEC.argv()), ToolResult(tuple(SPEC.argv()), 0, text, "", 1.0))
    out = tool_rows(run_, SPEC)
    assert isinstance(out, Finding) and out.severity is Severity.UNKNOWN
    assert out.message == ("all_reduce_perf did not check its results (#wrong is N/A although -c 1 was "
                           "given): correctness not known")


ROWS = [i for i, ln in enumerate(A3MEGA.splitlines()) if ln.strip()[:1].isdigit()]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ROWS), st.integers(min_value=0, max_value=12),
       st.text(alphabet="0123456789.-+eNA/x ", min_size=0, max_size=8))
def test_a_mangled_cell_in_the_capture_never_judges_a_bad_number(line: int, cell: int, token: str) -> None:
    lines = A3MEGA.splitlines()
    cells = lines[line].split()
    cells[cell] = token
    lines[line] = " ".join(cells)
    text = "\n".join(lines)
    run_ = nccltests.judge_output(tuple(SPEC.argv()), ToolResult(tuple(SPEC.argv()), 0, text, "", 1.0))
    out = tool_rows(run_, SPEC)
    if isinstance(out, Finding):
        assert out.severity in (Severity.UNKNOWN, Severity.FAIL), out.message
    else:
        assert all(r.busbw >= 0 and r.algbw >= 0 and r.seconds >= 0 and r.wrong >= 0 for r in out)
        # a line that no longer starts with a size is not a row at all (nor a mangled one): the
        # parser's limit; every other change is a row, or the reason for an unknown
        if cell != 0 or token.strip().isdigit():
            assert len(out) == 31
