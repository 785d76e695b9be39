"""The nccl check measuring with nccl-tests' ``all_reduce_perf`` (``checks.nccl.nccl_tests``).

``all_reduce_perf`` is a small real executable on a temporary tool path (handed to the check through
the ToolRunner's search_path, as tests/checks/test_rdma.py does with ib_write_bw). It records its
argv, one line per call, and prints a real capture from tests/data/nccl-tests (provenance in its
SOURCES.md): ``1.txt`` on the first call, ``2.txt`` on the second (the re-measurement), else
``default.txt``. Where a test needs wrong elements, no capture has any: the text is the real modern
capture with one ``#wrong`` cell and the footer changed the way a failing run prints them (or the
legacy capture's footer), and the test says so.

The tool runs on a real (not simulated) node's context built over the NVML injection library (8
healthy H100s, the ``nvml_state`` fixture), as tests/checks/test_p2p.py does: torch sees no CUDA
device here, so ``always`` runs the tool with ``-g`` = the GPUs NVML sees (8), and where the tool
fails without a result the torch sweep it falls back to ends in its own "GPUs not tested" unknown.
On a simulated node the tool never runs (it would measure this machine's real GPUs): ``auto`` and
``always`` both measure with the torch sweep's stand-ins there (tested, with the argv log empty).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.check import CheckContext, KernelLog
from gpumon.config import load_config, with_profile
from gpumon.errors import ConfigError
from gpumon.hw import Hardware, nccltests
from gpumon.hw.inventory import collect
from gpumon.hw.tools import ToolResult, ToolRunner
from gpumon.model import NODE, Action, Finding, Severity
from gpumon.profiles import builtin_profiles, select_profile
from gpumon.registry import load_checks
from gpumon_checks.nccl.check import (
    MEASURED_BY_TOOL,
    NcclCheck,
    NcclConfig,
    SizeRow,
    Sweep,
    _bus_key,
    nccl_tests_findings,
    tool_rows,
    verdict,
)

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


def real_ctx(tmp_path: Path, config_text: str, bin_dir: Path | None) -> CheckContext:
    """A real node's context (not simulated) over the NVML state the ``nvml_state`` fixture wrote:
    the agent's own config loading, with the profile its GPUs select (h100-sxm)."""
    host = tmp_path / "host"
    (host / "sys").mkdir(parents=True, exist_ok=True)
    cfg = Path(tempfile.mkstemp(dir=tmp_path, suffix=".yaml")[1])
    cfg.write_text(config_text)
    hw = Hardware(host)
    hw.nvml.init()
    hw.tools = ToolRunner(30, search_path=str(bin_dir if bin_dir else tmp_path / "empty"))
    inventory = collect(hw.nvml, hw.fs)
    profile = select_profile(builtin_profiles(), inventory.gpu_names, "auto")
    registry = load_checks()
    config = with_profile(load_config(cfg, registry, site_file=tmp_path / "absent.yaml"), registry, profile)
    return CheckContext(hw=hw, inventory=inventory, profile=profile,
                        options=config.settings(NcclCheck).options, state={}, kernel_log=KernelLog())


def run(tmp_path: Path, bin_dir: Path | None, config_text: str) -> list[Finding]:
    ctx = real_ctx(tmp_path, config_text, bin_dir)
    try:
        assert ctx.profile.name == "h100-sxm" and len(ctx.inventory.gpus) == 8
        result: list[Finding] = NcclCheck().run(ctx)
    finally:
        ctx.hw.nvml.shutdown()
    return result


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


DEFAULT_SWEEP = "-b 1048576 -e 17179869184 -f 4 -g 8 -n 20 -w 5 -c 1"


def test_healthy_capture_passes_with_busbw_and_the_tool_table_in_evidence(
        nvml_state: Path, tmp_path: Path, monkeypatch: Any) -> None:
    # the capture's own sweep (-b 8 -e 8G -f 2, 20 iterations, 5 warm-up), judged at 8 GiB
    monkeypatch.setenv("NCCL_TESTS_MIN_BW", "1000")  # a site's own floor must not reach the tool
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(tmp_path, bin_dir, config(min_bytes=8, max_bytes=8589934592, step_factor=2,
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
        nvml_state: Path, tmp_path: Path) -> None:
    # h100-sxm's profile floor is 460 GB/s (Azure's ND H100 v5); the capture reaches 338.82 at 8 GiB
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(tmp_path, bin_dir, config(judged_from_bytes=8589934592))
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
        nvml_state: Path, tmp_path: Path) -> None:
    # first the legacy capture (2x RTX 2080 Ti: 21.86 GB/s at 128 MiB), then the H100 capture (338.82
    # at 8 GiB): only a second low result fails
    bin_dir, log = fake_tool(tmp_path, {"1": LEGACY, "2": A3MEGA})
    (f,) = run(tmp_path, bin_dir, config(judged_from_bytes=134217728, busbw_min_gbps=300))
    assert f.severity is Severity.OK, f.message
    assert (f.evidence["attempts"], f.evidence["judged_busbw_gbps"]) == (2, 338.82)
    assert calls(log) == [DEFAULT_SWEEP, "-b 134217728 -e 134217728 -f 4 -g 8 -n 20 -w 5 -c 1"]
    # the legacy capture has no rank list: ranks are named by -g
    assert f.evidence["devices"] == [f"cuda:{r}" for r in range(8)]


def test_wrong_elements_fail_at_once_with_their_count(nvml_state: Path, tmp_path: Path) -> None:
    # the real capture with 3 wrong elements in the 4 GiB row's out-of-place half and the footer a
    # failing run prints; nccl-tests then exits with EXIT_FAILURE (src/common.cu)
    text = A3MEGA.replace("330.58      0", "330.58      3").replace("values : 0 OK", "values : 3 FAILED")
    assert text.count("      3    24365") == 1
    bin_dir, log = fake_tool(tmp_path, {"default": text}, status=1)
    (f,) = run(tmp_path, bin_dir, config(judged_from_bytes=8589934592))
    assert (f.component, f.severity, f.action) == (NODE, Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.message == ("all_reduce_perf found 3 wrong element(s) in the all-reduce results (at 4 GiB; "
                         "'Out of bounds values : 3 FAILED')")
    assert f.evidence["retryable"] is False and f.evidence["exit_status"] == 1
    assert calls(log) == [DEFAULT_SWEEP]  # wrong sums are not measured again


def test_out_of_bounds_count_of_a_legacy_build_fails(nvml_state: Path, tmp_path: Path) -> None:
    # legacy rows carry a deviation, not a count: the footer (here as a failing run prints it) counts
    text = LEGACY.replace("values : 0 OK", "values : 2 FAILED")
    bin_dir, _ = fake_tool(tmp_path, {"default": text}, status=1)
    (f,) = run(tmp_path, bin_dir, config())
    assert (f.severity, f.action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f.message == ("all_reduce_perf found 2 wrong element(s) in the all-reduce results "
                         "('Out of bounds values : 2 FAILED')")


NO_CUDA = "GPUs not tested: NVML sees 8 GPU(s) but torch sees no CUDA device"
FELL_BACK = "(nccl-tests' all_reduce_perf failed, so the torch sweep measured instead: "


def test_cut_off_output_falls_back_to_the_torch_sweep_with_the_tool_failure_in_evidence(
        nvml_state: Path, tmp_path: Path) -> None:
    """The real 2.19 capture that ends after its rank list, then the modern one cut after its 1 GiB
    row (as when a rank dies mid-sweep): nothing to judge, so the torch sweep measures, which would
    name a dead rank's GPU. torch sees no CUDA device here: its own unknown, with the tool's failure."""
    cut = A3MEGA[: A3MEGA.index("  2147483648")]
    for i, (text, why) in enumerate([
            (HEADER_ONLY, "no result rows (the output ends after the rank list)"),
            (cut, "no '# Avg bus bandwidth' footer after 28 row(s): the output was cut off at "
                  "1073741824 bytes")]):
        bin_dir, log = fake_tool(tmp_path / str(i), {"default": text})
        (f,) = run(tmp_path, bin_dir, config())
        assert (f.component, f.severity, f.action) == (NODE, Severity.UNKNOWN, Action.NONE)
        tool_said = f"all_reduce_perf gave no result that can be judged: {why}"
        assert f.message.startswith(NO_CUDA) and f.message.endswith(f"{FELL_BACK}{tool_said})"), f.message
        failed = f.evidence["nccl_tests_failed"]
        assert failed["message"] == tool_said
        assert (failed["command"], failed["exit_status"]) == (f"all_reduce_perf {DEFAULT_SWEEP}", 0)
        assert failed["last_lines"] == [ln.rstrip() for ln in text.splitlines() if ln.strip()][-20:]
        assert "measured_by" not in f.evidence  # torch measured (here: could not)
        assert calls(log) == [DEFAULT_SWEEP]


def test_a_failing_exit_status_without_output_falls_back_with_stderr_in_the_last_lines(
        nvml_state: Path, tmp_path: Path) -> None:
    # the words nccl-tests prints when a rank's CUDA call fails (src/common.cu CUDACHECK: "<host>:
    # Test CUDA failure common.cu:<line> '<error>'"), on stdout, then exit status 1
    said = "node1: Test CUDA failure common.cu:892 'unspecified launch failure'"
    bin_dir, _ = fake_tool(tmp_path, {"default": said}, status=1)
    (f,) = run(tmp_path, bin_dir, config())
    assert f.severity is Severity.UNKNOWN and f.message.startswith(NO_CUDA)
    failed = f.evidence["nccl_tests_failed"]
    assert failed["message"] == ("all_reduce_perf gave no result that can be judged: exit status 1: no "
                                 f"nccl-tests output found (no settings line, rank list or result row); it "
                                 f"said: {said}")
    assert failed["message"] in f.message and failed["exit_status"] == 1 and failed["last_lines"] == [said]


def test_no_fallback_when_the_torch_sweep_would_not_fit_the_checks_budget(nvml_state: Path,
                                                                          tmp_path: Path) -> None:
    # a torch sweep and its retry could take 2 x (400 + 8 x 30) = 1280 s of the check's 900 s
    bin_dir, _ = fake_tool(tmp_path, {"default": "node1: Test CUDA failure common.cu:892 'unspecified'"},
                           status=1)
    (f,) = run(tmp_path, bin_dir, config(startup_s=400))
    assert (f.severity, f.component) == (Severity.UNKNOWN, NODE)
    assert f.message.startswith("all-reduce not measured: nccl-tests failed after ")
    assert "a torch sweep (up to 1280 s) would not fit the check's 900 s budget" in f.message
    assert f.evidence["nccl_tests_failed"]["exit_status"] == 1


def test_a_tool_that_cannot_start_falls_back(nvml_state: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    script = bin_dir / "all_reduce_perf"
    script.write_text("#!/nonexistent/interpreter\n" + script.read_text())
    (f,) = run(tmp_path, bin_dir, config())
    assert f.severity is Severity.UNKNOWN and f.message.startswith(NO_CUDA) and FELL_BACK in f.message
    failed = f.evidence["nccl_tests_failed"]
    assert failed["message"].startswith("all_reduce_perf -b 1048576 ... failed: cannot start all_reduce_perf")
    assert (failed["exit_status"], failed["last_lines"]) == (None, [])
    assert calls(log) == []


def test_a_failed_re_measurement_falls_back_with_both_commands(nvml_state: Path, tmp_path: Path) -> None:
    # the capture's 8 GiB row (338.82 GB/s) is below h100-sxm's 460: measured again, and that run
    # prints nothing
    bin_dir, log = fake_tool(tmp_path, {"1": A3MEGA, "default": ""})
    (f,) = run(tmp_path, bin_dir, config(judged_from_bytes=8589934592))
    assert f.severity is Severity.UNKNOWN and f.message.startswith(NO_CUDA)
    failed = f.evidence["nccl_tests_failed"]
    assert failed["message"].startswith("all_reduce_perf gave no result that can be judged (re-measuring "
                                        "the judged sizes): exit status 0: no nccl-tests output found")
    assert failed["command"] == "all_reduce_perf -b 8589934592 -e 8589934592 -f 4 -g 8 -n 20 -w 5 -c 1"
    assert failed["first_command"] == f"all_reduce_perf {DEFAULT_SWEEP}"
    assert failed["first_nccl_tests_table"][-1].startswith("# Avg bus bandwidth")
    assert len(calls(log)) == 2


def test_hung_tool_is_killed_at_its_deadline_and_reported(nvml_state: Path, tmp_path: Path) -> None:
    # prints the real 2.19 header (up to its rank list), then never finishes; one size: 1 + 1 s
    bin_dir, log = fake_tool(tmp_path, {"default": HEADER_ONLY}, sleep=60)
    started = time.monotonic()
    (f,) = run(tmp_path, bin_dir, config(min_bytes=8589934592, max_bytes=8589934592, startup_s=1,
                                         per_size_s=1))
    assert time.monotonic() - started < 10
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert f.message.startswith("all_reduce_perf hung: all_reduce_perf -b 8589934592 ... did not finish "
                                "within 2 s (killed); last output: ")
    assert "NVIDIA B200" in f.message  # the tail of what it printed before it hung
    assert f.evidence["timeout_s"] == 2 and f.evidence["command"].startswith("all_reduce_perf -b 8589934592")
    assert calls(log) == ["-b 8589934592 -e 8589934592 -f 4 -g 8 -n 20 -w 5 -c 1"]


def test_always_without_the_tool_is_skipped_with_the_reason(nvml_state: Path, tmp_path: Path) -> None:
    (f,) = run(tmp_path, None, config("always"))
    assert (f.severity, f.action) == (Severity.SKIPPED, Action.NONE)
    assert f.message == ("nccl-tests' all_reduce_perf is not installed (not found on the tool path) and "
                         "checks.nccl.nccl_tests is 'always': all-reduce not measured")


def test_auto_and_never_leave_the_measurement_to_the_torch_sweep(sim: Callable[..., Any], nvml_state: Path,
                                                                 tmp_path: Path) -> None:
    """``nccl_tests_findings`` answering None is what makes ``run`` go on to the torch sweep (the
    torch sweep itself is tests/checks/test_nccl.py's): 'auto' without the tool; 'auto' with the tool
    where torch sees no CUDA device (a real node's context here); 'auto' and 'never' with the tool on
    a simulated node. The tool is never started."""
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    for tools in (None, bin_dir):
        ctx = real_ctx(tmp_path, config("auto"), tools)
        try:
            assert ctx.hw.devices.tools_measure_gpus and ctx.options.nccl_tests == "auto"
            assert nccl_tests_findings(ctx, ctx.options) is None, tools
        finally:
            ctx.hw.nvml.shutdown()
    for mode in ("auto", "never"):
        h = sim(SCENARIO, config(mode))
        ctx = h.context(NcclCheck, 0.0)
        ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir))
        assert not ctx.hw.devices.tools_measure_gpus and ctx.options.nccl_tests == mode
        assert nccl_tests_findings(ctx, ctx.options) is None, mode
    assert calls(log) == []


def test_always_on_a_simulated_node_measures_with_the_stand_ins_never_the_tool(
        sim: Callable[..., Any], tmp_path: Path) -> None:
    """The tool on the tool path would measure this machine's real GPUs and judge them as the simulated
    ones: the torch sweep's stand-ins measure instead (2 GPUs and one small size, to stay fast)."""
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    h = sim(SCENARIO.replace("gpus: 8", "gpus: 2"),
            config("always") + "    cpu: {sizes: [4096], iterations: 1, warmup: 0}\n")
    ctx = h.context(NcclCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir))
    (f,) = NcclCheck().run(ctx)
    assert calls(log) == []
    assert (f.component, f.severity) == (NODE, Severity.OK), f.message
    assert f.message.endswith("(not judged: CPU stand-ins: no profile reference)")
    assert f.evidence["backend"] == "gloo" and f.evidence["devices"] == ["GPU 0", "GPU 1"]
    assert f.evidence["nccl_tests_not_used"] == (
        "checks.nccl.nccl_tests is 'always', but all_reduce_perf is not used on a simulated node: it would "
        "measure this machine's real GPUs; the torch sweep's stand-ins for the simulated GPUs measured")
    assert "measured_by" not in f.evidence


def test_the_option_takes_only_its_three_modes(sim: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="must be one of auto, always, never; got 'sometimes'"):
        sim(SCENARIO, config("sometimes"))


# ------------------------------------------------------------------ the sweep ends on max_bytes


GIB, MIB = 1 << 30, 1 << 20


def test_the_sweep_starts_where_its_steps_end_exactly_on_max_bytes() -> None:
    # nccl-tests steps -b by -f while size <= -e: from 1 MiB, x8 steps end at 4 GiB, never 16 GiB
    assert nccltests.PerfSpec(MIB, 16 * GIB, 8, 8, 20, 5).sizes()[-1] == 4 * GIB
    for factor, start, count in ((2, MIB, 15), (4, MIB, 8), (8, 4 * MIB, 5)):
        assert nccltests.sweep_start(MIB, 16 * GIB, factor) == (start, None)
        sizes = nccltests.PerfSpec(start, 16 * GIB, factor, 8, 20, 5).sizes()
        assert (sizes[0], sizes[-1], len(sizes)) == (start, 16 * GIB, count), factor
    # a min_bytes that is no power of the factor: the smallest size of the series at or above it
    assert nccltests.sweep_start(1_000_000, 16 * GIB, 4) == (MIB, None)
    assert nccltests.sweep_start(3 * MIB, 16 * GIB, 8) == (4 * MIB, None)
    assert nccltests.sweep_start(16 * GIB, 16 * GIB, 4) == (16 * GIB, None)
    # 1000000 / 4^3 = 15625 is odd: the series cannot start lower and still end on 1000000
    start, why = nccltests.sweep_start(1000, 1_000_000, 4)
    assert start == 15625
    assert why == ("the sweep starts at 15625 bytes, not at min_bytes 1000: 15625 is not a multiple of the "
                   "step factor 4, so no smaller size reaches max_bytes 1000000 in x4 steps")
    assert nccltests.sweep_start(100, 1000, 3)[0] == 1000
    with pytest.raises(ValueError):
        nccltests.sweep_start(10, 1, 2)


@given(st.integers(min_value=1, max_value=1 << 36), st.integers(min_value=1, max_value=1 << 36),
       st.integers(min_value=2, max_value=16))
def test_any_sweep_ends_on_max_bytes_and_starts_as_low_as_it_can(a: int, b: int, factor: int) -> None:
    low, high = min(a, b), max(a, b)
    start, why = nccltests.sweep_start(low, high, factor)
    sizes = nccltests.PerfSpec(start, high, factor, 8, 20, 5).sizes()
    assert sizes[0] == start >= low and sizes[-1] == high
    if why is None:
        assert start // factor < low  # one step lower would be below min_bytes
    else:
        assert start % factor and start // factor >= low


def test_factor_8_measures_16_gib_and_a_sweep_without_the_judged_size_is_unknown(
        nvml_state: Path, tmp_path: Path) -> None:
    """The tool is asked for a series that ends on 16 GiB; the capture it replays stops at 8 GiB (the
    size it was run with), so nothing at the profile's 16 GiB was measured: unknown, not a pass."""
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(tmp_path, bin_dir, config(step_factor=8))
    assert calls(log) == ["-b 4194304 -e 17179869184 -f 8 -g 8 -n 20 -w 5 -c 1"]
    assert (f.component, f.severity, f.action) == (NODE, Severity.UNKNOWN, Action.NONE), f.message
    assert f.message == ("all-reduce over 16 GPUs exact, but busbw not judged: the profile's minimum "
                         "460 GB/s is for sizes >= 16 GiB and the largest size measured was 8 GiB")
    assert (f.evidence["busbw_min_gbps"], f.evidence["judged_from_bytes"]) == (460, 16 * GIB)
    assert f.evidence["source"].startswith("Azure/azurehpc-health-checks")
    assert "sweep_start_note" not in f.evidence


def test_a_start_above_min_bytes_is_said_in_evidence(nvml_state: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_tool(tmp_path, {"default": A3MEGA})
    (f,) = run(tmp_path, bin_dir, config(min_bytes=1000, max_bytes=8589934592 - 4, step_factor=2,
                                         judged_from_bytes=4 * GIB, busbw_min_gbps=300))
    # 8 GiB - 4 = 2147483647 x 4: odd after two halvings
    assert calls(log) == ["-b 2147483647 -e 8589934588 -f 2 -g 8 -n 20 -w 5 -c 1"]
    assert f.evidence["sweep_start_note"].startswith(
        "the sweep starts at 2147483647 bytes, not at min_bytes 1000: 2147483647 is not a multiple of the "
        "step factor 2")
    assert f.severity is Severity.OK, f.message  # the replayed capture's 4 GiB and 8 GiB rows are judged


def test_the_tool_reducing_max_bytes_for_memory_is_unknown_with_its_words(
        nvml_state: Path, tmp_path: Path) -> None:
    # the capture as a GPU too small for 8 GiB buffers prints it: nccl-tests (src/common.cu run())
    # prints "#\n# Reducing maxBytes to <n> due to memory limitation" after the rank list, and its
    # sweep then stops at the last size <= n (here the 8 GiB row is gone)
    reduced = 6442450944
    rows = A3MEGA.splitlines()
    text = "\n".join(ln for ln in rows if not ln.lstrip().startswith("8589934592"))
    at = text.index("#\n#  ")  # the '#' line after the rank list, before the table's header
    text = text[:at] + f"#\n# Reducing maxBytes to {reduced} due to memory limitation\n" + text[at:]
    assert nccltests.parse(text).reduced_max_bytes == reduced
    bin_dir, _ = fake_tool(tmp_path, {"default": text})
    (f,) = run(tmp_path, bin_dir, config(min_bytes=8, max_bytes=8589934592, step_factor=2,
                                         judged_from_bytes=8589934592))
    assert (f.severity, f.action) == (Severity.UNKNOWN, Action.NONE), f.message
    assert f.message == ("all-reduce over 16 GPUs exact, but busbw not judged: the profile's minimum "
                         "460 GB/s is for sizes >= 8 GiB and the largest size measured was 4 GiB "
                         "(all_reduce_perf lowered its largest size to 6 GiB for lack of GPU memory: "
                         "'Reducing maxBytes ... due to memory limitation')")
    assert f.evidence["nccl_tests_reduced_max_bytes"] == reduced


def _gpu_rows(*sizes: int) -> list[SizeRow]:
    # 8 GPUs at 470 GB/s busbw (algbw = busbw x 8/14)
    return [SizeRow(n, n / (470e9 * 8 / 14), 470 * 8 / 14, 470.0, 0, {}, 2 * n // 4) for n in sizes]


def test_verdict_without_a_judged_size_is_unknown_on_gpus_only() -> None:
    """Either path's sweep: a profile floor and no size at judged_from_bytes (config max_bytes below it,
    or a tool that lowered its maxBytes) is unknown on GPUs; CPU stand-ins and a profile without a
    floor stay ok, measured and not judged."""
    options = NcclConfig(max_bytes=GIB, judged_from_bytes=16 * GIB)
    labels = {r: f"GPU {r}" for r in range(8)}
    (f,) = verdict(Sweep(_gpu_rows(256 * MIB, GIB), True, labels), options, 460.0, "src")
    assert (f.severity, f.action) == (Severity.UNKNOWN, Action.NONE)
    assert f.message == ("all-reduce over 8 GPUs exact, but busbw not judged: the profile's minimum "
                         "460 GB/s is for sizes >= 16 GiB and the largest size measured was 1 GiB")
    (cpu,) = verdict(Sweep(_gpu_rows(GIB), False, labels), options, 460.0, "src")
    assert cpu.severity is Severity.OK
    assert cpu.message.endswith("(not judged: CPU stand-ins: no profile reference)")
    (free,) = verdict(Sweep(_gpu_rows(GIB), True, labels), options, None, None)
    assert free.severity is Severity.OK
    assert free.message.endswith("(not judged: no busbw_min_gbps in the profile)")
    (judged,) = verdict(Sweep(_gpu_rows(GIB, 16 * GIB), True, labels), options, 460.0, "src")
    assert judged.severity is Severity.OK and judged.evidence["judged_busbw_gbps"] == 470.0


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
